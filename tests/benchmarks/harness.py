"""``hivegrpo`` with a benchmark's strategies injected: what the benchmarks' child processes run.

    python -m tests.benchmarks.harness join ... --bench-batch-seconds 2 --bench-one-batch-per-version
    python -m tests.benchmarks.harness learn ... --bench-barrier

The ``--bench-*`` options are taken out of the command line, and the rest is the ``hivegrpo`` command as a user
runs it. A run never needs them; they make the swarms the benchmarks compare:

* ``--bench-batch-seconds S``: each rollout batch lasts at least S seconds (a slower machine, emulated by a pause
  before its groups are published);
* ``--bench-one-batch-per-version``: a rollout peer samples one batch per adapter version (a synchronous barrier's
  peer);
* ``--bench-barrier``: the learner's intake waits for every contributor's share of the current version (the
  synchronous baseline, :class:`peer.roles.learner.intake.Intake`'s ``barrier``).
"""

from __future__ import annotations

import sys
import time

from peer.roles.rollout.peer import Pacing


class BenchPacing(Pacing):
    def __init__(self, batch_seconds: float = 0.0, one_batch_per_version: bool = False):
        if not batch_seconds >= 0.0:
            raise ValueError(f"--bench-batch-seconds must be >= 0, got {batch_seconds}")
        self.batch_seconds, self.one_batch_per_version = batch_seconds, one_batch_per_version

    def before_batch(self, peer) -> None:
        if self.one_batch_per_version and peer.stats["batches"]:
            peer.wait_for_newer(max(peer.versions_used))

    def after_sampling(self, peer, started: float) -> None:
        left = self.batch_seconds - (time.perf_counter() - started)
        if left > 0:  # a slower machine would publish these groups only now
            peer.pause(left)


def _take(argv: list[str], flag: str, value: bool = False):
    """Remove ``flag`` (and its value) from ``argv``; its value, True for a flag present, None when absent."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    if not value:
        del argv[i]
        return True
    if i + 1 >= len(argv):
        raise SystemExit(f"{flag} needs a value")
    found = argv[i + 1]
    del argv[i : i + 2]
    return found


def main(argv: list[str] | None = None) -> None:
    from peer.roles.learner import peer as learner
    from peer.roles.rollout import peer as rollout

    argv = list(sys.argv[1:] if argv is None else argv)
    seconds = _take(argv, "--bench-batch-seconds", value=True)
    one = bool(_take(argv, "--bench-one-batch-per-version"))
    barrier = bool(_take(argv, "--bench-barrier"))
    if seconds is not None or one:
        pacing, run_rollout = BenchPacing(float(seconds or 0.0), one), rollout.run_rollout
        rollout.run_rollout = lambda config, on_ready=None: run_rollout(config, on_ready, pacing=pacing)
    if barrier:
        run_learner = learner.run_learner
        learner.run_learner = lambda config, on_ready=None: run_learner(config, on_ready, barrier=True)
    from peer.cli import main as hivegrpo

    hivegrpo(argv)


if __name__ == "__main__":
    main()
