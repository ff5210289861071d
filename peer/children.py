"""Starting a peer process of a local swarm: the demo's, a benchmark's, a test's children all start this way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def spawn(
    argv: list[str],
    log: Path,
    stdout=subprocess.PIPE,
    new_session: bool = True,
    nice: int = 0,
    env: dict | None = None,
) -> subprocess.Popen:
    """``python ARGV`` as a peer process of a local swarm (the demo's, a benchmark's, a test's): one torch thread,
    stderr to ``log``, stdin closed; ``new_session``: in a process group of its own, so that killing the group ends
    its DHT process and libp2p daemon too; ``nice``: its CPU priority; ``env``: added to this process's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, *argv],
            stdout=stdout,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=stdout is subprocess.PIPE,
            env=env,
            start_new_session=new_session,
            preexec_fn=(lambda: _lower_priority(nice)) if nice else None,
        )


def _lower_priority(nice: int) -> None:
    """In the child, before it runs: ``nice`` for its threads and for its session's autogroup. Where the kernel
    groups each session for scheduling (``/proc/sys/kernel/sched_autogroup_enabled``), a process's nice value only
    ranks it within its own session, and every session shares the CPU equally: a peer in a session of its own at
    nice 10 took as much CPU as the learner at nice 0 until its autogroup was niced too (docs/demo.md)."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups (not Linux, or a kernel without them): the nice value alone ranks it
        pass


__all__ = ["spawn"]
