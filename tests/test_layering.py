"""The layering rules of docs/architecture.md, checked on the source and on what really gets imported."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "bitsandbytes")


def _imports(package: str) -> dict[Path, set[str]]:
    found = {}
    for path in (ROOT / package.replace(".", "/")).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[path] = names
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def test_peer_never_imports_coordinator():
    offenders = {str(p): n for p, n in _imports("peer").items() if any(_top(m) == "coordinator" for m in n)}
    assert not offenders, f"peer must not import coordinator: {offenders}"


@pytest.mark.parametrize("package", ["peer.tasks", "peer.protocol", "peer.network"])
def test_light_packages_import_no_torch_in_source(package):
    if not (ROOT / package.replace(".", "/")).is_dir():
        pytest.skip(f"{package} does not exist yet")
    offenders = {str(p): sorted(m for m in n if _top(m) in HEAVY) for p, n in _imports(package).items()}
    offenders = {p: m for p, m in offenders.items() if m}
    assert not offenders, f"{package} must not import {HEAVY}: {offenders}"


def test_grpo_needs_no_model_library():
    offenders = {str(p): n for p, n in _imports("peer.grpo").items() if any(_top(m) in HEAVY[1:] for m in n)}
    assert not offenders, f"peer.grpo must import torch only: {offenders}"


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    return set(out.stdout.split())


def test_cli_help_imports_no_torch():
    loaded = _modules_after(
        "from click.testing import CliRunner\nfrom peer.cli import main\n"
        "r = CliRunner().invoke(main, ['--help'])\nassert r.exit_code == 0, r.output\n"
        "for c in ('eval', 'train-local', 'demo'):\n"
        "    assert CliRunner().invoke(main, [c, '--help']).exit_code == 0"
    )
    assert not {m for m in loaded if _top(m) in HEAVY}, "hivegrpo --help imported a heavy library"


def test_tasks_import_no_torch_at_run_time():
    loaded = _modules_after("from peer.tasks import get_task\nget_task('addition').example(0, 0)")
    assert not {m for m in loaded if _top(m) in HEAVY + ("reasoning_gym",)}


def test_status_and_the_web_page_import_no_torch():
    loaded = _modules_after(
        "import peer.status, coordinator.web\nfrom click.testing import CliRunner\nfrom peer.cli import main\n"
        "assert CliRunner().invoke(main, ['status', '--help']).exit_code == 0"
    )
    assert not {m for m in loaded if _top(m) in HEAVY}, "a status check would load torch"
