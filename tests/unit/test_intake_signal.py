"""A learner's intake and groups without signal (all rewards equal): verified and counted, never pooled or checked.

The groups are made here rather than sampled (``tests.helpers.intake.sample_run`` keeps only groups with signal):
each completion is the tokens of an answer to the signer's own example, right or wrong, its reward scored by the
run's task, so every group passes the intake's real checks (prompt re-derived from seed and seq, every reward
recomputed). Whether a group has signal is read off those rewards.
"""

import math
from types import SimpleNamespace

import pytest

from peer.roles.learner import intake as intake_module
from peer.roles.learner.intake import RECENT_SIGNAL
from peer.roles.learner.verify import REWARD_TOLERANCE, Refused
from tests.helpers import intake as ih
from tests.helpers.intake import answered_group
from tests.helpers.records import changed

# per seq: how many of the G completions answer right (0 or G: no signal)
PATTERN = {ih.A: [0, 1, 0, 3, "all", 1, 0, 2], ih.M: [1, 0, 2, 0]}


def has_signal(group) -> bool:
    return max(group.rewards) > min(group.rewards)


@pytest.fixture(scope="module")
def run():
    from coordinator.manifest import RunSettings, build_manifest
    from peer.model.loading import bundled_path, load_tokenizer
    from peer.run.spec import run_spec

    manifest = build_manifest(RunSettings(run_id="intake"), bundled_path(), "0" * 64, ih.PEER_ID)
    run = SimpleNamespace(spec=run_spec(manifest, ih.A), tokenizer=load_tokenizer(bundled_path()), groups={})
    G = run.spec.sampling.group_size
    for owner, pattern in PATTERN.items():
        run.groups[owner] = [
            answered_group(run, owner, seq, G if right == "all" else right) for seq, right in enumerate(pattern)
        ]
        assert [has_signal(g) for g in run.groups[owner]] == [r not in (0, "all") for r in pattern]
    assert {g.rewards[0] for g in run.groups[ih.A] if not has_signal(g)} == {0.0, 1.0}, "all wrong and all right"
    return run


def flat(run, owner):
    """``owner``'s honest groups whose rewards are all equal."""
    return [g for g in run.groups[owner] if not has_signal(g)]


def spread(run, owner):
    """``owner``'s honest groups whose rewards differ."""
    return [g for g in run.groups[owner] if has_signal(g)]


def test_the_groups_made_here_pass_the_intakes_checks(run):
    from peer.roles.learner.verify import check_group

    for owner, groups in run.groups.items():
        for g in groups:
            assert check_group(g, owner, run.spec, run.tokenizer, {0: ih.SHA0}.get) is None


def test_a_verified_group_with_all_rewards_equal_is_counted_not_pooled(run):
    intake = ih.new_intake(run)
    g = flat(run, ih.A)[0]
    assert intake.add(ih.fetched(ih.A, g), 0) == "no_signal"
    assert intake.counts["no_signal"] == 1 and intake.counts["admitted"] == 0
    assert ih.pool_ids(intake, ih.A) == [] and intake.waiting() == 0
    assert not intake.rejected and ih.A not in intake.banned, "an honest group without signal is no refusal"
    assert intake.seqs[ih.A][g.seq] == 0, "its seq is remembered (replays are still caught)"
    s = spread(run, ih.A)[0]
    assert intake.add(ih.fetched(ih.A, s), 0) is None
    assert ih.pool_ids(intake, ih.A) == [(0, s.seq)] and intake.counts["no_signal"] == 1


def test_a_signer_of_groups_without_signal_is_no_contributor(run):
    intake = ih.new_intake(run)
    for g in flat(run, ih.M):
        assert intake.add(ih.fetched(ih.M, g), 0) == "no_signal"
    assert ih.M not in intake.last_verified and ih.M not in intake.last_arrival
    assert intake.contributing(0) == [] and intake.contributors(0) == 0
    assert intake.take(0) is None, "no group was pooled: nothing for an update"


def sybil_keys(n: int) -> list[bytes]:
    """``n`` signers as the intake sees them (it only derives prompt seeds and fingerprints from the key)."""
    return [ih.M[:-2] + f"-sybil-{i}==".encode() for i in range(n)]


@pytest.mark.parametrize("sybils", [1, 100])
def test_sybils_with_groups_without_signal_neither_cap_nor_pace_a_lone_producer(run, sybils):
    """The attack of the 12-07 review (H1): fresh keys, each sending one all-wrong group for its own prompt (no model
    needed: the rewards are recomputed and right), made a lone honest producer's updates impossible (two
    "contributors" capped it at 12 of 16) and divided every producer's pace among the keys."""
    batch, producer = 16, ih.B
    lone = ih.new_intake(run, batch=batch)
    for seq in range(2 * batch):  # two updates' worth, each group with signal (1 or 2 of G right)
        assert lone.add(ih.fetched(producer, answered_group(run, producer, seq, 1 + seq % 2)), 0) is None
    for k in sybil_keys(sybils):
        group = answered_group(run, k, 0, 0)
        assert lone.add(ih.fetched(k, group), 0) == "no_signal", "verified: an honest-looking group without signal"
    assert lone.contributing(0) == [producer] and lone.contributors(0) == 1, "the sybils are no contributors"
    assert lone.cap(0) == batch, "the lone producer may fill a whole update"
    for _ in range(2):
        chosen = lone.take(0)
        assert chosen is not None and len(chosen) == batch and {a.owner for a in chosen} == {producer}
    assert not lone.counts["short_capped"]


def test_a_group_without_signal_is_never_drawn_for_a_logprob_check(run):
    intake = ih.new_intake(run, check_rate=1.0)  # every pooled group would be checked first
    for g in flat(run, ih.A):
        assert intake.add(ih.fetched(ih.A, g), 0) == "no_signal"
    assert intake.checks_waiting() == 0 and intake.pending_checks() == []
    with_signal = spread(run, ih.A)
    for g in with_signal:
        assert intake.add(ih.fetched(ih.A, g), 0) is None
    drawn = intake.pending_checks()
    assert sorted(a.group.seq for a in drawn) == sorted(g.seq for g in with_signal)
    assert all(has_signal(a.group) for a in drawn)


def test_an_update_takes_only_groups_with_signal(run):
    intake = ih.new_intake(run, batch=2, share_cap=1.0)
    for g in run.groups[ih.A]:
        intake.add(ih.fetched(ih.A, g), 0)
    chosen = intake.take(0)
    assert chosen is not None and len(chosen) == 2
    assert all(has_signal(a.group) for a in chosen)
    assert intake.counts["no_signal"] == len(flat(run, ih.A))
    assert intake.counts["admitted"] == len(spread(run, ih.A))


def test_no_signal_share_is_over_verified_groups_only(run):
    intake = ih.new_intake(run)
    assert intake.no_signal_share() == 0.0, "nothing verified yet"
    for g in run.groups[ih.A]:
        intake.add(ih.fetched(ih.A, g), 0)
    n, without = len(run.groups[ih.A]), len(flat(run, ih.A))
    assert intake.no_signal_share() == pytest.approx(without / n)
    before = intake.no_signal_share()
    # what is not verified leaves the share alone: a duplicate read, a stale group, a refused lie
    assert intake.add(ih.fetched(ih.A, run.groups[ih.A][0]), 0).reason == "duplicate"
    m_flat = flat(run, ih.M)[0]
    assert intake.add(ih.fetched(ih.M, m_flat), 0 + run.spec.staleness.tau_max + 1) == "stale"
    lie = changed(spread(run, ih.M)[0], rewards=[0.0] * run.spec.sampling.group_size)
    assert intake.add(ih.fetched(ih.M, lie), 0).reason == "reward"
    assert intake.no_signal_share() == before and len(intake.recent_signal) == n


def test_no_signal_share_covers_the_latest_recent_signal_groups(run, monkeypatch):
    assert RECENT_SIGNAL == 512
    monkeypatch.setattr(intake_module, "RECENT_SIGNAL", 2)  # read when an intake is made: a window of 2 groups
    intake = ih.new_intake(run)
    f, s = flat(run, ih.A), spread(run, ih.A)
    for g in f[:2]:
        intake.add(ih.fetched(ih.A, g), 0)
    assert intake.no_signal_share() == 1.0
    intake.add(ih.fetched(ih.A, s[0]), 0)
    assert intake.no_signal_share() == 0.5, "the oldest of the window fell out"
    intake.add(ih.fetched(ih.A, s[1]), 0)
    assert intake.no_signal_share() == 0.0
    assert intake.counts["no_signal"] == 2, "the count is of all time, the share of the window"


def test_a_group_claiming_equal_rewards_that_are_not_is_refused_as_a_reward_lie(run):
    g = spread(run, ih.M)[0]
    for claimed in (0.0, 1.0, g.rewards[0]):
        intake = ih.new_intake(run)
        lie = changed(g, rewards=[claimed] * len(g.rewards))
        result = intake.add(ih.fetched(ih.M, lie), 0)
        assert isinstance(result, Refused) and result.reason == "reward", (claimed, result)
        assert ih.M in intake.banned and intake.counts["no_signal"] == 0
        assert intake.no_signal_share() == 0.0 and not intake.recent_signal
        assert ih.M not in intake.last_verified and intake.contributors(0) == 0


def test_a_group_claiming_a_spread_its_completions_do_not_earn_is_refused(run):
    g = flat(run, ih.M)[0]
    intake = ih.new_intake(run)
    rewards = list(g.rewards)
    rewards[0] = 1.0 - rewards[0]  # one completion claims the other score: the group would seem to teach
    result = intake.add(ih.fetched(ih.M, changed(g, rewards=rewards)), 0)
    assert isinstance(result, Refused) and result.reason == "reward"
    assert ih.M in intake.banned and intake.waiting() == 0 and intake.checks_waiting() == 0
    assert intake.counts["no_signal"] == 0 and intake.counts["admitted"] == 0


def test_a_replay_of_a_group_without_signal_is_still_refused(run):
    g = flat(run, ih.M)[0]
    intake = ih.new_intake(run)
    assert intake.add(ih.fetched(ih.M, g), 0) == "no_signal"
    again = intake.add(ih.fetched(ih.M, g), 0)
    assert isinstance(again, Refused) and again.reason == "duplicate", "read twice: forgiven, not counted twice"
    assert intake.counts["no_signal"] == 1 and ih.M not in intake.banned
    replay = changed(g, version=1, adapter_sha256=ih.SHA1)  # the same seq under another version
    result = intake.add(ih.fetched(ih.M, replay), 1)
    assert isinstance(result, Refused) and result.reason == "replay"
    assert ih.M in intake.banned and intake.counts["no_signal"] == 1
    assert ih.M not in intake.last_verified, "a banned signer no longer contributes"


def within_tolerance(reward: float, up: bool) -> float:
    """The claim furthest from ``reward`` (above or below) that the rewards check still forgives."""
    out, back = (math.inf, -math.inf) if up else (-math.inf, math.inf)
    claim = reward + REWARD_TOLERANCE if up else reward - REWARD_TOLERANCE
    while abs(reward - claim) > REWARD_TOLERANCE:  # a few ulps at most
        claim = math.nextafter(claim, back)
    while abs(reward - math.nextafter(claim, out)) <= REWARD_TOLERANCE:
        claim = math.nextafter(claim, out)
    return claim


@pytest.mark.parametrize("r", [0.0, 1.0])
def test_a_spread_within_the_reward_tolerance_does_not_make_a_flat_group_take_a_slot(run, r):
    # The rewards check forgives up to REWARD_TOLERANCE per completion; a group whose real rewards are all equal
    # (all wrong: 0, all right: 1) must not pass as one with signal by claiming a spread that small (its
    # advantages would not be zero). Rewards are fractions: the claim moves into [0, 1].
    from peer.roles.learner.verify import check_group

    g = next(g for g in flat(run, ih.A) if g.rewards[0] == r)
    rewards = list(g.rewards)
    rewards[-1] = within_tolerance(r, up=r == 0.0)
    lie = changed(g, rewards=rewards)
    assert check_group(lie, ih.A, run.spec, run.tokenizer, {0: ih.SHA0}.get) is None, "forgiven by the check"
    intake = ih.new_intake(run)
    assert intake.add(ih.fetched(ih.A, lie), 0) == "no_signal", "a group whose real rewards are all equal was pooled"
    assert intake.waiting() == 0 and intake.checks_waiting() == 0
