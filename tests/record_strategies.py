"""hypothesis strategies for the protocol's records: valid ones within every documented bound, ways to break them,
and junk.

* ``KINDS``: every record stored in the DHT (manifest, heartbeat, adapter announcement, bucket entry inline and
  pointer, metrics, access list), each with a strategy of valid records, the key and subkey it lives under, and the
  ways to put one of its values out of range.
* ``VALUE_MUTATIONS``: edits of a record's value (the dict ``to_dht_value`` makes), each one known to make it
  invalid: a missing or extra field, a wrong type, a non-finite number, another protocol version;
  :func:`mutated_value` adds a value over the DHT size limit, :func:`out_of_range` each of a kind's range rules.
* ``junk``: arbitrary msgpack-able values, as hivemind's serializer carries them (tuples included).

Lists are drawn with :func:`sized`: any length in their range, bounds included, elements cycled from a few drawn
ones, so a list at its bound (1024 revoked invites, 64 completions) costs no more to generate than a short one.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic.v1 as pydantic
from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.codec import MAX_TOKEN_ID
from peer.protocol.limits import (
    HOLDER_RING,
    MAX_ANCESTORS,
    MAX_BANNED,
    MAX_BLOB_BYTES,
    MAX_COMPLETION_TOKENS,
    MAX_CREDIT,
    MAX_CREDIT_REASONS,
    MAX_CREDITED,
    MAX_DHT_VALUE_BYTES,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_ENTRY,
    MAX_HISTORY,
    MAX_INT,
    MAX_JSON_CHARS,
    MAX_MADDR_CHARS,
    MAX_MADDRS,
    MAX_MODEL_FILES,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_PEER_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROVIDERS,
    MAX_REASONS,
    MAX_REVOKED,
    MAX_RUN_ID_LEN,
    MAX_STATS,
    MAX_TALLIED,
)
from peer.protocol.records import (
    AccessRecord,
    AdapterRecord,
    BlobPointer,
    BucketEntry,
    Completion,
    Credit,
    CreditRecord,
    GroupRecord,
    HolderRecord,
    ManifestRecord,
    MetricsRecord,
    ModelFile,
    ModelSpec,
    PeerRecord,
    PeerTally,
    TaskSpec,
    encode_floats,
    encode_tokens,
    fits_inline,
    peer_name_problem,
)
from peer.protocol.version import PROTOCOL_VERSION

BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
HEX = "0123456789abcdef"
TINY = math.ulp(0.0)  # the smallest positive float: -TINY is the largest float below zero (-0.0 is not)
FLOAT32_TINY = 2.0**-149  # the smallest positive float32


@st.composite
def sized(draw, elements, max_size: int, min_size: int = 0, distinct: Callable[[Any, int], Any] | None = None):
    """A list of ``min_size .. max_size`` items cycled from up to four drawn ``elements``; ``distinct(item, i)``
    makes item ``i`` unique where the schema wants distinct items."""
    n = draw(st.integers(min_size, max_size))
    if n == 0:
        return []
    pool = draw(st.lists(elements, min_size=1, max_size=min(n, 4)))
    items = [pool[i % len(pool)] for i in range(n)]
    return [distinct(item, i) for i, item in enumerate(items)] if distinct else items


def base58(number: int, width: int) -> str:
    digits = ""
    for _ in range(width):
        number, digit = divmod(number, 58)
        digits = BASE58[digit] + digits
    return digits


def distinct_peer_id(peer_id: str, i: int) -> str:
    # equal lengths mean equal prefix lengths, so the fixed-width suffixes tell any two apart
    return peer_id[: MAX_PEER_ID_CHARS - 4] + base58(i, 4)


def distinct_hex(value: str, i: int) -> str:
    return value[:-4] + f"{i:04x}"


def distinct_name(name: str, i: int, limit: int = 64) -> str:
    return (f"{i:03d}" + name)[:limit]


# ---------------------------------------------------------------------------------------------------- fields

peer_ids = st.text(BASE58, min_size=1, max_size=MAX_PEER_ID_CHARS)
sha256s = st.text(HEX, min_size=64, max_size=64)
fingerprints = st.text(HEX, min_size=16, max_size=16)
timestamps = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
fractions = st.floats(min_value=0.0, max_value=1.0)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
counts = st.integers(0, MAX_INT)
short_names = st.text(min_size=1, max_size=64)
peer_names = st.text(min_size=1, max_size=MAX_PEER_NAME_CHARS).filter(lambda n: peer_name_problem(n) is None)
reasons = st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True)
credit_counts = st.integers(0, MAX_CREDIT)
names = st.text(min_size=1, max_size=MAX_NAME_CHARS)
RUN_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"
run_ids = st.text(RUN_ID_CHARS, min_size=1, max_size=MAX_RUN_ID_LEN)
token_ids = st.integers(0, MAX_TOKEN_ID)
logprobs = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
path_parts = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"), min_size=1, max_size=60
).filter(lambda part: part not in (".", ".."))

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
_json_values = st.recursive(
    _json_scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
json_objects = (
    st.dictionaries(st.text(max_size=8), _json_values, max_size=4)
    .map(lambda obj: json.dumps(obj, ensure_ascii=False))
    .filter(lambda text: len(text) <= MAX_JSON_CHARS)
)


# ---------------------------------------------------------------------------------------------------- records


@st.composite
def model_files(draw) -> list[ModelFile]:
    def make(parts_sha_size, i):
        parts, sha, size = parts_sha_size
        return ModelFile(path="/".join([f"f{i}", *parts]), sha256=sha, size=size)

    one = st.tuples(st.lists(path_parts, max_size=3), sha256s, st.integers(0, MAX_BLOB_BYTES))
    return draw(sized(one, MAX_MODEL_FILES, min_size=1, distinct=make))


@st.composite
def manifests(draw) -> ManifestRecord:
    return ManifestRecord(
        run_id=draw(run_ids),
        created=draw(timestamps),
        access=draw(st.sampled_from(["public", "private"])),
        seed=draw(counts),
        model=ModelSpec(
            name=draw(st.text(min_size=1, max_size=256)),
            revision=draw(st.none() | names),
            quantization=draw(st.sampled_from(["nf4", "int8", "none"])),
            files=draw(model_files()),
        ),
        task=TaskSpec(name=draw(names), config_json=draw(json_objects)),
        grpo_json=draw(json_objects),
        lora_json=draw(json_objects),
        adapter0_sha256=draw(sha256s),
        coordinator=draw(peer_ids),
    )


@st.composite
def holders(draw) -> HolderRecord:
    return HolderRecord(
        peer_id=draw(peer_ids),
        version=draw(counts),
        sha256=draw(sha256s),
        size=draw(st.integers(1, MAX_BLOB_BYTES)),
        created=draw(timestamps),
    )


@st.composite
def heartbeats(draw) -> PeerRecord:
    started, last_seen = sorted(draw(st.lists(timestamps, min_size=2, max_size=2)))
    stats = draw(sized(st.tuples(short_names, finite_floats), MAX_STATS))
    return PeerRecord(
        peer_id=draw(peer_ids),
        role=draw(st.sampled_from(["coordinator", "rollout", "learner", "observer"])),
        adapter_version=draw(st.integers(-1, MAX_INT)),
        throughput=draw(timestamps),
        hardware=draw(st.text(max_size=MAX_NAME_CHARS)),
        reachable=draw(st.booleans()),
        maddrs=draw(sized(st.text(min_size=1, max_size=MAX_MADDR_CHARS), MAX_MADDRS)),
        started=started,
        last_seen=last_seen,
        state=draw(st.sampled_from(["starting", "running", "leaving"])),
        stats={distinct_name(name, i): value for i, (name, value) in enumerate(stats)},
        name=draw(st.none() | peer_names),
    )


@st.composite
def adapters(draw) -> AdapterRecord:
    version = draw(counts)
    sha = draw(sha256s)
    parent = "" if version == 0 else draw(sha256s.filter(lambda other: other != sha))
    older = draw(st.lists(sha256s, max_size=min(MAX_ANCESTORS, version) - 1)) if version else []
    return AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256=parent,
        ancestors=[parent, *older] if version else [],
        size=draw(st.integers(1, MAX_BLOB_BYTES)),
        providers=draw(sized(peer_ids, MAX_PROVIDERS, min_size=1, distinct=distinct_peer_id)),
        created=draw(timestamps),
        learner=draw(peer_ids),
    )


@st.composite
def completions(draw, max_tokens: int) -> Completion:
    n = draw(st.integers(1, max_tokens))
    tokens = draw(sized(token_ids, n, min_size=n))
    return Completion(token_ids=encode_tokens(tokens), logprobs=encode_floats(draw(sized(logprobs, n, min_size=n))))


GROUP_FRAMING = 450  # bytes of a packed group besides its tokens and completions (names, hashes, numbers)
COMPLETION_FRAMING = 36  # bytes per completion besides its tokens (two names, two headers, a reward)


@st.composite
def groups(draw, version: int, seq: int, budget: int) -> GroupRecord:
    """A valid group that packs to at most ``budget`` bytes."""
    size = draw(st.integers(2, max(2, min(MAX_GROUP_SIZE, (budget - GROUP_FRAMING) // (COMPLETION_FRAMING + 8)))))
    room = budget - GROUP_FRAMING - size * COMPLETION_FRAMING
    prompt = draw(sized(token_ids, max(1, min(MAX_PROMPT_TOKENS, room // 8)), min_size=1))
    per_completion = max(1, min(MAX_COMPLETION_TOKENS, (room - 4 * len(prompt)) // (8 * size)))
    made = draw(sized(completions(per_completion), size, min_size=size))
    return GroupRecord(
        version=version,
        adapter_sha256=draw(sha256s),
        producer=draw(peer_ids),
        seq=seq,
        task_seed=draw(counts),
        task_index=draw(counts),
        prompt_ids=encode_tokens(prompt),
        completions=made,
        rewards=draw(sized(fractions, size, min_size=size)),
        created=draw(timestamps),
    )


@st.composite
def inline_entries(draw) -> BucketEntry:
    # mostly a few groups, sometimes up to the most an entry holds (each takes a share of the same byte budget)
    n = draw(st.integers(1, MAX_GROUPS_PER_ENTRY) if draw(st.integers(0, 3)) == 0 else st.integers(1, 3))
    version = draw(counts)
    seq = draw(st.integers(0, MAX_INT - n + 1))
    made = [draw(groups(version, seq + i, 44_000 // n)) for i in range(n)]
    assert fits_inline(made), "the strategy must stay inside the inline limit"
    return BucketEntry.of_groups(made)


@st.composite
def pointers(draw, kind: str = "group") -> BlobPointer:
    return BlobPointer(
        sha256=draw(sha256s),
        size=draw(st.integers(1, MAX_GROUP_BATCH_BYTES if kind == "group" else MAX_BLOB_BYTES)),
        providers=draw(sized(peer_ids, MAX_PROVIDERS, min_size=1, distinct=distinct_peer_id)),
        kind=kind,
    )


@st.composite
def pointer_entries(draw) -> BucketEntry:
    return BucketEntry.of_pointer(
        draw(pointers()), draw(counts), draw(counts), draw(st.integers(1, MAX_GROUPS_PER_ENTRY))
    )


@st.composite
def metrics(draw) -> MetricsRecord:
    rejected = draw(sized(st.tuples(short_names, counts), MAX_REASONS))
    tallies = draw(sized(st.tuples(fingerprints, counts, counts), MAX_TALLIED))
    return MetricsRecord(
        learner=draw(peer_ids),
        version=draw(counts),
        groups_accepted=draw(counts),
        groups_dropped_stale=draw(counts),
        groups_rejected={distinct_name(name, i): n for i, (name, n) in enumerate(rejected)},
        staleness_mean=draw(timestamps),
        staleness_max=draw(counts),
        reward_mean=draw(fractions),
        exact_match=draw(st.none() | fractions),
        step_seconds=draw(timestamps),
        banned=draw(sized(fingerprints, MAX_BANNED)),
        per_peer={distinct_hex(fp, i): PeerTally(accepted=a, rejected=r) for i, (fp, a, r) in enumerate(tallies)},
        reward_history=draw(sized(fractions, MAX_HISTORY)),
        created=draw(timestamps),
    )


@st.composite
def credit_entries(draw) -> Credit:
    listed = draw(
        st.dictionaries(reasons, st.integers(0, MAX_CREDIT // MAX_CREDIT_REASONS), max_size=MAX_CREDIT_REASONS)
    )
    refused = draw(st.integers(sum(listed.values()), MAX_CREDIT))
    return Credit(
        name=draw(st.none() | peer_names),
        used=draw(credit_counts),
        refused=refused,
        reasons=listed,
        stale=draw(credit_counts),
        no_signal=draw(credit_counts),
        since=draw(timestamps),
    )


@st.composite
def credits(draw) -> CreditRecord:
    entries = draw(sized(st.tuples(fingerprints, credit_entries()), MAX_CREDITED))
    contributors = {distinct_hex(fp, i): credit for i, (fp, credit) in enumerate(entries)}
    used = sum(c.used for c in contributors.values())
    return CreditRecord(
        learner=draw(peer_ids),
        version=draw(counts),
        groups_used=draw(st.integers(used, MAX_INT)),
        contributors_known=draw(st.integers(len(contributors), MAX_INT)),
        contributors=contributors,
        created=draw(timestamps),
    )


@st.composite
def access_lists(draw) -> AccessRecord:
    return AccessRecord(
        issuer=draw(sha256s),
        revoked=draw(sized(fingerprints, MAX_REVOKED)),
        created=draw(timestamps),
        signature=draw(st.text(HEX, min_size=128, max_size=128)),
    )


# ---------------------------------------------------------------------------------------------------- breaking them


def at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def put(data: Any, path: tuple, value: Any) -> None:
    at(data, path[:-1])[path[-1]] = value


def nodes(data: Any, prefix: tuple = ()) -> list[tuple]:
    """The path of every value inside ``data`` (its fields, list items and dict values), nested ones included."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found.append(prefix + (key,))
        found.extend(nodes(value, prefix + (key,)))
    return found


def model_paths(obj: Any, prefix: tuple = ()) -> dict[tuple, type]:
    """``{path: model class}`` of every record and sub-record (``()`` is the record itself) inside ``obj``."""
    found = {}
    if isinstance(obj, pydantic.BaseModel):
        found[prefix] = type(obj)
        for name in obj.__fields__:
            found.update(model_paths(getattr(obj, name), prefix + (name,)))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found.update(model_paths(item, prefix + (i,)))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            found.update(model_paths(item, prefix + (key,)))
    return found


def wrong_type(value: Any, draw) -> Any:
    """A value of a type the schema never takes where ``value`` is (strict types: 3.0 is no int, 1 no float)."""
    if isinstance(value, bool):
        options = [int(value), "true"]
    elif isinstance(value, int):
        options = [float(value), str(value), [value]]
    elif isinstance(value, float):
        options = [int(value) if abs(value) < 2**63 else 0, str(value), True]
    elif isinstance(value, str):
        options = [value.encode(), 0, [value]]
    elif isinstance(value, bytes):
        options = [value.decode("latin-1"), 0, list(value[:4])]
    elif value is None:  # an optional field: anything but None and its own type
        options = [b"\x00", 0]
    elif isinstance(value, list):
        options = [tuple(value), {}, 0]
    else:
        options = [[], 0, "x"]
    return draw(st.sampled_from(options))


OVER = MAX_DHT_VALUE_BYTES + 1024  # characters or bytes that alone put a value over the DHT limit


def bad_counts() -> st.SearchStrategy[int]:
    return st.integers(-(2**63), -1) | st.integers(MAX_INT + 1, 2**64 - 1)


def negative_floats() -> st.SearchStrategy[float]:
    return st.floats(max_value=-TINY, allow_nan=False, allow_infinity=False)


def bad_fractions() -> st.SearchStrategy[float]:
    return negative_floats() | st.floats(min_value=1.0, exclude_min=True, allow_infinity=False, allow_nan=False)


@st.composite
def bad_hex(draw, value: str) -> str:
    """``value`` (a fixed-length lowercase hex string) one character short or long, or with a foreign character."""
    how = draw(st.sampled_from(["short", "long", "foreign", "newline"]))
    if how == "short":
        return value[:-1]
    if how == "long":
        return value + draw(st.sampled_from(HEX))
    if how == "newline":
        return value + "\n"
    i = draw(st.integers(0, len(value) - 1))
    return value[:i] + draw(st.sampled_from("ABCDEFgxz -")) + value[i + 1 :]


@st.composite
def bad_peer_ids(draw, value: str) -> str:
    how = draw(st.sampled_from(["empty", "long", "foreign"]))
    if how == "empty":
        return ""
    if how == "long":
        return (value * (MAX_PEER_ID_CHARS + 1))[: MAX_PEER_ID_CHARS + 1]
    i = draw(st.integers(0, len(value) - 1))
    return value[:i] + draw(st.sampled_from("0OIl +/_")) + value[i + 1 :]


def bad_string(limit: int, empty_ok: bool = False) -> st.SearchStrategy[str]:
    too_long = st.text(min_size=1, max_size=8).map(lambda s: (s * (limit + 1))[: limit + 1 + len(s) % 3])
    return too_long if empty_ok else too_long | st.just("")


def bad_json() -> st.SearchStrategy[str]:
    return st.sampled_from(
        ["[1, 2]", "3", '"text"', "null", "{", '{"a": NaN}', '{"a": Infinity}', "", '{"a": 1} x']
    ) | st.just(json.dumps({"k": "v" * MAX_JSON_CHARS}))


@dataclass(frozen=True)
class Kind:
    """One record type stored in the DHT: how to make valid ones, where it lives, how to put it out of range."""

    name: str
    cls: type
    valid: st.SearchStrategy
    key: Callable[[str, Any], str]
    subkey: Callable[[bytes, Any], bytes]
    field: Callable[[Any], str]
    out_of_range: dict[str, Callable]  # label -> mutate(data, draw), in place
    oversize: Callable[[dict, Any], None]  # puts the value over MAX_DHT_VALUE_BYTES, in place
    also: tuple[str, ...] = ()  # other fields whose key holds this record too (a learner's heartbeat: core_peers)


def _owner(pub: bytes, _record) -> bytes:
    return keys.owner_subkey(pub)


def _single(field: str) -> dict:
    return dict(key=lambda run, _record: keys.field_key(run, field), subkey=_owner, field=lambda _record: field)


_BUCKET = dict(
    key=lambda run, entry: keys.bucket_key(run, entry.version),
    subkey=lambda pub, entry: keys.group_subkey(pub, entry.version, entry.seq),
    field=lambda entry: keys.bucket_field(keys.bucket_slot(entry.version)),
)


def _set(path: tuple, strategy_of: Callable[[Any], st.SearchStrategy]) -> Callable:
    """A mutation setting the value at ``path`` (``"*"`` picks an item) to one drawn from ``strategy_of(old)``."""

    def mutate(data, draw):
        concrete = []
        for part in path:
            if part == "*":
                container = at(data, tuple(concrete))
                part = draw(st.integers(0, len(container) - 1)) if container else None
                if part is None:
                    return False
            concrete.append(part)
        put(data, tuple(concrete), draw(strategy_of(at(data, tuple(concrete)))))
        return True

    return mutate


def _fixed(value: Any) -> Callable[[Any], st.SearchStrategy]:
    return lambda _old: st.just(value)


def _grow(path: tuple, limit: int, item: Callable[[Any, int], Any]) -> Callable:
    """A mutation making the list or dict at ``path`` one item longer than ``limit`` (distinct items)."""

    def mutate(data, draw):
        container = at(data, path)
        extra = draw(st.integers(1, 3))
        if isinstance(container, dict):
            put(data, path, {f"k{i:04d}": item(container, i) for i in range(limit + extra)})
        else:
            put(data, path, [item(container, i) for i in range(limit + extra)])
        return True

    return mutate


def _file(_files, i):
    return {"path": f"file{i}", "sha256": "a" * 64, "size": 1}


MANIFEST = Kind(
    name="manifest",
    cls=ManifestRecord,
    valid=manifests(),
    **_single(keys.MANIFEST_FIELD),
    out_of_range={
        "run id": _set(("run_id",), lambda _: bad_string(MAX_RUN_ID_LEN) | st.sampled_from(["a b", "../r", "rün"])),
        "negative created": _set(("created",), lambda _: negative_floats()),
        "access": _set(("access",), lambda _: st.sampled_from(["secret", "Public", ""])),
        "seed": _set(("seed",), lambda _: bad_counts()),
        "model name": _set(("model", "name"), lambda _: bad_string(256)),
        "revision": _set(("model", "revision"), lambda _: bad_string(MAX_NAME_CHARS)),
        "quantization": _set(("model", "quantization"), lambda _: st.sampled_from(["fp4", "NF4", ""])),
        "no files": _set(("model", "files"), _fixed([])),
        "too many files": _grow(("model", "files"), MAX_MODEL_FILES, _file),
        "file path": _set(
            ("model", "files", "*", "path"),
            lambda _: (
                st.sampled_from(["../x", "a/../b", "/etc/passwd", "a//b", "./a", "a\\b", "a\x00b", "a\x7f", ""])
                | bad_string(MAX_PATH_CHARS)
            ),
        ),
        "duplicate file path": lambda d, draw: (
            len(d["model"]["files"]) > 1 and not d["model"]["files"][1].update(path=d["model"]["files"][0]["path"])
        ),
        "file sha256": _set(("model", "files", "*", "sha256"), bad_hex),
        "file size": _set(("model", "files", "*", "size"), lambda _: bad_counts() | st.just(MAX_BLOB_BYTES + 1)),
        "task name": _set(("task", "name"), lambda _: bad_string(MAX_NAME_CHARS)),
        "task config": _set(("task", "config_json"), lambda _: bad_json()),
        "grpo json": _set(("grpo_json",), lambda _: bad_json()),
        "lora json": _set(("lora_json",), lambda _: bad_json()),
        "adapter0 sha256": _set(("adapter0_sha256",), bad_hex),
        "coordinator": _set(("coordinator",), bad_peer_ids),
    },
    oversize=lambda d, draw: d.update(grpo_json=json.dumps({"k": "x" * OVER})),
)


def _seen_before_start(d, draw):
    if d["started"] == 0.0:
        return False
    d["last_seen"] = draw(st.floats(0.0, d["started"], exclude_max=True))
    return True


PEER = Kind(
    name="heartbeat",
    cls=PeerRecord,
    valid=heartbeats(),
    **_single(keys.PEERS_FIELD),
    also=(keys.CORE_PEERS_FIELD,),
    out_of_range={
        "peer id": _set(("peer_id",), bad_peer_ids),
        "role": _set(("role",), lambda _: st.sampled_from(["admin", "Learner", ""])),
        "adapter version": _set(
            ("adapter_version",), lambda _: st.integers(-(2**63), -2) | st.integers(MAX_INT + 1, 2**64 - 1)
        ),
        "negative throughput": _set(("throughput",), lambda _: negative_floats()),
        "hardware": _set(("hardware",), lambda _: bad_string(MAX_NAME_CHARS, empty_ok=True)),
        "too many maddrs": _grow(("maddrs",), MAX_MADDRS, lambda _m, i: f"/ip4/10.0.0.{i % 256}/tcp/{i}"),
        "maddr": _set(("maddrs", "*"), lambda _: bad_string(MAX_MADDR_CHARS)),
        "negative started": lambda d, draw: d.update(started=draw(negative_floats())) or True,
        "seen before start": _seen_before_start,
        "state": _set(("state",), lambda _: st.sampled_from(["dead", "Running", ""])),
        "too many stats": _grow(("stats",), MAX_STATS, lambda _s, i: float(i)),
        "stat name": lambda d, draw: d["stats"].update({draw(bad_string(64)): 1.0}) or True,
        "name": _set(("name",), lambda _: bad_peer_names()),
    },
    oversize=lambda d, draw: d.update(hardware="x" * OVER),
)


def _lineage(d, draw):
    how = draw(st.sampled_from(["v0 with parent", "later without parent", "own parent"]))
    if how == "v0 with parent":
        d.update(version=0, parent_sha256=draw(sha256s.filter(lambda s: s != d["sha256"])))
    elif how == "later without parent":
        d.update(version=draw(st.integers(1, MAX_INT)), parent_sha256="")
    else:
        d.update(version=draw(st.integers(1, MAX_INT)), parent_sha256=d["sha256"])
    return True


def _providers(at_path: tuple) -> dict:
    return {
        "no providers": _set(at_path, _fixed([])),
        "too many providers": _grow(at_path, MAX_PROVIDERS, lambda _p, i: "Qm" + base58(i, 4)),
        "duplicate providers": lambda d, draw: at(d, at_path).append(at(d, at_path)[0]) or True,
        "provider id": _set(at_path + ("*",), bad_peer_ids),
    }


ADAPTER = Kind(
    name="adapter",
    cls=AdapterRecord,
    valid=adapters(),
    **_single(keys.ADAPTER_FIELD),
    out_of_range={
        "version": _set(("version",), lambda _: bad_counts()),
        "sha256": _set(("sha256",), bad_hex),
        "parent sha256": lambda d, draw: d["version"] > 0 and _set(("parent_sha256",), bad_hex)(d, draw),
        "lineage": _lineage,
        "ancestors not from the parent": lambda d, draw: (
            d["version"] > 0 and d.update(ancestors=[draw(sha256s.filter(lambda s: s != d["parent_sha256"]))]) is None
        ),
        "more ancestors than versions": lambda d, draw: (
            d.update(
                version=1,
                ancestors=[d["parent_sha256"] or "a" * 64, "b" * 64],
                parent_sha256=d["parent_sha256"] or "a" * 64,
            )
            is None
        ),
        "too many ancestors": lambda d, draw: (
            d.update(version=MAX_INT, parent_sha256="a" * 64, ancestors=["a" * 64] * (MAX_ANCESTORS + 1)) is None
        ),
        "size": _set(("size",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_BLOB_BYTES + 1, 2**64 - 1)),
        **_providers(("providers",)),
        "negative created": _set(("created",), lambda _: negative_floats()),
        "learner": _set(("learner",), bad_peer_ids),
    },
    oversize=lambda d, draw: d.update(providers=["Qm" + base58(i, 4) for i in range(OVER // 4)]),
)


def _group_fields(g: tuple) -> dict:
    """Out-of-range mutations of the group at path ``g`` inside an entry."""

    def tokens(n):
        return encode_tokens([1] * n)

    return {
        "empty prompt": _set(g + ("prompt_ids",), _fixed(b"")),
        "prompt too long": _set(g + ("prompt_ids",), _fixed(tokens(MAX_PROMPT_TOKENS + 1))),
        "ragged prompt bytes": _set(g + ("prompt_ids",), lambda old: st.integers(1, 3).map(lambda k: old + b"\0" * k)),
        "one completion": lambda d, draw: (
            at(d, g).update(completions=at(d, g)["completions"][:1], rewards=at(d, g)["rewards"][:1]) or True
        ),
        "too many completions": lambda d, draw: (
            at(d, g).update(completions=at(d, g)["completions"][:1] * 65, rewards=[0.0] * 65) or True
        ),
        "empty completion": _set(g + ("completions", "*"), _fixed({"token_ids": b"", "logprobs": b""})),
        "completion too long": _set(
            g + ("completions", "*"),
            _fixed({"token_ids": tokens(1025), "logprobs": encode_floats([-1.0] * 1025)}),
        ),
        "ragged token bytes": _set(g + ("completions", "*", "token_ids"), lambda old: st.just(old[:-1])),
        "fewer log-probs than tokens": _set(
            g + ("completions", "*"),
            lambda old: st.just({**old, "token_ids": old["token_ids"] + tokens(1)}),
        ),
        "more log-probs than tokens": _set(
            g + ("completions", "*", "logprobs"), lambda old: st.just(old + encode_floats([-1.0]))
        ),
        "nan or inf log-prob": _set(
            g + ("completions", "*", "logprobs"),
            lambda old: st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda x: encode_floats([x]) + old[4:]),
        ),
        "positive log-prob": _set(
            g + ("completions", "*", "logprobs"),
            lambda old: st.floats(min_value=FLOAT32_TINY, max_value=2.0**100, width=32).map(
                lambda x: encode_floats([x]) + old[4:]
            ),
        ),
        "fewer rewards": lambda d, draw: at(d, g)["rewards"].pop() is not None,
        "more rewards": lambda d, draw: at(d, g)["rewards"].append(0.5) or True,
        "reward out of range": _set(g + ("rewards", "*"), lambda _: bad_fractions()),
        "group adapter sha256": _set(g + ("adapter_sha256",), bad_hex),
        "producer": _set(g + ("producer",), bad_peer_ids),
        "task seed": _set(g + ("task_seed",), lambda _: bad_counts()),
        "negative group created": _set(g + ("created",), lambda _: negative_floats()),
    }


def _both_payloads(d, draw):
    d["pointer"] = draw(pointers()).dict()
    return True


def _seq_gap(d, draw):
    if len(d["inline"]) < 2:
        return False
    d["inline"][-1]["seq"] += draw(st.integers(1, 5))
    return True


def _mixed_versions(d, draw):
    if len(d["inline"]) < 2:
        return False
    d["inline"][-1]["version"] = d["inline"][-1]["version"] ^ draw(st.integers(1, 2**20))
    return True


def _header(name: str) -> Callable:
    def mutate(d, draw):
        d[name] = draw(st.integers(0, MAX_INT).filter(lambda v: v != d[name]))
        if name == "count":
            d[name] = 1 + d[name] % MAX_GROUPS_PER_ENTRY
            return d[name] != len(d["inline"])
        return True

    return mutate


def _inline_over_limit(d, draw):
    first = d["inline"][0]
    big = Completion.of([1] * MAX_COMPLETION_TOKENS, [-1.0] * MAX_COMPLETION_TOKENS).dict()
    d.update(inline=[{**first, "completions": [big] * 8, "rewards": [0.0] * 8}], count=1, seq=first["seq"])


INLINE = Kind(
    name="entry (inline)",
    cls=BucketEntry,
    valid=inline_entries(),
    **_BUCKET,
    out_of_range={
        "count": _header("count"),
        "entry version": _header("version"),
        "entry seq": _header("seq"),
        "no groups": _set(("inline",), _fixed([])),
        "seqs not consecutive": _seq_gap,
        "versions differ": _mixed_versions,
        "inline and pointer": _both_payloads,
        "neither payload": _set(("inline",), _fixed(None)),
        **_group_fields(("inline", 0)),
    },
    oversize=lambda d, draw: _inline_over_limit(d, draw),
)

POINTER = Kind(
    name="entry (pointer)",
    cls=BucketEntry,
    valid=pointer_entries(),
    **_BUCKET,
    out_of_range={
        "count": _set(("count",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_GROUPS_PER_ENTRY + 1, 2**63)),
        "inline and pointer": lambda d, draw: d.update(inline=[]) or True,
        "neither payload": _set(("pointer",), _fixed(None)),
        "pointer kind": _set(("pointer", "kind"), lambda _: st.sampled_from(["adapter", "model-file", "Group", ""])),
        "pointer sha256": _set(("pointer", "sha256"), bad_hex),
        "group blob size": _set(
            ("pointer", "size"), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_GROUP_BATCH_BYTES + 1, 2**63)
        ),
        **_providers(("pointer", "providers")),
    },
    oversize=lambda d, draw: d["pointer"].update(providers=["Qm" + base58(i, 4) for i in range(OVER // 4)]),
)

METRICS = Kind(
    name="metrics",
    cls=MetricsRecord,
    valid=metrics(),
    **_single(keys.METRICS_FIELD),
    out_of_range={
        "learner": _set(("learner",), bad_peer_ids),
        "a count": lambda d, draw: _set(
            (draw(st.sampled_from(["version", "groups_accepted", "groups_dropped_stale", "staleness_max"])),),
            lambda _: bad_counts(),
        )(d, draw),
        "too many reasons": _grow(("groups_rejected",), MAX_REASONS, lambda _r, i: i),
        "reason name": lambda d, draw: d["groups_rejected"].update({draw(bad_string(64)): 1}) or True,
        "reason count": lambda d, draw: d["groups_rejected"].update(x=draw(bad_counts())) or True,
        "negative staleness mean": _set(("staleness_mean",), lambda _: negative_floats()),
        "reward mean": _set(("reward_mean",), lambda _: bad_fractions()),
        "exact match": _set(("exact_match",), lambda _: bad_fractions()),
        "negative step seconds": _set(("step_seconds",), lambda _: negative_floats()),
        "too many bans": _grow(("banned",), MAX_BANNED, lambda _b, i: f"{i:016x}"),
        "banned fingerprint": lambda d, draw: d["banned"].append(draw(bad_hex("0" * 16))) or True,
        "too many producers": lambda d, draw: (
            d.update(per_peer={f"{i:016x}": {"accepted": 1, "rejected": 0} for i in range(MAX_TALLIED + 1)}) or True
        ),
        "producer fingerprint": lambda d, draw: (
            d["per_peer"].update({draw(bad_hex("0" * 16)): {"accepted": 0, "rejected": 0}}) or True
        ),
        "producer tally": lambda d, draw: (
            d["per_peer"].update({"0" * 16: {"accepted": draw(bad_counts()), "rejected": 0}}) or True
        ),
        "too long history": _grow(("reward_history",), MAX_HISTORY, lambda _h, i: 0.5),
        "history reward": lambda d, draw: d["reward_history"].append(draw(bad_fractions())) or True,
        "negative created": _set(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(banned=[f"{i:016x}" for i in range(OVER // 16)]),
)

ACCESS = Kind(
    name="access",
    cls=AccessRecord,
    valid=access_lists(),
    **_single(keys.ACCESS_FIELD),
    out_of_range={
        "issuer": _set(("issuer",), bad_hex),
        "too many revoked": _grow(("revoked",), MAX_REVOKED, lambda _r, i: f"{i:016x}"),
        "revoked id": lambda d, draw: d["revoked"].append(draw(bad_hex("0" * 16))) or True,
        "negative created": _set(("created",), lambda _: negative_floats()),
        "signature": _set(("signature",), bad_hex),
    },
    oversize=lambda d, draw: d.update(revoked=[f"{i:016x}" for i in range(OVER // 16)]),
)


def bad_peer_names() -> st.SearchStrategy[str]:
    """Names a peer must not show: empty, too long, only spaces, or with a control or format character."""
    controls = st.sampled_from(["\x1b[2J", "\n", "\x00", "\u202e", "\u200b", "\x7f"])
    inside = st.tuples(st.text(max_size=8), controls, st.text(max_size=8)).map("".join)
    return bad_string(MAX_PEER_NAME_CHARS) | st.sampled_from([" ", "   "]) | inside


def _credit_entry(i: int) -> dict:
    return {"name": None, "used": 1, "refused": 0, "reasons": {}, "stale": 0, "no_signal": 0, "since": 1.0}


def _a_contributor(d, draw) -> dict | None:
    return d["contributors"][draw(st.sampled_from(sorted(d["contributors"])))] if d["contributors"] else None


def _contributor_field(field: str, strategy_of: Callable[[Any], st.SearchStrategy]) -> Callable:
    def mutate(d, draw):
        entry = _a_contributor(d, draw)
        if entry is None:
            return False
        entry[field] = draw(strategy_of(entry[field]))
        return True

    return mutate


def _more_contributors(d, draw):
    n = MAX_CREDITED + draw(st.integers(1, 3))
    d["contributors"] = {f"{i:016x}": _credit_entry(i) for i in range(n)}
    d.update(groups_used=n, contributors_known=n)
    return True


def _more_reasons(d, draw):
    entry = _a_contributor(d, draw)
    if entry is None:
        return False
    n = MAX_CREDIT_REASONS + draw(st.integers(1, 3))
    entry.update(reasons={f"r{chr(97 + i)}": 1 for i in range(n)}, refused=n)
    return True


def _reasons_over_refused(d, draw):
    entry = _a_contributor(d, draw)
    if entry is None or entry["refused"] >= MAX_CREDIT:
        return False
    entry["reasons"] = {"reward": entry["refused"] + 1}
    return True


def _used_over_total(d, draw):
    used = sum(c["used"] for c in d["contributors"].values())
    if used == 0:
        return False
    d["groups_used"] = draw(st.integers(0, used - 1))
    return True


def _known_below_listed(d, draw):
    if not d["contributors"]:
        return False
    d["contributors_known"] = draw(st.integers(0, len(d["contributors"]) - 1))
    return True


def _bad_credit_count(_old) -> st.SearchStrategy[int]:
    return st.integers(-(2**63), -1) | st.integers(MAX_CREDIT + 1, 2**64 - 1)


CREDIT = Kind(
    name="credit",
    cls=CreditRecord,
    valid=credits(),
    **_single(keys.CREDIT_FIELD),
    out_of_range={
        "learner": _set(("learner",), bad_peer_ids),
        "a count": lambda d, draw: _set(
            (draw(st.sampled_from(["version", "groups_used", "contributors_known"])),), lambda _: bad_counts()
        )(d, draw),
        "too many contributors": _more_contributors,
        "contributor fingerprint": lambda d, draw: (
            d["contributors"].update({draw(bad_hex("0" * 16)): _credit_entry(0)}) or True
        ),
        "contributor count": lambda d, draw: _contributor_field(
            draw(st.sampled_from(["used", "refused", "stale", "no_signal"])), _bad_credit_count
        )(d, draw),
        "contributor name": _contributor_field("name", lambda _: bad_peer_names()),
        "negative since": _contributor_field("since", lambda _: negative_floats()),
        "too many reasons": _more_reasons,
        "reason name": lambda d, draw: _contributor_field(
            "reasons", lambda _: st.sampled_from(["", "Reward", "1x", "_x", "a" * 17, "re ward"]).map(lambda r: {r: 0})
        )(d, draw),
        "reasons over refused": _reasons_over_refused,
        "used over groups_used": _used_over_total,
        "known below listed": _known_below_listed,
        "negative created": _set(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(
        contributors={f"{i:016x}": _credit_entry(i) for i in range(OVER // 70)},
        groups_used=OVER,
        contributors_known=OVER,
    ),
)

HOLDER = Kind(
    name="holder",
    cls=HolderRecord,
    valid=holders(),
    key=lambda run, holder: keys.holders_key(run, holder.version),
    subkey=_owner,
    field=lambda holder: keys.holders_field(holder.version % HOLDER_RING),
    out_of_range={
        "peer id": _set(("peer_id",), bad_peer_ids),
        "version": _set(("version",), lambda _: bad_counts()),
        "sha256": _set(("sha256",), bad_hex),
        "size": _set(("size",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_BLOB_BYTES + 1, 2**64 - 1)),
        "negative created": _set(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(peer_id="Q" * OVER),
)

KINDS = {kind.name: kind for kind in (MANIFEST, PEER, ADAPTER, INLINE, POINTER, METRICS, ACCESS, CREDIT, HOLDER)}


# ---------------------------------------------------------------------------------------------------- value edits


def _missing(record, data, draw) -> str:
    fields = [path + (name,) for path, cls in model_paths(record).items() for name in cls.__fields__]
    path = draw(st.sampled_from(fields))
    del at(data, path[:-1])[path[-1]]
    return "/".join(map(str, path))


def _extra(record, data, draw) -> str:
    path, cls = draw(st.sampled_from(sorted(model_paths(record).items(), key=lambda item: str(item[0]))))
    name = draw(st.text(min_size=1, max_size=16).filter(lambda n: n not in cls.__fields__))
    at(data, path)[name] = draw(st.none() | st.integers(-5, 5) | st.text(max_size=4))
    return "/".join(map(str, path + (name,)))


def _wrong_type(record, data, draw) -> str:
    models = set(model_paths(record))
    free_dicts = [p for p in nodes(data) if isinstance(at(data, p), dict) and at(data, p) and p not in models]
    if free_dicts and draw(st.booleans()):  # a key of a free dict (stats, reasons, per-producer tallies)
        path = draw(st.sampled_from(free_dicts))
        container = at(data, path)
        key = draw(st.sampled_from(sorted(container)))
        container[key.encode()] = container.pop(key)
        return "/".join(map(str, path)) + " key"
    path = draw(st.sampled_from(nodes(data)))
    put(data, path, wrong_type(at(data, path), draw))
    return "/".join(map(str, path))


def _non_finite(record, data, draw) -> str:
    numbers = [p for p in nodes(data) if isinstance(at(data, p), float)]
    numbers = numbers or [p for p in nodes(data) if isinstance(at(data, p), int)]
    path = draw(st.sampled_from(numbers))
    put(data, path, draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    return "/".join(map(str, path))


def _protocol(record, data, draw) -> str:
    paths = [path for path, cls in model_paths(record).items() if "protocol_version" in cls.__fields__]
    path = draw(st.sampled_from(paths)) + ("protocol_version",)
    put(data, path, draw(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION)))
    return "/".join(map(str, path))


VALUE_MUTATIONS = {
    "missing field": _missing,
    "extra field": _extra,
    "wrong type": _wrong_type,
    "non-finite number": _non_finite,
    "other protocol version": _protocol,
}
"""name -> mutate(record, data, draw): edits ``data`` (a copy of the record's value) in place, returns where."""


def mutated_value(kind: Kind, record, name: str, draw) -> tuple[dict, str]:
    """A copy of ``record``'s value broken by the mutation ``name`` (one of ``VALUE_MUTATIONS`` or ``"over the size
    limit"``), and where it was changed."""
    data = copy.deepcopy(record.dict())
    if name == "over the size limit":
        kind.oversize(data, draw)
        return data, name
    return data, VALUE_MUTATIONS[name](record, data, draw)


def out_of_range(kind: Kind, record, label: str, draw) -> dict | None:
    """A copy of ``record``'s value with the part ``label`` names out of range, or None where this record cannot
    take that mutation (e.g. a seq gap in an entry of one group)."""
    data = copy.deepcopy(record.dict())
    return data if kind.out_of_range[label](data, draw) else None


# ---------------------------------------------------------------------------------------------------- junk

junk_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=24)
    | st.binary(max_size=32)
)
junk = st.recursive(
    junk_scalars,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=12) | st.binary(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
"""Anything hivemind's MSGPackSerializer carries: tuples too (its ext type 0x40), dict keys str or bytes."""


def near_records(cls: type) -> st.SearchStrategy[dict]:
    """Maps that look like a ``cls`` record: this protocol version and some of its field names, junk values."""
    fields = {name: junk for name in cls.__fields__ if name != "protocol_version"}
    return st.fixed_dictionaries({"protocol_version": st.just(PROTOCOL_VERSION)}, optional=fields)
