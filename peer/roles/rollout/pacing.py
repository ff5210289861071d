"""When a rollout peer samples: the learners' pace, the bucket's backlog, and a strategy hook.

* :class:`Pacer`: this peer's share of what the learners consume (the demand in their newest announcement), so that
  the learner's pool holds about ``POOL_TARGET`` updates' worth of groups: enough to never wait, few enough to not
  go stale;
* :class:`Backlog`: backpressure without a demand: how many groups the newest version's bucket holds, counted on a
  thread (a DHT get) only once the estimate nears the bound;
* :class:`Pacing`: the hook a benchmark uses to emulate other machines (a run's does nothing).

:class:`~peer.roles.rollout.peer.RolloutPeer` waits on the first two between batches (``_wait_for_learners``).
"""

from __future__ import annotations

import threading

from peer.log import get_logger

logger = get_logger(__name__)


class Backlog:
    """How many groups the bucket of a version holds, counted on a thread (a DHT get) every ``interval`` s once
    the estimate reaches ``near`` (other peers' groups are unknown until then: the bound is approached, not kept
    exactly, which is all backpressure needs).

    :meth:`estimate` adds what this peer enqueued since the last count, so the sampler never waits on the DHT.
    """

    def __init__(self, store, interval: float, near: int = 0):
        self.store = store
        self.interval = interval
        self.near = near  # counts start once the estimate reaches this many groups
        self.version = -1
        self.active = True  # False while the learners' demand paces the peer: no counting then
        self._counted: tuple[int, int, int] = (-1, 0, 0)  # (version, count, enqueued then)
        self._enqueued: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bucket-backlog", daemon=True)
        self._thread.start()

    def enqueued(self, version: int, n: int) -> None:
        with self._lock:
            self._enqueued[version] = self._enqueued.get(version, 0) + n

    def enqueued_in(self, min_version: int, max_version: int) -> int:
        """Groups this peer handed to its publisher for versions ``min_version..max_version``."""
        with self._lock:
            return sum(n for v, n in self._enqueued.items() if min_version <= v <= max_version)

    def estimate(self, version: int) -> int:
        with self._lock:
            counted_version, count, then = self._counted
            now = self._enqueued.get(version, 0)
        if counted_version != version:
            return now
        # the count misses what was enqueued but not yet stored (scoring, the linger, the store itself): this
        # peer's own groups are a floor, or the peer would sample past the bound while its last batches publish
        return max(count + now - then, now)

    def count_now(self, version: int) -> None:
        with self._lock:
            then = self._enqueued.get(version, 0)
        count = self.store.count(version, version)
        with self._lock:
            self._counted = (version, count, then)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            # a count is a DHT get of the whole bucket: only worth it once the estimate nears the bound
            if not self.active or self.version < 0 or self.estimate(self.version) < self.near:
                continue
            try:
                self.count_now(self.version)
            except Exception as e:  # the network boundary: keep the old count, try again
                logger.warning("could not count the bucket of v%d: %s", self.version, e)


DEMAND_FRESH_FACTOR, DEMAND_FRESH_SLACK = 3.0, 1.0  # a demand older than 3 version intervals + 1 s is not followed
OWN_PER_VERSION = 4  # while paced, at most this many updates' worth of its own groups per version (or --max-inflight)
POOL_TARGET = 2  # updates' worth of groups the pacing keeps waiting in a learner's pool: one for the next update,
# one so that a late batch of one producer does not hold it up (the per-peer cap makes it wait for each producer)


class Pacer:
    """This peer's share of what the learners consume (the :class:`~peer.protocol.Demand` in the newest admitted
    announcement): ``groups_per_second / contributors``, raised while the learner's pool holds fewer than
    ``target`` groups (it would wait for groups) and lowered while it holds more (they would go stale), within
    [``LOW``, ``HIGH``] times the share. A batch of ``n`` groups started at ``t`` lets the next start at
    ``t + n / rate``. Pure arithmetic: the demand comes from the follower, the clock from the caller."""

    GAIN = 0.5  # how hard the pool's distance from the target moves the rate
    LOW, HIGH = 0.5, 2.0

    def __init__(self, target: int):
        self.target = max(1, target)
        self.last: tuple[float, int] | None = None  # (start, groups) of the previous batch

    def rate(self, demand) -> float | None:
        """Groups per second this peer should make; None: no demand measured (make as many as backpressure lets)."""
        if demand is None or demand.groups_per_second <= 0:
            return None
        share = demand.groups_per_second / max(1, demand.contributors)
        error = (self.target - demand.waiting) / self.target
        return share * min(self.HIGH, max(self.LOW, 1.0 + self.GAIN * error))

    def wait(self, demand, now: float) -> float:
        """Seconds until the next batch may start (0: now)."""
        rate = self.rate(demand)
        if rate is None or self.last is None:
            return 0.0
        start, n = self.last
        return max(0.0, start + n / rate - now)

    def started(self, now: float, n: int) -> None:
        self.last = (now, n)


class Pacing:
    """When a batch starts and how long it lasts, beyond the learners' pacing (:class:`Pacer`): a run needs nothing
    more, so both hooks do nothing here. A benchmark passes its own (``tests/benchmarks/harness.py``: a slower
    machine emulated by a pause, a synchronous barrier's peer that samples once per version)."""

    def before_batch(self, peer) -> None:
        """Called before each batch of ``peer`` (the :class:`~peer.roles.rollout.peer.RolloutPeer`), after the adapter
        swap and the learners' pacing."""

    def after_sampling(self, peer, started: float) -> None:
        """Called once a batch is sampled (``started``: its ``time.perf_counter()``), before it is published."""


__all__ = ["DEMAND_FRESH_FACTOR", "DEMAND_FRESH_SLACK", "OWN_PER_VERSION", "POOL_TARGET", "Backlog", "Pacer", "Pacing"]
