"""The demo's observer: a peer of the run (role ``observer``) that follows the adapter and measures exact match.

It starts like any peer (:func:`peer.run.session.open_session`: manifest, base model as the run says, the newest
adapter), takes the newest version when it is about to evaluate (:meth:`Observer.catch_up`: one read of the
announcements through an :class:`~peer.run.adapters.AdapterFollower`, the blob over P2P from the learner or a
holder, checked against the announced sha256), and reads what the swarm publishes about itself: the heartbeats
(rollout peers' throughput) and the admitted learners' :class:`~peer.protocol.MetricsRecord`.

It only reads, so its DHT node runs in client mode: it serves no DHT requests, holds no replicas, is pushed no
announcements and lists itself as the holder of no adapter. It fetches a version only when it evaluates (every
``--eval-every`` seconds), not every version the learner makes: following every version, as a rollout peer must,
cost the demo's 2 cores more than the observer's evaluations (docs/demo.md, "The observer"). Exact match is
:func:`peer.model.evaluate.exact_match` on the task's held-out set — what ``hivegrpo eval`` runs — on the adapter
the observer holds, so the demo's numbers are checkable with the saved adapter file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from peer.closers import Closers
from peer.log import get_logger
from peer.network.swarm import NetworkConfig
from peer.protocol import MetricsRecord, metrics_key, owned_records

logger = get_logger(__name__)


@dataclass
class Snapshot:
    """What the swarm looked like at one moment."""

    adapter_version: int
    learner: dict | None  # the newest MetricsRecord, as a dict
    rollout: dict[str, float] = field(default_factory=dict)  # peer id -> groups/s from its heartbeat


def newest_metrics(found: dict, admitted: dict) -> MetricsRecord | None:
    """The newest of the ``MetricsRecord`` entries ``found`` (a DHT dictionary: owner subkey → value) that an
    admitted learner signed about itself (``admitted``: signer key → :class:`~peer.network.admission.Admission`);
    anyone can write the key, so the others, and what does not parse, are skipped."""
    newest = None
    for owner, record in owned_records(found, MetricsRecord):
        admission = admitted.get(owner)
        if admission is None or admission.peer_id != record.learner:
            continue
        if newest is None or record.version > newest.version:
            newest = record
    return newest


class Observer:
    def __init__(self, run_id: str, initial_peers: list[str], coordinator: str, cache_dir: Path):
        from peer.run.session import SessionConfig

        network = NetworkConfig.loopback(initial_peers, client_mode=True)  # a reader: it serves nobody
        self.config = SessionConfig(run_id, network, coordinator, device="cpu", cache_dir=cache_dir)
        self._closers = Closers()
        self.session = None
        self.follower = None

    def start(self) -> Observer:
        from peer.run.adapters import AdapterFollower
        from peer.run.session import open_session

        self.session = s = open_session(self.config, "observer", self._closers)
        # not started: no thread follows every version; catch_up polls once when asked. No own copy to watch
        # (local_every=0): a client-mode node holds nothing and is pushed nothing.
        self.follower = AdapterFollower(
            s.swarm,
            s.blobs,
            s.version,
            local_every=0,
            others=s.providers,
            admitted=s.admitted,
            check=s.check_adapter,
            held_sha=s.sha,
        )
        return self

    @property
    def version(self) -> int:
        return self.session.version

    def catch_up(self) -> bool:
        """Read the announcements, fetch and load the newest adapter if it is newer than the one held; whether the
        held version changed. A failed read or fetch is logged and leaves the held version (the next call tries
        again)."""
        try:
            self.follower.poll()
        except Exception as e:  # the network boundary: a bad announcement or a failed fetch
            logger.warning("could not fetch the newest adapter: %s", e)
        ready = self.follower.take()
        if ready is None:
            return False
        found, blob = ready
        self.session.swap(found.version, found.sha256, blob)
        self.follower.mark_held(found.version, found.sha256)
        return True

    def snapshot(self) -> Snapshot:
        from peer.network.heartbeat import live_peers

        s = self.session
        newest = newest_metrics(s.swarm.get_dict(metrics_key(s.spec.run_id), narrow=True), s.admitted.learners())
        group = s.spec.sampling.group_size
        rollout = {
            p.record.peer_id: p.record.throughput / group for p in live_peers(s.swarm, "rollout", include_leaving=True)
        }
        learner = None if newest is None else newest.dict()
        return Snapshot(s.version, learner, rollout)

    def exact_match(self, n: int) -> float:
        from peer.model.evaluate import exact_match

        s = self.session
        result = exact_match(s.model, s.tokenizer, s.spec.task, n=n, max_new_tokens=s.spec.sampling.max_new_tokens)
        return result.exact_match

    def close(self) -> None:
        self._closers.close()


__all__ = ["Observer", "Snapshot"]
