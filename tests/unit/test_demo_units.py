"""The demo's report arithmetic (pure functions; the demo itself runs for real in tests/integration/test_demo.py)."""

import json

from peer.demo.report import read_ledger, used_rate


def test_used_rate_is_groups_per_second_over_the_window():
    updates = [{"seconds": float(t), "groups": 16} for t in range(0, 31)]  # a version of 16 groups every second
    xs, ys = used_rate(updates, window=10.0)
    assert xs[0] == 10.0 and xs[-1] == 30.0
    assert all(y == 16.0 for y in ys)
    slow = [{"seconds": float(t), "groups": 16} for t in range(0, 41, 4)]  # one every 4 s
    assert set(used_rate(slow, window=8.0)[1]) == {4.0}


def test_read_ledger_keeps_versions_and_skips_cut_lines_and_updates_without_signal(tmp_path):
    line = {"version": 3, "sha256": "ab", "time": 105.5, "groups": 16, "reward_mean": 0.5, "staleness_mean": 1.0}
    line |= {"staleness_max": 2, "per_peer": {"f1": 16}}
    no_signal = {**line, "version": 3, "no_signal": True}
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(no_signal) + "\n" + json.dumps(line)[:20])
    rows = read_ledger(path, started=100.0)
    assert rows == [
        {
            "seconds": 5.5,
            "version": 3,
            "groups": 16,
            "reward_mean": 0.5,
            "staleness_mean": 1.0,
            "staleness_max": 2,
            "per_peer": {"f1": 16},
        }
    ]
    assert read_ledger(tmp_path / "missing.jsonl", started=0.0) == []
