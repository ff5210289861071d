"""peer.protocol without a network: keys, limits, codecs, every record's round trip and every way to break one."""

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import msgpack
import pydantic.v1 as pydantic
import pytest

from peer.errors import UserError
from peer.protocol import keys
from peer.protocol.errors import KeyFormatError, ProtocolVersionError, RecordError, RecordTooLarge
from peer.protocol.limits import (
    BUCKET_RING,
    HOLDER_RING,
    MAX_COMPLETION_TOKENS,
    MAX_DHT_VALUE_BYTES,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_BYTES,
    MAX_GROUP_SIZE,
    MAX_INLINE_GROUP_BYTES,
    MAX_PROMPT_TOKENS,
    check_value_size,
)
from peer.protocol.records import (
    BucketEntry,
    GroupBatch,
    GroupRecord,
    ModelFile,
    ModelSpec,
    PeerRecord,
    TaskSpec,
    decode_floats,
    decode_tokens,
    encode_floats,
    encode_tokens,
    fits_inline,
    from_dht_value,
    groups_of,
    pack,
    to_dht_value,
    unpack,
)
from peer.protocol.version import PROTOCOL_VERSION, check_protocol_version
from tests.helpers.records import (
    PEER_A,
    SHA_A,
    completion,
    make_adapter,
    make_credit,
    make_group,
    make_heartbeat,
    make_manifest,
    make_metrics,
    make_pointer,
)

ROOT = Path(__file__).resolve().parents[2]
# An OpenSSH-format RSA public key as hivemind's RSAPublicKey.to_bytes() gives; the keys module only checks its shape.
OWNER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/x=="


RECORDS = {
    "manifest": make_manifest,
    "heartbeat": make_heartbeat,
    "named heartbeat": lambda: make_heartbeat(name="alice's laptop"),
    "adapter": make_adapter,
    "group": make_group,
    "pointer": make_pointer,
    "entry_inline": lambda: BucketEntry.of_group(make_group()),
    "entry_pointer": lambda: BucketEntry.of_pointer(make_pointer(), version=9, seq=0),
    "metrics": make_metrics,
    "metrics_with_em": lambda: make_metrics(exact_match=0.75),
    "credit": make_credit,
}


# ---------------------------------------------------------------------------------------------------- keys


def test_key_builders_spell_every_key_once():
    assert keys.manifest_key("run-1") == "run-1_manifest"
    assert keys.peers_key("run-1") == "run-1_peers"
    assert keys.adapter_key("run-1") == "run-1_adapter"
    assert keys.metrics_key("run-1") == "run-1_metrics"
    assert keys.access_key("run-1") == "run-1_access"
    assert keys.learners_key("run-1") == "run-1_learners"
    assert keys.credit_key("run-1") == "run-1_credit"
    assert keys.bucket_key("run-1", 0) == "run-1_bucket_0"
    assert keys.core_peers_key("run-1") == "run-1_core_peers"
    assert keys.holders_key("run-1", 17) == "run-1_holders_1" == keys.holders_key("run-1", 1)
    all_keys = [keys.field_key("r", name) for name in keys.schema_fields()]
    assert len(set(all_keys)) == len(all_keys) == 8 + BUCKET_RING + HOLDER_RING


def test_bucket_ring_wraps_every_bucket_ring_versions():
    assert BUCKET_RING == 64
    assert keys.bucket_key("r", 65) == "r_bucket_1" == keys.bucket_key("r", 1)
    assert keys.bucket_key("r", 64) == keys.bucket_key("r", 0) != keys.bucket_key("r", 63)
    slots = {keys.bucket_key("r", v) for v in range(1000)}
    assert slots == {keys.field_key("r", keys.bucket_field(s)) for s in range(BUCKET_RING)}
    for bad in (-1, 1.0, True, "3", None):
        with pytest.raises(KeyFormatError):
            keys.bucket_key("r", bad)


@pytest.mark.parametrize("run_id", ["", "a" * 65, "a b", "a.b", "run/1", "rün", "a\n", None, 3])
def test_bad_run_ids_are_refused_with_the_rule(run_id):
    with pytest.raises(KeyFormatError, match="letters, digits, '_' and '-'") as error:
        keys.manifest_key(run_id)
    assert isinstance(error.value, UserError) and isinstance(error.value, ValueError)


def test_good_run_ids():
    for run_id in ("a", "Run_2-b", "x" * 64):
        assert keys.check_run_id(run_id) == run_id


def test_group_subkey_round_trips():
    subkey = keys.group_subkey(OWNER, 12, 3)
    assert subkey == b"[owner:" + OWNER + b"]12.3"
    assert keys.parse_group_subkey(subkey) == (OWNER, 12, 3)
    assert keys.parse_group_subkey(keys.group_subkey(OWNER, 0, 0)) == (OWNER, 0, 0)
    assert keys.owner_subkey(OWNER) == b"[owner:" + OWNER + b"]"
    assert keys.parse_owner_subkey(keys.owner_subkey(OWNER)) == OWNER


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"3.4",
        b"[owner:" + OWNER + b"]",
        b"[owner:" + OWNER + b"]3",
        b"[owner:" + OWNER + b"]03.4",
        b"[owner:" + OWNER + b"]3.04",
        b"[owner:" + OWNER + b"]-3.4",
        b"[owner:" + OWNER + b"]3.4\n",
        b"[owner:" + OWNER + b"]3.4.5",
        b"[owner:" + OWNER + b"][owner:" + OWNER + b"]3.4",
        b"[owner:not-a-key]3.4",
        b"x[owner:" + OWNER + b"]3.4",
        b"[owner:" + OWNER + b"]99999999999999999999.1",
        "[owner:ssh-rsa AAAA]3.4",
    ],
)
def test_parse_group_subkey_refuses_junk(junk):
    with pytest.raises(KeyFormatError):
        keys.parse_group_subkey(junk)


def test_owner_subkey_needs_the_bare_public_key():
    with pytest.raises(KeyFormatError, match="not the \\[owner:...\\] marker"):
        keys.owner_subkey(keys.owner_subkey(OWNER))
    for bad in (b"", b"ssh-ed25519 AAAA", b"ssh-rsa AAAA]x", "ssh-rsa AAAA", b"ssh-rsa " + b"A" * 2000):
        with pytest.raises(KeyFormatError):
            keys.owner_subkey(bad)
    with pytest.raises(KeyFormatError):
        keys.group_subkey(OWNER, 1, -1)


# ---------------------------------------------------------------------------------------------------- codec


def test_codecs_are_explicit_little_endian():
    assert encode_tokens([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert decode_tokens(encode_tokens([0, 7, 65535, 2**31])) == [0, 7, 65535, 2**31]
    assert encode_floats([-1.0, 0.5]) == struct.pack("<2f", -1.0, 0.5)
    assert decode_floats(struct.pack("<3f", -0.25, 0.0, -3.5)) == [-0.25, 0.0, -3.5]
    assert decode_tokens(b"") == []


def test_codecs_refuse_bad_input():
    for bad in ([-1], [2**32], [1.5], [True], ["1"]):
        with pytest.raises(ValueError):
            encode_tokens(bad)
    with pytest.raises(ValueError):
        encode_floats(["x"])
    for data in (b"\x00\x00\x00", b"\x00" * 5):
        with pytest.raises(ValueError, match="multiple of 4"):
            decode_tokens(data)
        with pytest.raises(ValueError, match="multiple of 4"):
            decode_floats(data)


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_every_record_round_trips(name):
    record = RECORDS[name]()
    assert record.protocol_version == PROTOCOL_VERSION
    cls = type(record)
    assert unpack(cls, pack(record)) == record
    value = to_dht_value(record)
    assert type(value) is dict
    assert from_dht_value(cls, value) == record
    assert from_dht_value(cls, msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)) == record


def test_dht_value_is_measured_as_hivemind_serializes_it():
    from hivemind.utils.serializer import MSGPackSerializer

    for make in RECORDS.values():
        record = make()
        assert MSGPackSerializer.dumps(to_dht_value(record)) == pack(record)


def test_group_accessors_decode_the_bytes():
    record = make_group()
    assert record.prompt_tokens() == [4, 5, 6]
    assert record.completions[0].tokens() == [1, 2, 3]
    assert record.completions[1].behaviour_logprobs() == [-1.25, -1.25]
    assert make_manifest().grpo()["staleness"] == {"tau_max": 4}
    assert make_manifest().task.config() == {"digits": 3}


def test_records_are_frozen():
    record = make_heartbeat()
    with pytest.raises(TypeError):
        record.throughput = 1.0


# ---------------------------------------------------------------------------------------------------- malformed


def _set(path, value):
    def mutate(data):
        *parents, last = path.split(".")
        for part in parents:
            data = data[int(part) if part.isdigit() else part]
        data[int(last) if last.isdigit() else last] = value

    return mutate


def _delete(name):
    return lambda data: data.pop(name)


G = make_group
BAD = {
    # schema shape
    "extra field": (G, _set("surprise", 1)),
    "extra nested field": (G, _set("completions.0.surprise", b"")),
    "missing field": (G, _delete("created")),
    "missing optional field": (make_metrics, _delete("exact_match")),
    "missing protocol version": (G, _delete("protocol_version")),
    "only unknown fields": (G, lambda data: data.clear() or data.update({"x": [1]})),
    # strict types
    "float for int": (G, _set("version", 5.0)),
    "bool for int": (G, _set("seq", True)),
    "str for int": (G, _set("task_index", "7")),
    "int for float": (G, _set("created", 1700000000)),
    "str for bytes": (G, _set("prompt_ids", "abcd")),
    "bytes for str": (G, _set("producer", b"QmPeerA")),
    "int for bool": (make_heartbeat, _set("reachable", 0)),
    "int in float dict": (make_heartbeat, _set("stats.tokens", 1000)),
    "float in int dict": (make_metrics, _set("groups_rejected.duplicate", 2.0)),
    # protocol version
    "newer protocol": (G, _set("protocol_version", PROTOCOL_VERSION + 1)),
    "older protocol": (G, _set("protocol_version", PROTOCOL_VERSION - 1)),
    "float protocol": (G, _set("protocol_version", float(PROTOCOL_VERSION))),
    "newer protocol inside a batch": (lambda: GroupBatch(groups=[G()]), _set("groups.0.protocol_version", 99)),
    # sizes
    "prompt too long": (G, _set("prompt_ids", encode_tokens([1] * (MAX_PROMPT_TOKENS + 1)))),
    "empty prompt": (G, _set("prompt_ids", b"")),
    "completion too long": (
        G,
        _set("completions.0", {"token_ids": encode_tokens([1] * 1025), "logprobs": encode_floats([-1.0] * 1025)}),
    ),
    "empty completion": (G, _set("completions.0", {"token_ids": b"", "logprobs": b""})),
    "group of 1": (G, lambda d: d.update(completions=d["completions"][:1], rewards=d["rewards"][:1])),
    "group of 65": (G, lambda d: d.update(completions=d["completions"][:1] * 65, rewards=[0.5] * 65)),
    "17 maddrs": (make_heartbeat, _set("maddrs", ["/ip4/1.2.3.4/tcp/1"] * 17)),
    "long maddr": (make_heartbeat, _set("maddrs", ["/" + "x" * 256])),
    "33 stats": (make_heartbeat, _set("stats", {f"s{i}": 1.0 for i in range(33)})),
    "17 reject reasons": (make_metrics, _set("groups_rejected", {f"r{i}": 1 for i in range(17)})),
    "33 providers": (make_adapter, _set("providers", [PEER_A + "a" * i for i in range(33)])),
    "no providers": (make_pointer, _set("providers", [])),
    "65 model files": (
        make_manifest,
        _set("model.files", [{"path": f"f{i}", "sha256": SHA_A, "size": 1} for i in range(65)]),
    ),
    "long task config": (make_manifest, _set("task.config_json", json.dumps({"x": "y" * 4096}))),
    "long hardware": (make_heartbeat, _set("hardware", "x" * 129)),
    "huge blob": (make_pointer, lambda d: d.update(kind="adapter", size=16 * 1024**3 + 1)),
    "huge group blob": (make_pointer, _set("size", MAX_GROUP_BATCH_BYTES + 1)),
    "zero-size adapter": (make_adapter, _set("size", 0)),
    # log-probs and tokens
    "nan log-prob": (G, _set("completions.0.logprobs", encode_floats([-0.5, math.nan, -0.5]))),
    "inf log-prob": (G, _set("completions.0.logprobs", encode_floats([-0.5, -math.inf, -0.5]))),
    "positive log-prob": (G, _set("completions.0.logprobs", encode_floats([-0.5, 0.125, -0.5]))),
    "fewer log-probs than tokens": (G, _set("completions.0.logprobs", encode_floats([-0.5, -0.5]))),
    "more log-probs than tokens": (G, _set("completions.0.logprobs", encode_floats([-0.5] * 4))),
    "ragged token bytes": (G, _set("completions.0.token_ids", b"\x01\x00\x00\x00\x02\x00")),
    "ragged prompt bytes": (G, _set("prompt_ids", b"\x01\x00\x00\x00\x02")),
    # rewards
    "fewer rewards than completions": (G, lambda d: d.update(completions=d["completions"] * 2)),
    "more rewards than completions": (G, _set("rewards", [1.0, 0.0, 1.0])),
    "reward over 1": (G, _set("rewards", [1.5, 0.0])),
    "negative reward": (G, _set("rewards", [-0.1, 0.0])),
    "nan reward": (G, _set("rewards", [math.nan, 0.0])),
    # hashes and ids
    "uppercase sha256": (G, _set("adapter_sha256", "A" * 64)),
    "short sha256": (G, _set("adapter_sha256", "a" * 63)),
    "non-hex sha256": (make_adapter, _set("sha256", "g" * 64)),
    "sha256 with newline": (make_adapter, _set("sha256", "a" * 64 + "\n")),
    "peer id not base58": (G, _set("producer", "QmPeerl0")),
    "peer id with space": (make_heartbeat, _set("peer_id", "Qm Peer")),
    "duplicate providers": (make_adapter, _set("providers", [PEER_A, PEER_A])),
    # manifest paths and documents
    "parent dir in path": (make_manifest, _set("model.files.0.path", "../evil")),
    "parent dir inside path": (make_manifest, _set("model.files.0.path", "a/../../evil")),
    "absolute path": (make_manifest, _set("model.files.0.path", "/etc/passwd")),
    "backslash path": (make_manifest, _set("model.files.0.path", "..\\evil")),
    "dot path": (make_manifest, _set("model.files.0.path", "./model.safetensors")),
    "empty path component": (make_manifest, _set("model.files.0.path", "a//b")),
    "duplicate paths": (make_manifest, _set("model.files.1.path", "model.safetensors")),
    "no model files": (make_manifest, _set("model.files", [])),
    "bad quantization": (make_manifest, _set("model.quantization", "fp4")),
    "bad access": (make_manifest, _set("access", "secret")),
    "json array config": (make_manifest, _set("grpo_json", "[1, 2]")),
    "broken json": (make_manifest, _set("lora_json", "{")),
    "json NaN": (make_manifest, _set("task.config_json", '{"x": NaN}')),
    "bad manifest run id": (make_manifest, _set("run_id", "../run")),
    # cross-field rules
    "unknown role": (make_heartbeat, _set("role", "admin")),
    "unknown state": (make_heartbeat, _set("state", "dead")),
    "version below -1": (make_heartbeat, _set("adapter_version", -2)),
    "infinite throughput": (make_heartbeat, _set("throughput", math.inf)),
    "seen before start": (make_heartbeat, _set("last_seen", 99.0)),
    "v0 with parent": (make_adapter, lambda d: d.update(version=0)),
    "v3 without parent": (make_adapter, _set("parent_sha256", "")),
    "own parent": (make_adapter, _set("parent_sha256", SHA_A)),
    "entry with both": (lambda: BucketEntry.of_group(G()), _set("pointer", make_pointer().dict())),
    "entry with neither": (lambda: BucketEntry.of_group(G()), _set("inline", None)),
    "entry's groups as a list": (lambda: BucketEntry.of_group(G()), _set("inline", [G().dict()])),
    "batch seqs not consecutive": (lambda: GroupBatch(groups=[G(seq=2), G(seq=3)]), _set("groups.1.seq", 4)),
    "entry points to adapter": (lambda: BucketEntry.of_pointer(make_pointer(), 1, 1), _set("pointer.kind", "adapter")),
    "exact match over 1": (make_metrics, _set("exact_match", 1.5)),
    "negative count": (make_metrics, _set("groups_accepted", -1)),
    "int over 64 bits": (G, _set("task_seed", 2**63)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_records_are_refused(case):
    make, mutate = BAD[case]
    good = make()
    data = good.dict()
    mutate(data)
    with pytest.raises(RecordError) as error:
        unpack(type(good), msgpack.packb(data, use_bin_type=True))
    assert isinstance(error.value, UserError) and isinstance(error.value, ValueError)
    message = str(error.value)
    assert type(good).__name__ in message and "\n" not in message
    with pytest.raises(RecordError):
        from_dht_value(type(good), data)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", pack(make_group())[:-1], pack(make_group()) + b"\x00", msgpack.packb([1, 2]), b"\xd4\x40\x00"],
)
def test_malformed_bytes_are_refused(data):
    with pytest.raises(RecordError):
        unpack(GroupRecord, data)


def test_unpack_refuses_oversized_input_before_decoding():
    with pytest.raises(RecordError, match="over its"):
        unpack(PeerRecord, b"\x00" * (MAX_DHT_VALUE_BYTES + 1))
    with pytest.raises(RecordError, match="over its"):
        unpack(GroupRecord, b"\x00" * (MAX_GROUP_BYTES + 1))


def test_protocol_version_message_names_both_versions_and_says_upgrade():
    with pytest.raises(ProtocolVersionError) as newer:
        check_protocol_version(PROTOCOL_VERSION + 1, "PeerRecord")
    assert f"protocol version {PROTOCOL_VERSION + 1}" in str(newer.value)
    assert f"speaks protocol version {PROTOCOL_VERSION}" in str(newer.value)
    assert "upgrade hivegrpo on this peer" in str(newer.value)
    with pytest.raises(ProtocolVersionError, match="older hivegrpo and must upgrade"):
        check_protocol_version(0, "PeerRecord")
    with pytest.raises(ProtocolVersionError, match="no valid protocol_version"):
        check_protocol_version(None, "PeerRecord")
    check_protocol_version(PROTOCOL_VERSION, "PeerRecord")


def test_construction_is_as_strict_as_parsing():
    with pytest.raises(pydantic.ValidationError):
        make_heartbeat(throughput=1)
    with pytest.raises(pydantic.ValidationError):
        make_group(version=5.0)
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        BucketEntry(version=1, seq=1, count=1, inline=None, pointer=None)
    with pytest.raises(pydantic.ValidationError, match="field required"):
        ModelSpec(name="bundled", quantization="nf4", files=make_manifest().model.files)


# ---------------------------------------------------------------------------------------------------- sizes


def test_check_value_size():
    check_value_size(b"x" * MAX_DHT_VALUE_BYTES, "peers")
    with pytest.raises(RecordTooLarge) as error:
        check_value_size(b"x" * (MAX_DHT_VALUE_BYTES + 1), "peers")
    message = str(error.value)
    assert f"{MAX_DHT_VALUE_BYTES + 1} bytes" in message and f"{MAX_DHT_VALUE_BYTES}-byte" in message
    assert "blob" in message and isinstance(error.value, UserError) and isinstance(error.value, ValueError)


def test_an_oversized_record_never_reaches_the_dht():
    big = make_group(
        completions=[completion(MAX_COMPLETION_TOKENS)] * 16, rewards=[0.0] * 16
    )  # 16 x 1024 tokens: ~130 KB
    dht = mock.Mock()
    with pytest.raises(RecordTooLarge, match="GroupRecord record is"):
        dht.store(keys.bucket_key("r", big.version), to_dht_value(big), expiration_time=time.time() + 60)
    dht.store.assert_not_called()
    assert not fits_inline(big)
    with pytest.raises(ValueError, match="publish them as a blob"):
        BucketEntry.of_group(big)
    assert len(pack(BucketEntry.of_pointer(make_pointer(size=len(pack(big))), big.version, big.seq))) < 1024


def test_an_entry_holds_its_groups_as_bytes_that_only_groups_of_parses_and_checks_against_its_header():
    groups = [make_group(version=5, seq=2), make_group(version=5, seq=3)]
    entry = BucketEntry.of_groups(groups)
    assert isinstance(entry.inline, bytes) and (entry.version, entry.seq, entry.count) == (5, 2, 2)
    assert groups_of(entry.inline, 5, 2, 2) == groups
    for header in ((6, 2, 2), (5, 3, 2), (5, 2, 1), (5, 2, 3)):
        with pytest.raises(RecordError, match="their entry says"):
            groups_of(entry.inline, *header)
    for junk in (b"\x00", pack(groups[0]), entry.inline[:-1]):
        with pytest.raises(RecordError):
            groups_of(junk, 5, 2, 2)


def test_the_inline_limit_is_exact_and_an_inline_entry_always_fits():
    completions = [completion(MAX_COMPLETION_TOKENS)] * 5

    def sized(prompt_tokens):
        return make_group(prompt=[3] * prompt_tokens, completions=completions, rewards=[0.5] * 5)

    base = len(pack(sized(100)))
    largest = 100 + (MAX_INLINE_GROUP_BYTES - base) // 4
    assert largest < MAX_PROMPT_TOKENS
    assert len(pack(sized(largest))) <= MAX_INLINE_GROUP_BYTES < len(pack(sized(largest + 1)))
    assert fits_inline(sized(largest)) and not fits_inline(sized(largest + 1))
    entry = BucketEntry.of_group(sized(largest))
    assert len(pack(entry)) <= MAX_DHT_VALUE_BYTES
    to_dht_value(entry)


def test_worst_case_records_fit_the_dht():
    """Every record but a group is bounded below the DHT limit by its own schema."""
    providers = [f"Qm{'z' * 125}{'123456789ABCDEFGHJKLMNPQRSTUVWXYZ'[i]}" for i in range(32)]
    files = [ModelFile(path=f"{i:02d}" + "p" * 254, sha256=SHA_A, size=1) for i in range(64)]
    doc = json.dumps({"k": "v" * 4087})
    assert len(doc) == 4096
    worst = [
        make_manifest(
            model=ModelSpec(name="m" * 256, revision="r" * 128, quantization="int8", files=files),
            task=TaskSpec(name="t" * 128, config_json=doc),
            grpo_json=doc,
            lora_json=doc,
        ),
        make_heartbeat(maddrs=["/" + "m" * 255] * 16, stats={f"{i:02d}" + "s" * 62: -1e300 for i in range(32)}),
        make_adapter(providers=providers),
        BucketEntry.of_pointer(make_pointer(providers=providers), 2**63 - 1, 2**63 - 1),
        make_metrics(groups_rejected={f"{i:02d}" + "r" * 62: 2**63 - 1 for i in range(16)}),
    ]
    for record in worst:
        to_dht_value(record)


def test_group_limits_match_the_documented_bounds():
    assert MAX_GROUP_SIZE == 64 and MAX_PROMPT_TOKENS == 2048 and MAX_COMPLETION_TOKENS == 1024
    biggest = make_group(
        prompt=[1] * MAX_PROMPT_TOKENS,
        completions=[completion(MAX_COMPLETION_TOKENS)] * MAX_GROUP_SIZE,
        rewards=[1.0] * MAX_GROUP_SIZE,
    )
    assert len(pack(biggest)) <= MAX_GROUP_BYTES
    assert unpack(GroupRecord, pack(biggest)) == biggest


# ---------------------------------------------------------------------------------------------------- layering


def test_import_peer_protocol_pulls_no_torch():
    code = (
        "import sys\n"
        "import peer.protocol, peer.protocol.records, peer.protocol.keys, peer.protocol.limits\n"
        "import peer.protocol.version, peer.protocol.codec, peer.protocol.serialization\n"
        "from peer.protocol import GroupRecord, pack, unpack, encode_tokens, encode_floats, Completion\n"
        "c = Completion.of([1, 2], [-0.5, -0.5])\n"
        "g = GroupRecord(version=0, adapter_sha256='a' * 64, producer='Qm', seq=0, task_seed=0, task_index=0,\n"
        "                prompt_ids=encode_tokens([1]), completions=[c, c], rewards=[0.0, 1.0], created=0.0)\n"
        "assert unpack(GroupRecord, pack(g)) == g\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'hivemind', 'numpy'))\n"
        "print(' '.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import peer.protocol loaded {out.stdout.strip()}"
