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
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )


__all__ = ["spawn"]
