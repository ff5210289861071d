"""The learner's two network threads: reading the buckets, and announcing adapter versions and metrics."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque

from peer.log import get_logger
from peer.protocol import AdapterRecord, Demand, MetricsRecord, metrics_key, owner_subkey, to_dht_value
from peer.protocol.limits import MAX_ANCESTORS
from peer.run.adapters import announce_adapter, store_announcement

logger = get_logger(__name__)

METRICS_EVERY = 2.0  # s between two stores of the learner's metrics record at most (a version comes every ~0.4 s)
REANNOUNCE_EVERY = 120.0  # s; the announcement lives ANNOUNCEMENT_TTL (600 s): an idle learner stays findable
REPLICATE_EVERY = 1.0  # s between two stores of the announcement on the adapter key's replicas at most (followers
# get every version at once, pushed; the replicas, read by newcomers, observers and status pages, the newest each
# second: stored with every version, the replicas' copies were a third of the learner's requests in the demo)


class Fetcher:
    """Reads the buckets of the staleness window on a thread; hands each new entry over exactly once.

    A store that :attr:`~peer.network.buckets.BucketStore.waits` (a learner's: rollout peers push their entries to
    its DHT node) is read as a wait: every read covers the whole window of the node's own copy in one call to the
    DHT process, which answers as soon as an entry is stored there (or after ``interval``), so a pushed group
    reaches the intake without a poll's delay. The network is read as a store without that copy is: down to as many
    versions behind as the groups read in the last ``LAG_SECONDS`` were (at least the newest two: where rollout
    peers publish); the whole window every ``FULL_EVERY`` reads (the late groups of slow peers); and a version's
    bucket once more as it leaves the window, so nothing published into the window goes unread — a late replay is
    still caught, though its group is too old to use. (Reading the whole window from the network every poll made the
    learner's DHT process the busiest process of the demo: every read fetches and validates every entry of every
    bucket again. Reading only the newest two left the groups of peers a few versions behind to the full reads,
    seconds later: a learner making 2-3 versions a second found them stale.)
    """

    FULL_EVERY = 8
    MIN_GAP = 0.05  # s between two reads at least, however often entries arrive or the learner wakes the fetcher
    LAG_SECONDS = 4.0  # s over which the versions behind of the groups read set how deep the next reads go

    def __init__(self, store, window: int, interval: float, skip=(), newcomers=()):
        self.store = store
        self.skip = skip  # signers whose entries are not even read (the intake's bans and mutes; a live view)
        self.newcomers = newcomers  # signers with little verified history: their blobs share half the workers
        self.window = window
        self.interval = interval
        self.version = 0
        self.queue: queue.Queue = queue.Queue()
        self.errors = 0
        self._seen: set = set()
        self._polls, self._last = 0, 0
        self._lags: deque[tuple[float, int]] = deque()  # (monotonic time, most versions behind) of recent reads
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bucket-fetcher", daemon=True)

    def wake(self) -> None:
        """Read again now, not at the next interval: the learner waits for groups (at most every MIN_GAP s; a
        waiting read answers when entries arrive anyway)."""
        self._wake.set()

    def start(self) -> Fetcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def depth(self) -> int:
        """How many versions below the newest the next (not full) read of the network goes: as far behind as the
        groups read in the last ``LAG_SECONDS`` were, at least 1, at most the window (what a stranger can make it
        read is bounded so)."""
        since = time.monotonic() - self.LAG_SECONDS
        while self._lags and self._lags[0][0] < since:
            self._lags.popleft()
        return max(1, min(self.window, max((lag for _, lag in self._lags), default=1)))

    def _run(self) -> None:
        waits = self.store.waits
        while not self._stop.is_set():
            self.poll(self.interval if waits else 0.0)
            if waits:
                self._stop.wait(self.MIN_GAP)  # entries arriving one by one: read them a few at a time
            elif self._wake.wait(self.interval):  # woken by a waiting learner: read again, but not at once
                self._wake.clear()
                self._stop.wait(self.MIN_GAP)

    def poll(self, wait: float = 0.0) -> None:
        """One read: the window (the network: the newest versions, the whole window every ``FULL_EVERY``-th time),
        then the versions leaving. ``wait``: see the class docstring."""
        version = self.version
        depth = self.window if self._polls % self.FULL_EVERY == 0 else self.depth()
        self._polls += 1
        hi = version - self.window - 1  # the versions that left the window since the last poll: their last read
        lo = max(0, self._last - self.window, hi - self.FULL_EVERY + 1)  # a jump (a resume) reads a few, not all
        try:
            fetched = self.store.fetch(
                max(0, version - self.window),
                version,
                self._seen,
                self.skip,
                wait=wait,
                network_from=version - depth,
                newcomers=self.newcomers,
            )
            if hi >= lo:
                fetched += self.store.fetch(lo, hi, self._seen, self.skip, newcomers=self.newcomers)
            self._last = version
        except Exception as e:  # the network boundary: say it, try again
            self.errors += 1
            logger.warning("could not read the buckets: %s", e)
            self._stop.wait(self.interval)
            fetched = []
        behind = [version - f.version for f in fetched if f.group is not None]
        behind = [lag for lag in behind if 0 <= lag <= self.window]
        if behind:
            self._lags.append((time.monotonic(), max(behind)))
        for f in fetched:
            self._seen.add(f.id)
            self.queue.put(f)
        oldest = version - self.window - 2
        self._seen = {i for i in self._seen if i[1] >= oldest}


class Announcer:
    """Announces the newest version (and the metrics) on a thread, so the learner never waits on the DHT; an
    older version not yet announced when a newer one is ready is skipped (followers want the newest). The metrics
    record (for status pages) is stored at most every ``METRICS_EVERY`` s, the newest one submitted, and at a flush:
    stored with every version, it was half of the learner's DHT requests in the demo.

    A submission may carry a ``gate``: it is announced only once ``gate()`` is true (a leading learner's helpers
    must hold the version first, :meth:`peer.roles.learner.team.lead.Lead.holds`); a newer submission replaces a
    waiting one.

    Each version is pushed to the followers (rollout peers) as it is announced; the adapter key's replicas get the
    newest announcement at most every ``REPLICATE_EVERY`` s (:func:`~peer.run.adapters.store_announcement`), and
    every announcement when no follower is known or none took it. A flush waits for that store too.
    """

    GATE_POLL = 0.01  # s between two looks at a closed gate
    GATE_FLUSH = 3.0  # s a flush waits for a closed gate before giving up on that submission

    def __init__(self, swarm, blobs, lineage=None, exempt=None, followers=None):
        self.swarm = swarm
        self.blobs = blobs
        self.lineage = lineage  # () -> {version: sha256} of the learner's recent lineage (for ancestors)
        self.exempt = exempt  # () -> peer ids served whenever they ask (the run's other learners), not seeded to
        self.followers = followers  # () -> peer ids each announcement is pushed to (peer.run.adapters)
        self.announced = -1
        self.failures = 0
        self._pending: tuple | None = None
        self._current: tuple | None = None
        self._blocked_since: float | None = None  # monotonic time a gate first held back what is pending now
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._metrics: MetricsRecord | None = None  # the newest metrics submitted and not yet stored
        self._metrics_at = -math.inf  # monotonic time of the last store of the metrics
        self._replicated_at = -math.inf  # monotonic time of the last store of an announcement on the replicas
        self._unreplicated: AdapterRecord | None = None  # announced to the followers alone, newest, not yet stored
        self._thread = threading.Thread(target=self._run, name="adapter-announcer", daemon=True)
        self._thread.start()

    def submit(
        self,
        version: int,
        blob: bytes,
        parent_sha: str,
        metrics: MetricsRecord | None,
        gate=None,
        demand: Demand | None = None,
    ) -> None:
        with self._lock:
            self._pending = (version, blob, parent_sha, metrics, gate, demand)
            self._idle.clear()
        self._wake.set()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted is announced; a submission whose gate stays closed for GATE_FLUSH s
        is dropped (it was never announced, so nobody is left holding it). The newest metrics are stored then too."""
        announced = self._wait_announced(timeout)
        self._store_metrics(force=True)  # the newest, however recent the last store
        return announced

    def _wait_announced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._idle.wait(min(self.GATE_FLUSH, max(0.0, deadline - time.monotonic()))):
            with self._lock:
                pending = self._pending
                if pending is not None and pending[4] is not None and not pending[4]():
                    logger.warning("adapter v%d was not announced: its helpers did not take it", pending[0])
                    self._pending = None
                    self._idle.set()
                    return False
            if time.monotonic() >= deadline:
                return False
        return True

    def blocked_for(self) -> float:
        """Seconds the gate has held back the pending submissions (0 when nothing waits on a gate)."""
        since = self._blocked_since
        return 0.0 if since is None else time.monotonic() - since

    def _ancestors(self, version: int, parent: str) -> list[str]:
        """The sha256 of the versions before ``version``, newest first, from the lineage this learner holds —
        only where it is this announcement's (its ``version - 1`` is ``parent``); else just the parent."""
        known = self.lineage().copy() if self.lineage is not None else {}
        if not parent or known.get(version - 1) != parent:
            return [parent] if parent else []
        out, v = [], version - 1
        while v >= 0 and v in known and len(out) < MAX_ANCESTORS:
            out.append(known[v])
            v -= 1
        return out

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            timeout = METRICS_EVERY if self._metrics is not None else REANNOUNCE_EVERY
            if self._unreplicated is not None:
                timeout = min(timeout, max(0.0, self._replicated_at + REPLICATE_EVERY - time.monotonic()))
            self._wake.wait(timeout=timeout)
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, None
                if pending is not None and pending[4] is not None and not pending[4]():
                    self._pending = pending  # not yet: look again soon (a newer submission replaces it)
                    self._wake.set()
                    pending = None
                    gated = True
                    if self._blocked_since is None:
                        self._blocked_since = time.monotonic()
                else:
                    gated = False
                    self._blocked_since = None
            if gated:
                self._stop.wait(self.GATE_POLL)
                continue
            if pending is None:
                if self._current is not None and time.monotonic() - last >= REANNOUNCE_EVERY:
                    pending = self._current
                else:
                    self._replicate()
                    self._store_metrics(force=False)
                    with self._lock:
                        if self._pending is None and self._unreplicated is None:
                            self._idle.set()
                    continue
            version, blob, parent, metrics, _, demand = pending
            try:
                replicate = time.monotonic() - self._replicated_at >= REPLICATE_EVERY
                record = announce_adapter(
                    self.swarm,
                    self.blobs,
                    version,
                    blob,
                    parent,
                    ancestors=self._ancestors(version, parent),
                    demand=demand,
                    exempt=self.exempt() if self.exempt is not None else None,
                    push_to=self.followers() if self.followers is not None else (),
                    replicate=replicate,
                )
                if replicate:
                    self._replicated_at, self._unreplicated = time.monotonic(), None
                else:  # to the followers alone (or, when none took it, the replicas too: stored again, harmless)
                    self._unreplicated = record
                self.announced, self._current, last = version, pending, time.monotonic()
            except Exception as e:  # the network boundary: keep learning; the next version is announced anyway
                self.failures += 1
                logger.warning("could not announce adapter v%d: %s", version, e)
            if metrics is not None:
                with self._lock:
                    self._metrics = metrics
            self._store_metrics(force=False)
            with self._lock:
                if self._pending is None and self._unreplicated is None:
                    self._idle.set()

    def _replicate(self) -> None:
        """Store the newest announcement that only the followers got on the replicas, once ``REPLICATE_EVERY``
        passed since the last such store (on the announcer's thread)."""
        record = self._unreplicated
        if record is None or time.monotonic() - self._replicated_at < REPLICATE_EVERY:
            return
        try:
            store_announcement(self.swarm, record)
        except Exception as e:  # the network boundary: the next version's store carries the lineage on
            self.failures += 1
            logger.warning("could not store the announcement of adapter v%d: %s", record.version, e)
        self._replicated_at = time.monotonic()
        if self._unreplicated is record:
            self._unreplicated = None

    def _store_metrics(self, force: bool) -> None:
        """Store the newest metrics submitted, if ``METRICS_EVERY`` passed since the last store (or ``force``).
        Runs on the announcer's thread, and on a flush's caller: each set of metrics is taken once."""
        with self._lock:
            metrics = self._metrics
            if metrics is None or (not force and time.monotonic() - self._metrics_at < METRICS_EVERY):
                return
            self._metrics, self._metrics_at = None, time.monotonic()
        item = (metrics_key(self.swarm.run_id), owner_subkey(self.swarm.public_key), to_dht_value(metrics))
        try:  # one key: its nodes are reused
            self.swarm.store_many([(*item, time.time() + 600.0)], "learner metrics", narrow=True)
        except Exception as e:  # the network boundary: the next ones are stored anyway
            logger.warning("could not store the learner's metrics: %s", e)


__all__ = ["Announcer", "Fetcher"]
