"""``python -m peer.demo.prestart INFO_FILE TIMEOUT MODULE ARG...``: a child of a local swarm that starts beside its
host instead of after it; or the same child forked (:func:`fork`) from a process that imported the libraries once.

A peer's first seconds go to importing torch, transformers, peft and hivemind (5-6 s of CPU on the demo's machine),
and the host takes as long before it can say where it is. A child started this way imports its role's libraries
first, at the lowest priority (the demo starts its session's autogroup at nice 19, where the kernel has them: the
host, which everyone waits for, comes first), then waits for the host's info file (written atomically), sets the
autogroup back to nice 0 (its threads were never niced), puts what it says in place of the arguments
:data:`JOIN` (``--coordinator`` and ``--initial-peers``) and :data:`CREDENTIAL` (a learner's credential), and runs
``python -m MODULE ARG...`` (``peer.cli``, or a benchmark's harness) in this process. It exits with code 3, saying
why, when the file does not come within ``TIMEOUT`` s or the process that started it is gone.

**Forked** (:func:`fork`), when the process that starts the swarm (the demo, which imports the same libraries for its
own evaluations) has no other thread: it imports the roles' modules once, beside the host, then forks each early child,
which runs :func:`main` as above without importing anything again. The libraries cost ~5 s of CPU to import on the
demo's machine in each process; forked, the demo's import serves its children too (docs/demo.md, "Start-up"). A forked
child is a new session with its stdin, stdout and stderr as a spawned one's, one torch thread, its own name
(``hivegrpo-join``, ``hivegrpo-learn``), the default signal handlers; it exits as the interpreter would (the command's
exit code, once its threads are done and the exit handlers have run: those the libraries registered on import, as a
fresh process's would, and its own; not the parent's finalizers, such as the one that deletes the swarm's temporary
folder), and its parent waits for it (:class:`Forked`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path

from peer.children import CHILD_ENV, set_session_nice
from peer.procname import name_process

JOIN = "@host:join"
CREDENTIAL = "@host:learner-credential"
ROLE_MODULES = {"learn": "peer.roles.learner.peer", "join": "peer.roles.rollout.peer"}
"""What each command imports first (the libraries under it are most of a peer's start-up)."""


def expand(argv: list[str], info: dict) -> list[str]:
    """``argv`` with the host's coordinator, initial peers and learner credential in place of the placeholders."""
    join = ["--coordinator", info["coordinator"]]
    for maddr in info["initial_peers"]:
        join += ["--initial-peers", maddr]
    out: list[str] = []
    for arg in argv:
        if arg == JOIN:
            out += join
        elif arg == CREDENTIAL:
            out.append(info["learner_credential"])
        else:
            out.append(arg)
    return out


def wait_for(info_file: Path, timeout: float, parent: int) -> dict | None:
    """The host's info, once its file exists; None after ``timeout`` s or once ``parent`` is no longer ours."""
    deadline = time.monotonic() + timeout
    while not info_file.exists():
        if time.monotonic() > deadline or os.getppid() != parent:
            return None
        time.sleep(0.1)
    return json.loads(info_file.read_text())


def main(argv: list[str]) -> None:
    info_file, timeout, module, *args = argv
    parent = os.getppid()
    if args and args[0] in ROLE_MODULES:
        importlib.import_module(ROLE_MODULES[args[0]])
    info = wait_for(Path(info_file), float(timeout), parent)
    if os.getsid(0) == os.getpid():  # a session of its own (started so by peer.children.spawn, at nice 19)
        set_session_nice(0)
    if info is None:
        print(f"the host's info file {info_file} did not come within {timeout} s, or the demo left", file=sys.stderr)
        sys.exit(3)
    sys.argv = [module, *expand(args, info)]
    # forked, the module (peer.cli) is in sys.modules already, imported by the demo; running it again as __main__ is
    # what a fresh peer does, so runpy's warning about the copy in sys.modules would only be noise in the peer's log
    warnings.filterwarnings(
        "ignore", message=r"'.+' found in sys\.modules after import of package", category=RuntimeWarning
    )
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def can_fork() -> bool:
    """Whether this process may fork a peer: Linux (``/proc``), no thread but this one (a lock another thread held at
    the fork would stay held in the child forever), and its own stdout and stderr (a test runner's stand-ins would
    keep the child's output)."""
    if not hasattr(os, "fork") or sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__:
        return False
    try:
        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class Forked:
    """A child this process forked, with the part of :class:`subprocess.Popen` a local swarm uses."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                pid, status = self.pid, 255 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never to a PID already reaped (it may be another process's by now)
            os.kill(self.pid, sig)


def fork(argv: list[str], log: Path, stdout: Path, name: str) -> Forked:
    """Fork a child that runs :func:`main` with ``argv`` (``INFO_FILE TIMEOUT MODULE ARG...``): a new session, stdin
    closed, stdout to ``stdout``, stderr to ``log``, named ``name``. Only when :func:`can_fork`."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, argv)
    code = 1
    try:
        for finalizer in list(weakref.finalize._registry):  # the parent's (its temporary folder): not at this exit
            finalizer.atexit = False
        os.setsid()
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, log, os.O_WRONLY)):
            opened = os.open(path, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(CHILD_ENV)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        name_process(name)
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:  # what the interpreter does on its way out: wait for the threads, then the exit handlers
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
