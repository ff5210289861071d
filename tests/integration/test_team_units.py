"""The team protocol's defences (peer/roles/learner/team/lead.py, "Trust"): what a learner reads of another's
messages, and how.

* requests and answers go through strict, bounded schemas (peer/roles/learner/team/messages.py): each malformed
message is
  refused with a sentence naming the field;
* the rpc layer checks who calls before reading a byte, caps a request's bytes before reading them and its maps and
  arrays while unpacking — with two real P2P daemons in this process;
* the AdamW state travels as step counts + safetensors moments, checked and loaded into this learner's own
  hyper-parameters (no ``torch.load`` of peer bytes);
* a helper keeps the leader's used seqs, reports its bans without taking them, and forgets them when it leads;
* the leader weighs a helper's share by the tokens it counts itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from types import SimpleNamespace

import msgpack
import pytest
import torch

from peer.network import rpc
from peer.network.blobs.wire import ProtocolError
from peer.roles.learner.intake import Intake
from peer.roles.learner.record import VersionRecord
from peer.roles.learner.team import lead as team
from peer.roles.learner.team import messages
from tests.helpers.p2p import P2P_KW

LEADER = "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT"
HELPER = "12D3KooWGRUVh7ZeEyWQQ5J3iWm2QnWvJCnTJ1Nmqv3pCd7P2Nf1"
SHA0 = hashlib.sha256(b"v0").hexdigest()
SHA1 = hashlib.sha256(b"v1").hexdigest()
X, Y = b"signer-x-public-key", b"signer-y-public-key"


def step(version=1, sha=SHA1, parent=SHA0, **changes) -> dict:
    good = {
        "version": version,
        "parent": parent,
        "sha": sha,
        "size": 10,
        "grads": b"g",
        "intake": {"used": {X.hex(): [[5, 0]]}, "banned": {X.hex(): "reward: claimed 1.0, recomputed 0.0"}},
        "record": {"version": version, "sha256": sha, "ids": [["ab12", 0, 5]], "loss": 0.1, "per_peer": {"ab": 1}},
    }
    return {**good, **changes}


def state(**changes) -> dict:
    good = {
        "version": 3,
        "sha": SHA0,
        "parent": "",
        "adapter": b"adapter",
        "optimizer": {"steps": [], "tensors": b"{}"},
        "intake": {"used": {}, "banned": {}},
    }
    return {**good, **changes}


# ---------------------------------------------------------------------------------------------------- schemas


def test_well_formed_requests_and_answers_pass_the_schemas_as_they_came():
    stats = STATS
    assert isinstance(messages.parse_request({"op": "probe", "invite": None}), messages.Probe)
    work = messages.parse_request({"op": "work", "version": 3, "sha": SHA0, "need_state": True, "invite": "hgi1.x"})
    assert work.version == 3 and work.need_state is True
    result = messages.parse_request({"op": "result", "task": 0, "grads": b"g", "tokens": 3, "stats": stats})
    assert result.stats.rows == 8
    assert messages.parse_request({"op": "result", "task": 0, "grads": b"", "tokens": 0, "stats": {}}).stats is None
    answers = [
        {"steps": [step()], "members": [LEADER, HELPER]},
        {"state": state(), "members": [LEADER]},
        {"task": {"id": 1, "version": 3, "groups": [{"owner": X, "group": b"packed"}]}, "members": [LEADER]},
        {"idle": True, "members": [LEADER]},
        {"leader": HELPER},
        {"leader": None},
        {"refused": "its gradient differs"},
    ]
    for answer in answers:
        assert messages.parse_work_answer(answer) is answer
    probe = {"leading": True, "leader": None, "version": -1, "sha": ""}
    assert messages.parse_probe_answer(probe) is probe


STATS = {"loss": 0.1, "clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_max": 1.2, "rows": 8}
BAD_REQUESTS = [
    ({"op": "steal"}, "unknown op 'steal'"),
    ({"version": 3}, "unknown op None"),
    ({"op": "work", "version": 3}, "sha: field required"),
    ({"op": "work", "version": "3", "sha": SHA0}, "version: value is not a valid integer"),
    ({"op": "work", "version": True, "sha": SHA0}, "version: value is not a valid integer"),
    ({"op": "work", "version": -1, "sha": SHA0}, "version: ensure this value is greater than or equal to 0"),
    ({"op": "work", "version": 3, "sha": "nope"}, "sha: string does not match regex"),
    ({"op": "work", "version": 3, "sha": SHA0, "need_state": 1}, "need_state: value is not a valid boolean"),
    ({"op": "work", "version": 3, "sha": SHA0, "extra": 1}, "extra: extra fields not permitted"),
    ({"op": "probe", "invite": "x" * 600}, "invite: ensure this value has at most 512 characters"),
    ({"op": "probe", "invite": b"hgi1"}, "invite: str type expected"),
    ({"op": "result", "task": 0, "grads": "g", "tokens": 3, "stats": {}}, "grads: byte type expected"),
    ({"op": "result", "task": 0, "grads": b"g", "tokens": 3}, "stats: field required"),
    (
        {"op": "result", "task": 0, "grads": b"g", "tokens": 3, "stats": {**STATS, "loss": float("nan")}},
        "stats.loss: ensure this value is a finite number",
    ),
    (
        {"op": "result", "task": 0, "grads": b"g", "tokens": 3, "stats": {**STATS, "evil": 1}},
        "stats.evil: extra fields not permitted",
    ),
]


@pytest.mark.parametrize("request_, reason", BAD_REQUESTS, ids=[r for _, r in BAD_REQUESTS])
def test_a_malformed_request_is_refused_with_the_field_and_the_reason(request_, reason):
    with pytest.raises(ProtocolError) as e:
        messages.parse_request(request_)
    assert reason in str(e.value), str(e.value)


BAD_ANSWERS = [
    ({"idle": True, "leader": HELPER, "members": []}, "a work answer is one of"),
    ({"members": [LEADER]}, "a work answer is one of"),
    ({"idle": True, "members": [LEADER] * 65}, "members: ensure this value has at most 64 items"),
    ({"idle": True, "members": ["not a peer id!"]}, "members.0: string does not match regex"),
    ({"leader": "x" * 200}, "leader: ensure this value has at most 128 characters"),
    ({"refused": "x" * 2000}, "refused: ensure this value has at most 1024 characters"),
    ({"steps": [], "members": []}, "steps: ensure this value has at least 1 items"),
    ({"steps": [step()] * 33, "members": []}, "steps: ensure this value has at most 32 items"),
    ({"steps": [step(sha="f" * 63)], "members": []}, "steps.0.sha: string does not match regex"),
    ({"steps": [step(record={"version": 2, "sha256": SHA1})], "members": []}, "record names another version"),
    ({"steps": [step(record={"version": 1, "sha256": SHA1, "x": b"raw"})], "members": []}, "a bytes, not a JSON"),
    (
        {"steps": [step(record={"version": 1, "sha256": SHA1, "x": [[[[[1]]]]]})], "members": []},
        "nested over 4 levels",
    ),
    (
        {"steps": [step(intake={"used": {X.hex(): [[5, 0, 1]]}, "banned": {}})], "members": []},
        "ensure this value has at most 2 items",
    ),
    ({"steps": [step(intake={"used": {"xyz": [[5, 0]]}, "banned": {}})], "members": []}, "does not match regex"),
    ({"steps": [step(intake={"used": {}})], "members": []}, "steps.0.intake.banned: field required"),
    ({"state": state(optimizer=b"\x80\x04pickle"), "members": []}, "state.optimizer: value is not a valid dict"),
    ({"state": state(optimizer={"steps": [-1], "tensors": b""}), "members": []}, "greater than or equal to 0"),
    ({"state": state(adapter=b""), "members": []}, "state.adapter: ensure this value has at least 1 characters"),
    ({"state": state(parent="x"), "members": []}, "state.parent: string does not match regex"),
    ({"task": {"id": 1, "version": 3, "groups": []}, "members": []}, "task.groups: ensure this value has at least 1"),
    (
        {"task": {"id": 1, "version": 3, "groups": [{"owner": X, "group": b"g" * (1 << 20 + 1)}]}, "members": []},
        "task.groups.0.group: ensure this value has at most 1048576 characters",
    ),
]


@pytest.mark.parametrize("answer, reason", BAD_ANSWERS, ids=[r for _, r in BAD_ANSWERS])
def test_a_malformed_answer_is_refused_with_the_field_and_the_reason(answer, reason):
    with pytest.raises(ProtocolError) as e:
        messages.parse_work_answer(answer)
    assert reason in str(e.value), str(e.value)


def test_a_malformed_probe_answer_is_refused():
    with pytest.raises(ProtocolError, match="version: ensure this value is greater than or equal to -1"):
        messages.parse_probe_answer({"leading": True, "leader": None, "version": -2, "sha": ""})
    with pytest.raises(ProtocolError, match="leading: value is not a valid boolean"):
        messages.parse_probe_answer({"leading": "yes", "leader": None, "version": 1, "sha": ""})


# ---------------------------------------------------------------------------------------------------- rpc bounds


def _reader(*frames: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for frame in frames:
        reader.feed_data(len(frame).to_bytes(4, "big") + frame)
    reader.feed_data(b"\0\0\0\0")
    reader.feed_eof()
    return reader


def test_a_message_over_the_limit_is_refused_before_the_frame_that_crosses_it_is_read():
    async def scenario():
        reader = _reader(msgpack.packb({"a": b"x" * 100})[:50], b"y" * 10_000)
        with pytest.raises(ProtocolError, match="message of over 1000 bytes"):
            await rpc.read_message(reader, 1000)
        return len(reader._buffer)

    assert asyncio.run(scenario()) == 10_000 + 4, "the frame over the limit stays unread"


def test_unpacking_is_bounded_by_the_messages_own_size_and_its_container_budget():
    many_lists = msgpack.packb({"a": [[]] * 1000})  # 1 byte of msgpack each, ~60 bytes of Python each
    with pytest.raises(ProtocolError, match="more than 8 maps and arrays"):
        rpc.unpack_message(many_lists, max_containers=8)
    assert len(rpc.unpack_message(many_lists)["a"]) == 1000, "without a budget (answers): within the size only"
    claims_more = b"\x81\xa1a\xdd\x00\x10\x00\x00"  # {"a": array of 1M items} in 8 bytes
    with pytest.raises(ProtocolError, match="exceeds max_array_len"):
        rpc.unpack_message(claims_more)
    with pytest.raises(ProtocolError, match="max_ext_len"):
        rpc.unpack_message(msgpack.packb({"t": msgpack.ExtType(1, b"x")}))
    with pytest.raises(ProtocolError, match="not a map"):
        rpc.unpack_message(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="undecodable"):
        rpc.unpack_message(msgpack.packb({1: 2}))


def test_an_answer_is_read_within_the_runs_container_budget_which_the_largest_honest_state_fits():
    from peer.roles.learner.intake import FORGET_EVERY, FORGET_MARGIN

    batch, tau_max = 16, 4
    remembered = tau_max + 1 + FORGET_MARGIN + FORGET_EVERY
    budget = messages.answer_containers(batch, remembered)
    # the largest state such a run holds: every signer the schema allows with its floor entry, and a window of
    # updates' used pairs spread over them
    used = {i.to_bytes(4, "big").hex(): [[i, 0]] for i in range(messages.MAX_SIGNERS)}
    for n in range(remembered * batch):
        used[(n % batch).to_bytes(4, "big").hex()].append([10**6 + n, 100 + n // batch])
    honest = msgpack.packb({"state": state(intake={"used": used, "banned": {}}), "members": [LEADER]})
    assert len(honest) < messages.MAX_ANSWER
    parsed = messages.parse_work_answer(rpc.unpack_message(honest, max_containers=budget))
    assert len(parsed["state"]["intake"]["used"]) == messages.MAX_SIGNERS
    inflating = msgpack.packb({"steps": [[]] * (budget + 1)})  # a leader's answer of empty arrays
    with pytest.raises(ProtocolError, match=f"more than {budget} maps and arrays"):
        rpc.unpack_message(inflating, max_containers=budget)
    assert budget < 300_000 < messages.MAX_ANSWER_CONTAINERS < 9_000_000, (budget, messages.MAX_ANSWER_CONTAINERS)


class _Admitted:
    def __init__(self, peers: set[str]):
        self.peers = peers
        self.asked: list[str] = []

    def admits_peer(self, peer: str) -> bool:
        self.asked.append(peer)
        return peer in self.peers


def test_the_leader_refuses_a_stranger_before_its_request_and_counts_it():
    admitted = _Admitted({HELPER})
    lead = team.Lead(LEADER, admitted=admitted, gradient_bytes=1000)
    assert lead.request_limit == 2 * 1000 + team.REQUEST_SLACK
    assert lead.precheck(HELPER) is None
    assert "not an admitted learner" in lead.precheck("QmStranger")
    assert lead.stats["refused_unadmitted"] == 1 and admitted.asked == [HELPER, "QmStranger"]
    assert team.Lead(LEADER).precheck("QmAnyone") is None, "a run without admission (tests, tools) lets all call"


@pytest.fixture
def p2p_pair():
    """A leader's and a caller's P2P daemons on loopback, run on one event loop thread (as the blob service's)."""
    import threading

    from hivemind.p2p import P2P

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run_on_loop(coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    started = []
    try:
        server = run_on_loop(P2P.create(**P2P_KW))
        started.append(server)
        caller = run_on_loop(P2P.create(initial_peers=run_on_loop(server.get_visible_maddrs()), **P2P_KW))
        started.append(caller)
        yield tuple(SimpleNamespace(p2p=p, run_coroutine=lambda go, t, p=p: run_on_loop(go(p), t)) for p in started)
    finally:
        for p in reversed(started):
            run_on_loop(p.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_over_p2p_a_strangers_request_is_not_read_and_an_oversized_or_malformed_one_is_refused(p2p_pair, monkeypatch):
    """The leader serves the team protocol (team.serve); an admitted caller asks, then a stranger does."""
    server, caller = p2p_pair
    server_reads: list[int] = []
    read_message = rpc.read_message

    async def counting(reader, limit, max_containers=None):
        if limit != team.MAX_ANSWER:  # the server's reads (a caller reads answers up to MAX_ANSWER)
            server_reads.append(limit)
        return await read_message(reader, limit, max_containers)

    monkeypatch.setattr(rpc, "read_message", counting)
    admitted = _Admitted({str(caller.p2p.peer_id)})
    lead = team.Lead(str(server.p2p.peer_id), admitted=admitted, gradient_bytes=4096)
    lead.lead(3, SHA0)
    handled = []
    handle = lead.handle

    inflated = {"steps": [[]] * 1000}  # an answer of empty arrays, as a rogue leader's would be

    async def recording(peer_id, request):
        if request.get("op") == "inflate":
            return inflated
        handled.append(request.get("op"))
        return await handle(peer_id, request)

    lead.handle = recording
    team.serve(server, lead)
    client, leader = team.TeamClient(caller, None), str(server.p2p.peer_id)

    answer = client.probe(leader)
    assert answer["leading"] is True and answer["version"] == 3
    assert server_reads == [lead.request_limit] and handled == ["probe"]
    with pytest.raises(rpc.RemoteError, match=f"bad request: message of over {lead.request_limit} bytes"):
        client._call(leader, {"op": "probe", "pad": b"x" * (lead.request_limit + 1)})
    with pytest.raises(rpc.RemoteError, match="bad request: more than 8 maps and arrays"):
        client._call(leader, {"op": "probe", "pad": [[]] * 100})
    with pytest.raises(rpc.RemoteError, match="bad request: malformed work request: version"):
        client._call(leader, {"op": "work", "version": "3", "sha": SHA0})
    assert handled == ["probe", "work"], "the oversized and the inflating requests never reached the handler"
    with pytest.raises(ProtocolError, match="more than 100 maps and arrays"):
        team.TeamClient(caller, None, max_containers=100)._call(leader, {"op": "inflate"})
    assert len(team.TeamClient(caller, None)._call(leader, {"op": "inflate"})["steps"]) == 1000, "within the default"

    admitted.peers.clear()  # the caller is a stranger now
    reads = len(server_reads)
    with pytest.raises(rpc.RemoteError, match="not an admitted learner"):
        client.probe(leader)
    with pytest.raises((rpc.RemoteError, ConnectionError, asyncio.IncompleteReadError)):
        client._call(leader, {"op": "probe", "pad": b"x" * (16 << 20)})  # refused, then the stream closed
    assert len(server_reads) == reads, "a stranger's request was read"
    assert handled == ["probe", "work"] and lead.stats["refused_unadmitted"] == 2


def test_a_helper_checks_the_leaders_answers_and_asks_for_the_whole_state_after_a_malformed_one():
    from peer.roles.learner.team.member import Teamwork

    malformed = {"steps": [step(sha="not a sha")], "members": [LEADER]}
    client = team.TeamClient(SimpleNamespace(run_coroutine=lambda go, timeout: malformed), None)
    with pytest.raises(ProtocolError, match="steps.0.sha"):
        client.work(LEADER, 0, SHA0)
    with pytest.raises(ProtocolError, match="leading: field required"):
        team.TeamClient(SimpleNamespace(run_coroutine=lambda go, timeout: {}), None).probe(LEADER)
    waited = []
    session = SimpleNamespace(version=0, sha=SHA0)
    peer = SimpleNamespace(session=session, stop_event=SimpleNamespace(wait=waited.append))
    tw = Teamwork(peer)
    tw.client, tw.leader, tw._synced = client, LEADER, True
    tw.help_once()
    assert tw.counts["malformed_answers"] == 1 and not tw._synced and waited == [0.5], "it asks for the state next"
    assert tw.leader == LEADER, "a malformed answer is not a dead leader: no takeover"


# ---------------------------------------------------------------------------------------------------- AdamW state


def _stepped_adamw(lr: float, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.AdamW(params, lr=lr)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return params, optimizer


def test_the_adamw_state_travels_as_counts_and_safetensors_and_keeps_the_receivers_hyper_parameters():
    from peer.roles.learner.update import optimizer_state_from_wire, optimizer_state_to_wire

    params, sender = _stepped_adamw(lr=1e-2, steps=3)
    wire = optimizer_state_to_wire(sender)
    assert wire["steps"] == [3, 3] and isinstance(wire["tensors"], bytes)
    messages.OptimizerState.parse_obj(wire)
    mine, receiver = _stepped_adamw(lr=5e-4, steps=0, seed=1)
    with torch.no_grad():
        for m, p in zip(mine, params, strict=True):
            m.copy_(p)
    receiver.load_state_dict(optimizer_state_from_wire(receiver, wire))
    assert receiver.param_groups[0]["lr"] == 5e-4, "the sender's learning rate is not taken"
    for a, b in zip(params, mine, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sender.state[a][name], receiver.state[b][name])
        assert float(receiver.state[b]["step"]) == 3.0
    fresh_params, fresh = _stepped_adamw(lr=1e-2, steps=0)
    assert optimizer_state_to_wire(fresh)["steps"] == []
    receiver.load_state_dict(optimizer_state_from_wire(receiver, optimizer_state_to_wire(fresh)))
    assert not receiver.state, "a fresh leader's state is a fresh state"


def test_an_adamw_state_that_does_not_fit_is_refused():
    from safetensors.torch import load, save

    from peer.roles.learner.update import optimizer_state_from_wire, optimizer_state_to_wire

    _, sender = _stepped_adamw(lr=1e-2, steps=2)
    _, receiver = _stepped_adamw(lr=1e-2, steps=0)
    good = optimizer_state_to_wire(sender)
    moments = load(good["tensors"])

    def with_tensors(**changes):
        return {"steps": [2, 2], "tensors": save({**moments, **changes})}

    bad = [
        ({"steps": [2], "tensors": good["tensors"]}, "step counts for 1 parameters"),
        ({"steps": [2, 2], "tensors": b"\x80\x04pickle"}, "unreadable AdamW moments"),
        (with_tensors(**{"0.exp_avg": torch.zeros(3, 4)}), "expected finite [4, 3]"),
        (with_tensors(**{"0.exp_avg": torch.full((4, 3), float("nan"))}), "expected finite"),
        (with_tensors(**{"1.exp_avg_sq": -torch.ones(5)}), "second moment below zero"),
        (with_tensors(**{"0.exp_avg": torch.zeros(4, 3, dtype=torch.float64)}), "torch.float64"),
        (with_tensors(**{"2.exp_avg": torch.zeros(1)}), "5 AdamW moment tensors where 4"),
        ({"steps": [2, 0], "tensors": good["tensors"]}, "4 AdamW moment tensors where 2"),
    ]
    for wire, reason in bad:
        with pytest.raises(ValueError) as e:
            optimizer_state_from_wire(receiver, wire)
        assert reason in str(e.value), (reason, str(e.value))
    assert not receiver.state, "nothing was loaded"


# ---------------------------------------------------------------------------------------------------- a helper


@pytest.fixture(scope="module")
def run():
    from tests.helpers.intake import sample_run

    return sample_run({X: 8})


def _helper(run, optimizer):
    """A Teamwork helping LEADER, on a stand-in learner holding ``run.model`` at v0 (sha SHA0): its lineage state is
    a real :class:`LearnerState`, the rest (network, journal, announcements) stand-ins."""
    from peer.roles.learner.state import LearnerState
    from peer.roles.learner.team.member import Teamwork

    advanced = []
    intake = Intake(run.spec, run.tokenizer, batch=4)
    intake.banned[Y] = "replay: its own ban"
    cache = SimpleNamespace(remove=lambda sha: None)
    session = SimpleNamespace(
        model=run.model, spec=run.spec, blobs=SimpleNamespace(cache=cache), version=0, sha=SHA0, blob=b"", parent=""
    )
    session.swapped = []

    def swap(version, sha, blob):
        session.swapped.append(version)
        session.version, session.sha, session.blob = version, sha, blob

    session.swap = swap
    learner_state = LearnerState(session, optimizer, intake)

    def advance(parent, sha, blob, record, metrics, delta, ledger_line=None):
        advanced.append(delta)
        learner_state.advance(parent, sha, blob)

    peer = SimpleNamespace(
        session=session,
        state=learner_state,
        intake=intake,
        advance=advance,
        adopt=learner_state.adopt,
        announcer=SimpleNamespace(submit=lambda *a: None),
        config=SimpleNamespace(checkpoint_dir=None, check_rate=0.0),
        stop_fetcher=lambda: None,
        start_fetcher=lambda: None,
        beat=lambda: None,
        pad_id=lambda: run.tokenizer.pad_token_id,
        credit_merges=[],
    )
    peer.merge_credit = lambda: peer.credit_merges.append(session.version)
    tw = Teamwork(peer)
    tw.me, tw.lead = HELPER, team.Lead(HELPER)
    tw.follow(LEADER)
    return tw, advanced


def test_a_helper_keeps_the_leaders_used_seqs_reports_its_bans_and_forgets_them_when_it_leads(run):
    from peer.model.adapter import adapter_to_bytes, lora_parameters, sha256_hex
    from peer.roles.learner.update import apply_gradient, tensors_to_bytes

    params = lora_parameters(run.model)
    start = [p.detach().clone() for p in params]
    grads = [torch.full_like(p, 0.01) for p in params]
    applied = [g.clone() for g in grads]
    apply_gradient(run.model, torch.optim.AdamW(params, lr=2e-3), applied, 1.0)  # the leader's step
    blob = adapter_to_bytes(run.model)
    with torch.no_grad():
        for p, v in zip(params, start, strict=True):
            p.copy_(v)
    tw, advanced = _helper(run, torch.optim.AdamW(params, lr=2e-3))
    sha = sha256_hex(blob)
    answer = {"steps": [step(sha=sha, size=len(blob), grads=tensors_to_bytes(applied))], "members": [LEADER, HELPER]}
    record = VersionRecord(1, sha, SHA0, time=1.0, groups=4, staleness_mean=0.0, staleness_max=0, reward_mean=0.5,
                           step_seconds=0.1, stats={"loss": 0.1})  # fmt: skip
    answer["steps"][0]["record"] = record.to_json()
    tw.client = SimpleNamespace(work=lambda *a, **k: messages.parse_work_answer(answer))
    tw._synced = True
    try:
        tw.help_once()
        intake = tw.peer.intake
        assert tw.peer.session.version == 1 and tw.counts["steps"] == 1, "the step was applied"
        assert dict(intake.used[X]) == {5: 0}, "the leader's used seqs are kept: a replay of seq 5 is caught"
        assert X not in intake.banned, "the leader's ban is not this learner's own"
        assert tw.leader_bans == {X.hex(): "reward: claimed 1.0, recomputed 0.0"} and tw.summary()["leader_bans"] == 1
        assert advanced == [{"used": {X.hex(): [[5, 0]]}, "banned": {}}], "the journal holds no ban of the leader's"
        tw.lead = team.Lead(HELPER)
        tw.take_lead("the leader is gone")
        assert tw.peer.credit_merges == [1], "taking the team over, it merges the learners' credit records"
        assert tw.leader_bans == {} and X not in intake.banned, "leading, it judges X by what it verifies itself"
        assert intake.banned == {Y: "replay: its own ban"}, "its own bans persist"
    finally:
        with torch.no_grad():
            for p, v in zip(params, start, strict=True):
                p.copy_(v)


def test_a_helper_takes_a_leaders_state_without_its_bans_and_refuses_one_that_does_not_fit(run):
    from safetensors.torch import save

    from peer.model.adapter import lora_parameters
    from peer.roles.learner.update import optimizer_state_to_wire

    params = lora_parameters(run.model)
    leader_optimizer = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    leader_optimizer.step()  # AdamW state only: the parameters are put back below
    start = [p.detach().clone() for p in params]
    tw, _ = _helper(run, torch.optim.AdamW(params, lr=2e-3))
    try:
        bans = {X.hex(): "logprobs: forged", Y.hex(): "replay: again"}
        wire = optimizer_state_to_wire(leader_optimizer)
        bad = {**wire, "tensors": save({})}  # step counts, but no moments
        for optimizer, adopted in ((bad, False), (wire, True)):
            the_state = state(
                version=7, optimizer=optimizer, intake={"used": {X.hex(): [[9, 6]]}, "banned": bans}, adapter=b"a"
            )
            answer = messages.parse_work_answer({"state": the_state, "members": [LEADER]})
            tw._adopt_state(answer["state"])
            assert (tw.peer.session.swapped == [7]) is adopted and tw._synced is adopted
        intake = tw.peer.intake
        optimizer = tw.peer.state.optimizer
        assert optimizer.param_groups[0]["lr"] == 2e-3, "its own learning rate"
        assert torch.equal(optimizer.state[params[0]]["exp_avg"], leader_optimizer.state[params[0]]["exp_avg"])
        assert dict(intake.used[X]) == {9: 6} and X not in intake.banned
        assert intake.banned == {Y: "replay: its own ban"} and set(tw.leader_bans) == {X.hex(), Y.hex()}
    finally:
        leader_optimizer.zero_grad()
        with torch.no_grad():
            for p, v in zip(params, start, strict=True):
                p.copy_(v)


# ---------------------------------------------------------------------------------------------------- tokens


def test_the_leader_counts_a_shares_tokens_as_the_helper_does(run):
    from peer.roles.learner.update import batch_tensors, share_gradient, signal_tokens

    groups = [SimpleNamespace(owner=X, group=g) for g in run.groups[X]]
    pad, cpu = run.tokenizer.pad_token_id, torch.device("cpu")
    for part in (groups[:1], groups[2:5], groups):
        batch = batch_tensors(part, 0, run.spec, pad, cpu)
        share = share_gradient(run.model, batch, run.spec)
        assert signal_tokens(batch) == (share.tokens if share else 0)


def test_a_helper_that_claims_ten_times_its_tokens_does_not_get_ten_times_the_weight(run, monkeypatch):
    from peer.roles.learner.team.member import _split
    from peer.roles.learner.update import batch_tensors, combine, share_gradient, tensors_to_bytes

    monkeypatch.setattr(team, "POLL_WAIT", 0.0)
    chosen = [SimpleNamespace(owner=X, group=g) for g in run.groups[X] if len(set(g.rewards)) > 1][:4]
    if len(chosen) < 4:
        pytest.skip("too few sampled groups with unequal rewards")
    pad, cpu = run.tokenizer.pad_token_id, torch.device("cpu")

    def share(part):
        return share_gradient(run.model, batch_tensors(part, 0, run.spec, pad, cpu), run.spec) if part else None

    from peer.roles.learner.team.member import Teamwork

    peer = SimpleNamespace(
        session=SimpleNamespace(model=run.model, version=0, spec=run.spec),
        config=SimpleNamespace(check_rate=0.0),
        share=share,
        pad_id=lambda: pad,
    )
    tw = Teamwork(peer)
    tw.me, tw.lead = LEADER, team.Lead(LEADER)
    tw.lead.lead(0, SHA0)
    asyncio.run(tw.lead.handle(HELPER, {"op": "work", "version": 0, "sha": SHA0}))  # the helper asks for work
    tw._helper_results[HELPER] = 10  # past its probation, and check_rate 0: its gradient is not recomputed
    tw._rng = random.Random(0)
    mine, theirs = _split(chosen, 2)
    honest = share(theirs)
    tw.lead.results.put((HELPER, 0, tensors_to_bytes(honest.grads), 10 * honest.tokens, honest.stats))
    combined, cost = tw.gradient(chosen)
    assert cost["helpers"] == 1 and tw.counts["shares_late"] == 0, "the helper's share was used"
    expected = combine([share(mine), honest])
    assert combined.tokens == expected.tokens and tw.counts["tokens_disagreed"] == 1
    for a, b in zip(combined.grads, expected.grads, strict=True):
        assert torch.allclose(a, b, atol=1e-7), float((a - b).abs().max())
