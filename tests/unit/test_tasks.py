"""Tests for peer.tasks: determinism, rewards, held-out sets, config errors, plug-ins and lazy imports.

reasoning-gym is used for real (no mocks); every reasoning-gym dataset here is one whose items are cheap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from peer.tasks import Example, PluginNotAllowed, Task, TaskError, builtin_task_names, derive_seed, get_task
from peer.tasks.addition import MAX_SAMPLED_HELDOUT
from peer.tasks.gym import CHUNK_SIZE

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, hash_seed: str) -> str:
    """Run ``code`` in a fresh interpreter (its own PYTHONHASHSEED) from the repository root; return stdout."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def parse_addition(example: Example) -> tuple[int, int]:
    a, b = example.prompt.removesuffix("=").split("+")
    return int(a), int(b)


# --- seeds -------------------------------------------------------------------------------------------------------


def test_derive_seed_is_stable_typed_and_63_bit():
    assert derive_seed("golden", 1, b"x") == 6283795998297570034  # fixed forever: peers on other machines rely on it
    assert derive_seed("golden", 1, b"x") == derive_seed("golden", 1, b"x")
    assert derive_seed("ab", "c") != derive_seed("a", "bc")
    assert derive_seed(1) != derive_seed("1") != derive_seed(b"1")
    values = [derive_seed("range", i) for i in range(2000)]
    assert all(0 <= v < 2**63 for v in values)
    assert max(values) >= 2**62  # uses the top bit of the 63
    with pytest.raises(TypeError):
        derive_seed(1.5)


# --- addition ----------------------------------------------------------------------------------------------------


def test_addition_prompt_and_reference_format():
    task = get_task("addition")
    ex = task.make_example(7, 45)
    assert (ex.prompt, ex.reference) == ("007+045=", "0052")
    assert get_task("addition", {"digits": 1}).make_example(9, 9).reference == "18"
    assert get_task("addition", {"digits": 6}).make_example(999999, 1).prompt == "999999+000001="
    for index in range(500):
        ex = task.example(3, index)
        assert len(ex.prompt) == 8 and ex.prompt[3] == "+" and ex.prompt.endswith("=")
        a, b = parse_addition(ex)
        assert ex.reference == f"{a + b:04d}"
        assert (ex.seed, ex.index, ex.entry) == (3, index, None)
    with pytest.raises(TaskError, match="operands"):
        task.make_example(1000, 0)


def test_addition_examples_are_deterministic_and_vary():
    first = [get_task("addition").example(11, i) for i in range(200)]
    again = [get_task("addition").example(11, i) for i in range(200)]
    assert first == again
    assert len({e.prompt for e in first}) > 190
    other_seed = [get_task("addition").example(12, i) for i in range(200)]
    assert sum(a.prompt == b.prompt for a, b in zip(first, other_seed, strict=True)) < 5
    with pytest.raises(TaskError, match="index"):
        get_task("addition").example(0, -1)


def test_addition_reward_exact_wrong_whitespace_and_junk():
    task = get_task("addition")
    ref = task.make_example(7, 45)
    assert task.reward("0052", ref) == 1.0
    assert task.reward("  0052\n", ref) == 1.0 and task.is_correct(" 0052 ", ref)
    for junk in ["0051", "52", "0052 0052", "", "   ", "abc", "\x00\ufffd", "9" * 10_000, "0052." * 3]:
        assert task.reward(junk, ref) == 0.0, junk
        assert not task.is_correct(junk, ref)


def test_addition_partial_credit_counts_matching_positions():
    task = get_task("addition", {"partial_credit": 0.5})
    ref = task.make_example(7, 45)  # "0052"
    assert task.reward("0052", ref) == 1.0
    assert task.reward("0051", ref) == pytest.approx(0.5 * 3 / 4)
    assert task.reward("00521", ref) == pytest.approx(0.5)  # too long: all four positions match
    assert task.reward("005", ref) == pytest.approx(0.5 * 3 / 4)  # too short: three positions match
    assert task.reward("52", ref) == 0.0  # not aligned to the right
    assert task.reward(" 0x5y ", ref) == pytest.approx(0.5 * 2 / 4)
    assert not task.is_correct("0051", ref) and not task.is_correct("00521", ref)
    assert all(0.0 <= task.reward(c, ref) <= 1.0 for c in ["", "x", "0" * 50, "0052" * 9])


def test_addition_generates_fast():
    """An example costs about as much as serializing a small dict (4.5-5x here): a rollout peer derives one per
    group and a verifier one per group checked. Measured side by side, best of 3, so a loaded machine slows both."""
    task = get_task("addition")

    def timed(work) -> float:
        start = time.perf_counter()
        for i in range(20_000):
            work(i)
        return time.perf_counter() - start

    examples = min(timed(lambda i: task.example(5, i)) for _ in range(3))
    dumps = min(timed(lambda i: json.dumps({"seed": 5, "index": i})) for _ in range(3))
    assert examples <= 15 * dumps, f"an example costs {examples / dumps:.1f}x a small json.dumps"


def test_addition_training_examples_never_come_from_heldout():
    task = get_task("addition")
    heldout = {parse_addition(e) for e in task.heldout(500)}
    train = {parse_addition(task.example(seed, i)) for seed in (0, 1) for i in range(10_000)}
    assert len(train) > 19_000
    assert not any(derive_seed("addition-heldout", 3, a, b) % 100 == 0 for a, b in train)
    assert not train & heldout
    # The partition is 1% of pairs, so 20k raw draws would hit it ~200 times: the redraw really happened.
    assert all(derive_seed("addition-heldout", 3, a, b) % 100 == 0 for a, b in heldout)


def test_addition_heldout_is_deterministic_distinct_and_sized():
    task = get_task("addition")
    first = task.heldout(300, seed=1)
    assert first == get_task("addition").heldout(300, seed=1)
    assert len({e.prompt for e in first}) == 300
    assert [e.index for e in first] == list(range(300)) and {e.seed for e in first} == {1}
    assert task.heldout(100, seed=1) == first[:100]
    assert task.heldout(300, seed=2) != first
    assert task.heldout(0) == []

    two = get_task("addition", {"digits": 2})
    size = sum(derive_seed("addition-heldout", 2, a, b) % 100 == 0 for a in range(100) for b in range(100))
    assert len(two.heldout(size)) == size
    with pytest.raises(TaskError, match=f"holds only {size}"):
        two.heldout(size + 1)

    four = get_task("addition", {"digits": 4})  # too many pairs to list: sampled from the partition
    sampled = four.heldout(30, seed=7)
    assert sampled == four.heldout(30, seed=7) and len({e.prompt for e in sampled}) == 30
    assert all(derive_seed("addition-heldout", 4, *parse_addition(e)) % 100 == 0 for e in sampled)
    with pytest.raises(TaskError, match="at most"):
        four.heldout(MAX_SAMPLED_HELDOUT + 1)


# --- reasoning-gym -------------------------------------------------------------------------------------------------


def test_reasoning_gym_task_end_to_end():
    task = get_task("chain_sum", {"min_terms": 2, "max_terms": 3})
    examples = [task.example(4, i) for i in range(CHUNK_SIZE - 2, CHUNK_SIZE + 2)]  # crosses a chunk boundary
    assert len({e.prompt for e in examples}) == 4
    for ex in examples:
        assert ex.prompt == ex.entry["question"] and ex.reference == str(ex.entry["answer"])
        assert task.reward(ex.reference, ex) == 1.0
        assert task.reward(f"\n  {ex.reference} \n", ex) == 1.0 and task.is_correct(ex.reference, ex)
        assert task.reward("no idea", ex) == 0.0 and not task.is_correct("no idea", ex)
        assert task.reward("", ex) == 0.0
    assert examples == [get_task("chain_sum", {"min_terms": 2, "max_terms": 3}).example(4, i) for i in range(254, 258)]
    assert task.example(5, 0).prompt != task.example(4, 0).prompt

    strict = get_task("basic_arithmetic")  # its own scorer gives a padded answer partial credit only
    ex = strict.example(0, 0)
    assert strict.reward(f"  {ex.reference}\n", ex) == 1.0
    assert 0.0 < strict.reward(f"{ex.reference} or so", ex) < 1.0  # the dataset's partial credit passes through


def test_reasoning_gym_scorer_errors_score_zero():
    task = get_task("prime_factorization")
    ex = task.example(0, 0)
    assert task.reward(ex.reference, ex) == 1.0
    assert task.reward("zzz junk", ex) == 0.0  # this dataset's own scorer raises ValueError on it
    no_entry = Example(prompt=ex.prompt, reference=ex.reference, seed=0, index=0)
    with pytest.raises(TaskError, match="no entry"):
        task.reward(ex.reference, no_entry)


def test_reasoning_gym_heldout_is_deterministic_and_separate():
    task = get_task("basic_arithmetic")
    heldout = task.heldout(20, seed=3)
    assert heldout == get_task("basic_arithmetic").heldout(20, seed=3)
    assert [e.prompt for e in heldout] == [e.prompt for e in get_task("basic_arithmetic").heldout(20, seed=3)]
    assert len({e.prompt for e in heldout}) == 20
    train = {task.example(3, i).prompt for i in range(300)}
    assert not train & {e.prompt for e in heldout}
    assert all(task.reward(e.reference, e) == 1.0 for e in heldout)
    tiny = get_task("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    with pytest.raises(TaskError, match="distinct questions"):
        tiny.heldout(500)  # 10 * 10 * 2 possible questions


def test_examples_match_across_processes():
    code = textwrap.dedent(
        """
        import json
        from peer.tasks import get_task
        add, gym = get_task("addition"), get_task("chain_sum")
        out = [add.example(9, i).prompt for i in range(50)] + [e.prompt for e in add.heldout(5, seed=2)]
        out += [gym.example(9, i).prompt for i in range(5)] + [e.prompt for e in gym.heldout(3)]
        print(json.dumps(out))
        """
    )
    here_add, here_gym = get_task("addition"), get_task("chain_sum")
    here = [here_add.example(9, i).prompt for i in range(50)] + [e.prompt for e in here_add.heldout(5, seed=2)]
    here += [here_gym.example(9, i).prompt for i in range(5)] + [e.prompt for e in here_gym.heldout(3)]
    assert json.loads(run_python(code, hash_seed="12345")) == here


# --- registry and configs ------------------------------------------------------------------------------------------


def test_unknown_task_name_explains_the_options():
    with pytest.raises(TaskError) as info:
        get_task("no_such_task_anywhere")
    message = str(info.value)
    assert "'no_such_task_anywhere'" in message and "addition" in message
    assert "reasoning-gym" in message and "module:attribute" in message
    with pytest.raises(TaskError, match="did you mean 'chain_sum'"):
        get_task("chain_sun")
    assert builtin_task_names() == ["addition"]


@pytest.mark.parametrize(
    "config, match",
    [
        ({"digits": 0}, "digits"),
        ({"digits": 7}, "digits"),
        ({"digits": "3"}, "digits"),
        ({"digits": True}, "digits"),
        ({"partial_credit": 1.5}, "partial_credit"),
        ({"partial_credit": -0.1}, "partial_credit"),
        ({"width": 3}, "unknown option"),
    ],
)
def test_addition_rejects_bad_config(config, match):
    with pytest.raises(TaskError, match=match):
        get_task("addition", config)


def test_reasoning_gym_rejects_bad_config():
    with pytest.raises(TaskError, match="no_such_option") as info:
        get_task("chain_sum", {"no_such_option": 1})
    assert "min_terms" in str(info.value)  # lists the options it does take
    with pytest.raises(TaskError, match="rejected config"):
        get_task("chain_sum", {"min_terms": 0})  # the dataset's own validation
    with pytest.raises(TaskError, match="seed"):
        get_task("chain_sum", {"seed": 1})


@pytest.mark.parametrize(
    "config, match",
    [
        ({"digits": object()}, "not JSON"),
        ({"partial_credit": float("nan")}, "finite"),
        ({"nested": {1: 2}}, "not a string"),
        ([("digits", 3)], "mapping"),
    ],
)
def test_configs_must_be_json(config, match):
    with pytest.raises(TaskError, match=match):
        get_task("addition", config)


def test_spec_round_trips_to_an_equal_task():
    tasks = [
        get_task("addition"),
        get_task("addition", {"digits": 5, "partial_credit": 0.25}),
        get_task("chain_sum", {"min_terms": 3, "max_terms": 4}),
    ]
    for task in tasks:
        spec = json.loads(json.dumps(task.spec()))
        rebuilt = get_task(**spec)
        assert rebuilt == task and hash(rebuilt) == hash(task) and rebuilt.spec() == task.spec()
        assert rebuilt.example(2, 3) == task.example(2, 3)
    assert get_task("addition", {"digits": 3}) == get_task("addition")  # defaults are part of the config
    assert get_task("addition", {"digits": 4}) != get_task("addition")
    spec = tasks[0].spec()
    spec["config"]["digits"] = 6
    assert tasks[0].config["digits"] == 3  # spec() hands out a copy


def test_import_pulls_in_neither_torch_nor_reasoning_gym():
    code = (
        "import sys, peer.tasks; t = peer.tasks.get_task('addition'); t.heldout(3); t.example(0, 0); "
        "print(sorted(m for m in ('torch', 'reasoning_gym') if m in sys.modules))"
    )
    assert run_python(code, hash_seed="0") == "[]"


# --- plug-ins --------------------------------------------------------------------------------------------------------

PLUGIN_SOURCE = """
from peer.tasks import Example, Task


class EchoTask(Task):
    name = "echo"

    def __init__(self, word="hi"):
        self.config = {"word": word}
        self.word = word

    def example(self, seed, index):
        return Example(prompt=f"{self.word} {seed} {index}", reference=self.word, seed=seed, index=index)

    def reward(self, completion, reference):
        return float(completion.strip() == reference.reference)

    def heldout(self, n, seed=0):
        return [self.example(seed, -1 - i) for i in range(n)]


INSTANCE = EchoTask("fixed")
NOT_A_TASK = 42


def make_echo(word="made"):
    return EchoTask(word)


def make_nothing():
    return "not a task"
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A throwaway plug-in module on sys.path; yields its name and forgets it afterwards."""
    name = f"hivegrpo_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('plug-in import exploded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    sys.modules.pop(f"{name}_broken", None)


def test_plugin_forms_load_and_round_trip(plugin_module):
    cls_task = get_task(f"{plugin_module}:EchoTask", {"word": "yo"})
    assert cls_task.example(1, 2).prompt == "yo 1 2" and cls_task.reward(" yo ", cls_task.example(1, 2)) == 1.0
    assert cls_task.is_correct("yo", cls_task.example(0, 0)) and not cls_task.is_correct("no", cls_task.example(0, 0))
    assert cls_task.heldout(2)[1].prompt == "yo 0 -2"
    instance = get_task(f"{plugin_module}:INSTANCE")
    assert instance.example(0, 0).prompt == "fixed 0 0"
    factory = get_task(f"{plugin_module}:make_echo")
    assert factory.example(0, 0).prompt == "made 0 0"
    assert get_task(f"{plugin_module}:make_echo", {"word": "w"}).example(0, 0).reference == "w"
    for task in (cls_task, instance, factory):
        assert isinstance(task, Task)
        spec = json.loads(json.dumps(task.spec()))
        assert spec["name"].startswith(f"{plugin_module}:")
        rebuilt = get_task(**spec)
        assert rebuilt == task and rebuilt.example(5, 6) == task.example(5, 6)
    assert cls_task.spec() == {"name": f"{plugin_module}:EchoTask", "config": {"word": "yo"}}


def test_plugin_errors_are_clear(plugin_module):
    cases = [
        ("no_such_module_for_hivegrpo:Thing", {}, "importing module"),
        (f"{plugin_module}_broken:Thing", {}, "plug-in import exploded"),
        (f"{plugin_module}:Missing", {}, "no attribute 'Missing'"),
        (f"{plugin_module}:NOT_A_TASK", {}, "not a Task instance"),
        (f"{plugin_module}:make_nothing", {}, "returned a str"),
        (f"{plugin_module}:INSTANCE", {"word": "x"}, "takes no config"),
        (f"{plugin_module}:EchoTask", {"colour": "red"}, "rejected config"),
        (":EchoTask", {}, "module:attribute"),
    ]
    for name, config, match in cases:
        with pytest.raises(TaskError, match=match):
            get_task(name, config)


# --- plug-ins named by someone else (a run's manifest) ---------------------------------------------------------------


@pytest.fixture
def tripwire_module(tmp_path, monkeypatch):
    """A module on sys.path that writes a file when imported; yields (its name, that file)."""
    name = f"hivegrpo_test_tripwire_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "imported.txt"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\nTHING = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    sys.modules.pop(name, None)


def test_a_plugin_whose_module_is_not_allowed_is_refused_before_any_import(tripwire_module):
    name, marker = tripwire_module
    for allowed in (frozenset(), {"os"}, {f"{name}.sub"}, {name[:-1]}, [name.upper()]):
        with pytest.raises(PluginNotAllowed, match=f"needs module '{name}'") as info:
            get_task(f"{name}:THING", allowed_modules=allowed)
        assert info.value.module == name and isinstance(info.value, TaskError)
    assert not marker.exists() and name not in sys.modules, "the refused module was imported"
    with pytest.raises(TypeError, match="not one string"):
        get_task(f"{name}:THING", allowed_modules=name)  # 'in' on a str would match substrings
    with pytest.raises(TaskError, match="not a Task instance"):
        get_task(f"{name}:THING", allowed_modules={name})  # allowed: imported (and refused for what it holds)
    assert marker.read_text() == "imported\n"


def test_builtin_and_reasoning_gym_tasks_need_no_allowance(plugin_module):
    assert get_task("addition", {"digits": 2}, allowed_modules=frozenset()) == get_task("addition", {"digits": 2})
    assert get_task("chain_sum", allowed_modules=frozenset()).name == "chain_sum"
    allowed = get_task(f"{plugin_module}:EchoTask", {"word": "yo"}, allowed_modules={plugin_module})
    assert allowed == get_task(f"{plugin_module}:EchoTask", {"word": "yo"})
