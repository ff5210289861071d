"""Heartbeats: every peer announces who it is, what it holds and how fast it goes, under ``{run}_peers``.

A :class:`Heartbeat` thread re-stores this peer's :class:`~peer.protocol.PeerRecord` every ``interval`` seconds
with an expiration ``ttl`` seconds ahead, under the subkey only its key can sign (a learner's and the coordinator's
also under ``{run}_core_peers``: every rollout peer looks the learners up every few seconds, and the whole table
grows with the number of peers, so it is not read for that); a peer that dies simply stops
refreshing and disappears within ``ttl``. On a clean stop it announces ``state="leaving"`` once (with the usual
expiration: hivemind keeps, per subkey, the entry that expires last, so a shorter one would be ignored).
:func:`live_peers` reads the table back, newest records only, optionally by role.
"""

from __future__ import annotations

import platform
import random
import threading
import time
from dataclasses import dataclass

from peer.log import get_logger
from peer.protocol import (
    PeerRecord,
    RecordError,
    core_peers_key,
    from_dht_value,
    owner_subkey,
    parse_owner_subkey,
    peers_key,
)

logger = get_logger(__name__)

HEARTBEAT_INTERVAL = 10.0
HEARTBEAT_TTL = 30.0
MAX_PROVIDERS_LISTED = 32  # other live peers blob_providers lists after the trusted ones (a fetch asks 8 at most)
CORE_ROLES = ("coordinator", "learner")  # their heartbeats also go under ``{run}_core_peers``: few, read by all


def default_hardware() -> str:
    return f"{platform.machine()} {platform.system()}"[:128]


class Heartbeat:
    """Announce this peer every ``interval`` seconds until :meth:`stop`; :meth:`update` changes what it says."""

    def __init__(
        self,
        swarm,
        role: str,
        *,
        interval: float = HEARTBEAT_INTERVAL,
        ttl: float = HEARTBEAT_TTL,
        hardware: str | None = None,
        reachable: bool | None = None,
        name: str | None = None,
    ):
        self.swarm = swarm
        self.interval = interval
        self.ttl = ttl
        self._lock = threading.Lock()
        now = time.time()
        self._fields = dict(
            peer_id=str(swarm.peer_id),
            role=role,
            adapter_version=-1,
            throughput=0.0,
            hardware=hardware or default_hardware(),
            reachable=not swarm.config.client_mode if reachable is None else reachable,
            maddrs=swarm.visible_maddrs()[:16],
            started=now,
            last_seen=now,
            state="starting",
            stats={},
            name=name,  # the volunteer's --name (a PeerName: 1-32 printable characters), or None
        )
        self.also: list = []  # callables run after every beat (e.g. a learner re-storing its admission)
        self.counters = None  # () -> stats added to every beat (e.g. the blob service's served and fetched bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{role}", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        with self._lock:
            self._fields.update(fields)

    def fields(self) -> dict:
        """A copy of what the next beat says (throughput, stats, ...), e.g. for a metrics scrape."""
        counters = self.counters() if self.counters is not None else {}
        with self._lock:
            return dict(self._fields, stats={**self._fields["stats"], **counters})

    def beat(self) -> bool:
        counters = self.counters() if self.counters is not None else {}
        with self._lock:
            self._fields["last_seen"] = time.time()
            record = PeerRecord(**dict(self._fields, stats={**self._fields["stats"], **counters}))
        run, value, expires = self.swarm.run_id, record.dict(), time.time() + self.ttl
        keys = [peers_key(run)] + ([core_peers_key(run)] if record.role in CORE_ROLES else [])
        subkey = owner_subkey(self.swarm.public_key)
        stored = self.swarm.store_many([(key, subkey, value, expires) for key in keys], "heartbeat")
        return all(stored)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                for also in self.also:
                    also()
            except Exception as e:  # the network boundary: keep beating, say why one failed
                logger.warning("heartbeat failed: %s", e)

    def stop(self, leaving: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)
        if leaving:
            self.update(state="leaving")
            try:
                self.beat()
            except Exception as e:
                logger.warning("could not announce leaving: %s", e)


@dataclass(frozen=True)
class LivePeer:
    owner: bytes  # the public key that signed the record
    record: PeerRecord


def live_peers(swarm, role: str | None = None, include_leaving: bool = False) -> list[LivePeer]:
    """Peers whose heartbeat has not expired, optionally of one role, sorted by peer id (learners and the
    coordinator from the small ``{run}_core_peers`` table)."""
    out = []
    key = core_peers_key(swarm.run_id) if role in CORE_ROLES else peers_key(swarm.run_id)
    for subkey, item in swarm.get_dict(key).items():
        try:
            owner = parse_owner_subkey(subkey)
            record = from_dht_value(PeerRecord, item.value)
        except (RecordError, ValueError):
            continue
        if role is not None and record.role != role:
            continue
        if record.state == "leaving" and not include_leaving:
            continue
        out.append(LivePeer(owner, record))
    return sorted(out, key=lambda p: p.record.peer_id)


def blob_providers(swarm, trusted=(), limit: int = MAX_PROVIDERS_LISTED) -> list:
    """PeerIDs to ask for a blob, in the order to ask them, this peer excluded: ``trusted`` first, in the order given
    (the peer id the manifest names for the coordinator, which seeds the model; admitted learners, which keep
    adapters), then at most ``limit`` other live peers in random order.

    A heartbeat is a claim anyone can make, and its peer id is not bound to its signer: sorted by the role a
    heartbeat claims, a thousand fake "coordinators" would push the real one out of the few providers a fetch asks
    (``MAX_PROVIDERS_TRIED``), and newcomers could never fetch the base model. So no heartbeat comes before a peer
    the run's own records name."""
    from hivemind.p2p import PeerID

    me = str(swarm.peer_id)
    first = [p for p in dict.fromkeys(trusted) if p != me]
    listed = dict.fromkeys(p.record.peer_id for p in live_peers(swarm))
    others = [p for p in listed if p != me and p not in first]
    random.shuffle(others)
    return [PeerID.from_base58(p) for p in first + others[:limit]]


class Reachable:
    """The peer ids of live peers of ``role`` (one, or a tuple of roles of the ``{run}_peers`` table) that others can
    reach (not in client mode), this peer excluded, re-read from the heartbeats at most every ``every`` seconds: a
    callable, e.g. a bucket store's ``push_to``.

    ``admitted`` (a :class:`~peer.network.admission.Admitted`): a heartbeat is a claim anyone can make; with it,
    only peers whose signer is an admitted learner bound to that peer id count (fake "learners" get no pushes).
    """

    def __init__(self, swarm, role: str | tuple[str, ...], every: float = 5.0, clock=time.monotonic, admitted=None):
        self.swarm, self.role, self.every, self._clock = swarm, role, every, clock
        self.admitted = admitted
        self._ids: tuple[str, ...] = ()
        self._read_at = -float("inf")

    def __call__(self) -> tuple[str, ...]:
        now = self._clock()
        if now - self._read_at >= self.every:
            self._read_at = now
            me = str(self.swarm.peer_id)
            try:
                roles = (self.role,) if isinstance(self.role, str) else self.role
                found = live_peers(self.swarm, roles[0] if len(roles) == 1 else None)  # several: one table's
                peers = [p for p in found if p.record.role in roles]
            except Exception as e:  # the network boundary: keep the last list, try again later
                logger.warning("could not read the %s peers: %s", self.role, e)
            else:
                self._ids = tuple(
                    p.record.peer_id
                    for p in peers
                    if p.record.reachable
                    and p.record.peer_id != me
                    and (self.admitted is None or self.admitted.admits(p.owner, p.record.peer_id))
                )
        return self._ids
