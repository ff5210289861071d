"""The learning benchmark's bookkeeping: checkpoints, EM at a time, time to target, the table (no training)."""

from argparse import Namespace

from tests.benchmarks.learning import checkpoints, em_at, first_at, print_table, ratio, summarize

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
