"""Probation: a new signer's groups with signal are all checked before any is pooled, within a budget.

Keys are free: with checks only sampled (``check_rate`` 0.1), a forger with many keys had ~90 % of its groups used
before each key's first check. Here every group of a fresh key is checked by the real log-prob check on the bundled
model (as the learner's loop runs it) before an update may take it, and a flood of fresh keys costs a bounded number
of checks per update, never a proven producer's place.
"""

import pytest

from peer.roles.learner import intake as intake_module
from peer.roles.learner.intake import PROBATION, PROBATION_BUDGET
from peer.roles.learner.verify import LogprobCheck, check_logprobs_many
from tests.helpers.intake import A, B, M, answered_group, fetched, new_intake, sample_run


@pytest.fixture(scope="module")
def run():
    return sample_run({A: PROBATION + 8, B: 4})


def sybils(n: int) -> list[bytes]:
    return [M[:-2] + f"-sybil-{i}==".encode() for i in range(n)]


def check_all(run, intake) -> int:
    """Run the learner's log-prob check on every group waiting for one (the real model, the run's tolerance) and
    hand each verdict back; returns how many were checked."""
    pending = intake.pending_checks()
    if pending:
        verdicts = check_logprobs_many(
            run.model, [a.group for a in pending], run.spec, check=LogprobCheck.with_tolerance(0.05)
        )
        for a, refused in zip(pending, verdicts, strict=True):
            intake.checked(a, refused)
    return len(pending)


def test_a_new_signer_is_checked_in_full_until_it_passes_probation_then_only_sampled(run):
    intake = new_intake(run, batch=4, check_rate=0.1)
    groups = run.groups[A]
    for g in groups[:PROBATION]:
        assert intake.add(fetched(A, g), 0) is None
    assert intake.on_probation(A) and intake.waiting() == 0, "nothing pooled before its check"
    assert intake.checks_waiting() == PROBATION, "every one waits for a check"
    assert intake.contributors(0) == 0, "not a contributor before a group of it is pooled"
    assert check_all(run, intake) == PROBATION and not intake.banned
    assert not intake.on_probation(A) and intake.waiting() == PROBATION and intake.contributors(0) == 1
    for g in groups[PROBATION:]:
        assert intake.add(fetched(A, g), 0) is None
    assert intake.checks_waiting() < len(groups) - PROBATION, "proven: its checks are sampled (rate 0.1)"


def test_updates_take_a_signer_out_of_probation_and_a_restart_remembers_it(run):
    intake = new_intake(run, batch=4, check_rate=0.1)
    for g in run.groups[A][:PROBATION]:
        intake.add(fetched(A, g), 0)
    check_all(run, intake)
    for _ in range(2):
        assert intake.take(0) is not None
    again = new_intake(run, batch=4, check_rate=0.1)
    again.restore(intake.state())
    assert not again.on_probation(A), "its groups in updates prove it after a restart"
    assert again.on_probation(B), "one never seen is new"
    assert B in again.newcomers and A not in again.newcomers, "the reader's view: whose blobs share half the workers"


def test_with_checks_off_there_is_no_probation(run):
    intake = new_intake(run, batch=4, check_rate=0.0)
    assert intake.add(fetched(B, run.groups[B][0]), 0) is None
    assert not intake.on_probation(B) and intake.waiting() == 1 and intake.checks_waiting() == 0


@pytest.mark.parametrize("keys", [10, 100])
def test_forged_groups_of_many_fresh_keys_never_reach_an_update(run, keys):
    """Each sybil key sends groups with signal for its own prompts (rewards right, so they pass every model-free
    check) whose log-probs no model gave; a proven honest producer keeps filling updates beside them."""
    batch = 4
    intake = new_intake(run, batch=batch, check_rate=0.1)
    honest = run.groups[A]
    for g in honest[:PROBATION]:
        intake.add(fetched(A, g), 0)
    check_all(run, intake)
    assert not intake.on_probation(A)
    checked_keys, used_by = set(), {}
    for i, key in enumerate(sybils(keys)):
        for seq in range(2):
            if intake.add(fetched(key, answered_group(run, key, seq, 1 + seq)), 0) is None:
                checked_keys.add(key)
        if i % batch == batch - 1:
            check_all(run, intake)
            chosen = intake.take(0)
            for a in chosen or []:
                used_by[a.owner] = used_by.get(a.owner, 0) + 1
    check_all(run, intake)
    assert checked_keys, "the forged groups passed the model-free checks and waited for a log-prob check"
    assert set(used_by) <= {A}, f"a forged group went into an update: {used_by}"
    assert used_by.get(A, 0) > 0 and intake.counts["short_capped"] == 0, "the honest producer was never held back"
    assert all(key in intake.banned for key in checked_keys), "each key whose group was checked is banned"
    assert intake.rejected["logprobs"] >= 1


def test_a_flood_of_fresh_keys_costs_a_bounded_number_of_checks_per_update(run):
    batch = 4
    intake = new_intake(run, batch=batch, check_rate=0.1)
    for g in run.groups[A][:PROBATION]:
        intake.add(fetched(A, g), 0)
    check_all(run, intake)
    assert intake.take(0) is not None, "an update: the budget the producer's probation spent is renewed"
    let_in = [intake.add(fetched(key, answered_group(run, key, 0, 1)), 0) for key in sybils(200)]
    budget = PROBATION_BUDGET * batch
    assert sum(v is None for v in let_in) == budget, "no more checks than the budget until the next update"
    assert all(v.reason == "busy" for v in let_in if v is not None) and not intake.banned, "busy: refused, no ban"
    assert intake.add(fetched(A, run.groups[A][PROBATION + 1]), 0) is None, "a proven producer is never busy"
    for g in run.groups[A][PROBATION + 2 : PROBATION + 2 + batch]:
        intake.add(fetched(A, g), 0)
    check_all(run, intake)
    assert intake.take(0) is not None, "an update, which renews the budget"
    one = sybils(201)[-1]
    mine = [intake.add(fetched(one, answered_group(run, one, seq, 1)), 0) for seq in range(PROBATION + 2)]
    assert sum(v is None for v in mine) == PROBATION, "one new key gets at most its probation's checks per renewal"
    assert intake_module.FORGIVEN.count("busy") == 1


def test_the_ban_list_keeps_the_most_recent_and_a_forgotten_liar_is_caught_again(run, monkeypatch):
    monkeypatch.setattr(intake_module, "MAX_BANS", 8)
    intake = new_intake(run, batch=4, check_rate=0.1)
    keys = sybils(20)
    for key in keys:
        intake.ban(key, "reward: lied")
    assert list(intake.banned) == keys[-8:] and intake.bans_made == 20 and intake.counts["bans_forgotten"] == 12
    forgotten = keys[0]
    assert intake.on_probation(forgotten), "a forgotten signer is a new one"
    assert intake.add(fetched(forgotten, answered_group(run, forgotten, 0, 1)), 0) is None
    check_all(run, intake)
    assert forgotten in intake.banned and intake.waiting() == 0, "its forged group: caught at its first check"
    again = new_intake(run, batch=4, check_rate=0.1)
    again.restore(intake.state())
    assert len(again.banned) == 8, "a checkpoint holds the bounded list"


def test_each_update_tells_the_bans_made_since_the_last_even_past_the_bound(run, monkeypatch):
    from types import SimpleNamespace

    from peer.roles.learner.state import LearnerState

    monkeypatch.setattr(intake_module, "MAX_BANS", 4)
    intake = new_intake(run, batch=4)
    state = SimpleNamespace(intake=intake, bans_recorded=0)  # what intake_delta reads of the learner's state
    keys = sybils(7)
    intake.ban(keys[0], "a")
    assert LearnerState.intake_delta(state, [])["banned"] == {keys[0].hex(): "a"}
    assert LearnerState.intake_delta(state, [])["banned"] == {}, "told once"
    for key in keys[1:]:
        intake.ban(key, "b")
    told = LearnerState.intake_delta(state, [])["banned"]
    assert list(told) == [k.hex() for k in keys[3:]], "six new bans, four remembered: those four, in order"
    assert state.bans_recorded == intake.bans_made == 7
