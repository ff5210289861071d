"""Credit per contributor without a network (peer.run.credit): counting in the intake, merging by maximum, the
bounds, the record's schema, the checkpoint + journal + host state that keep it, the contributors table of status,
and the rollout peer's progress line. The DHT is a dict here (``_Swarm``); signatures and credentials are real."""

import json

import msgpack
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from coordinator.credit_state import CreditState
from peer.network import admission
from peer.network.admission import Admitted
from peer.network.buckets import Fetched
from peer.protocol import (
    Credit,
    CreditRecord,
    RecordError,
    credit_key,
    from_dht_value,
    key_fingerprint,
    learners_key,
    owner_subkey,
    pack,
    to_dht_value,
    unpack,
)
from peer.protocol.limits import MAX_CREDIT, MAX_CREDIT_REASONS, MAX_CREDITED, MAX_DHT_VALUE_BYTES, MAX_INT
from peer.roles.learner.checkpoint import append_journal
from peer.roles.learner.checkpoint import restore_credit as restore
from peer.roles.rollout.progress import Counters, OwnCredit, Progress, progress_line
from peer.run.credit import CreditTable, admitted_credits, contributor_rows, merge_admitted, merged
from peer.status import render, summarize
from tests.helpers.dict_swarm import DictSwarm, public, run_keys

RUN = "credit-u"
FP = [f"{i:016x}" for i in range(1, 400)]


def _Swarm(key, peer_id="QmSelf") -> DictSwarm:
    return DictSwarm(key, RUN, peer_id)


@pytest.fixture(scope="module")
def keys():
    return run_keys()


_pub = public


def _record(used: dict[str, int], learner="QmLearner", **credit) -> CreditRecord:
    table = CreditTable(clock=lambda: 100.0)
    for fp, n in used.items():
        table.count(fp, "used", n)
        for what, k in credit.items():
            table.count(fp, what, k)
    return table.record(learner, 3)


# ---------------------------------------------------------------------------------------------------- counting


def test_counts_by_kind_and_reason_and_a_duplicate_is_not_the_producers_doing():
    table = CreditTable(clock=lambda: 100.0)
    table.count(FP[0], "used", 10)
    table.count(FP[0], "reward")
    table.count(FP[0], "surplus", 3)
    table.count(FP[0], "stale", 2)
    table.count(FP[0], "no_signal", 4)
    table.count(FP[0], "duplicate", 5)  # a learner re-reading its buckets after a restart
    t = table.get(FP[0])
    assert (t.used, t.refused, t.stale, t.no_signal, t.since) == (10, 4, 2, 4, 100.0)
    assert t.reasons == {"reward": 1, "surplus": 3}
    assert table.groups_used == 10 and len(table) == 1
    table.count(FP[1], "duplicate")
    assert table.get(FP[1]) is None, "a duplicate alone does not make a contributor"


def test_merging_takes_each_counts_maximum_never_lowers_one_and_adds_nothing_twice():
    mine = CreditTable(clock=lambda: 50.0)
    mine.count(FP[0], "used", 3)
    mine.count(FP[0], "reward", 2)
    mine.count(FP[1], "used", 5)
    theirs = _record({FP[0]: 10, FP[2]: 1}, surplus=4)
    assert mine.merge_record(theirs) == 2
    a, b, c = mine.get(FP[0]), mine.get(FP[1]), mine.get(FP[2])
    assert (a.used, a.since, a.reasons) == (10, 50.0, {"reward": 2, "surplus": 4})
    assert a.refused == 6, "refusals by reason from both sides: the total covers them"
    assert (b.used, c.used, c.since) == (5, 1, 100.0)
    assert mine.groups_used == 16
    before = mine.to_json()
    assert mine.merge_record(theirs) == 0 and mine.to_json() == before, "merging the same record again adds nothing"
    mine.merge_record(_record({FP[0]: 1, FP[1]: 1}))
    assert mine.to_json() == before, "a record with lower counts lowers none"
    mine.count(FP[0], "used", 2)
    assert mine.get(FP[0]).used == 12, "and counting goes on from the maximum"


def test_names_come_from_heartbeats_and_only_printable_ones_are_kept():
    table = CreditTable()
    table.count(FP[0], "used")
    table.set_names({FP[0]: "alice", FP[1]: "mallory"})
    assert table.get(FP[0]).name == "alice" and table.get(FP[1]) is None, "a name alone makes no contributor"
    table.set_names({FP[0]: "\x1b[2Jowned"})
    assert table.get(FP[0]).name == "alice"
    assert table.record("QmL", 1).contributors[FP[0]].name == "alice"


def test_the_intake_counts_what_happened_to_each_signers_groups():
    from tests.helpers.intake import A, M, fetched, new_intake, sample_run
    from tests.helpers.records import changed

    run = sample_run({A: 7, M: 2})
    intake = new_intake(run, batch=1)  # its pool keeps batch x (tau_max + 1) = 5 groups of a signer
    intake.credit = table = CreditTable()
    a, m = key_fingerprint(A), key_fingerprint(M)
    honest = run.groups[A]
    for g in honest[:6]:
        assert intake.add(fetched(A, g), 0) is None
    assert intake.add(fetched(A, honest[0]), 0).reason == "duplicate"
    one = honest[6].completions[0]
    flat = changed(honest[6], completions=[one] * len(honest[6].completions))
    flat = changed(
        flat,
        rewards=[
            run.spec.task.reward(
                run.tokenizer.decode(one.tokens(), skip_special_tokens=True), run.spec.example(A, flat.seq)
            )
        ]
        * len(flat.completions),
    )
    assert intake.add(fetched(A, flat), 0) == "no_signal"
    assert intake.add(fetched(A, changed(honest[1], seq=40, task_index=40, version=0)), 9) == "stale"
    lie = run.groups[M][0]
    assert intake.add(fetched(M, changed(lie, rewards=[1.0] * len(lie.rewards))), 0).reason == "reward"
    assert intake.add(fetched(M, run.groups[M][1]), 0) == "banned", "once banned, nothing more is counted"
    assert intake.add(Fetched(M, 0, 99, None, "cut short"), 0) == "banned"
    mine, liar = table.get(a), table.get(m)
    assert (mine.used, mine.refused, mine.reasons, mine.stale, mine.no_signal) == (0, 1, {"surplus": 1}, 1, 1)
    assert (liar.refused, liar.reasons, liar.used) == (1, {"reward": 1}, 0)
    intake.drop_stale(8)  # the pool's groups of v0 are too old at v8
    assert table.get(a).stale == 1 + 5


# ---------------------------------------------------------------------------------------------------- bounds


def test_the_record_lists_the_top_contributors_the_largest_reasons_and_capped_counts():
    table = CreditTable()
    for i in range(MAX_CREDITED + 50):
        table.count(FP[i], "used", i + 1)
    table.count(FP[1], "used", MAX_CREDIT + 10)
    record = table.record("QmLearner", 7)
    assert len(record.contributors) == MAX_CREDITED and record.contributors_known == MAX_CREDITED + 50
    assert FP[0] not in record.contributors and FP[MAX_CREDITED + 49] in record.contributors, "the top by used"
    assert record.contributors[FP[1]].used == MAX_CREDIT, "a count saturates at its cap"
    assert record.groups_used == table.groups_used >= sum(c.used for c in record.contributors.values())
    low = CreditTable()
    for i, reason in enumerate(
        ["shape", "vocabulary", "version", "lineage", "prompt", "reward", "logprobs", "schema"]
    ):
        low.count(FP[0], reason, i + 1)
    low.count(FP[0], "replay", 100)
    low.count(FP[0], "surplus", 50)
    credit = low.record("QmLearner", 1).contributors[FP[0]]
    assert len(credit.reasons) == MAX_CREDIT_REASONS and credit.refused == 186
    assert credit.reasons["replay"] == 100 and "shape" not in credit.reasons and "vocabulary" not in credit.reasons


def test_a_record_at_every_bound_fits_one_dht_value():
    name = "\U0001f600" * 32  # 4 bytes a character: the longest name in bytes
    contributors = {
        fp: Credit(
            name=name,
            used=MAX_CREDIT,
            refused=MAX_CREDIT,
            reasons={(chr(97 + j) * 16): MAX_CREDIT // MAX_CREDIT_REASONS for j in range(MAX_CREDIT_REASONS)},
            stale=MAX_CREDIT,
            no_signal=MAX_CREDIT,
            since=1e300,
        )
        for fp in FP[:MAX_CREDITED]
    }
    record = CreditRecord(
        learner="Q" * 128,
        version=MAX_INT,
        groups_used=MAX_INT,
        contributors_known=MAX_INT,
        contributors=contributors,
        created=1e300,
    )
    value = to_dht_value(record)  # RecordTooLarge if it did not fit
    assert len(pack(record)) < MAX_DHT_VALUE_BYTES - 8 * 1024, "with room to spare"
    assert from_dht_value(CreditRecord, value) == record


def test_the_table_keeps_at_most_max_kept_and_a_flood_of_fresh_keys_evicts_no_real_contributor():
    table = CreditTable(max_kept=16)
    for i in range(8):
        table.count(FP[i], "used", 5)
    for i in range(8, 300):  # strangers: one refused group each
        table.count(FP[i], "schema")
    assert len(table) <= 16 and table.evicted >= 284
    assert all(table.get(FP[i]).used == 5 for i in range(8)), "contributors with groups used stay"
    assert table.groups_used == 40


GOOD = _record({FP[0]: 4, FP[1]: 2}, surplus=1).dict()


def _bad(path: str, value):
    data = json.loads(json.dumps(GOOD))
    node = data
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return data


CASES = {
    "101 contributors": (
        lambda: dict(
            GOOD,
            contributors={fp: GOOD["contributors"][FP[0]] for fp in FP[: MAX_CREDITED + 1]},
            groups_used=10**6,
            contributors_known=10**6,
        ),
        "at most 100 entries",
    ),
    "9 reasons": (
        lambda: _bad(f"contributors.{FP[0]}.reasons", {f"r{chr(97 + i)}": 0 for i in range(9)}),
        "at most 8 entries",
    ),
    "fingerprint": (lambda: _bad("contributors", {"XYZ": GOOD["contributors"][FP[0]]}), "contributors"),
    "escape in name": (lambda: _bad(f"contributors.{FP[0]}.name", "a\x1b[2Jb"), "printable"),
    "long name": (lambda: _bad(f"contributors.{FP[0]}.name", "n" * 33), "at most 32 characters"),
    "count over cap": (lambda: _bad(f"contributors.{FP[0]}.stale", MAX_CREDIT + 1), "less than or equal to"),
    "negative count": (lambda: _bad(f"contributors.{FP[0]}.no_signal", -1), "greater than or equal to 0"),
    "reasons over refused": (lambda: _bad(f"contributors.{FP[0]}.reasons", {"reward": 5}), "reasons add up to 5"),
    "used over its total": (lambda: _bad("groups_used", 1), "more than its groups_used"),
    "knows fewer than it lists": (lambda: _bad("contributors_known", 1), "knows 1"),
    "float count": (lambda: _bad(f"contributors.{FP[0]}.used", 4.0), "not a valid integer"),
    "reason name": (lambda: _bad(f"contributors.{FP[0]}.reasons", {"Reward!": 0}), "reasons"),
    "unknown field": (lambda: dict(GOOD, bonus=10**9), "extra fields not permitted"),
    "older protocol": (lambda: dict(GOOD, protocol_version=4), "protocol version 4"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_credit_records_are_refused_with_one_clear_sentence(case):
    make, says = CASES[case]
    data = make()
    for read in (lambda: from_dht_value(CreditRecord, data), lambda: unpack(CreditRecord, msgpack.packb(data))):
        with pytest.raises(RecordError) as error:
            read()
        message = str(error.value)
        assert says in message and "CreditRecord" in message and "\n" not in message, message
    assert from_dht_value(CreditRecord, GOOD).dict() == GOOD, "the good record still reads"


def test_an_oversized_credit_record_is_refused_before_it_is_decoded():
    with pytest.raises(RecordError, match="over its 49152-byte limit"):
        unpack(CreditRecord, b"\x80" + b"\x00" * MAX_DHT_VALUE_BYTES)


# ---------------------------------------------------------------------------------------------------- who counts


def _publish(swarm, key, record: CreditRecord) -> None:
    swarm.records.setdefault(credit_key(RUN), {})[owner_subkey(_pub(key))] = to_dht_value(record)


def _admit(swarm, key, peer_id: str, host) -> None:
    learner = _Swarm(key, peer_id)
    record = admission.learner_record(admission.issue_credential(host, RUN), learner)
    swarm.records.setdefault(learners_key(RUN), {})[owner_subkey(_pub(key))] = to_dht_value(record)


def test_a_strangers_credit_record_is_ignored_and_named_an_admitted_learners_is_merged(keys):
    swarm = _Swarm(keys.host)
    _admit(swarm, keys.learner, "QmLearner", keys.host)
    _publish(swarm, keys.learner, _record({FP[0]: 7}, learner="QmLearner"))
    _publish(swarm, keys.stranger, _record({FP[0]: 10**6, FP[9]: 10**6}, learner="QmStranger"))
    admitted = Admitted(swarm, _pub(keys.host))
    kept = admitted_credits(swarm, admitted)
    assert [signer for signer, _ in kept] == [_pub(keys.learner)]
    assert "credit record" in admitted.refused[key_fingerprint(_pub(keys.stranger))]
    table = CreditTable()
    assert merge_admitted(table, swarm, admitted) == 1
    assert table.get(FP[0]).used == 7 and table.get(FP[9]) is None, "nothing of the stranger's reached the table"
    # an admitted key publishing for another peer id than its credential's is a stranger too
    _publish(swarm, keys.learner, _record({FP[0]: 10**6}, learner="QmSomeoneEse"))
    assert admitted_credits(swarm, admitted) == []


def test_status_shows_the_admitted_learners_credit_by_name_and_names_the_stranger(keys):
    from peer.protocol import PeerRecord
    from tests.helpers.status import NOW, status_manifest

    learner = _Swarm(keys.learner, "QmLearner")
    learner.run_id = "run-s"  # the status units' run
    admitted_record = admission.learner_record(admission.issue_credential(keys.host, "run-s"), learner)
    alice = RSAPrivateKey().get_public_key().to_bytes()
    beat = PeerRecord(
        peer_id="QmAnne",
        role="rollout",
        adapter_version=3,
        throughput=8.0,
        hardware="x86_64 Linux",
        reachable=True,
        maddrs=[],
        started=NOW - 100,
        last_seen=NOW - 1,
        state="running",
        stats={},
        name="[bold red]alice[/]",  # shown as written: a name is never read as markup
    )
    ours = _record({key_fingerprint(alice): 30, FP[5]: 10}, surplus=2)
    forged = _record({key_fingerprint(alice): 10**6, FP[6]: 10**6}, learner="QmStranger")
    status = summarize(
        "run-s",
        [(alice, beat)],
        [],
        [],
        [(_pub(keys.host), status_manifest())],
        now=NOW,
        learners=[(_pub(keys.learner), admitted_record)],
        credits=[(_pub(keys.learner), ours), (_pub(keys.stranger), forged)],
    )
    rows = {row["fingerprint"]: row for row in status["contributors"]}
    assert set(rows) == {key_fingerprint(alice), FP[5]}, "the stranger's contributor is not listed"
    first = status["contributors"][0]
    assert first["fingerprint"] == key_fingerprint(alice) and first["used"] == 30
    assert first["name"] == "[bold red]alice[/]" and first["share"] == 0.75 and first["reasons"] == {"surplus": 2}
    assert status["groups_used_total"] == 40
    assert any("credit record" in r["why"] for r in status["refused"]), status["refused"]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(status, contributors=True))
    text = console.export_text()
    assert "[bold red]alice[/]" in text and key_fingerprint(alice)[:8] in text and "75.0%" in text
    status["contributors"][1]["since"] = 1e300  # a valid timestamp no calendar holds: shown as "-", no crash
    console.print(render(status, contributors=True))


# ---------------------------------------------------------------------------------------------------- persistence


def test_a_learner_killed_between_checkpoints_gets_every_journalled_count_back(tmp_path):
    table = CreditTable(clock=lambda: 10.0)
    table.count(FP[0], "used", 4)
    table.count(FP[1], "reward")
    meta = {"credit": table.to_json()}  # a checkpoint
    table.take_delta()  # (a new checkpoint starts an empty journal)
    table.count(FP[0], "used", 4)
    table.count(FP[2], "no_signal", 3)
    append_journal(tmp_path, 5, "a" * 64, "b" * 64, {"used": {}, "banned": {}}, table.take_delta())
    table.count(FP[0], "used", 4)
    table.count(FP[0], "stale")
    append_journal(tmp_path, 6, "c" * 64, "a" * 64, {"used": {}, "banned": {}}, table.take_delta())
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"version": 7, "sha": "d", "credit": {"contributors": {"' + FP[0])  # cut short by the kill
    table.count(FP[0], "used", 100)  # never journalled: lost with the process
    restored = CreditTable()
    assert restore(restored, meta, tmp_path) == 2
    assert restored.get(FP[0]).used == 12 and restored.get(FP[0]).stale == 1
    assert restored.get(FP[1]).reasons == {"reward": 1} and restored.get(FP[2]).no_signal == 3
    assert restored.groups_used == 12
    # a journal line of a learner whose file someone edited: the bad entry is skipped, the rest kept
    bad = {"contributors": {FP[3]: {"used": -5, "since": 1.0}, FP[4]: {"used": 2, "since": 1.0}, "x": {}}}
    append_journal(tmp_path, 8, "e" * 64, "c" * 64, {"used": {}, "banned": {}}, bad)
    again = CreditTable()
    restore(again, meta, tmp_path)
    assert again.get(FP[3]) is None and again.get(FP[4]).used == 2


def test_the_host_keeps_the_table_it_saw_and_shows_it_at_once_after_a_restart(tmp_path):
    path = tmp_path / "host.id.run.credit.json"
    seen = contributor_rows(merged([_record({FP[0]: 8, FP[1]: 2}, surplus=1)]))
    host = CreditState(path, "run")
    status = host.update(
        {"contributors": seen, "groups_used_total": 10, "peers": [{"fingerprint": FP[0], "name": "al"}]}
    )
    assert [r["used"] for r in status["contributors"]] == [8, 2] and status["contributors"][0]["name"] == "al"
    assert path.exists() and host.saves == 1
    host.update({"contributors": seen, "groups_used_total": 10, "peers": []})
    assert host.saves == 1, "nothing changed: nothing written"

    restarted = CreditState(path, "run")  # no learner's record readable yet: the table is the file's
    shown = restarted.update({"contributors": [], "groups_used_total": 0, "peers": []})
    assert [(r["fingerprint"], r["used"], r["name"]) for r in shown["contributors"]] == [
        (FP[0], 8, "al"),
        (FP[1], 2, None),
    ]
    lower = contributor_rows(merged([_record({FP[0]: 1})]))
    shown = restarted.update({"contributors": lower, "groups_used_total": 1, "peers": []})
    assert shown["contributors"][0]["used"] == 8 and shown["groups_used_total"] == 10, "a count never goes down"

    path.write_text("{not json")
    assert len(CreditState(path, "run").table) == 0 and path.with_suffix(".json.bad").exists()


# ---------------------------------------------------------------------------------------------------- progress


def test_the_progress_line_says_version_rate_made_used_refused_stale_and_lag():
    credit = OwnCredit(records=1, used=96, refused=4, reasons=(("surplus", 3), ("reward", 1)), stale=7, no_signal=20)
    line = progress_line(Counters(version=12, made=128), 3.2, credit, 0.4)
    assert line == (
        "progress: v12 · 3.20 groups/s · made 128 · used 96 (75%) · refused 4 (surplus 3, reward 1) · stale 7 · "
        "no signal 20 · lag 0.4"
    )
    assert "used - (no learner's credit record yet)" in progress_line(Counters(0, 0), 0.0, OwnCredit(0), None)


def test_progress_measures_the_rate_and_lag_over_its_interval_and_reads_credit_once_per_interval():
    now, counters, reads = [0.0], [Counters(1, 0)], []

    def read():
        reads.append(now[0])
        if len(reads) == 2:
            raise OSError("the DHT did not answer")
        return OwnCredit(records=1, used=len(reads) * 10)

    progress = Progress(lambda: counters[0], read, every=10.0, live=False, clock=lambda: now[0])
    progress._window.append((0.0, counters[0]))
    now[0], counters[0] = 10.0, Counters(2, 40, lag_sum=20.0, lag_groups=40)
    assert progress.line().startswith("progress: v2 · 4.00 groups/s · made 40 · used 10 (25%)")
    now[0] = 15.0
    progress.line()
    assert reads == [10.0], "the credit is read at most once per interval"
    now[0], counters[0] = 20.0, Counters(3, 80, lag_sum=20.0, lag_groups=80)
    line = progress.line()
    assert reads == [10.0, 20.0] and "used 10 " in line, "a failed read keeps the last credit"
    assert "4.00 groups/s" in line and line.endswith("lag 0.0"), line
    now[0] = 30.0
    assert "used 30" in progress.line()


@pytest.mark.parametrize("command", ["join", "learn"])
@pytest.mark.parametrize("name", ["a\x1b[2Jb", "x" * 33, "", "  ", "rtl\u202eevil"])
def test_a_bad_name_is_one_line_and_exit_2_before_anything_starts(command, name):
    from click.testing import CliRunner

    from peer.cli import main

    result = CliRunner().invoke(main, [command, "--run-id", "r", "--name", name])
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and "'--name'" in error[0] and "e.g. --name alice-laptop" in error[0], result.output
