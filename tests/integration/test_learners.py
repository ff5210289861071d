"""Two learners, one lineage, in real processes: `hivegrpo host` + `join` + two `learn` on loopback.

The first learner leads; the second finds it through the adapter announcements, takes its state, and from then on
computes a share of every update and applies the leader's clipped gradient itself. Their ledgers (one JSON line
per version: sha256, parent, the ``[signer, version, seq]`` of every group the update used) must agree version by
version; the leader is then killed with its whole process group, and the helper must go on making versions from
where the lineage was, with no version lost, repeated or going backwards.
"""

import json
import signal
from pathlib import Path

import pytest

from tests.helpers.swarm import join_args, learn_args, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


def _ledger(path: Path) -> dict[int, dict]:
    """The versions a learner made or applied (no-signal updates make none), by version."""
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["version"]: line for line in lines if not line.get("no_signal")}


@pytest.mark.timeout(420)
def test_two_learners_make_one_lineage_and_the_helper_takes_over_when_the_leader_dies(tmp_path, procs, reader):
    from peer.run.adapters import announcements

    host, info = start_host(procs, tmp_path, "team1", "--groups-per-version", "4", "--tau-max", "4", "--learners", "2")
    rollout = procs.start("rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4")
    ledger_a, ledger_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = procs.start(
        "learner-a",
        "learn",
        *learn_args(info, 0),
        "--json",
        "--cache-dir",
        str(tmp_path / "a"),
        "--ledger",
        str(ledger_a),
        new_session=True,
    )
    wait_until(lambda: len(_ledger(ledger_a)) >= 2, "the first learner's first versions", 180, [a, rollout])
    b = procs.start(
        "learner-b",
        "learn",
        *learn_args(info, 1),
        "--json",
        "--cache-dir",
        str(tmp_path / "b"),
        "--ledger",
        str(ledger_b),
    )
    wait_until(lambda: len(_ledger(ledger_b)) >= 4, "the second learner applying versions", 180, [a, b, rollout])

    def helped() -> bool:
        return any(line.get("helpers", 0) >= 1 for line in _ledger(ledger_a).values())

    wait_until(helped, "an update whose gradient the second learner helped compute", 60, [a, b])

    # both learners hold the same adapter at every version both of them have
    made_a, made_b = _ledger(ledger_a), _ledger(ledger_b)
    both = sorted(set(made_a) & set(made_b))
    assert len(both) >= 4, (sorted(made_a), sorted(made_b))
    assert all(made_a[v]["sha256"] == made_b[v]["sha256"] for v in both), [
        (v, made_a[v]["sha256"][:8], made_b[v]["sha256"][:8]) for v in both
    ]
    # and both announce it: each learner's announcement names the sha256 of its version in the ledgers
    swarm, _ = reader("team1", info["initial_peers"])
    announced = wait_until(
        lambda: (
            len(got := [(r.version, r.sha256, r.learner) for _, r in announcements(swarm) if r.version]) >= 2 and got
        ),
        "both learners' announcements",
    )
    shas = {v: line["sha256"] for v, line in {**_ledger(ledger_a), **_ledger(ledger_b)}.items()}
    assert len({learner for _, _, learner in announced}) == 2, announced
    assert all(sha == shas[v] for v, sha, _ in announced), [
        (v, sha[:8], shas.get(v, "")[:8]) for v, sha, _ in announced
    ]

    # kill -9 the leader (its DHT process and libp2p daemon too): the helper leads and the lineage goes on
    last_a = max(_ledger(ledger_a))
    procs.kill_group(a)
    # what the dead leader published last stays in the DHT a while: the helper's lineage must contain it
    published = [(r.version, r.sha256) for _, r in announcements(swarm) if r.version]
    wait_until(lambda: max(_ledger(ledger_b)) >= last_a + 4, "versions made after the leader died", 120, [b])
    made_a, made_b = _ledger(ledger_a), _ledger(ledger_b)
    assert all(made_b[v]["sha256"] == sha for v, sha in published if v in made_b), (published, sorted(made_b))
    lineage = {**made_a, **made_b}
    first = min(made_b)
    versions = sorted(v for v in lineage if v >= first)
    assert versions == list(range(first, versions[-1] + 1)), f"a version missing: {versions}"
    for v in versions[1:]:
        assert lineage[v]["parent_sha256"] == lineage[v - 1]["sha256"], f"v{v} is not the child of v{v - 1}"
    # the two agree on every version both hold but, at most, the leader's last: one it made and never announced
    # (killed before its helper held it), which the helper then made itself
    differ = {v for v in set(made_a) & set(made_b) if made_a[v]["sha256"] != made_b[v]["sha256"]}
    assert differ <= {max(made_a)}, sorted(differ)
    ids = [tuple(i) for v in sorted(lineage) for i in lineage[v]["ids"]]
    assert len(ids) == len(set(ids)), "a group counted in two updates"
    assert any(v > last_a + 1 and line.get("staleness_max") is not None for v, line in made_b.items())

    b.send_signal(signal.SIGTERM)
    out, _ = b.communicate(timeout=90)
    assert b.returncode == 0, procs.log(b)[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["team"]["leading"] and summary["team"]["shares"] >= 1, summary
    assert summary["adapter_version"] == max(_ledger(ledger_b)), summary
    log_b = procs.log(b)
    assert "helping learner" in log_b and "leading the learners" in log_b
    for p in (rollout, host):
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        assert p.returncode == 0, procs.log(p)[-3000:]


@pytest.mark.timeout(300)
def test_two_learners_started_at_once_settle_on_one_leader_and_one_lineage(tmp_path, procs, reader):
    from peer.network.heartbeat import live_peers

    host, info = start_host(procs, tmp_path, "team2", "--groups-per-version", "4", "--learners", "2")
    credentials = info["learner_credentials"]
    assert len(set(credentials)) == 2 and credentials[0] == info["learner_credential"], "a credential per learner"
    assert [c in line for c, line in zip(credentials, info["learn_commands"], strict=True)] == [True, True]
    rollout = procs.start("rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4")
    ledgers = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    learners = [
        procs.start(
            "learner-" + n, "learn", *learn_args(info, i), "--cache-dir", str(tmp_path / n), "--ledger", str(ledger)
        )
        for i, (n, ledger) in enumerate(zip("ab", ledgers, strict=True))
    ]  # neither sees the other's versions at start: each may lead a lineage of its own for a while

    def agreed() -> list[int]:
        a, b = (_ledger(p) for p in ledgers)
        both = sorted(v for v in set(a) & set(b) if a[v]["sha256"] == b[v]["sha256"])
        return both if len(both) >= 4 else []

    both = wait_until(agreed, "four versions both learners hold with the same sha256", 180, [*learners, rollout])
    a, b = (_ledger(p) for p in ledgers)
    newest = max(both)
    assert all(a[v]["sha256"] == b[v]["sha256"] for v in set(a) & set(b) if v >= newest - 3)
    swarm, _ = reader("team2", info["initial_peers"])

    def roles() -> list[float]:
        found = sorted(p.record.stats.get("leading", -1.0) for p in live_peers(swarm, "learner"))
        return found if found == [0.0, 1.0] else []

    wait_until(roles, "one learner leading and one helping, in their heartbeats", 30)
    for p in (*learners, rollout, host):
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=90)
        assert p.returncode == 0, procs.log(p)[-3000:]
