"""Every class of malformed record a peer can receive, one named test each: refused at the layer that owns the rule,
and nothing else changed.

The layers: the run's DHT validators at store time (``make_validators``, as every peer runs them: a refused record
is stored nowhere), the readers (``from_dht_value`` / ``unpack``: what a validator cannot see, and blobs; a bucket
entry's groups are bytes to the DHT, so every rule of a group is its reader's, ``groups_of``), and a
learner's intake (``Intake.add``: what needs the run, its tokenizer and the signer's history; a refusal carries its
reason, and bans the signer unless the reason is forgiven). "Nothing else changed" means: the validator still
accepts a good record under the same key and subkey and did not remember the bad one; the intake's pool, seqs,
bans and refusals for every other signer equal those of an intake that never saw the bad record.

Other tests cover parts of this in more detail (tests/unit/test_protocol.py, test_protocol_validators.py,
test_learner_units.py, test_rollout_units.py); this file is where every class has its name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from types import SimpleNamespace
from unittest import mock

import msgpack
import pydantic.v1 as pydantic
import pytest
from hivemind.dht.schema import SchemaValidator
from hivemind.utils.serializer import MSGPackSerializer

from peer.errors import UserError
from peer.network.buckets import DHTBucketStore, MemoryBucketStore
from peer.protocol import RecordError, RecordTooLarge, keys
from peer.protocol.limits import (
    BUCKET_RING,
    MAX_COMPLETION_TOKENS,
    MAX_DHT_VALUE_BYTES,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_BYTES,
    MAX_GROUP_SIZE,
    MAX_INLINE_BATCH_BYTES,
    MAX_INLINE_GROUP_BYTES,
)
from peer.protocol.records import (
    AdapterRecord,
    BucketEntry,
    Completion,
    GroupBatch,
    GroupRecord,
    ManifestRecord,
    MetricsRecord,
    PeerRecord,
    encode_floats,
    encode_tokens,
    fits_inline,
    from_dht_value,
    groups_of,
    pack,
    to_dht_value,
    unpack,
)
from peer.protocol.version import PROTOCOL_VERSION
from peer.roles.learner.verify import Refused
from tests.helpers import intake as ih
from tests.helpers.records import (
    changed,
    make_adapter,
    make_group,
    make_heartbeat,
    make_manifest,
    make_metrics,
)
from tests.helpers.signing import KEY_A, KEY_B, PUB_A, PUB_B, RUN, composite, forge, record, signed

pytestmark = pytest.mark.timeout(120)

EXPIRATION = 2e9


# ---------------------------------------------------------------------------------------------------- helpers


def stored(validator, key: str, subkey, value):
    """The record ``validator``'s DHT builds and signs for ``DHT.store(key, value, EXPIRATION, subkey=subkey)``."""
    return signed(validator, record(key, subkey, value, EXPIRATION))


def remembered(validator) -> int:
    """How many accepted records the validator's schema check remembers."""
    return len(next(v for v in validator._validators if isinstance(v, SchemaValidator))._accepted)


def assert_refused_at_store(cls: type, key: str, subkey: bytes, bad: dict, good: dict) -> None:
    """``bad`` under ``key``/``subkey`` is refused by the writer's and another peer's validator and by the reader;
    the same key and subkey take ``good`` before and after, and the refusal left nothing remembered."""
    mine, theirs = composite(KEY_A), composite(KEY_B)
    accepted = stored(mine, key, subkey, good)
    assert mine.validate(accepted) and theirs.validate(accepted), "the control record must be accepted"
    before = remembered(mine), remembered(theirs)
    refused = stored(mine, key, subkey, bad)
    assert mine.validate(refused) is False and theirs.validate(refused) is False
    with pytest.raises(RecordError):
        from_dht_value(cls, bad)
    assert (remembered(mine), remembered(theirs)) == before, "a refused record was remembered"
    assert mine.validate(accepted) and theirs.validate(accepted)
    assert from_dht_value(cls, good) is not None


def assert_refused_by_the_reader(key: str, subkey: bytes, bad: dict) -> None:
    """The entry ``bad`` is stored by every DHT node (its groups are bytes there) and refused by its reader: the
    groups it holds break a rule of the protocol, or are not the ones its header names."""
    mine, theirs = composite(KEY_A), composite(KEY_B)
    entry = from_dht_value(BucketEntry, bad)
    held = stored(mine, key, subkey, bad)
    assert mine.validate(held) and theirs.validate(held), "a DHT node stores it: the groups are bytes there"
    with pytest.raises(RecordError):
        groups_of(entry.inline, entry.version, entry.seq, entry.count)


def inline_groups(value: dict) -> list[dict]:
    """The groups an inline entry's value holds, as the dicts they were packed from, unchecked."""
    return msgpack.unpackb(value["inline"], raw=False)["groups"]


def entry_value(group: GroupRecord) -> tuple[str, bytes, dict]:
    """Key, subkey (of PUB_A) and value of the bucket entry holding ``group`` inline."""
    return (
        keys.bucket_key(RUN, group.version),
        keys.group_subkey(PUB_A, group.version, group.seq),
        to_dht_value(BucketEntry.of_group(group)),
    )


def with_group(value: dict, **fields) -> dict:
    """An inline entry's value with fields of its (only) group replaced, unchecked."""
    batch = {"protocol_version": PROTOCOL_VERSION, "groups": [{**inline_groups(value)[0], **fields}]}
    return {**value, "inline": msgpack.packb(batch, use_bin_type=True)}


@pytest.fixture(scope="module")
def sampled():
    return ih.sample_run()


def read_with_a_lie(run, lie, learner_version: int = 0) -> SimpleNamespace:
    """Two intakes read the same honest groups — A's and B's, and M's seqs 0, 1 before and 9 after; one of them
    also reads ``lie`` (an entry signed by M) in the middle. Returns the lie's result, both intakes, and what M's
    honest group after the lie got."""
    before = [ih.fetched(ih.A, g) for g in run.groups[ih.A][:3]] + [ih.fetched(ih.M, g) for g in run.groups[ih.M][:2]]
    after = [ih.fetched(ih.B, g) for g in run.groups[ih.B][:3]]
    it, control = ih.new_intake(run), ih.new_intake(run)
    for entry in before:
        assert it.add(entry, learner_version) is None and control.add(entry, learner_version) is None
    result = it.add(lie, learner_version)
    for entry in after:
        assert it.add(entry, learner_version) is None and control.add(entry, learner_version) is None
    m_later = ih.fetched(ih.M, run.groups[ih.M][9])
    later = it.add(m_later, learner_version)
    assert control.add(m_later, learner_version) is None
    for owner in (ih.A, ih.B):
        assert ih.signer_state(it, owner) == ih.signer_state(control, owner), "an honest signer was affected"
    assert it.counts["admitted"] == 8 + (later is None)
    return SimpleNamespace(result=result, it=it, control=control, later=later)


def assert_banned(read, reason: str) -> None:
    assert isinstance(read.result, Refused) and read.result.reason == reason and reason not in ih.FORGIVEN_BY_DESIGN
    assert ih.M in read.it.banned and ih.pool_ids(read.it, ih.M) == [], "the liar's groups stayed in the pool"
    assert read.it.counts["purged"] == 2 and read.later == "banned" and read.it.counts["ignored_banned"] == 1
    assert read.it.rejected == {reason: 1}


def assert_forgiven(read, reason: str) -> None:
    assert isinstance(read.result, Refused) and read.result.reason == reason and reason in ih.FORGIVEN_BY_DESIGN
    assert ih.M not in read.it.banned and read.later is None
    assert ih.pool_ids(read.it, ih.M) == ih.pool_ids(read.control, ih.M) == [(0, 0), (0, 1), (0, 9)]
    assert read.it.rejected == {reason: 1}


# ---------------------------------------------------------------------------------------------------- wrong schema


@pytest.mark.parametrize(
    "case",
    [
        "extra field",
        "missing field",
        "missing field that has a default",
        "int for float",
        "float for int",
        "str for bytes",
        "tuple for list",
        "another record type",
        "newer protocol",
        "older protocol",
        "wrong type inside a group",
    ],
)
def test_wrong_schema_is_refused_at_store_time_and_by_the_reader(case):
    beat = to_dht_value(make_heartbeat())
    peers = (keys.peers_key(RUN), keys.owner_subkey(PUB_A))
    key, subkey, entry = entry_value(make_group())
    bad = {
        "extra field": lambda: (PeerRecord, *peers, {**beat, "admin": True}),
        "missing field": lambda: (PeerRecord, *peers, {k: v for k, v in beat.items() if k != "stats"}),
        "missing field that has a default": lambda: (
            MetricsRecord,
            keys.metrics_key(RUN),
            peers[1],
            {k: v for k, v in to_dht_value(make_metrics()).items() if k != "reward_history"},
        ),
        "int for float": lambda: (PeerRecord, *peers, {**beat, "throughput": 0}),
        "float for int": lambda: (PeerRecord, *peers, {**beat, "adapter_version": -1.0}),
        "str for bytes": lambda: (BucketEntry, key, subkey, with_group(entry, prompt_ids="abcd")),
        "tuple for list": lambda: (PeerRecord, *peers, {**beat, "maddrs": tuple(beat["maddrs"])}),
        "another record type": lambda: (AdapterRecord, keys.adapter_key(RUN), peers[1], beat),
        "newer protocol": lambda: (PeerRecord, *peers, {**beat, "protocol_version": PROTOCOL_VERSION + 1}),
        "older protocol": lambda: (PeerRecord, *peers, {**beat, "protocol_version": PROTOCOL_VERSION - 1}),
        "wrong type inside a group": lambda: (BucketEntry, key, subkey, with_group(entry, rewards=[1, 0])),
    }[case]
    cls, bad_key, bad_subkey, value = bad()
    good = {
        AdapterRecord: to_dht_value(make_adapter()),
        BucketEntry: entry,
        MetricsRecord: to_dht_value(make_metrics()),
    }
    good = good.get(cls, beat)
    if cls is BucketEntry:  # a rule of the group inside: the DHT holds it as bytes, its reader refuses it
        assert_refused_by_the_reader(bad_key, bad_subkey, value)
    else:
        assert_refused_at_store(cls, bad_key, bad_subkey, value, good)


def test_json_nested_too_deeply_is_refused_not_raised():
    """A 2,000-character JSON text (inside the 4,096 limit) nested 1,000 deep exhausted the parser's stack: the
    manifest, stored by any peer under its own subkey, made every validator and reader raise RecursionError."""
    deep = '{"a": ' + "[" * 1000 + "]" * 1000 + "}"
    good = to_dht_value(make_manifest(run_id=RUN))
    for field in ("grpo_json", "lora_json"):
        assert_refused_at_store(
            ManifestRecord, keys.manifest_key(RUN), keys.owner_subkey(PUB_A), {**good, field: deep}, good
        )
    bad_task = {**good, "task": {**good["task"], "config_json": deep}}
    assert_refused_at_store(ManifestRecord, keys.manifest_key(RUN), keys.owner_subkey(PUB_A), bad_task, good)


@pytest.mark.parametrize("key", [b"x", 7])
def test_a_record_map_with_a_key_that_is_not_a_name_is_refused(key):
    """pydantic raised TypeError ("keywords must be strings") for a bytes key: a blob of groups could carry one."""
    beat = to_dht_value(make_heartbeat())
    with pytest.raises(RecordError, match="named fields"):
        from_dht_value(PeerRecord, {**beat, key: 1})
    batch = {"protocol_version": PROTOCOL_VERSION, "groups": [pack(make_group())], b"extra": 1}
    with pytest.raises(RecordError):
        unpack(GroupBatch, msgpack.packb(batch, use_bin_type=True))


@pytest.mark.parametrize("subkey", [b"[owner:not a key]", [1, 2], {"a": 1}])
def test_a_subkey_hivemind_cannot_parse_is_refused_not_raised(subkey):
    """hivemind's own validators raised on these (ValueError "Invalid line format"; TypeError "unhashable type");
    any peer can send them in a store."""
    good = to_dht_value(make_heartbeat())
    mine, theirs = composite(KEY_A), composite(KEY_B)
    accepted = stored(mine, keys.peers_key(RUN), keys.owner_subkey(PUB_A), good)
    refused = stored(mine, keys.peers_key(RUN), subkey, good)
    assert mine.validate(refused) is False and theirs.validate(refused) is False
    assert mine.validate(accepted) and theirs.validate(accepted)


@pytest.mark.parametrize(
    "case",
    ["another version's slot", "subkey of another version", "subkey of another seq", "owner subkey", "no subkey"],
)
def test_wrong_schema_for_its_key_is_refused_at_store_time(case):
    """A valid entry stored where its key or subkey says something else: only the validator sees the key."""
    group = make_group(version=5, seq=2)
    key, subkey, value = entry_value(group)
    bad_key, bad_subkey = {
        "another version's slot": (keys.bucket_key(RUN, 6), subkey),
        "subkey of another version": (key, keys.group_subkey(PUB_A, 5 + BUCKET_RING, 2)),
        "subkey of another seq": (key, keys.group_subkey(PUB_A, 5, 3)),
        "owner subkey": (key, keys.owner_subkey(PUB_A)),
        "no subkey": (key, None),
    }[case]
    mine, theirs = composite(KEY_A), composite(KEY_B)
    good = stored(mine, key, subkey, value)
    assert mine.validate(good) and groups_of(from_dht_value(BucketEntry, value).inline, 5, 2, 1) == [group]
    before = remembered(mine)
    refused = stored(mine, bad_key, bad_subkey, value)
    assert mine.validate(refused) is False and theirs.validate(refused) is False
    assert remembered(mine) == before and mine.validate(good) and theirs.validate(good)


def test_wrong_schema_read_from_a_bucket_is_refused_as_schema_and_forgiven(sampled):
    """A group that does not parse (a blob cut short, bytes of the wrong shape) reaches the intake as a refusal."""
    shared = {}
    for owner in (ih.A, ih.M):
        for g in sampled.groups[owner][:3]:
            MemoryBucketStore(owner, shared).publish(g)
    bad = {**sampled.groups[ih.M][3].dict(), "rewards": "all of them"}
    shared[(ih.M, 0, 3)] = (time.time() + 600, msgpack.packb(bad, use_bin_type=True))
    fetched = MemoryBucketStore(ih.B, shared).fetch(0, 0)
    it = ih.new_intake(sampled)
    results = {f.id: it.add(f, 0) for f in fetched}
    assert results.pop((ih.M, 0, 3)).reason == "schema"
    assert list(results.values()) == [None] * 6, "every honest group is admitted"
    assert ih.M not in it.banned and it.rejected == {"schema": 1}
    assert ih.pool_ids(it, ih.M) == ih.pool_ids(it, ih.A) == [(0, 0), (0, 1), (0, 2)]


# ---------------------------------------------------------------------------------------------------- oversize


def big_group(completions: int = 8) -> GroupRecord:
    """A valid group over the inline limit: ``completions`` completions of the most tokens each."""
    longest = Completion.of([1] * MAX_COMPLETION_TOKENS, [-1.0] * MAX_COMPLETION_TOKENS)
    return make_group(completions=[longest] * completions, rewards=[0.0] * completions)


def test_oversize_record_raises_before_anything_reaches_hivemind():
    big = big_group()
    assert len(pack(big)) > MAX_DHT_VALUE_BYTES and not fits_inline(big)
    dht = mock.Mock()
    with pytest.raises(RecordTooLarge, match="GroupRecord record is"):
        dht.store(keys.bucket_key(RUN, big.version), to_dht_value(big), expiration_time=EXPIRATION)
    with pytest.raises(ValueError, match="publish them as a blob"):
        BucketEntry.of_group(big)
    swarm = SimpleNamespace(run_id=RUN, public_key=PUB_A, peer_id=ih.PEER_ID, store_many=mock.Mock())
    with pytest.raises(UserError, match="no blob service"):
        DHTBucketStore(swarm, None).publish(big)
    dht.store.assert_not_called()
    swarm.store_many.assert_not_called()


class BlobCache:
    def __init__(self):
        self.blobs = {}

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.blobs[sha] = data
        return sha


def test_oversize_group_batch_goes_as_a_blob_pointer():
    small = [make_group(version=5, seq=seq) for seq in (0, 1)]
    big = [big_group().copy(update={"seq": seq}) for seq in (10, 11)]
    stores, searches = [], set()
    swarm = SimpleNamespace(
        run_id=RUN,
        public_key=PUB_A,
        peer_id=ih.PEER_ID,
        store_many=lambda items, what, all_replicas, narrow, replicas: (
            searches.add(narrow) or stores.extend(items) or [True] * len(items)
        ),
    )
    cache = BlobCache()
    DHTBucketStore(swarm, SimpleNamespace(cache=cache)).publish_many(small + big)
    entries = {
        keys.parse_group_subkey(subkey)[2]: from_dht_value(BucketEntry, value) for _, subkey, value, _ in stores
    }
    assert sorted(entries) == [0, 10, 11], "the small groups share an entry, each big one has its own"
    assert searches == {True}, "bucket entries are stored with the narrow search"
    assert entries[0].pointer is None, "small groups still travel inline"
    assert groups_of(entries[0].inline, 5, 0, 2) == small
    for seq, group in zip((10, 11), big, strict=True):
        pointed = entries[seq]
        assert pointed.inline is None and (pointed.count, pointed.pointer.kind) == (1, "group")
        blob = cache.blobs[pointed.pointer.sha256]
        assert len(blob) == pointed.pointer.size <= MAX_GROUP_BATCH_BYTES
        assert unpack(GroupBatch, blob).groups == [group]
    validator = composite(KEY_A)
    for key, subkey, value, _ in stores:
        assert len(MSGPackSerializer.dumps(value)) <= MAX_DHT_VALUE_BYTES
        assert validator.validate(stored(validator, key, subkey, value)), "every peer accepts what was published"


def pointer_entries(seqs) -> tuple[list[tuple[int, int, dict]], BlobCache]:
    """``(version, seq, value)`` of bucket entries, one big group each, and the fake cache of A that holds them."""
    stores, cache = [], BlobCache()
    swarm = SimpleNamespace(
        run_id=RUN,
        public_key=PUB_A,
        peer_id=ih.PEER_ID,
        store_many=lambda items, *a, **k: stores.extend(items) or [True] * len(items),
    )
    DHTBucketStore(swarm, SimpleNamespace(cache=cache)).publish_many(
        [big_group().copy(update={"seq": s}) for s in seqs]
    )
    return [(*keys.parse_group_subkey(subkey)[1:], value) for _, subkey, value, _ in stores], cache


def test_a_blob_that_cannot_be_fetched_is_unavailable_and_one_that_does_not_parse_is_unreadable(tmp_path):
    """Not delivered proves nothing against the signer (the intake mutes it for a while); delivered bytes that are
    not its groups are the signer's (``schema``, which strikes)."""
    [(version, seq, value)], _ = pointer_entries([10])
    swarm = SimpleNamespace(run_id=RUN)

    def unanswered(sha256, size, providers, timeout):
        raise UserError(f"no provider of blob {sha256[:8]} answered in {timeout:g} s")

    blobs = SimpleNamespace(fetch=unanswered, cache=SimpleNamespace(remove=lambda sha: None))
    out = DHTBucketStore(swarm, blobs, fetch_timeout=3)._read(PUB_A, version, seq, value)
    assert [(f.seq, f.group, f.unavailable) for f in out] == [(10, None, True)]
    assert "group blob unavailable: no provider of blob" in out[0].error
    out = DHTBucketStore(swarm, None)._read(PUB_A, version, seq, value)
    assert out[0].unavailable and "no blob service" in out[0].error, "this reader's own lack, not the signer's"
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x93not a batch")
    blobs = SimpleNamespace(fetch=lambda *a, **k: junk, cache=SimpleNamespace(remove=lambda sha: None))
    out = DHTBucketStore(swarm, blobs)._read(PUB_A, version, seq, value)
    assert [(f.group, f.unavailable) for f in out] == [(None, False)] and out[0].error


def _stalled_reader(workers: int):
    """A reader with ``workers`` fetch workers whose every blob fetch hangs until ``release`` is set (then fails)."""
    import threading

    release = threading.Event()

    def slow(sha256, size, providers, timeout):
        release.wait(10)
        raise UserError("no provider answered")

    blobs = SimpleNamespace(fetch=slow, cache=SimpleNamespace(remove=lambda sha: None))
    return DHTBucketStore(SimpleNamespace(run_id=RUN), blobs, fetch_workers=workers), release


def test_one_signers_blobs_hold_at_most_a_quarter_of_the_fetch_workers():
    entries, _ = pointer_entries(range(10, 17))
    reader, release = _stalled_reader(2)
    try:
        for version, seq, value in entries[:6]:
            reader._submit(PUB_A, version, seq, value)
        assert (
            len(reader._inflight) == DHTBucketStore.MAX_INFLIGHT_PER_OWNER < 2 * DHTBucketStore.MAX_INFLIGHT_PER_WORKER
        )
        version, seq, value = entries[6]
        reader._submit(PUB_B, version, seq, value)
        assert len(reader._inflight) == DHTBucketStore.MAX_INFLIGHT_PER_OWNER + 1, "another signer's blob still goes"
        release.set()
        deadline = time.monotonic() + 10
        while not all(f.done() for f in reader._inflight.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        out = reader._arrived(set())
    finally:
        release.set()
        reader.close()
    assert not reader._inflight
    assert sorted((f.owner == PUB_B, f.seq, f.unavailable) for f in out) == [
        (False, 10, True),
        (False, 11, True),
        (False, 12, True),
        (False, 13, True),
        (True, 16, True),
    ], "each fetched blob that failed is refused as unavailable; the two left over wait for a later read"


def test_newcomers_blobs_together_hold_at_most_half_the_fetch_workers_however_many_keys():
    """M4 of the 12-07 review: four pointer entries of one key (or one each of four keys) held every worker. Now
    signers on probation share half of them: 100 fresh keys' entries put 2 of 4 workers' blobs in flight, and a
    proven producer's entry still goes at once."""
    entries, _ = pointer_entries(range(10, 12))
    reader, release = _stalled_reader(4)
    sybils = [b"sybil-%d" % i for i in range(100)]
    try:
        (version, seq, value), (version2, seq2, value2) = entries
        for key in sybils:
            reader._submit(key, version, seq, value, newcomers=set(sybils))
        assert len(reader._inflight) == 2, "the newcomers' share: half of the 4 workers"
        reader._submit(PUB_B, version2, seq2, value2, newcomers=set(sybils))
        assert len(reader._inflight) == 3 and (PUB_B, version2, seq2) in reader._inflight, "a proven signer's goes"
        reader._submit(b"another", version, seq, value)
        assert len(reader._inflight) == 4, "with no newcomers named (a rollout peer's reads), no such share"
    finally:
        release.set()
        reader.close()


@pytest.mark.parametrize("case", ["inline groups over the inline limit", "heartbeat over the DHT limit"])
def test_oversize_raw_value_under_a_run_key_is_refused_by_the_validator(case):
    if case == "heartbeat over the DHT limit":
        cls, key, subkey = PeerRecord, keys.peers_key(RUN), keys.owner_subkey(PUB_A)
        good = to_dht_value(make_heartbeat())
        bad = {**good, "hardware": "x" * MAX_DHT_VALUE_BYTES}
    else:
        cls, (key, subkey, good) = BucketEntry, entry_value(make_group())
        big = big_group().dict()
        bad = with_group(good, completions=big["completions"], rewards=big["rewards"])
        assert sum(len(msgpack.packb(g, use_bin_type=True)) for g in inline_groups(bad)) > MAX_INLINE_GROUP_BYTES
        assert len(bad["inline"]) > MAX_INLINE_BATCH_BYTES
    assert len(MSGPackSerializer.dumps(bad)) > MAX_DHT_VALUE_BYTES
    assert_refused_at_store(cls, key, subkey, bad, good)


def test_oversize_blob_is_refused_before_it_is_decoded():
    with pytest.raises(RecordError, match="over its"):
        unpack(GroupBatch, b"\x00" * (MAX_GROUP_BATCH_BYTES + 1))
    with pytest.raises(RecordError, match="over its"):
        unpack(GroupRecord, b"\x00" * (MAX_GROUP_BYTES + 1))
    biggest = make_group(
        completions=[Completion.of([1] * MAX_COMPLETION_TOKENS, [-1.0] * MAX_COMPLETION_TOKENS)] * MAX_GROUP_SIZE,
        rewards=[0.0] * MAX_GROUP_SIZE,
    )
    assert unpack(GroupRecord, pack(biggest)) == biggest, "a group at every bound is still read"


# ---------------------------------------------------------------------------------------------------- NaN / inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.5], ids=["nan", "inf", "-inf", "positive"])
def test_nan_or_inf_logprobs_are_refused_by_the_reader_and_the_writer(bad):
    with pytest.raises(pydantic.ValidationError, match="finite and <= 0"):
        Completion.of([1, 2, 3], [-0.5, bad, -0.5])
    key, subkey, good = entry_value(make_group())
    completion = {"token_ids": encode_tokens([1, 2, 3]), "logprobs": encode_floats([-0.5, bad, -0.5])}
    value = with_group(good, completions=[completion, inline_groups(good)[0]["completions"][1]])
    assert_refused_by_the_reader(key, subkey, value)
    with pytest.raises(RecordError):
        unpack(GroupRecord, msgpack.packb(inline_groups(value)[0], use_bin_type=True))


# ---------------------------------------------------------------------------------------------------- vocabulary


@pytest.mark.parametrize("where", ["prompt", "completion"])
@pytest.mark.parametrize("token", ["vocabulary size", "largest uint32"])
def test_token_ids_outside_the_vocabulary_are_refused_and_ban(sampled, where, token):
    bad_id = sampled.vocab if token == "vocabulary size" else 2**32 - 1
    g = sampled.groups[ih.M][2]
    if where == "prompt":
        lie = changed(g, prompt_ids=encode_tokens([*g.prompt_tokens()[:-1], bad_id]))
    else:
        c = g.completions[0]
        bad = {**c.dict(), "token_ids": encode_tokens([bad_id, *c.tokens()[1:]])}
        lie = changed(g, completions=[bad, *g.completions[1:]])
    assert_banned(read_with_a_lie(sampled, ih.fetched(ih.M, lie)), "vocabulary")


def test_token_ids_outside_uint32_cannot_be_written():
    for bad in (2**32, -1):
        with pytest.raises(ValueError, match="token ids must be ints"):
            encode_tokens([1, bad])


# ---------------------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(
    "case",
    [
        "fewer log-probs than tokens",
        "more log-probs than tokens",
        "fewer rewards than completions",
        "more rewards than completions",
        "ragged token bytes",
        "ragged log-prob bytes",
        "entry count differs from its groups",
    ],
)
def test_length_mismatch_is_refused_by_the_reader(case):
    key, subkey, good = entry_value(make_group())
    c0, c1 = inline_groups(good)[0]["completions"]  # 3 and 2 tokens
    edit = {
        "fewer log-probs than tokens": {"completions": [{**c0, "logprobs": encode_floats([-0.5] * 2)}, c1]},
        "more log-probs than tokens": {"completions": [{**c0, "logprobs": encode_floats([-0.5] * 4)}, c1]},
        "fewer rewards than completions": {"rewards": [1.0]},
        "more rewards than completions": {"rewards": [1.0, 0.0, 0.5]},
        "ragged token bytes": {"completions": [{**c0, "token_ids": c0["token_ids"][:-1]}, c1]},
        "ragged log-prob bytes": {"completions": [{**c0, "logprobs": c0["logprobs"] + b"\x00"}, c1]},
    }
    value = {**good, "count": 2} if case == "entry count differs from its groups" else with_group(good, **edit[case])
    assert_refused_by_the_reader(key, subkey, value)


def test_length_mismatch_with_the_run_a_completion_over_max_new_tokens_is_refused_and_bans(sampled):
    g = sampled.groups[ih.M][2]
    c = g.completions[0]
    extra = sampled.spec.sampling.max_new_tokens + 1 - len(c.tokens())
    longer = Completion.of(c.tokens() + [4] * extra, c.behaviour_logprobs() + [-1.0] * extra)
    assert len(longer.tokens()) == sampled.spec.sampling.max_new_tokens + 1
    lie = changed(g, completions=[longer, *g.completions[1:]])
    assert_banned(read_with_a_lie(sampled, ih.fetched(ih.M, lie)), "shape")


# ---------------------------------------------------------------------------------------------------- group size


@pytest.mark.parametrize("size", [1, MAX_GROUP_SIZE + 1])
def test_wrong_group_size_outside_the_protocol_is_refused_by_the_reader(size):
    key, subkey, good = entry_value(make_group())
    completions = (inline_groups(good)[0]["completions"] * MAX_GROUP_SIZE)[:size]
    value = with_group(good, completions=completions, rewards=[0.0] * size)
    assert_refused_by_the_reader(key, subkey, value)


@pytest.mark.parametrize("delta", [-1, +1])
def test_wrong_group_size_for_the_run_is_refused_and_bans(sampled, delta):
    g = sampled.groups[ih.M][2]
    n = sampled.spec.sampling.group_size + delta
    picked = [i % len(g.completions) for i in range(n)]
    lie = changed(g, completions=[g.completions[i] for i in picked], rewards=[g.rewards[i] for i in picked])
    assert_banned(read_with_a_lie(sampled, ih.fetched(ih.M, lie)), "shape")


# ---------------------------------------------------------------------------------------------------- versions


@pytest.mark.parametrize("version", [2, 7, 2**63 - 1], ids=["next", "future", "largest"])
def test_unknown_or_future_adapter_version_is_refused_and_forgiven(sampled, version):
    lie = changed(sampled.groups[ih.M][2], version=version, adapter_sha256="7" * 64)
    # the DHT has nothing against it: an entry of any version is valid in its slot; the learner judges the version
    validator = composite(KEY_A)
    assert validator.validate(stored(validator, *entry_value(lie)))
    read = read_with_a_lie(sampled, ih.fetched(ih.M, lie))
    assert_forgiven(read, "unknown_version")


def test_unknown_adapter_bytes_for_a_known_version_are_refused_as_lineage_and_forgiven(sampled):
    lie = changed(sampled.groups[ih.M][2], version=1, adapter_sha256=hashlib.sha256(b"a fork's v1").hexdigest())
    assert_forgiven(read_with_a_lie(sampled, ih.fetched(ih.M, lie), learner_version=1), "lineage")


# ---------------------------------------------------------------------------------------------------- replays


@pytest.mark.parametrize("version", [1, 2, 2**63 - 1])
def test_replayed_sequence_under_another_version_is_refused_and_bans(sampled, version):
    replay = changed(sampled.groups[ih.M][1], version=version, adapter_sha256=ih.SHA1)  # seq 1 was read as v0
    read = read_with_a_lie(sampled, ih.fetched(ih.M, replay), learner_version=1)
    assert_banned(read, "replay")


def test_replayed_sequence_read_again_is_a_forgiven_duplicate_used_once(sampled):
    read = read_with_a_lie(sampled, ih.fetched(ih.M, sampled.groups[ih.M][1]))
    assert_forgiven(read, "duplicate")
    assert ih.pool_ids(read.it, ih.M).count((0, 1)) == 1


def test_replayed_sequence_after_a_restart_is_still_caught(sampled):
    first = ih.new_intake(sampled, batch=1)
    g = sampled.groups[ih.M][0]
    assert first.add(ih.fetched(ih.M, g), 0) is None and [a.group for a in first.take(0)] == [g]
    restarted = ih.new_intake(sampled, batch=1)
    restarted.restore(first.state())
    assert restarted.add(ih.fetched(ih.A, sampled.groups[ih.A][0]), 1) is None
    refused = restarted.add(ih.fetched(ih.M, changed(g, version=1, adapter_sha256=ih.SHA1)), 1)
    assert refused.reason == "replay" and ih.M in restarted.banned
    assert ih.pool_ids(restarted, ih.A) == [(0, 0)] and ih.A not in restarted.banned


# ---------------------------------------------------------------------------------------------------- signatures


@pytest.mark.parametrize(
    "case",
    [
        "another owner's subkey signed with my key",
        "my subkey signed with another key",
        "another owner's subkey unsigned",
        "value changed after signing",
        "expiration extended after signing",
        "another owner's bucket entry",
    ],
)
def test_forged_owner_signature_is_refused_and_the_owners_record_stands(case):
    mine, theirs = composite(KEY_A), composite(KEY_B)
    peers = keys.peers_key(RUN)
    if case == "another owner's bucket entry":
        key, _, value = entry_value(make_group())
        owners = record(key, keys.group_subkey(PUB_B, 5, 2), value, EXPIRATION)
    else:
        owners = record(peers, keys.owner_subkey(PUB_B), to_dht_value(make_heartbeat(peer_id="QmPeerB")), EXPIRATION)
    genuine = signed(theirs, owners)  # what B's own DHT stores
    assert mine.validate(genuine) and theirs.validate(genuine)
    assert mine.validate(forge(owners, KEY_B)), "forge() must sign as hivemind does, or the refusals prove nothing"
    before = remembered(mine), remembered(theirs)
    leaving = to_dht_value(make_heartbeat(peer_id="QmPeerB", state="leaving"))
    theirs_leaving = record(peers, owners.subkey, leaving, EXPIRATION)
    forged = {
        "another owner's subkey signed with my key": lambda: forge(theirs_leaving, KEY_A),
        "my subkey signed with another key": lambda: forge(
            record(peers, keys.owner_subkey(PUB_A), leaving, EXPIRATION), KEY_B
        ),
        "another owner's subkey unsigned": lambda: theirs_leaving,
        "value changed after signing": lambda: dataclasses.replace(
            genuine, value=genuine.value.replace(b"running", b"leaving")
        ),
        "expiration extended after signing": lambda: dataclasses.replace(
            genuine, expiration_time=genuine.expiration_time + 3600
        ),
        "another owner's bucket entry": lambda: forge(owners, KEY_A),
    }[case]()
    assert forged.value != genuine.value or forged.expiration_time != genuine.expiration_time
    assert mine.validate(forged) is False and theirs.validate(forged) is False
    assert mine.sign_value(theirs_leaving) == theirs_leaving.value, "a peer's DHT does not sign another's subkey"
    assert (remembered(mine), remembered(theirs)) == before, "a refused record was remembered"
    assert mine.validate(genuine) and theirs.validate(genuine), "the owner's record still stands"


# ---------------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    "case",
    [
        "another signer's seed",
        "another seq's example",
        "another example's prompt tokens",
        "one prompt token changed",
        "another signer's group re-signed",
    ],
)
def test_prompt_not_matching_its_seed_is_refused_and_bans(sampled, case):
    g = sampled.groups[ih.M][2]
    a = sampled.groups[ih.A][2]
    prompt = g.prompt_tokens()
    lie = {
        "another signer's seed": lambda: changed(g, task_seed=a.task_seed),
        "another seq's example": lambda: changed(g, task_index=g.seq + 1),
        "another example's prompt tokens": lambda: changed(g, prompt_ids=sampled.groups[ih.M][3].prompt_ids),
        "one prompt token changed": lambda: changed(
            g, prompt_ids=encode_tokens([*prompt[:-2], (prompt[-2] + 1) % sampled.vocab, prompt[-1]])
        ),
        "another signer's group re-signed": lambda: a,
    }[case]()
    assert lie.prompt_ids != g.prompt_ids or (lie.task_seed, lie.task_index) != (g.task_seed, g.task_index)
    assert_banned(read_with_a_lie(sampled, ih.fetched(ih.M, lie)), "prompt")


def test_a_blob_of_empty_lists_is_refused_before_it_is_built_in_memory():
    import tracemalloc

    import msgpack

    from peer.protocol import GroupBatch, RecordError, unpack

    bomb = msgpack.packb({"groups": [[[] for _ in range(1000)] for _ in range(1000)]})  # ~1 MB: a million lists
    assert len(bomb) < 1_100_000
    tracemalloc.start()
    try:
        with pytest.raises(RecordError, match="lists and maps"):
            unpack(GroupBatch, bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated for a 1 MB blob"  # built whole: ~60 MiB
