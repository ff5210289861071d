"""The benchmarks' harness (tests/benchmarks/harness.py): its ``--bench-*`` options become the strategies injected into
the role it starts, and never reach the ``hivegrpo`` command."""

from types import SimpleNamespace

import pytest

from tests.benchmarks import harness


class _Peer:
    """What a Pacing reads of a rollout peer, recording what it was asked to wait for."""

    def __init__(self, batches: int, versions_used: set[int]):
        self.stats, self.versions_used, self.calls = {"batches": batches}, versions_used, []

    def pause(self, seconds: float) -> None:
        self.calls.append(("pause", seconds))

    def wait_for_newer(self, version: int) -> None:
        self.calls.append(("newer", version))


def test_a_paced_batch_lasts_at_least_its_seconds_and_a_barrier_peer_waits_for_a_newer_version(monkeypatch):
    monkeypatch.setattr(harness.time, "perf_counter", lambda: 100.75)
    peer = _Peer(batches=3, versions_used={2, 5})
    pacing = harness.BenchPacing(batch_seconds=2.0, one_batch_per_version=True)
    pacing.before_batch(peer)
    pacing.after_sampling(peer, started=100.0)  # 0.75 s of sampling: 1.25 s left
    assert peer.calls == [("newer", 5), ("pause", pytest.approx(1.25))]
    fast = _Peer(batches=0, versions_used=set())
    harness.BenchPacing(batch_seconds=0.5).before_batch(fast)
    harness.BenchPacing(batch_seconds=0.5).after_sampling(fast, started=100.0)  # took longer than 0.5 s already
    assert fast.calls == [], "the first batch never waits for a version; a slow batch is not paused"
    with pytest.raises(ValueError, match="--bench-batch-seconds must be >= 0"):
        harness.BenchPacing(batch_seconds=-1.0)


def test_the_harness_takes_its_options_out_and_injects_them_into_the_role(monkeypatch):
    from peer.roles.learner import peer as learner
    from peer.roles.rollout import peer as rollout

    seen = []
    done = SimpleNamespace(to_json=dict)
    monkeypatch.setattr(rollout, "run_rollout", lambda config, on_ready=None, pacing=None: seen.append(pacing) or done)
    monkeypatch.setattr(
        learner, "run_learner", lambda config, on_ready=None, barrier=False: seen.append(barrier) or done
    )
    argv = ["join", "--run-id", "r", "--bench-batch-seconds", "1.5", "--bench-one-batch-per-version", "--json"]
    with pytest.raises(SystemExit) as exit_:
        harness.main(argv)
    assert exit_.value.code == 0
    assert seen[-1].batch_seconds == 1.5 and seen[-1].one_batch_per_version
    with pytest.raises(SystemExit) as exit_:
        harness.main(["learn", "--run-id", "r", "--bench-barrier", "--learner-credential", _credential(), "--json"])
    assert exit_.value.code == 0 and seen[-1] is True


def test_hivegrpo_itself_refuses_the_benchmark_options():
    from click.testing import CliRunner

    from peer.cli import main

    out = CliRunner().invoke(main, ["join", "--run-id", "r", "--bench-batch-seconds", "1"])
    assert out.exit_code == 2 and "No such option" in out.output


def _credential() -> str:
    from peer.network.admission import issue_credential
    from peer.network.swarm import load_signing_key

    return issue_credential(load_signing_key(None), "r").token
