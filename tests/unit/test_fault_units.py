"""What keeps a run whole through crashes and freezes, unit by unit: the learner's journal, the announcement gate,
a leader's view of its helpers, and adapters fetched from any peer once their announcers are gone."""

import asyncio
import hashlib
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from peer.model.config import LoRAConfig
from peer.model.peft_folder import blob_from_tensors
from peer.roles.learner.checkpoint import JOURNAL, append_journal, journal_chain, write_checkpoint
from peer.roles.learner.team import lead as team
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------- the journal


def test_the_journal_chains_the_versions_after_a_checkpoint_and_skips_what_is_not_in_the_chain(tmp_path):
    d = tmp_path / "ckpt"
    append_journal(d, 1, sha("v1"), sha("v0"), {"used": {"aa": [[0, 0]]}, "banned": {}})
    append_journal(d, 2, sha("v2"), sha("v1"), {"used": {"aa": [[1, 1]]}, "banned": {"bb": "replay"}})
    append_journal(d, 2, sha("fork"), sha("other"), {"used": {}, "banned": {}})  # another lineage's v2
    append_journal(d, 3, sha("v3"), sha("v2"), {"used": {}, "banned": {}})
    with open(d / JOURNAL, "a") as f:
        f.write('{"version": 4, "sha": "cut sho')  # killed mid-line
    chain = journal_chain(d, 0, sha("v0"))
    assert [(line["version"], line["sha"]) for line in chain] == [(1, sha("v1")), (2, sha("v2")), (3, sha("v3"))]
    assert chain[1]["intake"]["banned"] == {"bb": "replay"}
    assert [line["version"] for line in journal_chain(d, 2, sha("v2"))] == [3], "from a checkpoint at v2"
    assert journal_chain(d, 2, sha("fork")) == [], "nothing follows the other lineage's v2"
    assert journal_chain(tmp_path / "none", 0, sha("v0")) == []
    # the learner restarted after that kill goes on: its next line starts on a line of its own, not after the torn one
    append_journal(d, 4, sha("v4"), sha("v3"), {"used": {}, "banned": {}})
    assert [line["version"] for line in journal_chain(d, 0, sha("v0"))] == [1, 2, 3, 4]


def test_a_checkpoint_starts_an_empty_journal(tmp_path):
    d = tmp_path / "ckpt"
    append_journal(d, 1, sha("v1"), sha("v0"), {"used": {}, "banned": {}})
    state = {"state": {}, "param_groups": []}
    blob = blob_from_tensors({"base_model.model.l.lora_A.weight": torch.ones(2, 3)}, LoRAConfig(r=2))
    write_checkpoint(d, {"run_id": "r", "version": 1, "sha256": hashlib.sha256(blob).hexdigest()}, blob, state, "m")
    assert not (d / JOURNAL).exists()
    append_journal(d, 2, sha("v2"), hashlib.sha256(blob).hexdigest(), {"used": {}, "banned": {}})
    assert [json.loads(line)["version"] for line in (d / JOURNAL).read_text().splitlines()] == [2]


# ---------------------------------------------------------------------------------------------------- the gate


class _Swarm:
    """Records what an Announcer stores (the announcement itself goes through a patched ``announce_adapter``)."""

    run_id = "r"
    public_key = b"ssh-rsa AAAA"

    def store(self, *args, **kwargs):
        return True

    def __init__(self):
        self.stored = []

    def store_many(self, items, what, **kwargs):
        self.stored.extend((what, value) for _, _, value, _ in items)
        return [True] * len(items)


@pytest.fixture
def announcer(monkeypatch):
    from peer.roles.learner import io as learner_io

    announced = []
    monkeypatch.setattr(learner_io, "announce_adapter", lambda swarm, blobs, v, blob, parent, **_: announced.append(v))
    monkeypatch.setattr(learner_io, "to_dht_value", lambda record: record)  # the metrics as submitted
    a = learner_io.Announcer(_Swarm(), None)
    a.GATE_FLUSH = 0.3
    a.announced_versions = announced
    yield a
    a.close()


def test_a_gated_version_is_announced_only_once_its_gate_opens(announcer):
    held, looks = threading.Event(), []

    def gate() -> bool:
        looks.append(held.is_set())
        return looks[-1]

    announcer.submit(5, b"blob", sha("v4"), None, gate=gate)
    wait_until(lambda: len(looks) >= 5, "the announcer looking at the closed gate again and again", 5, interval=0.01)
    assert announcer.announced_versions == [] and announcer.blocked_for() > 0
    held.set()
    wait_until(lambda: announcer.announced_versions == [5], "v5 announced once its gate opened", 5, interval=0.01)
    assert announcer.blocked_for() == 0.0
    announcer.submit(6, b"blob", sha("v5"), None)  # no gate: at once
    wait_until(lambda: announcer.announced_versions == [5, 6], "v6 announced", 5, interval=0.01)


def test_a_newer_version_replaces_a_gated_one_and_a_flush_drops_a_gate_that_stays_closed(announcer):
    announcer.submit(7, b"blob", sha("v6"), None, gate=lambda: False)
    announcer.submit(8, b"blob", sha("v7"), None, gate=lambda: False)
    assert announcer.flush(timeout=5) is False, "a closed gate is given up after GATE_FLUSH"
    assert announcer.announced_versions == []
    announcer.submit(9, b"blob", sha("v8"), None, gate=lambda: True)
    assert announcer.flush(timeout=5) and announcer.announced_versions == [9]


def test_the_metrics_are_stored_at_most_every_few_seconds_the_newest_one_and_at_a_flush(announcer, monkeypatch):
    """A version comes every ~0.4 s in the demo: storing the metrics record with each one was half of the learner's
    DHT requests. The newest is stored once ``METRICS_EVERY`` has passed (learning or not), and at a flush."""
    from peer.roles.learner import io as learner_io

    monkeypatch.setattr(learner_io, "METRICS_EVERY", 0.5)
    metrics = lambda: [value for what, value in announcer.swarm.stored if what == "learner metrics"]  # noqa: E731
    for v in range(1, 6):
        announcer.submit(v, b"blob", sha(f"v{v - 1}"), f"metrics of v{v}")
        time.sleep(0.02)
    wait_until(lambda: announcer.announced_versions[-1:] == [5], "v5 announced", 5, interval=0.01)
    assert metrics() == ["metrics of v1"], "the first at once, then not with every version"
    wait_until(lambda: len(metrics()) == 2, "the newest stored once METRICS_EVERY passed", 5, interval=0.01)
    assert metrics()[-1] == "metrics of v5"
    announcer.submit(6, b"blob", sha("v5"), "metrics of v6")
    assert announcer.flush(timeout=5) and metrics()[-1] == "metrics of v6", "a flush stores the newest at once"
    assert announcer.flush(timeout=5) and len(metrics()) == 3, "nothing new: nothing stored again"
    announcer.close()
    started = time.monotonic()
    assert announcer.flush(timeout=5) and time.monotonic() - started < 1, "closed: a flush answers at once"


def test_followers_get_every_version_and_the_replicas_the_newest_at_most_every_so_often(monkeypatch):
    """Each version goes to the followers as it is announced; the replicas get the newest announcement once
    ``REPLICATE_EVERY`` has passed, also when no version follows it, and a flush waits for that store."""
    from peer.roles.learner import io as learner_io

    monkeypatch.setattr(learner_io, "REPLICATE_EVERY", 0.4)
    announced, replicated = [], []

    def announce(swarm, blobs, version, blob, parent, replicate, **_):
        announced.append((version, replicate))
        return f"record of v{version}"

    monkeypatch.setattr(learner_io, "announce_adapter", announce)
    monkeypatch.setattr(learner_io, "store_announcement", lambda swarm, record: replicated.append(record))
    a = learner_io.Announcer(_Swarm(), None, followers=lambda: ("QmRollout",))
    try:
        for v in range(1, 5):
            a.submit(v, b"blob", sha(f"v{v - 1}"), None)
            wait_until(lambda: announced[-1:] and announced[-1][0] == v, f"v{v} announced", 5, interval=0.01)  # noqa: B023
        assert announced == [(1, True), (2, False), (3, False), (4, False)], "the first on the replicas, then pushed"
        assert replicated == []
        wait_until(lambda: replicated == ["record of v4"], "the newest on the replicas, no version after it", 5)
        a.submit(5, b"blob", sha("v4"), None)
        started = time.monotonic()
        assert a.flush(timeout=5) and replicated == ["record of v4", "record of v5"], "a flush waits for it"
        assert time.monotonic() - started < 1.0
        time.sleep(0.45)
        a.submit(6, b"blob", sha("v5"), None)
        assert a.flush(timeout=5) and announced[-1] == (6, True), "REPLICATE_EVERY after the last: at once"
        assert replicated == ["record of v4", "record of v5"]
    finally:
        a.close()


# ---------------------------------------------------------------------------------------------------- the leader


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(team, "POLL_WAIT", 0.0)  # a work request with nothing to do answers "idle" at once


def _work(lead: team.Lead, helper: str, version: int, sha256: str) -> dict:
    return asyncio.run(lead.handle(helper, {"op": "work", "version": version, "sha": sha256}))


def test_a_leader_announces_only_what_every_active_helper_holds(monkeypatch):
    lead = team.Lead("leader")
    lead.lead(3, sha("v3"))
    assert lead.holds(4), "alone: nobody else needs to hold a version"
    lead.advance({"version": 4, "sha": sha("v4"), "parent": sha("v3")})
    _work(lead, "h1", 4, sha("v4"))
    _work(lead, "h2", 3, sha("v3"))
    assert not lead.alone and not lead.holds(4), "h2 holds v3 only"
    _work(lead, "h2", 4, sha("v4"))
    assert lead.holds(4)
    _work(lead, "h1", 4, sha("elsewhere"))  # a version of another lineage does not count
    lead.advance({"version": 5, "sha": sha("v5"), "parent": sha("v4")})
    assert not lead.holds(5)

    clock = [time.monotonic()]
    monkeypatch.setattr(team.time, "monotonic", lambda: clock[0])
    clock[0] += team.ACTIVE_FOR + 1  # both went quiet (dead, frozen, or this leader was)
    assert lead.helpers() == [] and lead.silent() == ["h1", "h2"]
    assert not lead.holds(5), "silent helpers are not a reason to announce: the leader asks them first"
    lead.release(["h1"])
    assert not lead.alone and lead.silent() == ["h2"]
    lead.release(["h2"])
    assert lead.alone and lead.holds(5)


def test_a_step_is_serialized_for_the_first_helper_that_asks_for_it_and_only_then():
    from peer.roles.learner.update import tensors_from_bytes, tensors_to_bytes

    lead = team.Lead("leader")
    lead.lead(3, sha("v3"))
    grads = [torch.randn(4, 2), torch.randn(2, 4)]
    step = {"version": 4, "sha": sha("v4"), "parent": sha("v3"), "grads": grads}
    lead.advance(step)
    assert step["grads"] is grads, "a learner alone never serializes a step"
    sent = _work(lead, "h1", 3, sha("v3"))["steps"][0]["grads"]
    assert sent == tensors_to_bytes(grads) and step["grads"] == sent, "bytes on the wire, kept for the next helper"
    again = _work(lead, "h2", 3, sha("v3"))["steps"][0]["grads"]
    assert again is sent, "serialized once"
    assert all(torch.equal(a, b) for a, b in zip(tensors_from_bytes(again, grads), grads, strict=True))


class _Client:
    def __init__(self, answers: dict):
        self.answers = answers
        self.asked = []

    def probe(self, peer, timeout=5.0):
        self.asked.append(peer)
        answer = self.answers.get(peer)
        if answer is None:
            raise TimeoutError(f"{peer} did not answer")
        return answer


class _Admitted:
    """The admitted learners' peer ids (a stand-in for peer.network.admission.Admitted: pure logic here)."""

    def __init__(self, peers=None):
        self.peers = peers

    def admits_peer(self, peer: str) -> bool:
        return self.peers is None or peer in self.peers


def _teamwork(answers: dict, helpers: list[str], admitted: set | None = None):
    from peer.roles.learner.team.member import Teamwork

    followed = []
    session = SimpleNamespace(admitted=_Admitted(admitted))
    peer = SimpleNamespace(stop_fetcher=lambda: None, beat=lambda: None, session=session)
    tw = Teamwork(peer)
    tw.me, tw.client = "leader", _Client(answers)
    tw.lead = team.Lead("leader")
    tw.lead.lead(9, sha("v9"))
    for h in helpers:
        _work(tw.lead, h, 9, sha("v9"))
    tw.follow = lambda leader, same_team=False, deposed=False: followed.append((leader, deposed))
    return tw, followed


def test_a_leader_whose_helper_took_over_follows_it():
    tw, followed = _teamwork({"h1": None, "h2": {"leading": True, "version": 12}}, ["h1", "h2"])
    tw.check_team(["h1", "h2"])
    assert followed == [("h2", True)], "deposed: its own newer versions give way to the team's"


def test_a_leader_never_follows_a_stranger_that_claims_to_lead():
    answers = {"h1": None, "stranger": {"leading": True, "version": 99}}
    tw, followed = _teamwork(answers, ["h1"], admitted={"leader", "h1"})
    tw.check_team(["h1", "stranger"])
    assert followed == [] and "stranger" not in tw.client.asked, "a peer without admission is not even asked"
    tw, followed = _teamwork(answers, ["h1"], admitted={"leader", "h1", "stranger"})
    tw.check_team(["h1", "stranger"])
    assert followed == [("stranger", True)], "the same answer from an admitted learner is followed"


def test_a_leader_forgets_helpers_that_are_gone_and_keeps_those_that_still_help_it():
    tw, followed = _teamwork({"h1": None, "h2": {"leading": False, "leader": "leader"}}, ["h1", "h2"])
    tw.check_team(["h1", "h2"])
    assert followed == [] and not tw.lead.alone
    assert tw.lead.helpers() == ["h2"], "h1 did not answer: no longer a member"
    tw, followed = _teamwork({}, ["h1"])
    tw.check_team(["h1"])
    assert followed == [] and tw.lead.alone and tw.lead.holds(10)


# ---------------------------------------------------------------------------------------------------- adapters


def test_an_adapter_whose_announcers_are_gone_is_fetched_from_other_peers(tmp_path):
    from hivemind.p2p import PeerID

    from peer.network.blobs import BlobUnavailable
    from peer.run.adapters import fetch_adapter

    gone, holder, stranger = (PeerID(hashlib.sha256(n).digest()) for n in (b"gone", b"holder", b"stranger"))
    blob = tmp_path / "blob"
    blob.write_bytes(b"adapter")
    asked = []

    class Blobs:
        def fetch(self, sha256, size, providers, timeout, shuffle, progress=None):
            asked.append(list(providers))
            if holder in providers:
                return blob
            raise BlobUnavailable(f"none of {len(providers)} delivered")

    assert fetch_adapter(Blobs(), sha("a"), 7, [gone.to_base58()], lambda: [gone, stranger, holder], 5.0) == b"adapter"
    assert asked[0] == [gone] and sorted(asked[1], key=str) == sorted([stranger, holder], key=str)
    asked.clear()
    with pytest.raises(BlobUnavailable):
        fetch_adapter(Blobs(), sha("a"), 7, [gone.to_base58()], lambda: [gone], 5.0)
    assert asked == [[gone]], "nobody else to ask: the announcers' failure is the answer"
