"""The learning benchmark's bookkeeping: checkpoints, EM at a time, time to target, the table (no training)."""

from argparse import Namespace

from tests.benchmarks.learning import (
    checkpoints,
    em_at,
    first_at,
    median,
    print_summary,
    print_table,
    ratio,
    ratios_of,
    summarize,
    summarize_rounds,
)

CURVE = [(0.0, 0, 0.3), (15.1, 100, 0.56), (30.2, 200, 0.7), (45.0, 300, 0.81), (60.1, 400, 0.78), (75.3, 500, 0.9)]


def test_checkpoints_are_whole_minutes_and_the_end():
    assert checkpoints(300) == [60, 120, 180, 240, 300]
    assert checkpoints(40) == [40]
    assert checkpoints(150) == [60, 120, 150]


def test_em_at_takes_the_newest_evaluation_made_by_then():
    assert em_at(CURVE, 60, 7.5) == 0.78  # the evaluation at 60.1 s counts for 60 s
    assert em_at(CURVE, 30, 0) == 0.56
    assert em_at(CURVE, 1000, 7.5) == 0.9
    assert em_at([(27.0, 0, 0.3)], 10, 5) is None


def test_first_at_and_ratio():
    assert first_at(CURVE, 0.8) == 45.0
    assert first_at(CURVE, 0.95) is None
    assert ratio(60.0, 45.0) == 1.333
    assert ratio(None, 45.0) is None and ratio(60.0, None) is None


def test_summarize_and_table_with_a_skipped_and_a_failed_system(capsys):
    args = Namespace(duration=60.0, eval_every=15.0, target=0.8)
    ran = summarize(
        {
            "clock": "c",
            "steps_per_s": 7.0,
            "groups_per_s": 112.0,
            "step_seconds_mean": 0.14,
            "staleness_mean": 0.0,
            "evaluations": [list(row) for row in CURVE],
        },
        args,
    )
    assert ran["em_at"] == {"60": 0.78} and ran["seconds_to_target"] == 45.0 and ran["final_exact_match"] == 0.9
    systems = {
        "reference": ran,
        "trl": {"system": "trl", "skipped": "TRL is not installed"},
        "swarm": {"system": "swarm", "error": "exit code 1; the log's end:\nboom"},
    }
    print_table({"systems": systems, "ratios": {"swarm / reference": None}}, args)
    out = capsys.readouterr().out
    assert "TRL is not installed" in out and "swarm failed: exit code 1" in out and "45.0" in out


def test_median_counts_a_system_that_never_reached_the_target_as_slowest():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median([None, 1.0, 2.0]) == 2.0  # None ranks last, the middle is 2.0
    assert median([None, None, 1.0]) is None
    assert median([None, 1.0]) is None  # the middle pair holds the None
    assert median([]) is None


def _ran(curve, args):
    return summarize({"clock": "c", "evaluations": [list(row) for row in curve]}, args)


def test_rounds_give_each_ratio_by_round_its_median_and_how_often_the_goal_was_met(capsys):
    args = Namespace(duration=120.0, eval_every=15.0, target=0.8, rounds=3)
    fast = [(0.0, 0, 0.3), (45.0, 1, 0.81), (120.0, 2, 0.9)]
    slow = [(0.0, 0, 0.3), (60.0, 1, 0.7), (90.0, 2, 0.82)]
    never = [(0.0, 0, 0.3), (60.0, 1, 0.5), (120.0, 2, 0.6)]
    rounds = []
    for swarm, reference in ((slow, fast), (fast, slow), (never, fast)):
        systems = {"swarm": _ran(swarm, args), "reference": _ran(reference, args)}
        rounds.append({"systems": systems, "ratios": ratios_of(systems, args.target)})
    assert rounds[0]["ratios"] == {"swarm / reference time to EM ≥ 0.8": 2.0}
    summary = summarize_rounds(rounds, args)
    row = summary["ratios"]["swarm / reference time to EM ≥ 0.8"]
    assert row["rounds"] == [2.0, 0.5, None]
    assert row["median"] == 2.0 and row["met"] == 1
    swarm = summary["systems"]["swarm"]
    assert swarm["seconds_to_target"] == [90.0, 45.0, None] and swarm["median_seconds"] == 90.0
    # EM at 60 s: slow 0.7, fast 0.81, never 0.5; at 120 s: 0.82, 0.9, 0.6
    assert swarm["em_at"] == {"60": round((0.7 + 0.81 + 0.5) / 3, 3), "120": round((0.82 + 0.9 + 0.6) / 3, 3)}
    print_summary(summary, args)
    out = capsys.readouterr().out
    assert "median 2.000" in out and "≤ 1.3 in 1 of 3" in out and "90.0, 45.0, -" in out


def test_rounds_leave_out_a_failed_run_of_a_system():
    args = Namespace(duration=60.0, eval_every=15.0, target=0.8, rounds=2)
    ok = {"swarm": _ran(CURVE, args), "reference": _ran(CURVE, args)}
    failed = {"swarm": {"system": "swarm", "error": "exit code 1"}, "reference": _ran(CURVE, args)}
    rounds = [{"systems": s, "ratios": ratios_of(s, args.target)} for s in (ok, failed)]
    summary = summarize_rounds(rounds, args)
    assert summary["systems"]["swarm"]["rounds"] == 1 and summary["systems"]["reference"]["rounds"] == 2
    assert summary["ratios"]["swarm / reference time to EM ≥ 0.8"]["rounds"] == [1.0, None]
