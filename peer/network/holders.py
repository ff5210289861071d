"""Holders: the peers that serve an adapter version besides the learners that announced it.

A learner serves each new version to a couple of peers only (its blob server's seeding limit, see
:class:`peer.network.blobs.server.Seeding`); everyone else gets it from a peer that already holds it. A peer that
fetched a version and verified it says so with a :class:`~peer.protocol.HolderRecord` under
``holders_key(run, version)`` (its own owner subkey, signed, expiring after ``HOLDER_TTL`` seconds), but only while
fewer than ``HOLDERS_WANTED`` holders of that version are listed: the records per version stay bounded whatever the
number of peers, and so do the bytes every fetcher reads. docs/blobs.md, "Spreading adapters", says why.

A record is stored on the key's 2 nearest nodes (``HOLDER_REPLICAS``), the ones a narrow read asks, as a bucket
entry is. On 5, in a swarm of fewer nodes no full set of nearest nodes was found, so none was remembered
(``peer.network.near_store``), and every holder record of every peer at every version was a lookup of 3 requests and
3 stores: in the demo, 816 of a rollout peer's ~1,800 outgoing DHT requests over 60 s. On 2, a slot's nodes are
remembered for the 16 versions of the ring and beyond: 2 requests.

A holder record is a claim anyone can make. The fetch checks the bytes' sha256 as from any provider; a fetcher asks
a bounded number of holders before the announcers, gives a holder a short timeout, and does not ask one that failed
it again for a minute (:class:`BadHolders`, :func:`peer.run.adapters.fetch_adapter`): a liar costs a short failed
attempt, and at worst the fetch falls back to the learners, as before holders existed. Records are not matched
against heartbeats: that table grows with the number of peers, and a liar can write a heartbeat as easily.
"""

from __future__ import annotations

import threading
import time

from peer.log import get_logger
from peer.protocol import (
    HolderRecord,
    RecordError,
    from_dht_value,
    holders_key,
    owner_subkey,
    parse_owner_subkey,
    to_dht_value,
)

logger = get_logger(__name__)

HOLDER_TTL = 20.0  # s a holder record lives (the newest versions matter; older ones are superseded in seconds)
HOLDERS_WANTED = 8  # a peer lists itself only while fewer holders of the version are listed
HOLDER_REPLICAS = 2  # nodes a holder record is stored on: the 2 nearest, which a narrow read asks
HOLDERS_FIRST_FOR = 16  # versions a follower reads holders first (and lists itself) after a provider refused it


def read_holders(swarm, version: int, sha256: str, size: int) -> list[str]:
    """Peer ids (base58) listed as holding adapter ``version`` with these bytes, this peer excluded, newest first."""
    me = str(swarm.peer_id)
    found: list[tuple[float, str]] = []
    for subkey, item in swarm.get_dict(holders_key(swarm.run_id, version), narrow=True).items():
        try:
            parse_owner_subkey(subkey)
            record = from_dht_value(HolderRecord, item.value)
        except (RecordError, ValueError):
            continue
        if (record.version, record.sha256, record.size) == (version, sha256, size) and record.peer_id != me:
            found.append((record.created, record.peer_id))
    return list(dict.fromkeys(p for _, p in sorted(found, reverse=True)))


class BadHolders:
    """Holders that failed this peer recently (base58 id -> when), not asked again for ``forget`` seconds; the
    newest ``remember`` only. A liar's made-up holders then cost each fetcher one short attempt each."""

    def __init__(self, forget: float = 60.0, remember: int = 1024, clock=time.monotonic):
        self.forget, self.remember, self._clock = forget, remember, clock
        self._failed: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, peers) -> None:
        with self._lock:
            for peer in peers:
                self._failed.pop(peer, None)
                self._failed[peer] = self._clock()
            while len(self._failed) > self.remember:
                self._failed.pop(next(iter(self._failed)))

    def __contains__(self, peer: str) -> bool:
        with self._lock:
            at = self._failed.get(peer)
            if at is not None and self._clock() - at >= self.forget:
                del self._failed[peer]
                at = None
            return at is not None


class HolderUse:
    """Whether a follower reads a version's holders before asking its announcers, and lists itself once it has it.

    Where the learner's seeding covers every fetcher (a swarm of at most ``SEED_COPIES`` followers, like the demo's)
    no fetch is ever refused, so the holders key is read and written for nothing: in the demo that was ~580 of a
    rollout peer's ~1,550 DHT requests a minute. So a follower asks the announcers first and lists nothing until a
    provider refuses it (``seeded``, ``busy``: more fetchers than seeds); from then on, for ``versions`` versions
    past the one refused, it reads the holders first and lists itself, as every follower did before. A refused
    fetch reads the holders in its next rounds either way (:func:`peer.run.adapters.fetch_adapter`).

    Only refusals switch it, and a refusal only brings back the full use: a stranger can make honest followers use
    the holders key more, never less.
    """

    def __init__(self, versions: int = HOLDERS_FIRST_FOR):
        self.versions = versions
        self.until = -1  # the last version read holders-first
        self.refusals = 0

    def first(self, version: int) -> bool:
        return version <= self.until

    def refused(self, version: int) -> None:
        self.refusals += 1
        self.until = max(self.until, version + self.versions)


def advertise(swarm, version: int, sha256: str, size: int, ttl: float = HOLDER_TTL) -> bool:
    """Say that this peer holds and serves adapter ``version`` (``sha256``, ``size`` bytes) for ``ttl`` seconds."""
    now = time.time()
    record = HolderRecord(peer_id=str(swarm.peer_id), version=version, sha256=sha256, size=size, created=now)
    return swarm.store_many(
        [(holders_key(swarm.run_id, version), owner_subkey(swarm.public_key), to_dht_value(record), now + ttl)],
        "holder",
        narrow=True,
        replicas=HOLDER_REPLICAS,
    )[0]


__all__ = [
    "HOLDERS_FIRST_FOR",
    "HOLDERS_WANTED",
    "HOLDER_REPLICAS",
    "HOLDER_TTL",
    "BadHolders",
    "HolderUse",
    "advertise",
    "read_holders",
]
