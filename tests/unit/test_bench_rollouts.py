"""The rollout benchmark's arithmetic on made-up ledgers (the benchmark itself runs whole swarms, never as a test)."""

from tests.benchmarks.rollouts import accepted_rate, gaps, own_rate, pct, propagation, share_of, taken_rate


def versions(*times_groups):
    return [{"version": i + 1, "time": t, "groups": g} for i, (t, g) in enumerate(times_groups)]


def test_rates_count_what_happened_inside_the_window_only():
    learner = versions((10.0, 24), (11.0, 24), (12.0, 24), (14.0, 24), (30.0, 24))
    assert accepted_rate(learner, 10.0, 14.0) == 72 / 4.0  # the first version in the window opens the span
    assert accepted_rate(learner, 13.0, 20.0) is None  # a single version has no span
    assert gaps(learner, 10.0, 14.0) == [1.0, 1.0, 2.0]
    batches = [
        {"time": 1.0, "groups": 8, "sample_seconds": 9.0},  # before the window
        {"time": 11.0, "groups": 8, "sample_seconds": 1.0},
        {"time": 13.0, "groups": 8, "sample_seconds": 3.0},  # a paced batch: its own time, waits between excluded
    ]
    assert own_rate(batches, 10.0, 20.0) == 16 / 4.0
    assert own_rate(batches, 20.0, 30.0) is None
    for line, no_signal in zip(learner, (5, 9, 9, 13, 40), strict=True):  # a running count on each line
        line["dropped_no_signal"] = no_signal
    assert taken_rate(learner, 10.0, 14.0) == (72 + 13 - 5) / 4.0, "used, and counted without signal, in the span"
    assert taken_rate(learner, 13.0, 20.0) is None


def test_propagation_measures_each_peer_from_the_announcement_to_its_swap():
    learner = versions((100.0, 24), (101.0, 24), (102.0, 24))
    a = [
        {"kind": "start", "time": 90.0, "version": 0},
        {
            "kind": "swap",
            "time": 100.5,
            "version": 1,
            "announced": 100.1,
            "size": 100,
            "fetched_bytes": 100,
            "fetches": 1,
        },
        # skips v2: v3 reaches it at 102.6, which is when it first samples with something at least as new as v2
        {
            "kind": "swap",
            "time": 102.6,
            "version": 3,
            "announced": 102.2,
            "size": 100,
            "fetched_bytes": 220,
            "fetches": 2,
        },
        {"kind": "batch", "time": 103.0},
    ]
    b = [
        {"kind": "start", "time": 90.0, "version": 0},
        {
            "kind": "swap",
            "time": 100.3,
            "version": 1,
            "announced": 100.1,
            "size": 100,
            "fetched_bytes": 100,
            "fetches": 1,
        },
        {
            "kind": "swap",
            "time": 101.4,
            "version": 2,
            "announced": 101.1,
            "size": 100,
            "fetched_bytes": 200,
            "fetches": 2,
        },
        {"kind": "batch", "time": 101.5},  # then it died: v3 is not counted for it
    ]
    late = [{"kind": "start", "time": 102.0, "version": 2}, {"kind": "batch", "time": 103.0}]  # started with v2 loaded
    p = propagation({"a": a, "b": b, "late": late}, learner, 100.0, 103.0)
    # v1 (announced 100.1): a 0.4, b 0.2; v2 (101.1; from b's swap line): a 1.5, b 0.3; v3 (102.2): a 0.4
    expected = sorted([0.4, 0.2, 1.5, 0.3, 0.4])
    assert p["pairs"] == 5
    assert p["p50_s"] == round(expected[2], 4) and p["p95_s"] == round(expected[4], 4)
    assert p["every_peer_p50_s"] == 0.4  # the last peer per version: 0.4, 1.5, 0.4
    # a: 220 bytes in 2 fetches of a 100-byte adapter, 2 swaps, 3 versions announced while it ran
    assert p["bytes"]["a"] == {"per_fetch": 1.1, "per_version_announced": round(2.2 / 3, 4), "per_version_used": 1.1}
    # b: 200 bytes, 2 fetches, 2 swaps, 2 versions announced before its last line (v3 came after it died)
    assert p["bytes"]["b"] == {"per_fetch": 1.0, "per_version_announced": 1.0, "per_version_used": 1.0}
    assert p["bytes"]["late"] is None  # it never swapped


def test_pct_and_share():
    assert pct([], 0.5) is None
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0 and pct([3.0, 1.0, 2.0], 0.95) == 3.0
    learner = [{"groups": 24, "per_peer": {"x": 8, "y": 16}}, {"groups": 24, "per_peer": {"y": 24}}]
    assert share_of(learner, "x") == round(8 / 48, 4) and share_of([], "x") is None
