"""The command line's shared options are declared once (``peer.cli_options``) and used by both packages' commands.

Checked on the source (what is written, and what the coordinator imports) and on the commands click builds (what a
user gets): options that ``host`` and ``join`` share are the same option, the model choices are the model config's,
and an option that sets a config field shows that field's help.
"""

import ast
from collections import Counter
from pathlib import Path

import click
import pytest

from peer.cli import main
from peer.cli_options import FieldOption, field_help
from peer.model.config import DTYPES, QUANTIZATIONS

ROOT = Path(__file__).resolve().parents[2]
CLI_SOURCES = ("peer/cli.py", "peer/cli_options.py", "peer/cli_checks.py", "coordinator/cli.py")
# The same flag on commands where it means something else (or takes another range), so each is its own option:
# --seed is the run's, the held-out set's, the training's or the tiny model's; --out a new folder in each command;
# --max-new-tokens, --group-size, --eval-every, --eval-n, --duration and --target keep each command's own range and
# default; --private, --name and --identity of `invite` are not the peers' ones; --learners is the demo's learner
# processes and the host's learn lines (one credential each).
OWN_MEANING_PER_COMMAND = {
    "--seed",
    "--out",
    "--max-new-tokens",
    "--group-size",
    "--eval-every",
    "--eval-n",
    "--duration",
    "--target",
    "--private",
    "--name",
    "--identity",
    "--learners",
}


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(main)
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


def test_the_coordinator_imports_no_private_peer_name():
    offenders = []
    for path in sorted((ROOT / "coordinator").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        peer_modules = set()  # names bound to a peer module in this file: `from peer import cli_checks`, ...
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "peer":
                for alias in node.names:
                    if alias.name.startswith("_"):
                        offenders.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                    peer_modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                peer_modules.update(a.asname or a.name for a in node.names if a.name.split(".")[0] == "peer")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in peer_modules
            ):
                offenders.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not offenders, f"the coordinator must use peer's public names only: {offenders}"


def test_each_shared_option_is_declared_once():
    declared = Counter()
    for source in CLI_SOURCES:
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "option":
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
                if flags:
                    declared[flags[0]] += 1
    twice = {flag: n for flag, n in declared.items() if n > 1 and flag not in OWN_MEANING_PER_COMMAND}
    assert not twice, f"declare these once in peer/cli_options.py: {twice}"


def test_the_model_choices_are_written_only_in_the_model_config():
    for source in CLI_SOURCES:
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts:
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert values not in (set(QUANTIZATIONS), set(DTYPES)), (
                    f"{source}:{node.lineno} spells out {sorted(values)}: use peer.model.config's constant"
                )
    choices = {"quantization": QUANTIZATIONS, "dtype": DTYPES}
    seen = Counter()
    for name, command in _commands().items():
        for option in _options(command).values():
            if option.name in choices:
                seen[option.name] += 1
                assert tuple(option.type.choices) == choices[option.name], (name, option.name)
    assert seen["quantization"] >= 3 and seen["dtype"] >= 2, f"fewer commands than expected take them: {seen}"


def test_host_and_join_share_the_same_options():
    commands = _commands()
    host, join = commands["host"], commands["join"]
    shared = _options(host).keys() & _options(join).keys()
    network = {"initial_peers", "host_maddrs", "announce_maddrs", "identity", "client_mode", "no_relay", "invite"}
    assert network | {"cache_dir", "max_upload", "run_id", "quantization"} <= shared
    for name in sorted(shared):
        a, b = _options(host)[name], _options(join)[name]
        assert a.callback is b.callback and a.type.to_info_dict() == b.type.to_info_dict(), name
        if name in ("run_id", "quantization"):  # which run, and whether the manifest decides: worded per command
            continue
        assert a.to_info_dict() == b.to_info_dict(), name  # help included
    for command in ("learn", "status", "export"):
        options = _options(commands[command])
        for name in network:
            assert options[name].to_info_dict() == _options(join)[name].to_info_dict(), (command, name)


@pytest.mark.parametrize("name", ["host", "join", "learn", "status", "export", "eval", "train-local"])
def test_an_option_setting_a_config_field_shows_that_fields_help(name):
    command = _commands()[name]
    fields = [o for o in _options(command).values() if isinstance(o, FieldOption)]
    assert fields, f"{name} sets no config field from an option"
    shown = command.get_help(click.Context(command, info_name=name))
    for option in fields:
        assert option.help.startswith(field_help(option.config_field)), option.name
        assert " ".join(field_help(option.config_field).split()[:4]) in " ".join(shown.split()), option.name
