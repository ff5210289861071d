"""Starting a peer process of a local swarm (the demo's, a benchmark's, a test's children all start this way), and
forking a helper process of a peer (a rollout peer's publisher, a learner's spot checker) with the pipe between them.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

from peer.procname import name_process

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one torch thread each: several share the cores


def spawn(
    argv: list[str],
    log: Path,
    stdout=subprocess.PIPE,
    new_session: bool = True,
    nice: int = 0,
    env: dict | None = None,
    session_nice: int = 0,
) -> subprocess.Popen:
    """``python ARGV`` as a peer process of a local swarm (the demo's, a benchmark's, a test's): one torch thread,
    stderr to ``log``, stdin closed; ``new_session``: in a process group of its own, so that killing the group ends
    its DHT process and libp2p daemon too; ``nice``: its CPU priority; ``env``: added to this process's;
    ``session_nice``: its session's autogroup alone starts at that nice value (its threads are left at ``nice``),
    which the child may set back to 0 later (only a negative value needs privileges): :mod:`peer.demo.prestart`
    does, once its host is up."""
    env = {**os.environ, **CHILD_ENV, **(env or {})}
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, *argv],
            stdout=stdout,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=stdout is subprocess.PIPE,
            env=env,
            start_new_session=new_session,
            preexec_fn=(lambda: _lower_priority(nice, session_nice)) if nice or session_nice else None,
        )


def _lower_priority(nice: int, session_nice: int = 0) -> None:
    """In the child, before it runs: ``nice`` for its threads, and the larger of the two for its session's autogroup.
    Where the kernel groups each session for scheduling (``/proc/sys/kernel/sched_autogroup_enabled``), a process's
    nice value only ranks it within its own session, and every session shares the CPU equally: a peer in a session
    of its own at nice 10 took as much CPU as the learner at nice 0 until its autogroup was niced too
    (docs/demo.md)."""
    if nice:
        os.nice(nice)
    set_session_nice(max(nice, session_nice))


def lower_priority(nice: int) -> None:
    """Lower this running process to ``nice``: every thread of it and of its child processes (its DHT process, the
    libp2p daemon), and its session's autogroup (see :func:`_lower_priority`). Never raises it: a thread already
    nicer keeps its value. Where ``/proc`` lacks a part (not Linux), that part is skipped."""
    for pid in _self_and_descendants():
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            tids = [pid] if pid == os.getpid() else []
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:  # gone meanwhile, or not ours
                pass
    if current_session_nice() < nice:
        set_session_nice(nice)


def _self_and_descendants() -> list[int]:
    found, todo = [], [os.getpid()]
    while todo and len(found) < 256:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return found


def current_session_nice() -> int:
    """This session's autogroup nice value (0 where there are no autogroups)."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def set_session_nice(nice: int) -> None:
    """This session's autogroup to ``nice`` (back to 0 is allowed: only a negative value needs privileges)."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups (not Linux, or a kernel without them): the nice value alone ranks it
        pass


QUIET = {signal.SIGINT, signal.SIGTERM}


def fork_helper(target, args: tuple, name: str):
    """Fork a helper process of this peer running ``target(conn, parent_end, *args)``; returns ``(process, conn)``,
    this side's end of their pipe. The helper inherits what the peer has loaded (the model, the task, the keys), so
    only messages travel. SIGINT and SIGTERM are blocked while forking: a Ctrl-C in the helper's first instants,
    before :func:`enter_helper` ignores them, would kill it mid-start."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    process = context.Process(target=target, args=(theirs, ours, *args), name=name, daemon=True)
    masked = signal.pthread_sigmask(signal.SIG_BLOCK, QUIET)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, masked)
    theirs.close()
    return process, ours


def enter_helper(parent_end, name: str) -> None:
    """A forked helper's first step: close the peer's end of the pipe (only the peer holds it now: its exit ends the
    helper's reads with EOFError), take ``name``, leave SIGINT/SIGTERM to the peer (a Ctrl-C reaches the whole group;
    the peer says when to stop) and unblock them, and keep the tokenizers library off its own threads (not forked)."""
    parent_end.close()
    name_process(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, QUIET)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def send_message(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn):
    """The next message on a peer's pipe to its helper. Unpickling is safe there only: the pipe is a socketpair made
    before the fork, so its two ends are this peer and its own helper; nothing from the network reaches it."""
    return pickle.loads(conn.recv_bytes())


__all__ = [
    "CHILD_ENV",
    "current_session_nice",
    "enter_helper",
    "fork_helper",
    "lower_priority",
    "receive_message",
    "send_message",
    "set_session_nice",
    "spawn",
]
