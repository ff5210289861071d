"""Starting a peer process of a local swarm (peer.children.spawn): its priority, where the kernel schedules by
session (autogroups), is that of its whole session, not only its own nice value."""

import os
import subprocess
from pathlib import Path

import pytest

from peer.children import spawn

READ = "import os; print(os.nice(0)); print(open('/proc/self/autogroup').read().split()[-1])"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no scheduling autogroups")
def test_a_child_started_nicer_is_nicer_in_its_own_session_too(tmp_path):
    child = spawn(["-c", READ], tmp_path / "child.log", nice=10)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, (tmp_path / "child.log").read_text()
    nice, group_nice = (int(line) for line in out.split())
    assert nice == os.nice(0) + 10
    assert group_nice == 10, "in a session of its own, only the autogroup's nice ranks it against other sessions"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no scheduling autogroups")
def test_a_child_at_the_default_priority_is_left_at_it(tmp_path):
    child = spawn(["-c", READ], tmp_path / "child.log")
    out, _ = child.communicate(timeout=60)
    assert [int(line) for line in out.split()] == [os.nice(0), 0], "a new session's autogroup starts at nice 0"


def test_a_child_starts_with_one_torch_thread_and_no_stdin(tmp_path):
    code = "import os, sys; print(os.environ['OMP_NUM_THREADS'], sys.stdin.read() == '')"
    child = spawn(["-c", code], tmp_path / "child.log", stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=60)
    assert out.split() == ["1", "True"] and child.returncode == 0


LOWER = """
import os, subprocess, sys, threading, time
from peer.children import lower_priority
ready = threading.Event()
threading.Thread(target=lambda: (ready.set(), time.sleep(30)), daemon=True).start()
ready.wait()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(0.2)
lower_priority(7)
threads = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")]
print(len(threads), min(threads), os.getpriority(os.PRIO_PROCESS, grandchild.pid))
print(open("/proc/self/autogroup").read().split()[-1])
grandchild.kill()
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no scheduling autogroups")
def test_a_running_peer_lowers_every_thread_its_children_and_its_session(tmp_path):
    """``hivegrpo join --nice``: once ready, the whole peer (its threads, its DHT process and p2pd, its session's
    autogroup) goes to the nice value asked for (in a session of its own here: never the test's)."""
    child = spawn(["-c", LOWER], tmp_path / "child.log", stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, (tmp_path / "child.log").read_text()
    (threads, lowest, grandchild), (group,) = (line.split() for line in out.strip().splitlines())
    assert int(threads) >= 2 and int(lowest) == int(grandchild) == max(7, os.nice(0)), out
    assert int(group) == 7


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no scheduling autogroups")
def test_a_child_started_at_a_session_nice_keeps_its_threads_at_their_nice_and_may_go_back_to_0(tmp_path):
    code = (
        f"{READ}; open('/proc/self/autogroup', 'w').write('0'); print(open('/proc/self/autogroup').read().split()[-1])"
    )
    child = spawn(["-c", code], tmp_path / "child.log", session_nice=19)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, (tmp_path / "child.log").read_text()
    assert [int(line) for line in out.split()] == [os.nice(0), 19, 0], "threads untouched, the session 19, then 0"
