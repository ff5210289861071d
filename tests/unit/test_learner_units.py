"""A learner's logic without a network: the intake (verification, bans, replays, staleness, the per-peer cap, the
pool bound), packing groups into the loss's tensors, one update, and checkpoints. Groups are really sampled from
the bundled model, so every check runs against honest data first."""

import hashlib
import json
import random
from types import SimpleNamespace

import pytest
import torch

from peer.errors import UserError
from peer.grpo import staleness_weight
from peer.network.buckets import Fetched
from peer.protocol import GroupRecord, key_fingerprint
from peer.roles.learner.intake import Intake
from peer.roles.learner.peer import batch_tensors, learn_step, read_checkpoint, write_checkpoint
from tests.helpers.intake import SHA0, SHA1, new_intake, sample_run
from tests.helpers.intake import fetched as entry
from tests.helpers.records import changed

PEER_ID = "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT"
A = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/peer-a=="
B = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/peer-b=="
C = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/peer-c=="


@pytest.fixture(scope="module")
def setup():
    return sample_run({A: 12, B: 4, C: 2})


def intake(setup, batch=4, share_cap=0.5, check_rate=0.0) -> Intake:
    return new_intake(setup, batch, share_cap, check_rate)


def test_honest_groups_are_admitted_and_taken_once(setup):
    it = intake(setup)
    for g in setup.groups[A][:3]:
        assert it.add(entry(A, g), 0) is None
    assert it.take(0) is None, "three groups are not an update of four"
    assert it.add(entry(A, setup.groups[A][3]), 0) is None
    chosen = it.take(0)
    assert sorted(a.group.seq for a in chosen) == [0, 1, 2, 3]
    assert it.take(0) is None and it.waiting() == 0
    assert not it.banned and not it.rejected


def test_an_inflated_reward_bans_its_signer_and_purges_what_it_sent(setup):
    it = intake(setup)
    honest = setup.groups[B]
    assert it.add(entry(B, honest[0]), 0) is None
    lie = honest[1]
    inflated = changed(lie, rewards=[1.0] * len(lie.rewards))
    assert inflated.rewards != lie.rewards, "the sampled group was already all right; pick another"
    refused = it.add(entry(B, inflated), 0)
    assert refused.reason == "reward" and B in it.banned
    assert it.waiting() == 0 and it.counts["purged"] == 1, "its earlier, honest-looking group left the pool too"
    assert it.add(entry(B, honest[2]), 0) == "banned"
    assert it.counts["ignored_banned"] == 1


def test_a_replayed_seq_is_refused_in_any_version_and_bans(setup):
    it = intake(setup)
    g = setup.groups[C][0]
    assert it.add(entry(C, g), 0) is None
    replay = changed(g, version=1, adapter_sha256=SHA1)  # the same prompt and answers, re-tagged as fresh
    refused = it.add(Fetched(C, 1, g.seq, replay), 1)
    assert refused.reason == "replay" and C in it.banned


def test_the_same_entry_read_twice_is_a_forgiven_duplicate_and_used_once(setup):
    it = intake(setup)
    g = setup.groups[A][0]
    assert it.add(entry(A, g), 0) is None
    assert it.add(entry(A, g), 0).reason == "duplicate" and A not in it.banned
    assert it.waiting() == 1


def test_stale_unknown_and_unreadable_entries_are_not_banned(setup):
    it = intake(setup)
    g = setup.groups[A][0]
    assert it.add(entry(A, g), setup.spec.staleness.tau_max + 1) == "stale"
    unknown = changed(setup.groups[A][1], version=7, adapter_sha256="7" * 64)
    assert it.add(Fetched(A, 7, unknown.seq, unknown), 7).reason == "unknown_version"
    assert it.add(Fetched(A, 0, 99, None, "cut short"), 0).reason == "schema"
    assert not it.banned and it.counts["dropped_stale"] == 1
    assert it.rejected == {"unknown_version": 1, "schema": 1}


def test_someone_elses_prompt_bans_and_another_lineages_version_is_only_refused(setup):
    it = intake(setup)
    g = setup.groups[A][0]
    assert it.add(entry(A, changed(g, adapter_sha256=SHA1)), 0).reason == "lineage"  # a fork's v0: not a lie
    assert A not in it.banned
    it2 = intake(setup)
    assert it2.add(entry(B, setup.groups[A][1]), 0).reason == "prompt"  # A's group re-signed by B
    assert B in it2.banned


def test_a_long_run_of_another_lineages_groups_bans_a_short_one_is_forgiven(setup):
    from peer.roles.learner.intake import STRIKE_UPDATES

    it = intake(setup)
    limit = STRIKE_UPDATES * it.batch * (setup.spec.staleness.tau_max + 1)
    forked = changed(setup.groups[A][0], adapter_sha256=SHA1)
    for seq in range(limit):  # a peer that kept sampling with a lost lineage's adapter, then caught up
        assert it.add(entry(A, changed(forked, seq=1000 + seq)), 0).reason == "lineage"
    assert A not in it.banned
    assert it.add(entry(A, setup.groups[A][1]), 0) is None, "a verified group wipes the slate"
    for seq in range(limit + 1):  # one that never does: a flood the learner reads and refuses for ever
        it.add(entry(A, changed(forked, seq=5000 + seq)), 0)
    assert A in it.banned and "not in this lineage" in it.banned[A]


def test_a_long_run_of_unreadable_entries_bans_a_short_one_is_forgiven(setup):
    """An inline entry's groups are signed bytes that only learners parse: one that does not parse may be a blob
    cut in transit, a flood of them is the signer's."""
    from peer.roles.learner.intake import STRIKE_UPDATES

    it = intake(setup)
    limit = STRIKE_UPDATES * it.batch * (setup.spec.staleness.tau_max + 1)
    for seq in range(limit):
        assert it.add(Fetched(A, 0, 1000 + seq, None, "cut short"), 0).reason == "schema"
    assert A not in it.banned
    assert it.add(entry(A, setup.groups[A][1]), 0) is None, "a verified group wipes the slate"
    for seq in range(limit + 1):
        it.add(Fetched(A, 0, 5000 + seq, None, "not msgpack"), 0)
    assert A in it.banned and "unreadable groups in a row" in it.banned[A]


def test_a_blob_that_could_not_be_fetched_mutes_its_signer_for_a_while_and_never_bans(setup):
    """A producer whose blobs do not arrive (behind a firewall, gone, or a stranger naming providers that never
    serve) proves nothing, but each such blob holds a fetch worker until its deadline: its signer is muted (its
    entries not read), twice as long each time with no verified group between, and a verified group clears it."""
    from peer.roles.learner.intake import MUTE_FIRST, MUTE_MOST, STRIKE_UPDATES

    now = [100.0]
    it = intake(setup)
    it.clock = lambda: now[0]
    limit = STRIKE_UPDATES * it.batch * (setup.spec.staleness.tau_max + 1)

    def unavailable(seq):
        return it.add(Fetched(A, 0, seq, None, "group blob unavailable: no provider answered", True), 0)

    assert A not in it.skipped and B not in it.skipped
    refused = unavailable(1000)
    assert refused.reason == "unavailable" and "no provider answered" in refused
    assert A in it.skipped and B not in it.skipped, "muted: the reader skips A's entries, and only A's"
    assert unavailable(1001).reason == "unavailable", "in flight when the mute began: refused, the mute unchanged"
    assert it.muted[A] == (100.0 + MUTE_FIRST, MUTE_FIRST) and it.counts["muted"] == 1
    now[0] += MUTE_FIRST
    assert A not in it.skipped, "the mute ended"
    lasted = []
    for seq in range(limit + 1):  # more than a ban's worth of strikes: never banned, muted longer and longer
        unavailable(2000 + seq)
        lasted.append(it.muted[A][1])
        now[0] = it.muted[A][0]
    assert A not in it.banned and not it.strikes[A]
    assert lasted[:4] == [2 * MUTE_FIRST, 4 * MUTE_FIRST, 8 * MUTE_FIRST, 16 * MUTE_FIRST] and lasted[-1] == MUTE_MOST
    assert it.rejected == {"unavailable": limit + 3}
    assert it.add(entry(A, setup.groups[A][1]), 0) is None, "a verified group clears the mute"
    assert A not in it.muted and A not in it.skipped
    unavailable(9000)
    assert it.muted[A][1] == MUTE_FIRST, "and starts the doubling again"
    it.ban(A, "reward: lied")
    assert A in it.skipped and A not in it.muted, "a ban is for good"


def test_groups_go_stale_in_the_pool(setup):
    it = intake(setup)
    for g in setup.groups[A][:4]:
        it.add(entry(A, g), 0)
    assert it.take(setup.spec.staleness.tau_max + 1) is None
    assert it.counts["dropped_stale"] == 4 and it.waiting() == 0


def owners(chosen) -> list[str]:
    return sorted(key_fingerprint(a.owner) for a in chosen)


def test_the_share_cap_lets_a_peer_lend_half_its_cap_to_one_update_and_holds_it_to_its_share_after(setup):
    """The cap is a token bucket (``BURST``): a peer may give one update up to half its cap more when another's
    groups are short, and is held to its cap in the next updates until it has paid it back."""
    it = intake(setup, batch=4, share_cap=0.5)
    for g in setup.groups[A]:
        it.add(entry(A, g), 0)
    assert it.cap(0) == 4, "alone, a peer may fill an update"
    it.add(entry(B, setup.groups[B][0]), 0)
    assert it.contributors(0) == 2 and it.cap(0) == 2
    fa, fb = key_fingerprint(A), key_fingerprint(B)
    assert owners(it.take(0)) == sorted([fa] * 3 + [fb]), "B has 1 of its 2: A lends it one (cap 2 + burst 1)"
    assert it.take(0) is None, "A lent one and has 2 now; B has none: the update waits for B"
    it.add(entry(B, setup.groups[B][1]), 0)
    assert it.take(0) is None, "A 2 + B 1 is not an update of 4"
    it.add(entry(B, setup.groups[B][2]), 0)
    assert owners(it.take(0)) == sorted([fa] * 2 + [fb] * 2)
    assert it.tokens == {A: 2}, "A gave its cap: still at it; B is full again, so forgotten"
    assert it.waiting() == len(setup.groups[A]) - 5 and it.take(0) is None


def test_a_peer_that_died_stops_holding_the_others_to_the_cap(setup):
    """Counting contributors by version alone, an update would wait forever for a dead peer's share: no version
    is made, so the dead peer's last groups never leave the window."""
    now = [0.0]
    it = Intake(setup.spec, setup.tokenizer, batch=4, check_rate=0.0, rng=random.Random(3), clock=lambda: now[0])
    it.known.update({0: SHA0})
    it.add(entry(B, setup.groups[B][0]), 0)  # B contributes, then dies
    now[0] = 5.0
    for g in setup.groups[A][:8]:
        it.add(entry(A, g), 0)
    assert it.contributors(0) == 2 and it.take(0) is not None, "A lends one to B's single group: 3 + 1"
    assert it.take(0) is None, "then A alone may give 2 of 4 while B counts"
    now[0] = 5.0 + it.recent  # B's last group is older than `recent`: it no longer counts
    assert it.contributors(0) == 1
    chosen = it.take(0)
    assert chosen is not None and {a.owner for a in chosen} == {A}, "A's debt at the old cap does not hold it"


def test_the_benchmarks_barrier_takes_every_peers_share_of_the_current_version_only(setup):
    """``barrier`` (the synchronous baseline of docs/benchmarks.md): an update waits until every contributor has
    its share sampled with the learner's version, takes exactly that share of each, and never older groups."""
    it = Intake(setup.spec, setup.tokenizer, batch=4, check_rate=0.0, rng=random.Random(3), barrier=True)
    it.known.update({0: SHA0, 1: SHA1})
    for g in setup.groups[A][:6]:
        it.add(entry(A, g), 0)
    it.add(entry(B, setup.groups[B][0]), 0)
    assert it.take(0) is None, "B has 1 of its 2"
    it.add(entry(B, setup.groups[B][1]), 0)
    chosen = it.take(0)
    assert sorted(key_fingerprint(a.owner) for a in chosen) == sorted(
        [key_fingerprint(A)] * 2 + [key_fingerprint(B)] * 2
    )
    assert it.waiting() == 4 and it.take(1) is None, "A's other v0 groups do not count at v1"
    assert it.waiting() == 4


def test_the_pool_keeps_a_bounded_number_per_peer(setup):
    it = intake(setup, batch=1)
    bound = setup.spec.staleness.tau_max + 1
    for g in setup.groups[A][: bound + 3]:
        it.add(entry(A, g), 0)
    assert it.waiting() == bound and it.rejected["surplus"] == 3
    assert sorted(a.group.seq for a in it.pool[A]) == list(range(3, bound + 3)), "the oldest surplus goes"


def test_spot_checks_wait_for_a_batch_or_a_second_whichever_comes_first(setup):
    """On the loop, one forward pass per version serves every due group of that version: the learner checks once
    ``SPOT_CHECK_BATCH`` are due, or as soon as the first has waited ``SPOT_CHECK_WAIT`` s. A learner with a
    checking process hands every due group over at once (its forward passes cost the loop nothing)."""
    from types import SimpleNamespace

    from peer.roles.learner.peer import SPOT_CHECK_BATCH, SPOT_CHECK_WAIT, LearnerPeer

    now = [100.0]
    it = intake(setup, check_rate=1.0)
    it.clock = lambda: now[0]
    learner = SimpleNamespace(intake=it, checker=None)
    assert LearnerPeer._checks_due(SimpleNamespace(intake=it, checker=object())) == 1, "a checking process: any one"
    assert LearnerPeer._checks_due(learner) == SPOT_CHECK_BATCH > 1, "nothing due: nothing forces a check"
    g0, g1 = setup.groups[A][:2]
    it.add(entry(A, g0), 0)
    now[0] += SPOT_CHECK_WAIT / 2
    it.add(entry(A, g1), 0)
    assert it.checks_waiting() == 2 and LearnerPeer._checks_due(learner) == SPOT_CHECK_BATCH
    now[0] += SPOT_CHECK_WAIT / 2
    assert LearnerPeer._checks_due(learner) == 1, "the first drawn has waited long enough: check what is due"
    for a in it.pending_checks():
        it.checked(a, None)
    assert LearnerPeer._checks_due(learner) == SPOT_CHECK_BATCH
    it.add(entry(A, setup.groups[A][2]), 0)
    assert LearnerPeer._checks_due(learner) == SPOT_CHECK_BATCH, "the wait counts from the oldest still due"


def test_spot_checked_groups_wait_for_their_check(setup):
    it = intake(setup, check_rate=1.0)
    g0, g1 = setup.groups[A][:2]
    it.add(entry(A, g0), 0)
    it.add(entry(A, g1), 0)
    assert it.waiting() == 0
    first, second = it.pending_checks()
    it.checked(first, None)
    assert it.waiting() == 1
    from peer.roles.learner.verify import Refused

    it.checked(second, Refused("logprobs", "off by 3"))
    assert A in it.banned and it.waiting() == 0


def test_spot_checks_catch_forged_logprobs_on_the_real_model(setup):
    from peer.protocol import Completion
    from peer.roles.learner.verify import check_logprobs

    g = setup.groups[A][0]
    assert check_logprobs(setup.model, g, setup.spec, 1e-3) is None
    forged = changed(
        g, completions=[Completion.of(c.tokens(), [-0.01] * len(c.tokens())) for c in g.completions]
    )  # "the model was sure": ratios computed against these would be wrong
    assert check_logprobs(setup.model, forged, setup.spec, 0.05).reason == "logprobs"


def test_batched_spot_checks_judge_each_group_as_alone(setup):
    from peer.protocol import Completion, encode_tokens
    from peer.roles.learner.verify import check_logprobs, check_logprobs_many

    groups = setup.groups[A][:3] + setup.groups[B][:2]
    forged = [Completion.of(c.tokens(), [-0.01] * len(c.tokens())) for c in groups[2].completions]
    # a shorter prompt (its first token dropped) makes the batch left-pad the others
    short = changed(groups[4], prompt_ids=encode_tokens(groups[4].prompt_tokens()[1:]))
    batch = [*groups[:2], changed(groups[2], completions=forged), groups[3], short]
    found = check_logprobs_many(setup.model, batch, setup.spec, 1e-3)
    alone = [check_logprobs(setup.model, g, setup.spec, 1e-3) for g in batch]
    assert found[:4] == [None, None, found[2], None] and found[2].reason == "logprobs", "only the forged one"
    assert found == alone, "the same verdicts, and the same worst differences, as one group at a time"


def test_intake_state_keeps_bans_and_what_updates_used(setup):
    it = intake(setup, batch=1)
    used, unused = setup.groups[A][0], setup.groups[A][1]
    assert it.add(entry(A, used), 0) is None
    assert [a.group for a in it.take(0)] == [used]
    assert it.add(entry(A, unused), 0) is None  # read, not yet used when the checkpoint is written
    it.ban(C, "reward: lied")
    again = intake(setup, batch=1)
    again.restore(it.state())
    assert again.banned == {C: "reward: lied"} and again.seqs[A] == {used.seq: 0}
    assert again.add(entry(A, used), 0).reason == "duplicate", "read again after a restart: not used twice"
    assert again.add(entry(A, unused), 0) is None, "read but never used: the restarted learner uses it"
    retagged = changed(used, version=1, adapter_sha256=SHA1)
    assert again.add(Fetched(A, 1, used.seq, retagged), 1).reason == "replay"


def test_batch_tensors_and_one_update_move_only_the_adapter(setup):
    from peer.model.adapter import adapter_to_bytes, lora_parameters

    it = intake(setup, batch=4)
    for g in setup.groups[A][:4]:
        it.add(entry(A, g), 0)
    chosen = it.take(2)  # held at v2: these v0 groups are 2 versions stale
    batch = batch_tensors(chosen, 2, setup.spec, setup.tokenizer.pad_token_id, torch.device("cpu"))
    G = setup.spec.sampling.group_size
    assert batch.completion_ids.shape[0] == 4 * G and batch.rewards.shape == (4, G)
    assert torch.allclose(batch.weights, torch.full((4 * G,), staleness_weight(2, setup.spec.staleness)))
    for row, a in enumerate(chosen):
        c = a.group.completions[0]
        n = len(c.tokens())
        assert (
            batch.completion_ids[row * G, :n].tolist() == c.tokens() and int(batch.completion_mask[row * G].sum()) == n
        )
        assert batch.prompt_ids[row * G][batch.prompt_mask[row * G].bool()].tolist() == a.group.prompt_tokens()
    if not bool(batch.advantages.ne(0).any()):
        pytest.skip("every sampled group had equal rewards")
    base_before = {n: p.detach().clone() for n, p in setup.model.named_parameters() if "lora_" not in n}
    adapter_before = adapter_to_bytes(setup.model)
    optimizer = torch.optim.AdamW(lora_parameters(setup.model), lr=2e-3)
    stats = learn_step(setup.model, batch, setup.spec, optimizer, 1.0)
    assert stats is not None and stats["rows"] > 0 and 0.0 <= stats["clip_fraction"] <= 1.0
    assert adapter_to_bytes(setup.model) != adapter_before
    for n, p in setup.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), f"base weight {n} changed"


def test_an_update_without_signal_changes_nothing(setup):
    it = intake(setup, batch=2)
    flat = [changed(g, rewards=[0.0] * len(g.rewards)) for g in setup.groups[A][:2]]
    chosen = [SimpleNamespace(owner=A, group=g) for g in flat]
    batch = batch_tensors(chosen, 0, setup.spec, 0, torch.device("cpu"))
    assert learn_step(setup.model, batch, setup.spec, None, 1.0) is None
    assert it.waiting() == 0


def test_checkpoints_round_trip_and_refuse_a_corrupt_one(tmp_path):
    from peer.model.config import LoRAConfig
    from peer.model.peft_folder import blob_from_tensors, read_adapter

    adapter = blob_from_tensors({"base_model.model.l.lora_A.weight": torch.ones(2, 3)}, LoRAConfig(r=2))
    meta = {"run_id": "r", "version": 3, "sha256": hashlib.sha256(adapter).hexdigest(), "parent_sha256": "p"}
    state = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 2e-3, "params": [0]}]}
    directory = tmp_path / "ck"
    write_checkpoint(directory, meta, adapter, state, "some/model")
    write_checkpoint(directory, {**meta, "version": 4}, adapter, state, "some/model")  # replaces it whole
    got_meta, got_adapter, got_state = read_checkpoint(directory)
    assert got_meta["version"] == 4 and got_adapter == adapter
    assert torch.equal(got_state["state"][0]["step"], torch.tensor(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert read_checkpoint(tmp_path / "none") is None
    assert read_adapter(directory) == (adapter, LoRAConfig(r=2)), "a checkpoint is a PEFT folder of its adapter"
    assert json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"] == "some/model"
    (directory / "adapter_model.safetensors").write_bytes(b"flipped")
    with pytest.raises(UserError, match="unreadable"):
        read_checkpoint(directory)


def test_the_fetcher_reads_every_group_published_into_its_window_once(setup):
    from peer.network.buckets import MemoryBucketStore
    from peer.roles.learner.io import Fetcher as _Fetcher

    store = MemoryBucketStore(A)
    fetcher = _Fetcher(store, window=4, interval=0.01)  # polled by hand here, not on its thread

    def drain() -> list[tuple[int, int]]:
        out = []
        while not fetcher.queue.empty():
            f = fetcher.queue.get()
            out.append((f.version, f.seq))
        return out

    g = setup.groups[A][0]
    store.publish(changed(g, version=2, seq=0))
    fetcher.version = 4
    fetcher.poll()  # the first poll reads the whole window
    assert drain() == [(2, 0)]
    fetcher.poll()
    assert drain() == [], "handed over once"
    store.publish(changed(g, version=2, seq=1))  # late, two versions behind, as the group read lately was
    store.publish(changed(g, version=4, seq=2))
    fetcher.poll()
    assert sorted(drain()) == [(2, 1), (4, 2)], "read as far behind as the groups read lately were: at once"
    fetcher.LAG_SECONDS = 0.0  # nothing read lately counts any more: the newest two versions only
    assert fetcher.depth() == 1
    store.publish(changed(g, version=2, seq=3))  # late, into a version no longer among the newest two
    fetcher.poll()
    assert drain() == []
    fetcher.version = 7  # version 2 leaves the window (7 - 4 = 3) before the next whole-window read
    fetcher.poll()
    assert drain() == [(2, 3)], "a version's bucket is read once more as it leaves the window"
    store.publish(changed(g, version=3, seq=10))  # late into an older version that stays in the window
    polls = 0
    while not (found := drain()):
        fetcher.poll()
        polls += 1
    assert found == [(3, 10)] and 1 < polls <= _Fetcher.FULL_EVERY, "read by the next whole-window read"


def test_how_far_back_the_fetcher_reads_is_bounded_by_the_window(setup):
    """What a stranger publishes far behind cannot make every read cover more than the staleness window."""
    from peer.network.buckets import MemoryBucketStore
    from peer.roles.learner.io import Fetcher as _Fetcher

    store = MemoryBucketStore(A)
    fetcher = _Fetcher(store, window=4, interval=0.01)
    fetcher.version = 10
    g = setup.groups[A][0]
    store.publish(changed(g, version=2, seq=0))  # 8 versions behind: read once as its bucket leaves, never used
    fetcher.poll()
    assert fetcher.queue.qsize() == 1 and fetcher.depth() == 1, "a group beyond the window deepens nothing"
    store.publish(changed(g, version=6, seq=1))  # 4 behind: the window's edge
    for _ in range(_Fetcher.FULL_EVERY):
        fetcher.poll()
    assert fetcher.queue.qsize() == 2 and fetcher.depth() == 4, "at most the window"


def test_the_fetcher_does_not_read_what_banned_signers_publish(setup):
    from peer.network.buckets import MemoryBucketStore
    from peer.roles.learner.io import Fetcher as _Fetcher

    entries: dict = {}
    store_a, store_b = MemoryBucketStore(A, entries), MemoryBucketStore(B, entries)
    banned: dict = {}
    fetcher = _Fetcher(store_a, window=4, interval=0.01, skip=banned)
    store_a.publish(setup.groups[A][0])
    store_b.publish(setup.groups[B][0])
    banned[B] = "replay"  # the intake's bans, as the learner shares them
    fetcher.poll()
    got = [fetcher.queue.get_nowait() for _ in range(fetcher.queue.qsize())]
    assert [f.owner for f in got] == [A]
    del banned[B]
    fetcher.poll()
    assert [fetcher.queue.get_nowait().owner for _ in range(fetcher.queue.qsize())] == [B], "not marked seen"


# --- an update in shares (several learners, peer.roles.learner.update) -----------------------------------------------


def test_shares_combined_by_tokens_are_the_whole_batch_gradient_and_replay_bit_for_bit(setup):
    from peer.model.adapter import adapter_to_bytes, lora_parameters
    from peer.roles.learner.update import (
        apply_gradient,
        combine,
        share_gradient,
        tensors_from_bytes,
        tensors_to_bytes,
    )

    groups = [g for g in setup.groups[A] if len(set(g.rewards)) > 1][:4]
    if len(groups) < 4:
        pytest.skip("too few sampled groups with unequal rewards")
    chosen = [SimpleNamespace(owner=A, group=g) for g in groups]
    pad, cpu = setup.tokenizer.pad_token_id, torch.device("cpu")
    assert setup.spec.lora.dropout == 0.0  # the same rows give the same gradient

    def grad_of(part):
        return share_gradient(setup.model, batch_tensors(part, 1, setup.spec, pad, cpu), setup.spec)

    whole = grad_of(chosen)
    halves = combine([grad_of(chosen[:1]), grad_of(chosen[1:])])
    assert halves.tokens == whole.tokens and halves.stats["rows"] == whole.stats["rows"]
    for a, b in zip(whole.grads, halves.grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), float((a - b).abs().max())
    assert any(float(g.abs().max()) > 0 for g in whole.grads), "no gradient at all: the check would be empty"

    # a helper applying the leader's clipped gradient through the same AdamW state gets the same adapter bytes
    params = lora_parameters(setup.model)
    start = [p.detach().clone() for p in params]
    leader = torch.optim.AdamW(params, lr=2e-3)
    applied = [g.clone() for g in halves.grads]
    apply_gradient(setup.model, leader, applied, 1.0)
    leader_bytes = adapter_to_bytes(setup.model)
    with torch.no_grad():
        for p, v in zip(params, start, strict=True):
            p.copy_(v)
    helper = torch.optim.AdamW(params, lr=2e-3)
    apply_gradient(setup.model, helper, tensors_from_bytes(tensors_to_bytes(applied), params), None)
    assert adapter_to_bytes(setup.model) == leader_bytes
    with pytest.raises(ValueError, match="expected"):
        tensors_from_bytes(tensors_to_bytes([t[:1] for t in applied]), params)
    with pytest.raises(ValueError, match="tensors"):
        tensors_from_bytes(tensors_to_bytes(applied[:-1]), params)
    with pytest.raises(ValueError, match="unreadable"):
        tensors_from_bytes(b"not safetensors", params)


def test_split_and_who_wins():
    from peer.roles.learner.team.lead import wins
    from peer.roles.learner.team.member import _split

    assert _split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert _split([1], 2) == [[1], []] and _split([], 1) == [[]]
    assert wins((5, "b"), (4, "a")) and wins((5, "a"), (5, "b")) and not wins((5, "b"), (5, "a"))


def test_the_leaders_answers_to_a_helper(setup):
    """The team protocol's leader side on its own: state, steps, a task, a redirect, a refusal — each answer as a
    helper checks it (peer.roles.learner.team.messages)."""
    import asyncio
    import threading

    from peer.roles.learner.team.lead import Lead
    from peer.roles.learner.team.messages import parse_work_answer

    leader, helper = "12D3KooWLeader", "12D3KooWHe1per"
    lead = Lead(leader)
    lead.lead(3, SHA0)

    def ask(version, sha, need_state=False):
        request = {"op": "work", "version": version, "sha": sha, "need_state": need_state}
        return parse_work_answer(asyncio.run(lead.handle(helper, request)))

    snapshot = {
        "version": 3,
        "sha": SHA0,
        "parent": "",
        "adapter": b"a",
        "optimizer": {"steps": [], "tensors": b"o"},
        "intake": {"used": {}, "banned": {}},
    }

    def offer():  # the learner's loop answers a wanted snapshot
        if lead.snapshot_wanted.wait(timeout=5):
            lead.offer_snapshot(snapshot)

    t = threading.Thread(target=offer)
    t.start()
    got = ask(3, SHA0, need_state=True)  # just joined: the whole state even though v3 is in the lineage
    t.join()
    assert got["state"]["version"] == 3 and got["members"] == [leader, helper]
    intake = {"used": {A.hex(): [[1, 3]]}, "banned": {}}
    step = {"version": 4, "parent": SHA0, "sha": SHA1, "size": 10, "grads": b"g", "intake": intake, "record": {}}
    step["record"] = {"version": 4, "sha256": SHA1}
    lead.advance(step)
    assert ask(3, SHA0)["steps"] == [step]  # behind by one: the step
    assert lead.helpers() == [helper]
    task_id = lead.assign(helper, [{"owner": A, "group": b"packed"}])
    assert ask(4, SHA1)["task"]["id"] == task_id
    answer = asyncio.run(
        lead.handle(helper, {"op": "result", "task": task_id, "grads": b"g", "tokens": 3, "stats": {}})
    )
    assert answer == {"ok": True} and lead.results.get_nowait()[:2] == (helper, task_id)
    with pytest.raises(ValueError, match="sha: string does not match regex"):
        parse_work_answer({"steps": [{**step, "sha": "nope"}], "members": []})
    lead.refuse(helper, "its gradient differs")
    assert ask(4, SHA1) == {"refused": "its gradient differs"}
    lead.follow("12D3KooWOther")
    assert asyncio.run(lead.handle("x", {"op": "probe"}))["leader"] == "12D3KooWOther"
    assert asyncio.run(lead.handle("x", {"op": "work", "version": 4, "sha": SHA1})) == {"leader": "12D3KooWOther"}


def test_a_private_swarms_leader_answers_only_invited_learners():
    import asyncio

    from peer.roles.learner.team.lead import Lead

    access = SimpleNamespace(
        check=lambda invite: None if invite == "hgi1.good" else "no invite: this swarm is private"
    )
    lead = Lead("leader", access)
    lead.lead(0, SHA0)
    refused = asyncio.run(lead.handle("stranger", {"op": "probe"}))
    assert refused["error"].startswith("not authorized (no invite")
    assert asyncio.run(lead.handle("member", {"op": "probe", "invite": "hgi1.good"}))["leading"] is True
    assert lead.helpers() == []  # the stranger was never taken for a helper


def _made_up(setup, owner: bytes, seq: int, version: int, sha: str) -> GroupRecord:
    """What a peer flooding the buckets without sampling anything sends (tests/procs/flooder.py)."""
    from tests.procs.flooder import made_up_group

    return made_up_group(setup.spec, setup.tokenizer, owner, PEER_ID, seq, version, sha)


def test_a_flood_100_times_the_honest_rate_stays_under_the_cap_and_in_bounded_memory(setup):
    """Signer A publishes 100 groups per version (spot checks off: as if they were honest), B 1 or 3: every update
    takes at most the cap and its burst from A, any run of updates at most the cap per update and one burst, and
    what the intake keeps of A (pool, seqs) stays bounded however long it goes."""
    from peer.roles.learner.intake import FORGET_EVERY, FORGET_MARGIN

    it = intake(setup, batch=4, share_cap=0.5)
    tau_max = setup.spec.staleness.tau_max
    seq_a = seq_b = 0
    sizes, versions, given_a = [], 60, []
    for version in range(versions):
        sha = hashlib.sha256(f"v{version}".encode()).hexdigest()
        it.known[version] = sha
        for _ in range(100):
            assert it.add(entry(A, _made_up(setup, A, seq_a, version, sha)), version) is None
            seq_a += 1
        for _ in range(1 if version % 2 else 3):  # B is short of its 2 every other version
            assert it.add(entry(B, _made_up(setup, B, seq_b, version, sha)), version) is None
            seq_b += 1
        chosen = it.take(version)
        assert chosen is not None
        given_a.append(sum(a.owner == A for a in chosen))
        assert given_a[-1] <= it.cap(version) + 1 and it.cap(version) == 2, "A over its cap and burst"
        for m in range(1, len(given_a) + 1):  # any m updates in a row: at most m x cap + the burst
            assert sum(given_a[-m:]) <= 2 * m + 1, f"A over its share in its last {m} updates: {given_a[-m:]}"
        sizes.append((len(it.pool[A]), len(it.seqs[A])))
    assert A not in it.banned and B not in it.banned
    assert max(given_a) == 3 and sum(given_a) <= 2 * versions + 1, "A lent to updates B was short of, and no more"
    bound = it.batch * (tau_max + 1)
    assert max(pool for pool, _ in sizes) <= bound, "the pool of one signer is bounded"
    remembered = 100 * (tau_max + 1 + FORGET_MARGIN + FORGET_EVERY)
    assert max(seqs for _, seqs in sizes) <= remembered, "the seqs remembered grow with the run"
    assert sizes[-1][1] <= remembered and it.floor[A] > 0
    # what updates used is bounded by the window too (checkpoints and team states carry it), its floor kept
    window = tau_max + 1 + FORGET_MARGIN + FORGET_EVERY
    assert len(it.used[A]) <= 3 * window + 1 and len(it.used[B]) <= 3 * window + 1, (len(it.used[A]), len(it.used[B]))
    restored = intake(setup, batch=4)
    restored.restore(it.state())
    restored.forget_window(versions + FORGET_EVERY)
    old_seq = min(it.used[A])  # the highest of those forgotten, kept as the floor's carrier
    assert restored.floor[A] >= old_seq
    restored.known[versions] = it.known[versions - 1]
    replayed = _made_up(setup, A, old_seq - 1, versions, it.known[versions - 1])  # a used seq re-tagged as new
    assert restored.add(entry(A, replayed), versions).reason == "replay", "a restored intake still knows the floor"


def test_a_flood_of_fresh_keys_keeps_the_intakes_per_signer_memory_bounded(setup):
    """10,000 keys, each with one unreadable and one unavailable entry (a strike, a refusal and a mute each) and a
    stale one: what the intake keeps per signer stays within its caps, and an honest signer is judged as before."""
    from peer.roles.learner.intake import MAX_SIGNER_STATE

    it = intake(setup)
    keys = [b"fresh-key-%05d" % i for i in range(10_000)]
    for i, key in enumerate(keys):
        assert it.add(Fetched(key, 0, 1, None, "cut short"), 0).reason == "schema"
        assert it.add(Fetched(key, 0, 2, None, "group blob unavailable", True), 0).reason == "unavailable"
        assert it.add(entry(key, changed(setup.groups[A][i % 4], seq=3)), 40) == "stale"
    it.forget_window(40)
    sizes = {
        "rejected_by": len(it.rejected_by), "strikes": len(it.strikes), "muted": len(it.muted), "seqs": len(it.seqs),
    }  # fmt: skip
    assert max(sizes.values()) <= MAX_SIGNER_STATE, sizes
    assert keys[-1] in it.muted and it.rejected_by[keys[-1]] == 2, "the newest are the ones kept"
    assert it.rejected_by[keys[0]] == 0, "a forgotten signer's count reads as 0"
    assert len(it.floor) == len(keys), "a floor each (within MAX_FLOORS): the stale entries' seqs"
    assert it.add(entry(A, setup.groups[A][0]), 0) is None, "the honest signer's group is taken as before"


def test_a_restored_intake_knows_the_floor_of_a_signer_whose_used_groups_all_left_the_window(setup):
    it = intake(setup, batch=4)
    for g in setup.groups[A][:4]:  # seqs 0..3 with v0, all used by one update
        assert it.add(entry(A, g), 0) is None
    assert len(it.take(0)) == 4
    it.forget(10)  # far past v0: of what updates used, only the highest seq stays
    assert it.used[A] == {3: 0}
    restored = intake(setup, batch=4)
    restored.restore(it.state())  # a restart from a checkpoint, or a helper taking the team's state
    restored.forget(10)
    assert restored.floor[A] == 3
    restored.known[19] = SHA1
    replayed = changed(setup.groups[A][1], version=19, adapter_sha256=SHA1)  # seq 1 re-tagged as new
    assert restored.add(entry(A, replayed), 20).reason == "replay" and A in restored.banned


def test_a_replay_of_a_seq_long_forgotten_still_bans_and_an_old_entry_read_again_does_not(setup):
    it = intake(setup, batch=4)
    for g in setup.groups[A][:4]:  # seqs 0..3 with v0
        assert it.add(entry(A, g), 0) is None
    it.forget(10)  # the learner is far past v0 now
    assert it.seqs[A] == {} and it.floor[A] == 3
    assert it.add(entry(A, setup.groups[A][2]), 20) == "stale", "an old entry read again is only stale"
    assert A not in it.banned
    it.known[19] = SHA1
    replayed = changed(setup.groups[A][1], version=19, adapter_sha256=SHA1)  # seq 1 re-tagged as new
    assert it.add(entry(A, replayed), 20).reason == "replay" and A in it.banned
