"""A learner's lineage state, in pure pieces: where it resumes (``plan_resume``: its checkpoint, the journal's versions
after it whose adapters are still cached, or the swarm's newest version when that is newer) and what it records per
version (``VersionRecord``: the ledger's line, the history's entry, a team step's record)."""

from peer.roles.learner.checkpoint import plan_resume


def _chain(start: int, shas: list[str], parent: str) -> list[dict]:
    out = []
    for i, sha in enumerate(shas):
        out.append({"version": start + 1 + i, "sha": sha, "parent": parent, "intake": {}})
        parent = sha
    return out


META = {"version": 4, "sha256": "c4", "parent_sha256": "c3"}
ALL = lambda sha: True  # noqa: E731


def test_a_checkpoint_newer_than_the_swarm_is_taken_with_its_whole_journal():
    plan = plan_resume(META, _chain(4, ["j5", "j6"], "c4"), ALL, (3, "s3"))
    assert plan.own and (plan.version, plan.sha, plan.parent) == (6, "j6", "j5")
    assert [line["version"] for line in plan.chain] == [5, 6]
    assert plan.describe("D") == "checkpoint D + 2 journalled version(s)"


def test_the_journal_ends_at_the_newest_version_whose_adapter_is_cached():
    plan = plan_resume(META, _chain(4, ["j5", "j6", "j7"], "c4"), lambda sha: sha not in ("j6", "j7"), (0, "a0"))
    assert (plan.version, plan.sha, len(plan.chain)) == (5, "j5", 1)
    plan = plan_resume(META, _chain(4, ["j5", "j6", "j7"], "c4"), lambda sha: sha != "j6", (0, "a0"))
    assert (plan.version, plan.sha, len(plan.chain)) == (7, "j7", 3)  # only the adapter it resumes with is read


def test_without_a_checkpoint_the_journal_alone_resumes_and_says_so():
    plan = plan_resume(None, _chain(0, ["j1", "j2"], "a0"), ALL, (1, "j1"))
    assert plan.own and plan.version == 2 and plan.describe("D") == "journal D"


def test_nothing_of_its_own_means_the_swarm_without_rewriting_the_directory():
    plan = plan_resume(None, [], ALL, (7, "s7"))
    assert not plan.own and not plan.rewrite and plan.describe("D") == "swarm"
    assert not plan_resume(None, _chain(0, ["j1"], "a0"), lambda sha: False, (0, "a0")).own


def test_an_older_state_or_the_same_version_with_other_bytes_gives_way_to_the_swarm_and_is_rewritten():
    older = plan_resume(META, [], ALL, (5, "s5"))
    assert not older.own and older.rewrite and older.version == 4
    fork = plan_resume(META, [], ALL, (4, "other"))
    assert not fork.own and fork.rewrite


def test_the_same_version_and_bytes_as_announced_is_its_own_checkpoint():
    plan = plan_resume(META, [], ALL, (4, "c4"))
    assert plan.own and not plan.chain and plan.parent == "c3" and plan.describe("D") == "checkpoint D"


# ---------------------------------------------------------------------------------------------------- records


def _record(**over):
    from peer.roles.learner.record import VersionRecord

    fields = dict(version=3, sha256="s3", parent_sha256="s2", time=1.0e9, groups=8, staleness_mean=0.5)
    fields |= dict(staleness_max=1, reward_mean=0.25, step_seconds=0.1, per_peer={"ab" * 8: 8})
    return VersionRecord(**(fields | over))


def test_a_version_record_is_its_ledger_line_and_back():
    from peer.roles.learner.record import VersionRecord

    record = _record(stats={"loss": 0.5, "clip_fraction": 0.0, "helpers": 1})
    line = record.to_json()
    assert (
        line["loss"] == 0.5 and line["per_peer"] == {"ab" * 8: 8} and "stats" not in line and "no_signal" not in line
    )
    assert VersionRecord.from_json(line) == record
    silent = _record(parent_sha256=None)
    assert silent.no_signal and silent.to_json()["no_signal"] is True
    assert VersionRecord.from_json(silent.to_json()) == silent


def test_a_leaders_record_that_is_not_one_is_refused_with_a_value_error():
    import pytest

    from peer.roles.learner.record import VersionRecord

    line = _record(stats={}).to_json()
    for broken in (
        {k: v for k, v in line.items() if k != "groups"},
        {**line, "reward_mean": "high"},
        {**line, "time": None},
    ):
        with pytest.raises(ValueError, match="not a version record"):
            VersionRecord.from_json(broken)
    assert VersionRecord.from_json({**line, "ids": [[1, 2, 3]]}).stats == {"ids": [[1, 2, 3]]}  # kept, not lost
