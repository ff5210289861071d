"""Name a process as ``top``/``ps -o comm`` show it (Linux: its main thread's ``comm``; elsewhere nothing happens).

A peer forks helper processes (its DHT node, its group publisher) that would otherwise all show the parent's name;
named, a volunteer (and ``tests.benchmarks.cpu``) can tell which one uses the CPU.
"""

from __future__ import annotations

import os
import sys


def name_process(name: str) -> bool:
    """Set this process's name (at most 15 bytes are kept), from any of its threads; returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:  # the main thread's comm (prctl would name only the calling thread: the DHT's runs an event loop thread)
        with open(f"/proc/{os.getpid()}/comm", "wb") as f:
            f.write(name.encode()[:15])
        return True
    except OSError:
        return False


__all__ = ["name_process"]
