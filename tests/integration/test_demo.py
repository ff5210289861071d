"""``hivegrpo demo`` end to end, short: a real local swarm runs, reports, saves an adapter that checks out, and
leaves no process behind. (Whether the default run reaches its target in time is measured in docs/demo.md.)"""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


def _run_watching_tree(argv: list[str], logs: Path, timeout: float) -> tuple[int, str, str, dict[int, str]]:
    """Run ``argv`` (stdout and stderr to files in ``logs``); also return every PID ever in its process tree, with
    the name it last had."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out, err = logs / "demo.out", logs / "demo.err"
    seen: dict[int, str] = {}
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env)
    deadline = time.time() + timeout
    try:
        while proc.poll() is None and time.time() < deadline:  # a census every 0.5 s while it runs
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        seen[p.pid] = p.name()
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode, out.read_text(), err.read_text(), seen


def _still_running(pids: set[int]) -> list[str]:
    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and not p.name().startswith("torch_shm_manag"):
                left.append(f"{pid} {p.name()} {' '.join(p.cmdline()[:6])}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.timeout(420)
def test_demo_runs_a_local_swarm_reports_it_and_saves_an_adapter_that_evaluates_to_the_reported_number(tmp_path):
    report_dir = tmp_path / "report"
    argv = [sys.executable, "-m", "peer.cli", "demo", "--duration", "55", "--no-target", "--eval-every", "20"]
    argv += ["--eval-n", "100", "--report-dir", str(report_dir), "--json"]
    code, out, err, tree = _run_watching_tree(argv, tmp_path, timeout=360)
    assert code == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])

    # the whole swarm was real processes: host, learner, two rollout peers (each with its DHT), and all are gone;
    # the learner and the rollout peers were forked from the demo once it had imported their libraries
    assert len(tree) >= 8, tree
    assert {"hivegrpo-learn", "hivegrpo-join"} <= set(tree.values()), tree
    wait_until(lambda: _still_running(set(tree)) == [], "every process of the demo's tree to exit", 10)

    assert summary["stopped_by"] == "time limit"
    assert 55 <= summary["seconds"] < 55 + 60
    assert summary["versions"] >= 3 and summary["groups"] >= 3 * 16
    metrics = json.loads(Path(summary["metrics"]).read_text())
    assert set(metrics["exit_codes"]) == {"host", "learner", "rollout-1", "rollout-2"}
    assert all(code == 0 for code in metrics["exit_codes"].values()), metrics["exit_codes"]

    # the host's summary holds the learner credential: its folder and files are this user's alone
    logs = report_dir / "logs"
    assert oct(logs.stat().st_mode & 0o777) == "0o700", "the logs folder"
    assert all(oct(f.stat().st_mode & 0o077) == "0o0" for f in logs.iterdir() if f.suffix == ".json"), "summaries"

    # evaluations start at v0, move forward, and the last is of the adapter the report saved
    evaluations = metrics["evaluations"]
    assert evaluations[0]["version"] == 0 and len(evaluations) >= 2
    assert [e["version"] for e in evaluations] == sorted(e["version"] for e in evaluations)
    assert evaluations[-1]["version"] == summary["adapter_version"] > 0
    assert evaluations[-1]["exact_match"] == summary["final_exact_match"]

    # the saved adapter is the version the learner's ledger says, byte for byte
    lines = [json.loads(line) for line in (report_dir / "ledger.jsonl").read_text().splitlines()]
    ledger = [line for line in lines if not line.get("no_signal")]  # an update without signal makes no version
    by_version = {line["version"]: line["sha256"] for line in ledger}
    adapter = (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes()  # a PEFT folder
    assert hashlib.sha256(adapter).hexdigest() == by_version[summary["adapter_version"]]
    assert len(ledger) == metrics["learner"]["versions_made"] == summary["versions"]

    # both rollout peers published, and their groups reached updates
    contributors = {fp for line in ledger for fp in line["per_peer"]}
    assert len(contributors) == 2, contributors
    assert all(r and r["published"] > 0 for r in metrics["rollout"].values()), metrics["rollout"]
    assert metrics["rollout_throughput"] and len(metrics["rollout_throughput"]) == 2

    # the plots are PNG files
    for name in ("learning.png", "throughput.png"):
        data = (report_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name

    # an independent evaluation of the saved adapter gives the reported number
    check = subprocess.run(
        [sys.executable, "-m", "peer.cli", "eval", "--adapter", summary["adapter"], "--n", "100", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout.strip().splitlines()[-1])["exact_match"] == summary["final_exact_match"]
