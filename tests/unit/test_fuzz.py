"""Property-based fuzzing of every record a peer reads: through the run's DHT validators, the readers, and a
learner's intake. Examples are derandomized, so the default run generates the same records every time; ``-m slow``
runs ten times as many with random seeds (and shrinks what fails).

What is generated, and what must happen (counts of the default run; the lower bounds in ``MINIMUM`` are asserted):

* **Validators** (``make_validators``), for each record stored in the DHT — manifest, heartbeat, adapter
  announcement, bucket entry with inline groups (a packed batch: bytes to the DHT), bucket entry with a blob pointer,
  metrics, access list: valid
  records within the documented bounds (lists up to their longest, numbers up to 2**63 - 1), signed as hivemind
  signs them, are accepted by the writer's and another peer's validator and read back equal by ``from_dht_value``
  and ``unpack``. Each is then broken every way, and every broken record is refused (``validate`` returns False and
  never raises; the value mutations are refused by ``from_dht_value`` too): a missing or extra field, a wrong type,
  a non-finite number, another protocol version, a value over the DHT size limit, each out-of-range rule of its type
  (``strategies.KINDS``: bad hashes and peer ids, lengths and counts past their bounds, cross-field rules),
  another run key, an unknown key, no subkey, a malformed subkey, the subkey of another owner, a forged, missing,
  spliced or doubled signature, a tampered value or expiration. About 8,400 records, 280 of them valid.
* **Batches**: an inline entry's groups are bytes to the DHT (protocol 7), so each way a group or a batch can be
  broken (``strategies.BATCH_BREAKS``), and an entry header naming other groups, is stored by the validators and
  refused by ``groups_of``, the learner's read. About 1,100 records.
* **Junk** under every run key — any msgpack-able value, raw bytes, maps shaped like the key's record with junk
  values, a valid value under a junk subkey — signed: refused, never raises. 800 records.
* **Readers**: ``from_dht_value`` and ``unpack`` of every top-level record type raise only ``RecordError`` on junk
  values and junk bytes (1,200 records); valid records with one part replaced by junk or by the same part of
  another valid record: reader and validator give the same answer, and what is accepted reads back exactly (400).
* **Intake** (``peer.roles.learner.intake.Intake`` on groups really sampled from the bundled model): honest groups of
  two signers are admitted; one lie of a third signer among them (a changed reward, a token outside the vocabulary, the
  prompt of another seq, seed, example or signer, the wrong number of completions, a completion over
  ``max_new_tokens``, an unknown or future adapter version, another lineage's sha256, a replayed seq, a duplicate, an
  unreadable entry) is refused with its reason and banned or forgiven as intake.py documents, and the honest signers'
  state (pool, seqs, bans, refusals) equals that of an intake that never saw the lie: 300 scenarios, 3,000 records.
  Groups with one flaw or none: admitted exactly when they follow the documented rules (300).

In all about 15,000 records, in about 45 s on 2 idle cores (``OMP_NUM_THREADS=1 pytest tests/unit/test_fuzz.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from peer.protocol import RecordError, keys
from peer.protocol.limits import BUCKET_RING, HOLDER_RING, MAX_DHT_VALUE_BYTES, MAX_INLINE_BATCH_BYTES, MAX_INT
from peer.protocol.records import (
    AccessRecord,
    AdapterRecord,
    BlobPointer,
    BucketEntry,
    CreditRecord,
    GroupBatch,
    GroupRecord,
    HolderRecord,
    ManifestRecord,
    MetricsRecord,
    PeerRecord,
    encode_floats,
    encode_tokens,
    from_dht_value,
    groups_of,
    pack,
    to_dht_value,
    unpack,
)
from peer.roles.learner.verify import REASONS, Refused
from peer.run.spec import prompt_seed
from tests.helpers import intake as ih
from tests.helpers import strategies as rs
from tests.helpers.records import (
    changed,
    make_adapter,
    make_credit,
    make_group,
    make_heartbeat,
    make_manifest,
    make_metrics,
)
from tests.helpers.signing import KEY_A, KEY_B, PUB_A, PUB_B, RUN, composite, forge, record, signed

pytestmark = pytest.mark.timeout(600)

EXPIRATION = 2e9
EXAMPLES = {
    "validators": 40,
    "junk": 800,
    "readers": 600,
    "grafted": 400,
    "batches": 40,
    "intake": 300,
    "groups": 300,
}
RECORD_MUTATIONS = (
    "wrong key",
    "unknown key",
    "no subkey",
    "malformed subkey",
    "subkey of another owner",
    "forged signature",
    "unsigned",
    "spliced signature",
    "two signatures",
    "tampered value",
    "tampered expiration",
)
MUTATIONS = (*rs.VALUE_MUTATIONS, "over the size limit", *RECORD_MUTATIONS)
MINIMUM = {  # records each test generates at least
    **{f"validators[{name}]": EXAMPLES["validators"] * (1 + len(MUTATIONS)) for name in rs.KINDS},
    "junk": EXAMPLES["junk"],
    "readers": 2 * EXAMPLES["readers"],
    "grafted": EXAMPLES["grafted"],
    "batches": EXAMPLES["batches"] * (len(rs.BATCH_BREAKS) + 3),
    "intake": 8 * EXAMPLES["intake"],
    "groups": EXAMPLES["groups"],
}
READ_CLASSES = (
    ManifestRecord,
    PeerRecord,
    AdapterRecord,
    MetricsRecord,
    AccessRecord,
    CreditRecord,
    BucketEntry,
    GroupRecord,
    GroupBatch,
    BlobPointer,
    HolderRecord,
)
FIELD_CLASSES = {
    keys.MANIFEST_FIELD: ManifestRecord,
    keys.PEERS_FIELD: PeerRecord,
    keys.CORE_PEERS_FIELD: PeerRecord,
    keys.ADAPTER_FIELD: AdapterRecord,
    keys.METRICS_FIELD: MetricsRecord,
    keys.ACCESS_FIELD: AccessRecord,
    keys.CREDIT_FIELD: CreditRecord,
    **{keys.bucket_field(slot): BucketEntry for slot in range(BUCKET_RING)},
    **{keys.holders_field(slot): HolderRecord for slot in range(HOLDER_RING)},
}


def fuzz(examples: int, randomized: bool = False) -> settings:
    """Settings of one fuzz run. The default (derandomized) one does not shrink a failing example: shrinking a bucket
    entry can take minutes, and the report already names the mutation and shows every value drawn."""
    phases = tuple(Phase) if randomized else (Phase.explicit, Phase.generate)
    return settings(
        max_examples=examples,
        derandomize=not randomized,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def stored(validator, key: str, subkey, value, expiration: float = EXPIRATION) -> DHTRecord:
    """The record ``validator``'s DHT stores for ``DHT.store(key, value, expiration, subkey=subkey)``, signed."""
    return signed(validator, record(key, subkey, value, expiration))


def subkey_for(field: str, pub: bytes, draw) -> bytes:
    """A well-formed subkey of ``pub`` for run key ``field`` (a bucket's names a version of its slot)."""
    if not field.startswith(keys.BUCKET_FIELD_PREFIX):
        return keys.owner_subkey(pub)
    slot = int(field.removeprefix(keys.BUCKET_FIELD_PREFIX))
    version = slot + BUCKET_RING * draw(st.integers(0, (MAX_INT - slot) // BUCKET_RING))
    return keys.group_subkey(pub, version, draw(rs.counts))


def malformed_subkeys(kind: rs.Kind, rec) -> st.SearchStrategy:
    """Subkeys that name this peer as owner but do not have the shape the key takes (or name another entry)."""
    own = keys.owner_subkey(PUB_A)
    common = [own.decode(), own + own, b"x" + own, own + b"\n"]
    if kind.cls is not BucketEntry:
        return st.sampled_from(common) | st.tuples(rs.counts, rs.counts).map(lambda vs: keys.group_subkey(PUB_A, *vs))
    v, s = rec.version, rec.seq
    numbered = [f"0{v}.{s}", f"{v}.0{s}", f"+{v}.{s}", f"{v}.{s}.", f"{v}.{s + 1}", f"{v + BUCKET_RING}.{s}"]
    numbered += [f"{v}", f"{v}.{s}.0", f"{v}_{s}", f"{v}.{s + 2**63}"]
    return st.sampled_from([own, *common[1:], *(own + n.encode() for n in numbered)])


def broken_record(validator, kind: rs.Kind, rec, value: dict, name: str, draw) -> DHTRecord:
    """The valid ``rec`` stored wrongly: under another key or subkey, or with a bad signature (RECORD_MUTATIONS)."""
    key, subkey, field = kind.key(RUN, rec), kind.subkey(PUB_A, rec), kind.field(rec)
    plain = record(key, subkey, value, EXPIRATION)
    if name == "wrong key":
        other = draw(st.sampled_from([f for f in keys.schema_fields() if f != field and f not in kind.also]))
        return stored(validator, keys.field_key(RUN, other), subkey, value)
    if name == "unknown key":
        unknown = st.text(min_size=1, max_size=20).filter(lambda f: f not in FIELD_CLASSES).map(lambda f: f"{RUN}_{f}")
        other_run = rs.run_ids.filter(lambda r: r != RUN).map(lambda r: keys.field_key(r, field))
        return stored(validator, draw(unknown | other_run), subkey, value)
    if name == "no subkey":
        return stored(validator, key, None, value)
    if name == "malformed subkey":
        return stored(validator, key, draw(malformed_subkeys(kind, rec)), value)
    if name == "subkey of another owner":
        theirs = record(key, kind.subkey(PUB_B, rec), value, EXPIRATION)
        return signed(validator, theirs) if draw(st.booleans()) else forge(theirs, KEY_A)
    if name == "forged signature":
        return forge(plain, KEY_B)
    if name == "unsigned":
        return plain
    sealed = signed(validator, plain)
    other_signature = signed(validator, dataclasses.replace(plain, expiration_time=EXPIRATION + 1)).value[
        len(plain.value) :
    ]
    if name == "spliced signature":  # a genuine signature of this peer, for another record
        return dataclasses.replace(plain, value=plain.value + other_signature)
    if name == "two signatures":
        return dataclasses.replace(sealed, value=sealed.value + other_signature)
    if name == "tampered value":
        tampered = bytearray(sealed.value)
        tampered[draw(st.integers(0, len(plain.value) - 1))] ^= draw(st.integers(1, 255))
        return dataclasses.replace(sealed, value=bytes(tampered))
    assert name == "tampered expiration"
    return dataclasses.replace(sealed, expiration_time=draw(rs.timestamps.filter(lambda t: t != EXPIRATION)))


# ---------------------------------------------------------------------------------------------------- validators


def fuzz_validators(kind: rs.Kind, tally: Counter, config: settings) -> None:
    """Valid records of ``kind`` are accepted; each is then broken every way (``MUTATIONS``, and each of the kind's
    out-of-range labels that applies to it), and every broken one is refused."""
    mine, another_peer = composite(KEY_A), composite(KEY_B)
    ways = [*MUTATIONS, *(f"out of range: {label}" for label in sorted(kind.out_of_range))]

    @config
    @given(st.data())
    def run(data):
        draw = data.draw
        rec = draw(kind.valid, label="record")
        value = to_dht_value(rec)  # RecordTooLarge if a record within the bounds did not fit the DHT
        key, subkey = kind.key(RUN, rec), kind.subkey(PUB_A, rec)
        good = stored(mine, key, subkey, value)
        assert mine.validate(good) and another_peer.validate(good), "a valid record was refused"
        assert from_dht_value(kind.cls, value) == rec and unpack(kind.cls, pack(rec)) == rec
        tally["accepted"] += 1
        for name in ways:
            if name in RECORD_MUTATIONS:
                bad, where = broken_record(mine, kind, rec, value, name, draw), name
            else:
                if name.startswith("out of range: "):
                    broken, where = rs.out_of_range(kind, rec, name.removeprefix("out of range: "), draw), name
                    if broken is None:
                        continue
                else:
                    broken, where = rs.mutated_value(kind, rec, name, draw)
                if name == "over the size limit":
                    assert len(MSGPackSerializer.dumps(broken)) > MAX_DHT_VALUE_BYTES
                with pytest.raises(RecordError):
                    from_dht_value(kind.cls, broken)
                bad = stored(mine, key, subkey, broken)
            assert mine.validate(bad) is False, f"{name} ({where}) was accepted"
            tally[name] += 1
        assert mine.validate(good), "refusing the mutations changed what the validator accepts"

    run()


@pytest.mark.parametrize("name", sorted(rs.KINDS))
def test_validators_accept_valid_records_and_refuse_every_mutation(name):
    kind, tally = rs.KINDS[name], Counter()
    fuzz_validators(kind, tally, fuzz(EXAMPLES["validators"]))
    assert tally["accepted"] >= EXAMPLES["validators"]
    assert sum(tally.values()) >= MINIMUM[f"validators[{name}]"]
    ways = {"accepted", *MUTATIONS, *(f"out of range: {label}" for label in kind.out_of_range)}
    assert set(tally) == ways, f"never tried: {ways - set(tally)}"


# ---------------------------------------------------------------------------------------------------- junk


def junk_subkeys(pub: bytes) -> st.SearchStrategy:
    """Subkeys hivemind can carry that are not the protocol's: scalars, tuples, lists and maps of them, owner
    markers with junk after them, and owner markers around something that is not an RSA key (hivemind's own
    validators raised on the last two kinds: the run's validators must refuse them)."""
    scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=16)
    marked = st.binary(max_size=16).map(lambda junk: keys.owner_subkey(pub) + junk)
    not_a_key = st.binary(min_size=1, max_size=24).filter(lambda b: b"]" not in b).map(lambda b: b"[owner:" + b + b"]")
    unhashable = st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
    return (
        scalars | st.binary(max_size=24) | st.lists(scalars, max_size=3).map(tuple) | marked | not_a_key | unhashable
    )


def proper(field: str) -> tuple[dict, bytes]:
    """A valid value for run key ``field`` and the subkey it belongs under."""
    if field.startswith(keys.BUCKET_FIELD_PREFIX):
        slot = int(field.removeprefix(keys.BUCKET_FIELD_PREFIX))
        return to_dht_value(BucketEntry.of_group(make_group(version=slot, seq=0))), keys.group_subkey(PUB_A, slot, 0)
    if field.startswith(keys.HOLDERS_FIELD_PREFIX):
        slot = int(field.removeprefix(keys.HOLDERS_FIELD_PREFIX))
        holder = HolderRecord(peer_id="QmHo", version=slot, sha256="a" * 64, size=1, created=1.0)
        return to_dht_value(holder), keys.owner_subkey(PUB_A)
    access = AccessRecord(issuer="a" * 64, revoked=["b" * 16], created=1.0, signature="c" * 128)
    made = {
        keys.MANIFEST_FIELD: make_manifest(run_id=RUN),
        keys.PEERS_FIELD: make_heartbeat(),
        keys.CORE_PEERS_FIELD: make_heartbeat(),
        keys.ADAPTER_FIELD: make_adapter(),
        keys.METRICS_FIELD: make_metrics(),
        keys.ACCESS_FIELD: access,
        keys.CREDIT_FIELD: make_credit(),
    }[field]
    return to_dht_value(made), keys.owner_subkey(PUB_A)


def fuzz_junk(tally: Counter, config: settings) -> None:
    mine = composite(KEY_A)

    @config
    @given(st.data())
    def run(data):
        draw = data.draw
        field = draw(st.sampled_from(sorted(FIELD_CLASSES)))
        key = keys.field_key(RUN, field)
        what = draw(st.sampled_from(["value", "bytes", "near record", "subkey"]))
        subkey = subkey_for(field, PUB_A, draw)
        if what == "subkey":  # a valid value, accepted under its own subkey, under a junk one
            value, own = proper(field)
            assert mine.validate(stored(mine, key, own, value))
            rec = stored(mine, key, draw(junk_subkeys(PUB_A).filter(lambda junk: junk != own)), value)
        elif what == "bytes":
            raw = draw(st.binary(max_size=256))
            rec = dataclasses.replace(record(key, subkey, None, EXPIRATION), value=raw)
            rec = dataclasses.replace(rec, value=mine.sign_value(rec))
        else:
            value = draw(rs.near_records(FIELD_CLASSES[field]) if what == "near record" else rs.junk)
            rec = stored(mine, key, subkey, value)
        assert mine.validate(rec) is False, f"junk under {key}: {rec}"
        tally[what] += 1

    run()


def test_junk_under_every_run_key_is_refused():
    tally = Counter()
    fuzz_junk(tally, fuzz(EXAMPLES["junk"]))
    assert sum(tally.values()) >= MINIMUM["junk"] and set(tally) == {"value", "bytes", "near record", "subkey"}


# ---------------------------------------------------------------------------------------------------- readers


# Keys of any kind msgpack carries: a bytes key once made pydantic raise TypeError ("keywords must be strings").
top_level_junk = st.dictionaries(
    st.text(max_size=12) | st.binary(max_size=8) | st.integers(), rs.junk, max_size=6
) | rs.junk.filter(lambda value: not isinstance(value, dict))


def fuzz_readers(tally: Counter, config: settings) -> None:
    @config
    @given(st.data())
    def run(data):
        draw = data.draw
        cls = draw(st.sampled_from(READ_CLASSES))
        value = draw(top_level_junk | rs.near_records(cls))
        with pytest.raises(RecordError):
            from_dht_value(cls, value)
        raw = draw(
            st.binary(max_size=512)
            | rs.near_records(cls).map(lambda v: msgpack.packb(v, use_bin_type=True))
            | st.dictionaries(st.text(max_size=12) | st.binary(max_size=8), rs.junk, max_size=6).map(
                lambda v: msgpack.packb(v, use_bin_type=True)
            )
        )
        with pytest.raises(RecordError):
            unpack(cls, raw)
        tally[cls.__name__] += 2

    run()


def test_readers_raise_only_record_errors_on_junk():
    tally = Counter()
    fuzz_readers(tally, fuzz(EXAMPLES["readers"]))
    assert sum(tally.values()) >= MINIMUM["readers"] and set(tally) == {cls.__name__ for cls in READ_CLASSES}


def fuzz_grafted(tally: Counter, config: settings) -> None:
    mine = composite(KEY_A)

    @config
    @given(st.data())
    def run(data):
        draw = data.draw
        kind = draw(st.sampled_from(sorted(rs.KINDS.values(), key=lambda k: k.name)))
        rec = draw(kind.valid)
        value = copy.deepcopy(rec.dict())
        path = draw(st.sampled_from(rs.nodes(value)))
        donor = draw(kind.valid).dict()  # the same part of another valid record: sometimes valid here too
        graft = st.just(rs.at(donor, path)) if path in rs.nodes(donor) else rs.junk
        rs.put(value, path, draw(rs.junk | graft))
        try:
            parsed = from_dht_value(kind.cls, value)
        except RecordError:
            parsed = None
        expected = parsed is not None
        if parsed is not None:
            assert parsed.dict() == value and pack(parsed) == msgpack.packb(value, use_bin_type=True)
            if kind.cls is BucketEntry:  # the validator also checks the entry against its slot and subkey
                expected = (parsed.version, parsed.seq) == (rec.version, rec.seq)
            if kind.cls is HolderRecord:  # and a holder against its slot
                expected = parsed.version % HOLDER_RING == rec.version % HOLDER_RING
        accepted = mine.validate(stored(mine, kind.key(RUN, rec), kind.subkey(PUB_A, rec), value))
        assert accepted is expected, f"validator says {accepted}, reader says {parsed is not None}: {path}"
        tally["accepted" if accepted else "refused"] += 1

    run()


def test_reader_and_validator_agree_on_records_with_a_part_replaced_by_junk():
    tally = Counter()
    fuzz_grafted(tally, fuzz(EXAMPLES["grafted"]))
    assert sum(tally.values()) >= MINIMUM["grafted"] and tally["refused"] > tally["accepted"] > 0


def fuzz_batches(tally: Counter, config: settings) -> None:
    """An inline entry whose groups are broken (``rs.BATCH_BREAKS``), or whose header names other groups, is stored
    by the DHT (its groups are bytes there) and refused by ``groups_of``, the learner's read, with a RecordError."""
    mine = composite(KEY_A)

    @config
    @given(st.data())
    def run(data):
        draw = data.draw
        entry = draw(rs.INLINE.valid, label="entry")
        header = (entry.version, entry.seq, entry.count)
        assert groups_of(entry.inline, *header) == unpack(GroupBatch, entry.inline).groups
        for label, brk in rs.BATCH_BREAKS.items():
            batch = copy.deepcopy(unpack(GroupBatch, entry.inline).dict())
            if not brk(batch, draw):
                continue
            broken = msgpack.packb(batch, use_bin_type=True)
            value = {**to_dht_value(entry), "inline": broken}
            if len(broken) <= MAX_INLINE_BATCH_BYTES:  # an entry a DHT node takes: it cannot tell
                assert mine.validate(stored(mine, rs.INLINE.key(RUN, entry), rs.INLINE.subkey(PUB_A, entry), value))
            with pytest.raises(RecordError):
                groups_of(broken, *header)
            tally[label] += 1
        for i, name in enumerate(("version", "seq", "count")):  # the header names other groups than it holds
            other = list(header)
            other[i] = 1 + other[i] % 64 if name == "count" and entry.count < 64 else other[i] ^ 1
            if tuple(other) == header:
                other[i] -= 1
            with pytest.raises(RecordError):
                groups_of(entry.inline, *other)
            tally[f"header {name}"] += 1

    run()


def test_a_broken_batch_of_groups_is_refused_by_its_reader():
    tally = Counter()
    fuzz_batches(tally, fuzz(EXAMPLES["batches"]))
    assert sum(tally.values()) >= MINIMUM["batches"] - EXAMPLES["batches"] * 2  # one group: no gap, no mixed versions
    never = {*rs.BATCH_BREAKS, "header version", "header seq", "header count"} - set(tally)
    assert not never, f"never tried: {never}"


# ---------------------------------------------------------------------------------------------------- intake


@pytest.fixture(scope="module")
def sampled():
    return ih.sample_run()


def lies(run, read: list[GroupRecord], target: GroupRecord) -> dict[str, tuple[st.SearchStrategy, str]]:
    """name -> (strategy of the lying entry, signed by M; the reason it must be refused). ``target`` is an honest
    group of M with a seq M has not used yet; ``read`` are M's groups the intake has read already."""
    s, vocab = run.spec.sampling, run.vocab
    own_seed = prompt_seed(run.spec.seed, ih.M)

    def with_completion(c: int, **fields) -> GroupRecord:
        completion = {**target.completions[c].dict(), **fields}
        return changed(target, completions=[*target.completions[:c], completion, *target.completions[c + 1 :]])

    @st.composite
    def changed_reward(draw):
        i = draw(st.integers(0, len(target.rewards) - 1))
        new = draw(rs.fractions.filter(lambda r: abs(r - target.rewards[i]) > 1e-5))
        return changed(target, rewards=[*target.rewards[:i], new, *target.rewards[i + 1 :]])

    @st.composite
    def out_of_vocabulary(draw):
        if draw(st.booleans()):
            prompt = target.prompt_tokens()
            prompt[draw(st.integers(0, len(prompt) - 1))] = draw(st.integers(vocab, 2**32 - 1))
            return changed(target, prompt_ids=encode_tokens(prompt))
        c = draw(st.integers(0, len(target.completions) - 1))
        tokens = target.completions[c].tokens()
        tokens[draw(st.integers(0, len(tokens) - 1))] = draw(st.integers(vocab, 2**32 - 1))
        return with_completion(c, token_ids=encode_tokens(tokens))

    @st.composite
    def other_prompt_tokens(draw):
        prompt = target.prompt_tokens()
        i = draw(st.integers(0, len(prompt) - 1))
        prompt[i] = draw(st.integers(0, vocab - 1).filter(lambda t: t != prompt[i]))
        return changed(target, prompt_ids=encode_tokens(prompt))

    @st.composite
    def wrong_group_size(draw):
        picked = [i % s.group_size for i in range(draw(st.integers(2, 64).filter(lambda n: n != s.group_size)))]
        return changed(
            target, completions=[target.completions[i] for i in picked], rewards=[target.rewards[i] for i in picked]
        )

    @st.composite
    def too_long(draw):
        c = draw(st.integers(0, len(target.completions) - 1))
        tokens = target.completions[c].tokens()
        extra = draw(st.integers(s.max_new_tokens + 1, 1024)) - len(tokens)
        filler = draw(st.integers(0, vocab - 1))
        return with_completion(
            c,
            token_ids=encode_tokens(tokens + [filler] * extra),
            logprobs=target.completions[c].logprobs + encode_floats([-1.0] * extra),
        )

    @st.composite
    def replayed(draw):
        original = draw(st.sampled_from(read))
        return changed(original, version=draw(st.integers(1, MAX_INT)), adapter_sha256=draw(rs.sha256s))

    other_lineage = st.tuples(st.sampled_from([0, 1]), rs.sha256s.filter(lambda h: h not in (ih.SHA0, ih.SHA1)))
    groups = {
        "changed reward": (changed_reward(), "reward"),
        "token outside the vocabulary": (out_of_vocabulary(), "vocabulary"),
        "prompt of another seq": (
            st.integers(0, MAX_INT).filter(lambda i: i != target.seq).map(lambda i: changed(target, task_index=i)),
            "prompt",
        ),
        "prompt of another seed": (
            rs.counts.filter(lambda seed: seed != own_seed).map(lambda seed: changed(target, task_seed=seed)),
            "prompt",
        ),
        "prompt tokens of another example": (other_prompt_tokens(), "prompt"),
        "another signer's group": (st.just(run.groups[ih.A][target.seq]), "prompt"),
        "wrong group size": (wrong_group_size(), "shape"),
        "completion too long": (too_long(), "shape"),
        "unknown or future version": (
            st.integers(2, MAX_INT).map(lambda v: changed(target, version=v)),
            "unknown_version",
        ),
        "another lineage's sha256": (
            other_lineage.map(lambda vh: changed(target, version=vh[0], adapter_sha256=vh[1])),
            "lineage",
        ),
        "replayed seq": (replayed(), "replay"),
        "duplicate": (st.sampled_from(read), "duplicate"),
    }
    entries = {
        name: (strategy.map(lambda g: ih.fetched(ih.M, g)), reason) for name, (strategy, reason) in groups.items()
    }
    entries["unreadable"] = (st.just(ih.Fetched(ih.M, 0, target.seq, None, "cut short")), "schema")
    return entries


LIES = (
    "changed reward",
    "token outside the vocabulary",
    "prompt of another seq",
    "prompt of another seed",
    "prompt tokens of another example",
    "another signer's group",
    "wrong group size",
    "completion too long",
    "unknown or future version",
    "another lineage's sha256",
    "replayed seq",
    "duplicate",
    "unreadable",
)


def fuzz_intake(run, tally: Counter, config: settings) -> None:
    n = {owner: len(groups) for owner, groups in run.groups.items()}

    @config
    @given(st.data())
    def scenario(data):
        draw = data.draw
        learner_version = draw(st.integers(0, run.spec.staleness.tau_max), label="learner version")
        honest = [
            ("honest", ih.fetched(owner, run.groups[owner][seq]))
            for owner in (ih.A, ih.B)
            for seq in draw(st.lists(st.integers(0, n[owner] - 1), unique=True, max_size=6))
        ]
        honest = draw(st.permutations(honest), label="honest order")
        seqs = draw(st.lists(st.integers(0, n[ih.M] - 1), unique=True, min_size=3, max_size=7), label="M's seqs")
        k = draw(st.integers(1, len(seqs) - 1), label="M's groups before the lie")
        read, target = [run.groups[ih.M][seq] for seq in seqs[:k]], run.groups[ih.M][seqs[k]]
        later = [run.groups[ih.M][seq] for seq in seqs[k + 1 :]]
        name = draw(st.sampled_from(LIES), label="lie")
        strategy, reason = lies(run, read, target)[name]
        lie = draw(strategy, label="lying entry")
        at = draw(st.integers(0, len(honest)), label="position")
        mallory = [("before", ih.fetched(ih.M, g)) for g in read] + [("lie", lie)]
        mallory += [("after", ih.fetched(ih.M, g)) for g in later]
        stream = honest[:at] + mallory + honest[at:]

        it, control = ih.new_intake(run), ih.new_intake(run)
        results = [(tag, it.add(entry, learner_version)) for tag, entry in stream]
        assert all(control.add(entry, learner_version) is None for tag, entry in stream if tag != "lie")
        (refused,) = [result for tag, result in results if tag == "lie"]
        assert isinstance(refused, Refused) and refused.reason == reason, f"{name}: {refused!r}"
        forgiven = reason in ih.FORGIVEN_BY_DESIGN
        assert it.rejected == Counter({reason: 1})
        assert it.counts["admitted"] == len(honest) + len(read) + (len(later) if forgiven else 0)
        assert all(result is None for tag, result in results if tag in ("honest", "before"))
        for owner in (ih.A, ih.B):
            assert ih.signer_state(it, owner) == ih.signer_state(control, owner), "an honest signer was affected"
        after = [result for tag, result in results if tag == "after"]
        if forgiven:
            assert ih.M not in it.banned and after == [None] * len(later)
            assert ih.pool_ids(it, ih.M) == ih.pool_ids(control, ih.M)
        else:
            assert ih.M in it.banned and ih.pool_ids(it, ih.M) == [], "a banned signer's groups stayed in the pool"
            assert it.counts["purged"] == len(read) and after == ["banned"] * len(later)
            assert it.counts["ignored_banned"] == len(later)
        tally[name] += 1
        tally["records"] += len(stream)

    scenario()


def test_intake_admits_honest_groups_and_refuses_each_lie_without_touching_others(sampled):
    tally = Counter()
    fuzz_intake(sampled, tally, fuzz(EXAMPLES["intake"]))
    assert tally["records"] >= MINIMUM["intake"]
    assert set(tally) == {"records", *LIES}, f"lies never told: {set(LIES) - set(tally)}"


def follows_the_rules(run, owner: bytes, group: GroupRecord, learner_version: int) -> bool:
    """What docs/learner.md says a group must be to be admitted, checked here from the run's spec alone."""
    s = run.spec.sampling
    example = run.spec.example(owner, group.seq)
    completions = [c.tokens() for c in group.completions]
    texts = [run.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in completions]
    return (
        learner_version - group.version <= run.spec.staleness.tau_max
        and {0: ih.SHA0, 1: ih.SHA1}.get(group.version) == group.adapter_sha256
        and len(completions) == s.group_size
        and all(len(tokens) <= s.max_new_tokens for tokens in completions)
        and max(group.prompt_tokens() + [t for tokens in completions for t in tokens]) < run.vocab
        and (group.task_seed, group.task_index) == (prompt_seed(run.spec.seed, owner), group.seq)
        and group.prompt_tokens() == run.tokenizer(example.prompt)["input_ids"]
        and all(abs(run.spec.task.reward(t, example) - r) <= 1e-6 for t, r in zip(texts, group.rewards, strict=True))
    )


FLAWS = (None, "stale", "version", "sha256", "size", "length", "vocabulary", "seed", "index", "prompt", "rewards")
"""What a made-up group gets wrong: nothing, one thing, or (``"anything"``) whatever is drawn."""


def fuzz_groups(run, tally: Counter, config: settings) -> None:
    """Schema-valid groups with one flaw (or none, or anything random), so that every check is reached."""
    s, tau_max = run.spec.sampling, run.spec.staleness.tau_max
    own_seed = prompt_seed(run.spec.seed, ih.M)
    in_vocabulary = st.integers(0, run.vocab - 1)

    @config
    @given(st.data())
    def run_one(data):
        draw = data.draw
        flaw = draw(st.sampled_from((*FLAWS, "anything")))
        wrong = flaw == "anything" or flaw
        seq = draw(st.integers(0, 40))
        example = run.spec.example(ih.M, seq)
        prompt = run.tokenizer(example.prompt)["input_ids"]
        if wrong in (True, "prompt"):
            prompt = draw(st.lists(in_vocabulary | rs.token_ids, min_size=1, max_size=24))
        size = draw(st.integers(2, 16)) if wrong in (True, "size") else s.group_size
        length = st.integers(1, s.max_new_tokens)
        if wrong in (True, "length"):
            length = st.integers(1, 12)
        made = [draw(st.lists(in_vocabulary, min_size=1, max_size=draw(length))) for _ in range(size)]
        if draw(st.booleans()):  # one completion answers right: random tokens alone rarely differ in reward
            answer = run.tokenizer(example.reference, add_special_tokens=False)["input_ids"]
            made[0] = answer[: s.max_new_tokens]
        if wrong in (True, "vocabulary"):
            made[draw(st.integers(0, size - 1))].append(draw(st.integers(run.vocab, 2**32 - 1)))
        texts = [run.tokenizer.decode(t, skip_special_tokens=True) for t in made]
        rewards = [float(run.spec.task.reward(text, example)) for text in texts]
        if wrong in (True, "rewards"):
            rewards = draw(st.lists(st.sampled_from([0.0, 1.0]) | rs.fractions, min_size=size, max_size=size))
        version = draw(st.sampled_from([0, 1]))
        learner_version = draw(st.integers(version, version + tau_max))
        if wrong in (True, "stale"):
            learner_version = draw(st.integers(version, version + 2 * tau_max + 1) | st.just(version + tau_max + 1))
        if wrong in (True, "version"):
            version = draw(rs.counts)
        sha = draw(rs.sha256s) if wrong in (True, "sha256") else {0: ih.SHA0, 1: ih.SHA1}.get(version, ih.SHA0)
        group = make_group(
            version=version,
            adapter_sha256=sha,
            producer=ih.PEER_ID,
            seq=seq,
            task_seed=draw(rs.counts) if wrong in (True, "seed") else own_seed,
            task_index=draw(rs.counts) if wrong in (True, "index") else seq,
            prompt=prompt,
            completions=made,
            logprob=-1.0,
            rewards=rewards,
            created=1.0,
        )
        it = ih.new_intake(run)
        result = it.add(ih.fetched(ih.M, group), learner_version)
        admitted = result in (None, "no_signal")  # verified; kept for an update only when its rewards differ
        assert admitted is follows_the_rules(run, ih.M, group, learner_version), f"{result!r}: {group}"
        signal = max(group.rewards) - min(group.rewards) > 2e-6
        assert result != ("no_signal" if signal else None), f"{result!r}: the rewards {group.rewards}"
        assert it.waiting() == int(admitted and signal)
        if result not in (None, "no_signal", "stale"):
            assert isinstance(result, Refused) and result.reason in REASONS
            assert (ih.M in it.banned) is (result.reason not in ih.FORGIVEN_BY_DESIGN)
        tally[("admitted" if signal else "no_signal") if admitted else getattr(result, "reason", result)] += 1

    run_one()


def test_intake_admits_exactly_the_groups_that_follow_the_rules(sampled):
    tally = Counter()
    fuzz_groups(sampled, tally, fuzz(EXAMPLES["groups"]))
    assert sum(tally.values()) >= MINIMUM["groups"]
    every = {"admitted", "no_signal", "stale", "prompt", "reward", "shape", "vocabulary", "unknown_version", "lineage"}
    assert every <= set(tally), f"never reached: {every - set(tally)}"


@pytest.mark.slow
@pytest.mark.parametrize("what", ["validators", "junk", "readers", "grafted", "batches", "intake", "groups"])
def test_randomized_fuzzing_ten_times_longer(what, request):
    tally = Counter()
    config = fuzz(10 * EXAMPLES[what], randomized=True)
    if what == "validators":
        for kind in rs.KINDS.values():
            fuzz_validators(kind, tally, config)
    elif what in ("intake", "groups"):
        run = request.getfixturevalue("sampled")
        (fuzz_intake if what == "intake" else fuzz_groups)(run, tally, config)
    else:
        fuzzers = {"junk": fuzz_junk, "readers": fuzz_readers, "grafted": fuzz_grafted, "batches": fuzz_batches}
        fuzzers[what](tally, config)
    assert sum(tally.values()) >= 10 * EXAMPLES[what]
