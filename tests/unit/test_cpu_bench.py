"""Naming helper processes (peer.procname) and the CPU benchmark's labels and totals (tests.benchmarks.cpu).

Whatever renames a process runs in a child, so this test runner keeps its own name; every child is ended by PID.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.benchmarks.cpu import CpuSampler, groups, label

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process names are read from /proc")


def own_comm() -> str:
    return Path(f"/proc/{os.getpid()}/comm").read_text().strip()


NAME_FROM_A_THREAD = """
import os, threading, json
from peer.procname import name_process

def comm(tid=None):
    path = f"/proc/{os.getpid()}/comm" if tid is None else f"/proc/{os.getpid()}/task/{tid}/comm"
    return open(path).read().strip()

out = {"before": comm()}
def work(name):
    out[name] = name_process(name)
    out["thread_" + name] = comm(threading.get_native_id())
for name in ("hivegrpo-dht", "hivegrpo-publisher"):
    t = threading.Thread(target=work, args=(name,))
    t.start()
    t.join()
    out["after_" + name] = comm()
print(json.dumps(out))
"""


def test_name_process_names_the_process_from_any_thread():
    mine = own_comm()
    done = subprocess.run(
        [sys.executable, "-c", NAME_FROM_A_THREAD], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["before"] != "hivegrpo-dht"
    assert out["hivegrpo-dht"] is True and out["after_hivegrpo-dht"] == "hivegrpo-dht", "the main thread's name"
    assert out["thread_hivegrpo-dht"] != "hivegrpo-dht", "not (only) the calling thread's"
    assert out["after_hivegrpo-publisher"] == "hivegrpo-publis", "cut to the 15 bytes Linux keeps"
    assert own_comm() == mine, "the test runner keeps its name"


# A rollout peer (its command line says ``join``) that forks a helper; the helper names itself on "go", spins
# until it has used ``SPIN`` CPU seconds, says "spun" and waits to be ended.
SPIN = 0.6
TREE = f"""
import os, sys, time
from peer.procname import name_process

pid = os.fork()
if pid == 0:
    sys.stdin.readline()
    name_process("hivegrpo-dht")
    cpu, wall = time.process_time(), time.monotonic()
    while time.process_time() - cpu < {SPIN} and time.monotonic() - wall < 30:
        pass
    print("spun", flush=True)
    time.sleep(60)
    os._exit(0)
print("forked", pid, flush=True)
os.waitpid(pid, 0)
"""


def end(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            p.kill()
            p.wait(timeout=10)


def test_a_helper_is_labelled_under_its_parent_once_it_names_itself_and_its_cpu_is_counted(monkeypatch):
    root = subprocess.Popen(
        [sys.executable, "-c", TREE, "join"], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    helper = None
    try:
        line = root.stdout.readline().split()
        assert line[:1] == ["forked"], line
        helper = int(line[1])
        sampler = CpuSampler(root.pid)
        sampler.sample()
        assert sampler.labels[root.pid] == "rollout 1"
        assert not sampler.labels[helper].endswith(" dht"), "not named yet"
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "spun"
        sampler.sample()
        assert sampler.labels[root.pid] == "rollout 1", "a role keeps its number"
        assert sampler.labels[helper] == "rollout 1 dht"
        assert sampler.seconds[helper] > 0.3
        by_label = sampler.by_label()
        assert set(by_label) == {"rollout 1", "rollout 1 dht"}, "the helper's seconds moved to its new label"
        assert by_label["rollout 1 dht"] > 0.3
        totals = groups(by_label)
        assert totals["dht"] == by_label["rollout 1 dht"] and totals["p2pd"] == 0.0
        assert totals["all"] == pytest.approx(by_label["rollout 1"] + by_label["rollout 1 dht"], abs=0.11)
        import tests.benchmarks.cpu as cpu

        monkeypatch.setattr(cpu, "label", lambda process, labels: "?")  # as for a process ending meanwhile
        sampler.sample()
        assert sampler.labels[helper] == "rollout 1 dht" and "?" not in sampler.by_label(), "its seconds stay its own"
    finally:
        end(*([helper] if helper else []), root.pid)
        root.wait(timeout=10)


class FakeProcess:
    """What :func:`label` reads of a process."""

    def __init__(self, name, cmdline=(), ppid=1, gone=False):
        self._name, self._cmdline, self._ppid, self._gone = name, list(cmdline), ppid, gone

    def name(self):
        if self._gone:
            raise psutil.NoSuchProcess(4242)
        return self._name

    def cmdline(self):
        return self._cmdline

    def ppid(self):
        return self._ppid


@pytest.mark.parametrize(
    "process, expected",
    [
        (FakeProcess("hivegrpo", ["python", "/venv/bin/hivegrpo", "join", "--run-id", "x"]), "rollout"),
        (FakeProcess("python3", ["python3", "-m", "peer.cli", "learn"]), "learner"),
        (FakeProcess("hivegrpo", ["hivegrpo", "host"]), "host"),
        (
            FakeProcess("python", ["python", "-m", "peer.demo.prestart", "/t/info.json", "180", "peer.cli", "join"]),
            "rollout",
        ),
        (
            FakeProcess("python", ["python", "-m", "peer.demo.prestart", "/t/i", "180", "tests.h", "learn", "--json"]),
            "learner",
        ),
        (FakeProcess("hivegrpo", ["hivegrpo", "demo", "--json"]), "demo"),
        (FakeProcess("hivegrpo-join", ["hivegrpo", "demo", "--json"], ppid=13), "rollout"),  # forked by the demo
        (FakeProcess("hivegrpo-learn", ["python", "-m", "tests.benchmarks.learning"], ppid=13), "learner"),
        (FakeProcess("hivegrpo-dht", ["python3", "-m", "peer.cli", "join"], ppid=10), "rollout 1 dht"),
        (FakeProcess("hivegrpo-publis", ["python3", "-m", "peer.cli", "join"], ppid=11), "learner 1 publis"),
        (FakeProcess("hivegrpo-dht", ["python3"], ppid=99), "? dht"),
        (FakeProcess("p2pd", ["/venv/lib/hivemind_cli/p2pd", "-listen"]), "p2pd"),
        (FakeProcess("p2pd-wrapper", ["/opt/bin/p2pd"]), "p2pd"),
        (FakeProcess("p2pd", ["/venv/lib/hivemind_cli/p2pd"], ppid=12), "rollout 1 p2pd"),
        (FakeProcess("bash", ["bash", "-c", "sleep 1"]), "bash"),
        (FakeProcess("python3", [], gone=True), "?"),
    ],
)
def test_label(process, expected):
    assert label(process, {10: "rollout 1", 11: "learner 1", 12: "rollout 1 dht", 13: "demo"}) == expected


def test_by_label_adds_up_the_processes_of_one_label():
    sampler = CpuSampler(os.getpid())
    sampler.labels = {1: "rollout 1", 2: "rollout 1 dht", 3: "rollout 1", 4: "p2pd"}
    sampler.seconds = {1: 1.04, 2: 0.5, 3: 2.0, 4: 0.26}
    assert sampler.by_label() == {"p2pd": 0.3, "rollout 1": 3.0, "rollout 1 dht": 0.5}
    assert list(sampler.by_label()) == sorted(sampler.by_label())


def test_groups_sums_the_helpers_and_their_share():
    by_label = {
        "rollout 1": 10.0,
        "rollout 1 dht": 2.0,
        "rollout 1 publis": 1.5,
        "learner 1": 20.0,
        "learner 1 dht": 3.0,
        "p2pd": 3.5,
        "learner 1 p2pd": 1.0,
        "demo": 0.0,
    }
    assert groups(by_label) == {
        "all": 41.0,
        "dht": 5.0,
        "p2pd": 4.5,
        "publisher": 1.5,
        "dht_and_p2pd_share": round(9.5 / 41.0, 3),
    }
    assert groups({}) == {"all": 0, "dht": 0, "p2pd": 0, "publisher": 0, "dht_and_p2pd_share": 0.0}


def test_the_command_line_measures_a_command_and_passes_on_its_exit_code(tmp_path):
    out = tmp_path / "cpu.json"
    command = [sys.executable, "-c", "import sys; sys.exit(3)"]
    done = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.cpu", "--every", "0.05", "--out", str(out), "--", *command],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    result = json.loads(out.read_text())
    assert result["command"] == command and result["exit_code"] == 3
    assert set(result["totals"]) == {"all", "dht", "p2pd", "publisher", "dht_and_p2pd_share"}
    assert result["totals"]["all"] == pytest.approx(sum(result["cpu_seconds"].values()), abs=0.2)
