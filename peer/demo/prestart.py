"""``python -m peer.demo.prestart INFO_FILE TIMEOUT MODULE ARG...``: a child of a local swarm that starts beside its
host instead of after it.

A peer's first seconds go to importing torch, transformers, peft and hivemind (5-6 s of CPU on the demo's machine),
and the host takes as long before it can say where it is. A child started this way imports its role's libraries
first, at the lowest priority (the demo starts its session's autogroup at nice 19, where the kernel has them: the
host, which everyone waits for, comes first), then waits for the host's info file (written atomically), sets the
autogroup back to nice 0 (its threads were never niced), puts what it says in place of the arguments
:data:`JOIN` (``--coordinator`` and ``--initial-peers``) and :data:`CREDENTIAL` (a learner's credential), and runs
``python -m MODULE ARG...`` (``peer.cli``, or a benchmark's harness) in this process. It exits with code 3, saying
why, when the file does not come within ``TIMEOUT`` s or the process that started it is gone.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from pathlib import Path

from peer.children import set_session_nice

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
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
