"""A demo child started beside its host (peer.demo.prestart): what it puts in place of the host's placeholders,
and how it waits for the host's info file."""

import json
import os
import threading
import time

from peer.demo.prestart import CREDENTIAL, JOIN, expand, wait_for

INFO = {
    "coordinator": "0123456789abcdef",
    "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/B"],
    "learner_credential": "cred",
}


def test_the_placeholders_become_the_hosts_address_and_credential_and_nothing_else_changes():
    argv = ["learn", "--run-id", "demo", JOIN, "--learner-credential", CREDENTIAL, "--json"]
    assert expand(argv, INFO) == [
        "learn", "--run-id", "demo",
        "--coordinator", "0123456789abcdef",
        "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/A", "--initial-peers", "/ip4/127.0.0.1/tcp/2/p2p/B",
        "--learner-credential", "cred", "--json",
    ]  # fmt: skip
    assert expand(["join", "--name", "x"], INFO) == ["join", "--name", "x"]


def test_it_waits_for_the_info_file_and_gives_up_after_the_timeout(tmp_path):
    path = tmp_path / "info.json"
    started = time.monotonic()
    assert wait_for(path, 0.3, os.getppid()) is None
    assert 0.3 <= time.monotonic() - started < 5
    # written whole, then renamed, as the host writes it (peer.files.write_private): a reader never sees half of it
    part = tmp_path / "info.json.part"
    threading.Timer(0.3, lambda: (part.write_text(json.dumps(INFO)), part.replace(path))).start()
    assert wait_for(path, 30, os.getppid()) == INFO


def test_it_gives_up_when_the_process_that_started_it_is_gone(tmp_path):
    started = time.monotonic()
    assert wait_for(tmp_path / "never.json", 30, os.getppid() + 1) is None, "another parent: the demo left"
    assert time.monotonic() - started < 5


FORKING_PARENT = r"""
import json, os, signal, subprocess, sys, tempfile, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from peer.demo.prestart import can_fork, fork

out = Path(sys.argv[1])
info = out / "info.json"
info.write_text(json.dumps({"coordinator": "c0ffee", "initial_peers": [], "learner_credential": "cred"}))
kept = tempfile.TemporaryDirectory(dir=out)  # the parent's: the child's exit must not delete it
assert can_fork(), "a fresh process with one thread may fork"
argv = [str(info), "30", "forked_probe", "@host:learner-credential", "x"]
child = fork(argv, out / "c.log", out / "c.json", "hivegrpo-probe")
code = child.wait(60)
import forked_pkg.main  # as the demo imported peer.cli before forking the peer that runs it
fork([str(info), "30", "forked_pkg.main"], out / "p.log", out / "p.json", "hivegrpo-pkg").wait(60)
sleeper = fork([str(info), "30", "forked_sleeper"], out / "s.log", out / "s.json", "hivegrpo-sleep")
try:
    sleeper.wait(0.5)
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
sleeper.send_signal(signal.SIGTERM)
stopped = sleeper.wait(30)
sleeper.send_signal(signal.SIGTERM)  # after it was reaped: nothing is sent, nothing raises
threading.Thread(target=time.sleep, args=(2,)).start()
print(json.dumps({"code": code, "kept": Path(kept.name).is_dir(), "timed_out": timed_out, "stopped": stopped,
                  "with_a_thread": can_fork()}))
"""

PROBE = r"""
import atexit, json, os, signal, sys, threading, time
from pathlib import Path
out = Path(__file__).parent
print(json.dumps({
    "argv": sys.argv[1:],
    "session_leader": os.getsid(0) == os.getpid(),
    "name": Path(f"/proc/{os.getpid()}/comm").read_text().strip(),
    "mkl": os.environ.get("MKL_NUM_THREADS"),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "stdin": sys.stdin.read(),
}))
print("to the log", file=sys.stderr)
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
sys.exit(7)
"""


def test_a_forked_child_runs_the_command_as_a_fresh_peer_would_and_exits_as_the_interpreter_would(tmp_path):
    import subprocess
    import sys

    (tmp_path / "forked_probe.py").write_text(PROBE)
    (tmp_path / "forked_sleeper.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "forked_pkg").mkdir()
    (tmp_path / "forked_pkg" / "__init__.py").write_text("")
    (tmp_path / "forked_pkg" / "main.py").write_text("if __name__ == '__main__':\n    print('ran as main')\n")
    done = subprocess.run(
        [sys.executable, "-c", FORKING_PARENT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "3"},  # the child takes one
    )
    assert done.returncode == 0, done.stderr
    parent = json.loads(done.stdout.strip().splitlines()[-1])
    assert parent == {"code": 7, "kept": True, "timed_out": True, "stopped": -15, "with_a_thread": False}
    child = json.loads((tmp_path / "c.json").read_text())
    assert child == {
        "argv": ["cred", "x"],  # the placeholder became the host's credential
        "session_leader": True,
        "name": "hivegrpo-probe",
        "mkl": "1",
        "sigterm_default": True,
        "stdin": "",
    }
    assert "to the log" in (tmp_path / "c.log").read_text()
    assert (tmp_path / "p.json").read_text() == "ran as main\n", "a module the parent imported runs again as __main__"
    assert "Warning" not in (tmp_path / "p.log").read_text(), "with no runpy warning in the peer's log"
    assert (tmp_path / "thread").read_text() == "done", "its threads finish before it exits"
    assert (tmp_path / "atexit").read_text() == "ran", "its own exit handlers run"


DEMO_WITH_THREADS_IN_THE_ENVIRONMENT = r"""
import importlib, json, os, sys
import peer.cli
import peer.demo.swarm

def start_then_stop(self, *args, **kwargs):  # where the demo starts its host, then what it imports and forks after
    torch_before = "torch" in sys.modules
    from peer.demo.prestart import ROLE_MODULES, can_fork

    for module in ROLE_MODULES.values():
        importlib.import_module(module)
    out = {"torch_before_the_host": torch_before, "omp": os.environ["OMP_NUM_THREADS"], "can_fork": can_fork()}
    print(json.dumps(out), flush=True)
    os._exit(0)

peer.demo.swarm.LocalSwarm.start = start_then_stop
peer.cli.main(["demo", "--json", "--report-dir", sys.argv[1]])
"""


def test_the_demo_starts_its_host_before_importing_torch_and_keeps_one_thread_so_that_it_can_fork_its_peers(tmp_path):
    """The host imports its libraries (~5 s of CPU) beside the demo's own imports, not after them (a top-level import
    of torch in the demo's modules once delayed version 1 by ~6 s: docs/demo.md, "Start-up"); and whatever the
    environment says, the demo's one thread lets it fork its peers."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DEMO_WITH_THREADS_IN_THE_ENVIRONMENT, str(tmp_path / "report")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "2"},  # importing torch with 2 starts a thread
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "torch_before_the_host": False,
        "omp": "1",
        "can_fork": True,
    }
