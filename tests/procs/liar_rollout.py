"""A lying rollout peer for the learner tests: the real ``hivegrpo join`` with its record building patched.

Usage: python tests/procs/liar_rollout.py MODE join ARGS...   (ARGS as for ``hivegrpo join``)

MODE ``inflate``: every group claims reward 1.0 for every completion (0.0 where the honest rewards were all 1.0,
so every group is a lie). MODE ``replay``: behaves honestly, except that the first time it samples with a newer
adapter version than its first group's, it first re-publishes that first group re-tagged with the new version
and its sha256 (the same seq: a group counted twice), then goes on honestly. MODE ``forge``: every group claims
behaviour log-probs of -0.01 per token ("the model was sure"), which skews the ratio a learner computes; only a
recomputation (the learner's spot check) can tell. Signatures are the liar's own and valid: only the content lies.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def patch(mode: str) -> None:
    from peer.roles.rollout import peer as rollout

    honest = rollout.build_groups
    state: dict = {"first": None, "replayed": False}

    def inflate(group, put):
        lie = [0.0 if all(r == 1.0 for r in group.rewards) else 1.0] * len(group.rewards)
        put(group.copy(update={"rewards": lie}))

    def replay(group, put):
        first = state["first"]
        if first is None:
            state["first"] = group
        elif group.version > first.version and not state["replayed"]:
            state["replayed"] = True
            copy = first.copy(update={"version": group.version, "adapter_sha256": group.adapter_sha256})
            print(
                f"replaying group {first.version}.{first.seq} as {group.version}.{first.seq}",
                file=sys.stderr,
                flush=True,
            )
            put(copy)
        put(group)

    def forge(group, put):
        from peer.protocol import Completion

        sure = [Completion.of(c.tokens(), [-0.01] * len(c.tokens())) for c in group.completions]
        put(group.copy(update={"completions": sure}))

    lie = {"inflate": inflate, "replay": replay, "forge": forge}[mode]

    def build_groups(*args, **kwargs):
        out = []
        for group in honest(*args, **kwargs):
            lie(group, out.append)
        return out

    rollout.build_groups = build_groups


if __name__ == "__main__":
    mode, *argv = sys.argv[1:]
    patch(mode)
    from peer.cli import main

    sys.argv = ["hivegrpo", *argv]
    main()
