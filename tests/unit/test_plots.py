"""matplotlib is the optional extra ``plots``: the demo's report without it, and the benchmarks' ``--plot``.

"Without it" is a real interpreter where ``import matplotlib`` fails as it does when the package is absent (a None in
``sys.modules`` makes Python raise ModuleNotFoundError for it), running the same functions the demo and the
benchmarks run.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from peer.plots import SKIPPED

ROOT = Path(__file__).parents[2]

REPORT = {
    "evaluations": [{"seconds": 0.0, "exact_match": 0.3}, {"seconds": 20.0, "exact_match": 0.6}],
    "updates": [{"seconds": float(t), "groups": 16, "reward_mean": 0.4 + t / 100} for t in range(0, 21, 2)],
    "target": 0.8,
    "rollout_throughput": {"QmPeer123456": [[1.0, 2.0], [11.0, 2.5]]},
}


def _without_matplotlib(code: str, *argv: str) -> subprocess.CompletedProcess:
    """``python -c code argv...`` in this checkout, with matplotlib unimportable."""
    prelude = "import sys; sys.modules['matplotlib'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_the_demo_report_without_matplotlib_skips_its_plots_with_one_line(tmp_path):
    code = (
        "import json, sys; from pathlib import Path; from peer.demo.report import plot\n"
        "print(json.dumps(plot(json.loads(sys.argv[1]), Path(sys.argv[2]))))"
    )
    out = _without_matplotlib(code, json.dumps(REPORT), str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [], "no plot paths reported"
    assert out.stderr.strip().splitlines() == [SKIPPED]
    assert SKIPPED == "plots skipped: matplotlib is not installed (pip install 'hivegrpo[plots]')"
    assert list(tmp_path.iterdir()) == []


def test_the_demo_report_with_matplotlib_writes_both_plots(tmp_path):
    from peer.demo.report import plot  # the test set-up installs the plots extra (make install, the README)

    written = plot(REPORT, tmp_path)
    assert written == [str(tmp_path / "learning.png"), str(tmp_path / "throughput.png")]
    assert all(Path(p).read_bytes().startswith(b"\x89PNG") for p in written)


@pytest.mark.parametrize("bench", ["rollouts", "learning"])
def test_a_benchmark_asked_to_plot_without_matplotlib_stops_at_once_with_one_line(bench, tmp_path):
    out = _without_matplotlib(
        f"from tests.benchmarks.{bench} import main; main(['--plot', {str(tmp_path / 'x.png')!r}])"
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "--plot needs matplotlib, which is not installed: pip install 'hivegrpo[plots]'"
    ]
    assert out.stdout == "" and list(tmp_path.iterdir()) == [], "nothing ran"
