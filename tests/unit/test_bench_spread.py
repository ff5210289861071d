"""The spread benchmark's window arithmetic on made-up ledgers (the benchmark itself runs whole swarms, never as a
test)."""

from tests.benchmarks.spread import (
    adapter_size,
    counter_span,
    peer_traffic,
    served_sum,
    summarize,
    upload_per_version,
)

SIZE = 1000


def learner(*times_served, size=SIZE):
    """Learner ledger lines: ``(time, served_bytes or None)`` per version."""
    out = []
    for i, (t, served) in enumerate(times_served):
        line = {"version": i + 1, "time": t, "groups": 24}
        if served is not None:
            line["served_bytes"] = served
        if size is not None:
            line["size"] = size
        out.append(line)
    return out


def swap(t, version, fetched, served=None, announced=None):
    line = {"kind": "swap", "time": t, "version": version, "announced": announced or t - 0.2, "size": SIZE}
    line |= {"fetched_bytes": fetched, "fetches": fetched // SIZE}
    if served is not None:
        line["served_bytes"] = served
    return line


def test_learner_upload_counts_the_served_bytes_between_the_first_and_last_version_of_the_window():
    # before the window the learner served every peer itself (4 per version); inside, 1.5 per version
    versions = learner((5.0, 0), (10.0, 4000), (12.0, 5500), (14.0, 7000), (16.0, 8500), (30.0, 20000))
    assert upload_per_version(versions, 10.0, 16.0) == 1.5  # 4500 bytes over 3 versions of 1000 bytes
    assert upload_per_version(versions, 0.0, 100.0) == round(20000 / 5 / SIZE, 4)
    # the size from elsewhere (a rollout peer's swap line) when the learner's lines lack it
    no_size = learner((10.0, 0), (12.0, 3000), size=None)
    assert upload_per_version(no_size, 0.0, 20.0) is None
    assert upload_per_version(no_size, 0.0, 20.0, size=500) == 6.0


def test_learner_upload_is_none_without_two_versions_or_without_the_counter():
    versions = learner((10.0, 0), (12.0, 1500), (30.0, 9000))
    assert upload_per_version(versions, 11.0, 20.0) is None  # one version in the window: no span
    assert upload_per_version(versions, 40.0, 50.0) is None  # none
    old = learner((10.0, None), (12.0, None), (14.0, None))  # a build without served_bytes
    assert upload_per_version(old, 0.0, 20.0) is None
    half = learner((10.0, 0), (12.0, 1000), (14.0, None))  # the last version in the window lacks it
    assert upload_per_version(half, 0.0, 20.0) is None


def test_adapter_size_prefers_the_learner_then_any_swap_line():
    peers = {"rollout-1": [{"kind": "start", "time": 0.0, "version": 0}, swap(1.0, 1, 1000)]}
    assert adapter_size(learner((1.0, 0), size=777), peers) == 777
    assert adapter_size(learner((1.0, 0), size=None), peers) == SIZE
    assert adapter_size(learner((1.0, 0), size=None), {"rollout-1": []}) is None


def test_peer_counters_grow_from_the_last_swap_before_the_window_to_the_last_inside():
    rows = [
        {"kind": "start", "time": 1.0, "version": 0},
        swap(5.0, 1, 1000, served=0),  # before the window: the baseline
        {"kind": "batch", "time": 9.0},
        swap(11.0, 2, 2000, served=1000),
        swap(13.0, 4, 3000, served=3000),  # v3 superseded before its fetch: never fetched
        swap(15.0, 5, 4000, served=5000),
        swap(25.0, 6, 5000, served=9000),  # after the window
    ]
    base, last = counter_span(rows, 10.0, 20.0)
    assert (base["version"], last["version"]) == (1, 5)
    # 4 versions announced between (2..5): 3000 fetched, 5000 served
    assert peer_traffic(rows, 10.0, 20.0, SIZE) == {"served_per_version": 1.25, "fetched_per_version": 0.75}
    # a peer that joins inside the window counts from its start line (counters 0)
    late = [{"kind": "start", "time": 12.0, "version": 2}, swap(13.0, 3, 1000, served=500), swap(14.0, 4, 2000)]
    assert peer_traffic(late, 10.0, 20.0, SIZE) == {"served_per_version": None, "fetched_per_version": 1.0}
    assert peer_traffic(late[:2], 10.0, 20.0, SIZE) == {"served_per_version": 0.5, "fetched_per_version": 1.0}


def test_peer_traffic_is_none_where_a_counter_or_the_swaps_are_missing():
    none = {"served_per_version": None, "fetched_per_version": None}
    old = [{"kind": "start", "time": 1.0, "version": 0}, swap(11.0, 1, 1000), swap(13.0, 2, 2000)]
    assert peer_traffic(old, 10.0, 20.0, SIZE) == {"served_per_version": None, "fetched_per_version": 1.0}
    never = [{"kind": "start", "time": 1.0, "version": 0}, {"kind": "batch", "time": 12.0}]
    assert counter_span(never, 10.0, 20.0) is None and peer_traffic(never, 10.0, 20.0, SIZE) == none
    stuck = [{"kind": "start", "time": 1.0, "version": 0}, swap(5.0, 1, 1000, served=0)]  # no swap in the window
    assert counter_span(stuck, 10.0, 20.0) is None and peer_traffic(stuck, 10.0, 20.0, SIZE) == none
    headless = [swap(11.0, 1, 1000, served=1000)]  # no start line, nothing before the window
    assert peer_traffic(headless, 10.0, 20.0, SIZE) == none
    assert peer_traffic(old, 10.0, 20.0, None) == none
    assert served_sum({"a": {"served_per_version": 0.5}, "b": {"served_per_version": None}}) == 0.5
    assert served_sum({"a": {"served_per_version": None}}) is None


def test_summarize_one_round():
    # 3 versions in the window [10, 16]; the learner served 1 adapter per version, the two peers the rest
    versions = learner((5.0, 0), (10.0, 2000), (13.0, 3000), (16.0, 4000))
    a = [
        {"kind": "start", "time": 1.0, "version": 0},
        swap(5.5, 1, 1000, served=0, announced=5.0),
        swap(10.4, 2, 2000, served=500, announced=10.0),
        swap(13.4, 3, 3000, served=1000, announced=13.0),
        swap(16.4, 4, 4000, served=1500, announced=16.0),
        {"kind": "batch", "time": 17.0},
    ]
    b = [
        {"kind": "start", "time": 1.0, "version": 0},
        swap(5.8, 1, 1000, served=1000, announced=5.0),
        swap(10.8, 2, 2000, served=1500, announced=10.0),
        swap(13.2, 3, 3000, served=2000, announced=13.0),
        swap(16.2, 4, 4000, served=2500, announced=16.0),
        {"kind": "batch", "time": 17.0},
    ]
    s = summarize(versions, {"rollout-1": a, "rollout-2": b}, 10.0, 16.0)
    assert s["versions"] == 3 and s["versions_per_s"] == 0.5 and s["adapter_size"] == SIZE
    assert s["learner_upload_per_version"] == 1.0
    # each peer: from its v1 swap (5.5 / 5.8) to its v3 swap (v4's at 16.2 / 16.4 is after the window): 2 versions
    assert s["peers"]["rollout-1"] == {"served_per_version": 0.5, "fetched_per_version": 1.0}
    assert s["peers"]["rollout-2"] == {"served_per_version": 0.5, "fetched_per_version": 1.0}
    assert s["rollout_served_per_version_sum"] == 1.0
    # delays: v2 0.4 / 0.8, v3 0.4 / 0.2, v4 0.4 / 0.2 (v4 at 16.0 is in the window)
    assert s["propagation"]["pairs"] == 6
    assert s["propagation"]["p50_s"] == 0.4 and s["propagation"]["p95_s"] == 0.8
    assert s["propagation"]["every_peer_p50_s"] == 0.4  # per version: 0.8, 0.4, 0.4
