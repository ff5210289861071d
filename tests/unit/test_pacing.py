"""A rollout peer's pacing to its learners' demand (roles/rollout/pacing.py: Pacer; RolloutPeer._wait_for_learners).

Pure arithmetic for the pacer; for the wait, a RolloutPeer made without ``__init__`` holds fakes of its follower
(the demand it read) and its backlog (the bucket count), as in tests/unit/test_rollout_units.py.
"""

import threading
import time
from types import SimpleNamespace

import pytest

from peer.protocol import Demand
from peer.roles.rollout import pacing
from peer.roles.rollout.pacing import Pacer
from peer.roles.rollout.peer import RolloutPeer
from tests.helpers.waiting import wait_until


def demand(gps: float, waiting: int = 16, contributors: int = 1) -> Demand:
    return Demand(groups_per_second=gps, waiting=waiting, contributors=contributors)


# ---------------------------------------------------------------------------------------------------- the pacer


def test_without_a_measured_demand_there_is_no_rate_and_no_wait():
    pacer = Pacer(16)
    pacer.started(100.0, 8)
    for d in (None, demand(0.0), demand(0.0, waiting=0, contributors=0)):
        assert pacer.rate(d) is None
        assert pacer.wait(d, 100.0) == 0.0


def test_the_first_batch_never_waits():
    assert Pacer(16).wait(demand(0.001), 0.0) == 0.0


def test_at_the_target_the_rate_is_this_peers_share_of_the_demand():
    pacer = Pacer(16)
    assert pacer.rate(demand(12.0, waiting=16, contributors=3)) == pytest.approx(4.0)
    assert pacer.rate(demand(12.0, waiting=16, contributors=1)) == pytest.approx(12.0)
    assert pacer.rate(demand(12.0, waiting=16, contributors=0)) == pytest.approx(12.0), "no contributor yet: all"


def test_a_short_pool_raises_the_rate_and_a_full_one_lowers_it_within_bounds():
    pacer = Pacer(16)
    share = 2.0
    rates = [pacer.rate(demand(8.0, waiting=w, contributors=4)) for w in range(0, 100)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False)), "never more for a fuller pool"
    assert rates[0] > share and rates[15] > share and rates[17] < share and rates[16] == pytest.approx(share)
    assert all(Pacer.LOW * share - 1e-9 <= r <= Pacer.HIGH * share + 1e-9 for r in rates)
    assert rates[-1] == pytest.approx(Pacer.LOW * share), "a pool far over the target: the lowest rate"
    empty = share * min(Pacer.HIGH, 1.0 + Pacer.GAIN)
    assert rates[0] == pytest.approx(empty), "an empty pool: the most the gain gives"


def test_the_constants_keep_the_rate_positive_and_around_the_share():
    assert 0.0 < Pacer.LOW < 1.0 < Pacer.HIGH and Pacer.GAIN > 0.0
    assert Pacer(0).target == 1 and Pacer(-5).target == 1, "a target of at least one group"
    assert Pacer(0).rate(demand(1.0, waiting=1)) == pytest.approx(1.0), "a pool at the (raised) target of 1"


def test_the_next_batch_may_start_n_over_rate_after_the_last_one():
    pacer = Pacer(16)
    d = demand(4.0, waiting=16, contributors=2)  # rate 2 groups/s
    pacer.started(100.0, 8)  # a batch of 8 at t = 100: the next at t = 104
    assert pacer.wait(d, 100.0) == pytest.approx(4.0)
    assert pacer.wait(d, 101.5) == pytest.approx(2.5)
    assert pacer.wait(d, 104.0) == 0.0
    assert pacer.wait(d, 250.0) == 0.0, "never negative"
    assert pacer.wait(demand(8.0, waiting=16, contributors=2), 101.0) == pytest.approx(1.0), "the demand now"
    pacer.started(104.0, 2)  # only the latest batch counts
    assert pacer.wait(d, 104.0) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------- the wait


class Follower:
    """No new version comes; ``demand`` is what the newest announcement said."""

    def __init__(self, demand=None, seen_ago: float = 0.0):
        self.demand = demand
        self.demand_seen = time.monotonic() - seen_ago  # when the newest version (and its demand) came
        self.waits: list[float] = []

    def wait(self, timeout):  # the real one returns early only when a new version is ready
        self.waits.append(timeout)
        time.sleep(min(timeout, 0.05))

    def take(self):
        return None


class Backlog:
    """A bucket stuffed by strangers: the estimate is far over any bound."""

    def __init__(self, estimate: int = 10**9):
        self.version, self.active, self.value, self.asked = -1, True, estimate, 0

    def estimate(self, version):
        self.asked += 1
        return self.value

    def enqueued_in(self, low, high):  # this peer's own groups of the version: none yet
        return 0


def peer(follower, backlog, *, max_pause: float = 10.0) -> RolloutPeer:
    p = RolloutPeer.__new__(RolloutPeer)
    p._stop, p.follower, p.stats = threading.Event(), follower, {"waited_s": 0.0}
    p.session, p.max_inflight, p.MAX_PAUSE = SimpleNamespace(version=3), 32, max_pause
    p.spec = SimpleNamespace(groups_per_version=16)
    p.backlog, p.pacer, p.own_bound = backlog, Pacer(16), 64
    return p


def timed(p: RolloutPeer) -> float:
    t0 = time.perf_counter()
    p._wait_for_learners()
    return time.perf_counter() - t0


def test_with_a_demand_the_peer_paces_and_a_stuffed_bucket_does_not_throttle_it():
    backlog = Backlog()
    p = peer(Follower(demand(8.0, waiting=16, contributors=1)), backlog)  # 8 groups/s for this peer
    assert timed(p) < 0.1, "no batch yet: start at once"
    p.pacer.started(time.perf_counter(), 4)  # 4 groups: the next batch 0.5 s later
    took = timed(p)
    assert 0.4 <= took < 1.5, took
    assert backlog.active is False and backlog.asked == 0, "the bucket count decides nothing (and is not taken)"
    assert 0.3 <= p.stats["waited_s"] <= took


def test_a_long_pacing_wait_looks_at_the_demand_again_every_half_second():
    follower = Follower(demand(1.0, waiting=16, contributors=1))
    p = peer(follower, Backlog())
    p.pacer.started(time.perf_counter(), 100)  # 100 s at 1 group/s ...

    def faster():  # ... until the learners announce they consume 1000 groups/s, 0.3 s into the wait: a time,
        time.sleep(0.3)  # not a condition, since the wait under test is what must notice it
        follower.demand = demand(1000.0, waiting=16, contributors=1)

    threading.Thread(target=faster).start()
    took = timed(p)
    assert took < 1.5, took
    assert max(follower.waits) <= 0.5 + 1e-9, "never one long sleep on a demand that may change"


def test_pacing_still_waits_at_most_max_pause():
    p = peer(Follower(demand(0.01, waiting=16, contributors=1)), Backlog(), max_pause=0.3)
    p.pacer.started(time.perf_counter(), 8)  # 800 s away
    assert 0.3 <= timed(p) < 1.5


def test_a_new_version_does_not_cut_pacing_short_but_ends_backpressure():
    p = peer(Follower(demand(8.0, waiting=16, contributors=1)), Backlog())
    p._follow = lambda: True  # a new version arrives at every look
    p.pacer.started(time.perf_counter(), 4)
    assert timed(p) >= 0.4, "paced: the batch is due in 0.5 s whatever the version"
    p = peer(Follower(None), Backlog())
    p._follow = lambda: True
    assert timed(p) < 1.0, "backpressure: a new version ends the wait (not MAX_PAUSE = 10 s)"


def test_without_a_demand_the_old_backpressure_applies():
    backlog = Backlog()
    p = peer(Follower(None), backlog, max_pause=0.3)
    p.pacer.started(time.perf_counter(), 10**6)  # the pacer has no say without a demand
    assert 0.3 <= timed(p) < 2.0
    assert backlog.active is True and backlog.asked >= 1 and backlog.version == 3
    backlog.value = 31  # room in the bucket: no pause
    assert timed(p) < 0.1


def test_a_demand_of_zero_groups_per_second_falls_back_to_backpressure():
    backlog = Backlog()
    p = peer(Follower(demand(0.0, waiting=0, contributors=0)), backlog, max_pause=0.3)
    assert 0.3 <= timed(p) < 2.0, "the bucket is full: the old backpressure waits"
    assert backlog.asked >= 1 and backlog.version == 3


def test_a_demand_of_zero_keeps_the_bucket_counted_while_it_decides():
    # backpressure decides on the bucket count: its counting thread must not be switched off meanwhile
    backlog = Backlog()
    p = peer(Follower(demand(0.0, waiting=0, contributors=0)), backlog, max_pause=0.1)
    p._wait_for_learners()
    assert backlog.active is True, "backpressure on a count that is no longer refreshed"


def test_an_inactive_backlog_takes_no_count():
    class Store:
        def __init__(self):
            self.counts = 0

        def count(self, lo, hi):
            self.counts += 1
            return 100

    store = Store()
    backlog = pacing.Backlog(store, interval=0.01, near=0)
    try:
        backlog.active, backlog.version = False, 2
        time.sleep(0.15)  # 15 counting intervals: that no count happens can only be seen by letting time pass
        assert store.counts == 0
        backlog.active = True
        wait_until(lambda: store.counts >= 1, "a count once the backlog is active", 2.0, interval=0.01)
        assert backlog.estimate(2) == 100
    finally:
        backlog.stop()


def test_a_demand_whose_version_came_long_ago_no_longer_paces():
    """A learner that stopped announces nothing new: after 3 version intervals (16 groups at 16/s: 1 s, at least
    the 2 s between a waiting learner's re-announcements) + 1 s its last demand is not followed and backpressure
    decides again (here: an empty bucket, so the batch starts)."""
    demand = Demand(groups_per_second=16.0, waiting=32, contributors=1)
    fresh = peer(Follower(demand), Backlog(0))
    fresh.pacer.started(time.perf_counter(), 8)
    assert timed(fresh) >= 0.3 and fresh.backlog.active is False, "a fresh demand paces (8 groups at 16/s)"
    stale = peer(Follower(demand, seen_ago=9.0), Backlog(0))
    stale.pacer.started(time.perf_counter(), 8)
    assert timed(stale) < 0.2 and stale.backlog.active is True and stale.backlog.asked >= 1


def test_while_paced_a_peer_makes_at_most_its_own_bound_of_groups_per_version():
    """However fresh the demand, a peer holding one version stops at ``own_bound`` groups of it (its own count:
    no one else moves it) and waits for a new version, at most MAX_PAUSE."""

    class Own(Backlog):
        def enqueued_in(self, low, high):
            return 64

    p = peer(Follower(Demand(groups_per_second=1000.0, waiting=0, contributors=1)), Own(0), max_pause=0.6)
    waited = timed(p)
    assert 0.5 <= waited < 2.0, "waited for a new version until MAX_PAUSE"
