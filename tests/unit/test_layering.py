"""The layering rules of docs/architecture.md, checked on the source and on what really gets imported.

From the bottom up: ``peer.protocol``, ``peer.tasks``, ``peer.grpo``, ``peer.network``, ``peer.model`` (the
libraries), then ``peer.run`` (what every peer of a run shares), then ``peer.roles`` (one package per role, which
never import each other), then the entry points (``peer.cli``, ``peer.demo``, ``peer.status``, ``peer.export``).
``coordinator`` sits beside the roles: it uses ``peer.run``, never a role. The source checks read every import,
those inside functions too (a deferred import is still a dependency); the circle check reads only what runs when a
module is imported.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


LIBRARIES = ("peer.protocol", "peer.tasks", "peer.grpo", "peer.network", "peer.model")
ENTRY_POINTS = ("peer.cli", "peer.demo", "peer.status", "peer.export")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in ("peer", "coordinator") for p in (ROOT / package).rglob("*.py")}


def _imported(path: Path, *, on_import_only: bool = False) -> set[str]:
    """The dotted names ``path`` imports, relative imports resolved: ``import a.b`` gives ``a.b``, ``from a import b``
    gives ``a`` and ``a.b`` (``b`` may be a submodule). ``on_import_only``: only the statements that run when the
    module is imported (not inside a function; ``if TYPE_CHECKING:`` blocks count: they say what a module needs)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if on_import_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in child.names if alias.name != "*")
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def _offenders(importer: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules within ``importer`` that import anything within one of ``forbidden``, with what they import."""
    found = {}
    for module, path in sorted(_project_modules().items()):
        if _within(module, importer):
            bad = sorted(n for n in _imported(path) if any(_within(n, f) for f in forbidden))
            if bad:
                found[module] = bad
    return found


def test_coordinator_never_imports_a_role():
    offenders = _offenders("coordinator", ("peer.roles",))
    assert not offenders, f"coordinator must use peer.run, never a role package: {offenders}"


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_never_import_what_is_built_on_them(library):
    offenders = _offenders(library, ("peer.run", "peer.roles", *ENTRY_POINTS))
    assert not offenders, f"{library} is below peer.run, the roles and the entry points, yet imports them: {offenders}"


def test_run_never_imports_a_role():
    offenders = _offenders("peer.run", ("peer.roles",))
    assert not offenders, f"peer.run is what every role shares; it must not import a role: {offenders}"


@pytest.mark.parametrize(("role", "other"), [("rollout", "learner"), ("learner", "rollout")])
def test_roles_never_import_each_other(role, other):
    offenders = _offenders(f"peer.roles.{role}", (f"peer.roles.{other}",))
    assert not offenders, (
        f"peer.roles.{role} imports peer.roles.{other} (move what both need to peer.run): {offenders}"
    )


def test_framing_sits_at_the_bottom_of_the_network():
    """peer.network.framing imports at most peer.log and peer.protocol of the project, and rpc (built on it) no blob
    module: a request/answer protocol must not load the blob layer, its cache and the invite checks."""
    modules = _project_modules()
    below = ("peer.log", "peer.protocol")
    framing = _imported(modules["peer.network.framing"])
    bad = sorted(n for n in framing if _top(n) in ("peer", "coordinator") and n != "peer")
    bad = [n for n in bad if not any(_within(n, ok) for ok in below)]
    assert not bad, f"peer.network.framing must import nothing of the project but {below}: {bad}"
    rpc = sorted(n for n in _imported(modules["peer.network.rpc"]) if _within(n, "peer.network.blobs"))
    assert not rpc, f"peer.network.rpc imports the blob layer: {rpc}"


def _import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (as the modules along it, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def test_no_import_circles():
    modules = _project_modules()
    graph = {
        module: {n for n in _imported(path, on_import_only=True) if n in modules and n != module}
        for module, path in modules.items()
    }
    circle = _import_circle(graph)
    assert circle is None, f"import circle: {' -> '.join(circle)}; move what both need into a lower module"


MANIFEST_CODE = """
import json, time
from peer.run.spec import DEFAULT_GROUPS_PER_VERSION, grpo_json, run_spec
from peer.grpo.config import LossConfig, PromptConfig, SamplingConfig, StalenessConfig
from peer.model.config import LoRAConfig
from peer.protocol import ManifestRecord, ModelSpec, TaskSpec
from peer.protocol.records import ModelFile
from peer.tasks import get_task

task = get_task("addition", {}).spec()
manifest = ManifestRecord(  # the fields coordinator.manifest.build_manifest fills
    run_id="r",
    created=time.time(),
    access="public",
    seed=0,
    model=ModelSpec(
        name="bundled",
        revision=None,
        quantization="nf4",
        files=[ModelFile(path="config.json", sha256="0" * 64, size=1)],
    ),
    task=TaskSpec(name=task["name"], config_json=json.dumps(task["config"], sort_keys=True)),
    grpo_json=grpo_json(
        SamplingConfig(), LossConfig(), StalenessConfig(weighting="hinge", tau_max=3), DEFAULT_GROUPS_PER_VERSION,
        PromptConfig(),
    ),
    lora_json=json.dumps(LoRAConfig().to_dict(), sort_keys=True),
    adapter0_sha256="0" * 64,
    coordinator="peer",
)
spec = run_spec(manifest, b"")
assert spec.staleness == StalenessConfig(weighting="hinge", tau_max=3), spec.staleness
"""


def test_parsing_a_manifest_imports_no_torch():
    loaded = _modules_after(MANIFEST_CODE)
    assert not {m for m in loaded if _top(m) in HEAVY}, "reading a run manifest loaded a model library"


def test_the_coordinator_manifest_module_imports_no_torch():
    loaded = _modules_after("import coordinator.manifest")
    assert not {m for m in loaded if _top(m) in HEAVY}, "importing coordinator.manifest loaded a model library"
