"""Every record schema of the protocol (pydantic v1 models, as hivemind's SchemaValidator needs).

Records are small, typed, signed and expiring. The same models serve three purposes: writers build them (and get
a ``ValidationError`` on a bad value at once), every peer's DHT validator checks each stored value against them
(:mod:`peer.protocol.validators`), and readers parse DHT values and blobs with them (:func:`from_dht_value`,
:func:`unpack`). Hence the rules:

* Types are strict (``StrictInt``, ``StrictFloat``, ``StrictBytes``, ...): hivemind's SchemaValidator rejects a
  value that pydantic had to convert, but it compares with ``==``, where ``3.0 == 3``; strict types close that gap.
  Floats must be ``float`` (``0.0``, not ``0``), and must be finite.
* Every field is required, optional ones included (pass ``None``): a value missing a field would not equal its
  parsed form, so the DHT would refuse it; requiring it makes the error say so.
* Unknown fields are refused. A new field is a protocol change (see :mod:`peer.protocol.version`).
* Every top-level record has ``protocol_version`` (defaulting to :data:`PROTOCOL_VERSION`) and refuses others.
* Sizes are bounded by :mod:`peer.protocol.limits`: every record stored in the DHT fits ``MAX_DHT_VALUE_BYTES``
  even with every field at its bound; a group over ``MAX_INLINE_GROUP_BYTES`` travels as a blob. A bucket entry's
  groups are packed bytes (a :class:`GroupBatch`), parsed by the learners that read them, not by every DHT node.

Token ids travel as little-endian uint32 bytes and log-probs as little-endian float32 bytes
(:mod:`peer.protocol.codec`); validators decode them with the stdlib to check lengths, finiteness and signs.
"""

import json
from typing import Any, ClassVar, Literal

import pydantic.v1 as pydantic

from peer.protocol.codec import (
    all_finite_nonpositive,
    decode_floats,
    decode_tokens,
    encode_floats,
    encode_tokens,
)
from peer.protocol.errors import RecordError
from peer.protocol.limits import (
    MAX_ANCESTORS,
    MAX_BANNED,
    MAX_BLOB_BYTES,
    MAX_CERTIFICATE_BYTES,
    MAX_COMPLETION_TOKENS,
    MAX_CREDIT,
    MAX_CREDIT_REASONS,
    MAX_CREDITED,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_BYTES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_ENTRY,
    MAX_HISTORY,
    MAX_INLINE_BATCH_BYTES,
    MAX_INLINE_GROUP_BYTES,
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
    MAX_STATS,
    MAX_TALLIED,
    RUN_ID_PATTERN,
)
from peer.protocol.serialization import from_dht_value, owned_records, pack, to_dht_value, unpack
from peer.protocol.version import PROTOCOL_VERSION, check_protocol_version

__all__ = [
    "AccessRecord",
    "AdapterRecord",
    "BlobPointer",
    "BucketEntry",
    "Completion",
    "Credit",
    "CreditRecord",
    "GroupBatch",
    "GroupRecord",
    "LearnerRecord",
    "ManifestRecord",
    "MetricsRecord",
    "ModelFile",
    "ModelSpec",
    "PeerName",
    "PeerRecord",
    "PeerTally",
    "TaskSpec",
    "decode_floats",
    "decode_tokens",
    "encode_floats",
    "encode_tokens",
    "fits_inline",
    "groups_of",
    "peer_name_problem",
    "split_batches",
    "from_dht_value",
    "owned_records",
    "pack",
    "to_dht_value",
    "unpack",
]

Sha256 = pydantic.constr(strict=True, regex=r"[0-9a-f]{64}\Z")
PeerId = pydantic.constr(strict=True, min_length=1, max_length=MAX_PEER_ID_CHARS, regex=r"[1-9A-HJ-NP-Za-km-z]+\Z")
Name = pydantic.constr(strict=True, min_length=1, max_length=MAX_NAME_CHARS)
Count = pydantic.conint(strict=True, ge=0, le=MAX_INT)
Seed = pydantic.conint(strict=True, ge=0, le=MAX_INT)
Timestamp = pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)
NonNegative = pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)
Finite = pydantic.confloat(strict=True, allow_inf_nan=False)
Fraction = pydantic.confloat(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)
BlobSize = pydantic.conint(strict=True, ge=1, le=MAX_BLOB_BYTES)
Providers = pydantic.conlist(PeerId, min_items=1, max_items=MAX_PROVIDERS)
ShortName = pydantic.constr(strict=True, min_length=1, max_length=64)
Revision = pydantic.constr(strict=True, min_length=1, max_length=MAX_NAME_CHARS)
Maddr = pydantic.constr(strict=True, min_length=1, max_length=MAX_MADDR_CHARS)


class JsonObject(pydantic.ConstrainedStr):
    """A JSON document (at most ``MAX_JSON_CHARS`` characters) whose top level is an object."""

    strict = True
    max_length = MAX_JSON_CHARS

    @classmethod
    def __get_validators__(cls):
        yield from super().__get_validators__()
        yield cls._is_object

    @classmethod
    def _is_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value, parse_constant=_refuse_constant)
        except ValueError as error:
            raise ValueError(f"not valid JSON ({error})") from None
        except RecursionError:  # ~1000 nested brackets fit the length limit and exhaust the parser's stack
            raise ValueError("nested too deeply") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object, got a JSON {type(parsed).__name__}")
        return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in protocol JSON")


def peer_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a peer's name (``--name``), in one sentence, or None when it can.

    A name is 1-32 printable characters (``str.isprintable``: no control characters such as newlines or terminal
    escapes, no invisible format characters such as right-to-left overrides), not only spaces. Others show it in
    status tables and the host's page, so it must not be able to redraw a terminal or disguise itself.
    """
    if not isinstance(name, str):
        return f"a name must be text, got {type(name).__name__}"
    if not 1 <= len(name) <= MAX_PEER_NAME_CHARS:
        return f"a name has 1 to {MAX_PEER_NAME_CHARS} characters, got {len(name)}"
    if not name.isprintable():
        bad = next(char for char in name if not char.isprintable())
        return f"a name must be printable characters only, got {bad!r} (control and format characters are refused)"
    if not name.strip():
        return "a name must not be only spaces"
    return None


class PeerName(pydantic.ConstrainedStr):
    """A peer's display name (``--name``): see :func:`peer_name_problem`."""

    strict = True
    min_length = 1
    max_length = MAX_PEER_NAME_CHARS

    @classmethod
    def __get_validators__(cls):
        yield from super().__get_validators__()
        yield cls._displayable

    @classmethod
    def _displayable(cls, value: str) -> str:
        problem = peer_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class _Model(pydantic.BaseModel):
    """Frozen, closed (unknown fields refused), every field validated."""

    class Config:
        extra = pydantic.Extra.forbid
        frozen = True


class _Record(_Model):
    """A top-level record: it carries the protocol version and accepts only this peer's."""

    protocol_version: pydantic.StrictInt = PROTOCOL_VERSION

    @pydantic.validator("protocol_version")
    def _same_protocol(cls, value: int) -> int:
        check_protocol_version(value, cls.__name__)
        return value


def _unique(values: list[Any], what: str) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{what} must not repeat")


def _check_bounded_dict(value: dict[str, Any], limit: int) -> dict[str, Any]:
    if len(value) > limit:
        raise ValueError(f"at most {limit} entries, got {len(value)}")
    return value


# ---------------------------------------------------------------------------------------------------- manifest


class ModelFile(_Model):
    """One file of the base model: where it goes (relative to the model folder), its content hash and size."""

    path: pydantic.constr(strict=True, min_length=1, max_length=MAX_PATH_CHARS)
    sha256: Sha256
    size: pydantic.conint(strict=True, ge=0, le=MAX_BLOB_BYTES)

    @pydantic.validator("path")
    def _relative(cls, value: str) -> str:
        if value.startswith("/") or "\\" in value or any(ord(char) < 32 or char == "\x7f" for char in value):
            raise ValueError("must be a relative POSIX path without backslashes or control characters")
        if any(part in ("", ".", "..") for part in value.split("/")):
            raise ValueError("must not contain '.', '..' or empty components")
        return value


class ModelSpec(_Model):
    """The base model every peer runs: hub name (or ``bundled``), revision, quantization, and its files."""

    name: pydantic.constr(strict=True, min_length=1, max_length=256)
    revision: Revision | None = pydantic.Field(...)
    quantization: Literal["nf4", "int8", "none"]
    files: pydantic.conlist(ModelFile, min_items=1, max_items=MAX_MODEL_FILES)

    @pydantic.validator("files")
    def _distinct_paths(cls, value: list[ModelFile]) -> list[ModelFile]:
        _unique([item.path for item in value], "file paths")
        return value


class TaskSpec(_Model):
    """The verifiable task: its registered name and its configuration as a JSON object."""

    name: Name
    config_json: JsonObject

    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)


class ManifestRecord(_Record):
    """What a run is, published by the coordinator: the base model, task, hyperparameters and adapter v0.

    ``grpo_json`` holds ``{"sampling": SamplingConfig, "loss": LossConfig, "staleness": StalenessConfig}`` as
    dicts and ``lora_json`` the LoRA shape; each config's own ``from_dict`` reads them back strictly. Readers take
    the manifest under the subkey of the coordinator's known public key and check ``run_id`` is the run they join.
    """

    run_id: pydantic.constr(strict=True, regex=RUN_ID_PATTERN.pattern)
    created: Timestamp
    access: Literal["public", "private"]
    seed: Seed
    model: ModelSpec
    task: TaskSpec
    grpo_json: JsonObject
    lora_json: JsonObject
    adapter0_sha256: Sha256
    coordinator: PeerId

    def grpo(self) -> dict[str, Any]:
        return json.loads(self.grpo_json)

    def lora(self) -> dict[str, Any]:
        return json.loads(self.lora_json)


# ---------------------------------------------------------------------------------------------------- peers


class PeerRecord(_Record):
    """A heartbeat: who a peer is, what it holds, how fast it goes, how to reach it. Refreshed, short-lived."""

    peer_id: PeerId
    role: Literal["coordinator", "rollout", "learner", "observer"]
    adapter_version: pydantic.conint(strict=True, ge=-1, le=MAX_INT)
    throughput: NonNegative
    hardware: pydantic.constr(strict=True, max_length=MAX_NAME_CHARS)
    reachable: pydantic.StrictBool
    maddrs: pydantic.conlist(Maddr, max_items=MAX_MADDRS)
    started: Timestamp
    last_seen: Timestamp
    state: Literal["starting", "running", "leaving"]
    stats: dict[ShortName, Finite]
    name: PeerName | None = None  # the volunteer's --name (protocol 5); None: it gave none

    _stats_bounded = pydantic.validator("stats", allow_reuse=True)(lambda v: _check_bounded_dict(v, MAX_STATS))

    @pydantic.root_validator(skip_on_failure=True)
    def _seen_after_start(cls, values: dict[str, Any]) -> dict[str, Any]:
        if values["last_seen"] < values["started"]:
            raise ValueError("last_seen must not be before started")
        return values


# ---------------------------------------------------------------------------------------------------- adapters


class Demand(_Model):
    """What the announcing learner consumes, so rollout peers make about that much (docs/rollout.md, "Pacing").

    ``groups_per_second``: verified groups it used or counted as without signal, per second, over its recent
    updates; ``waiting``: verified groups in its pool when it announced (made, not yet used); ``contributors``: the
    producers with a verified group in its recent window. Only an admitted learner's announcement counts, so only
    the run's learners can slow a rollout peer down.
    """

    groups_per_second: pydantic.confloat(strict=True, ge=0.0, le=1e6, allow_inf_nan=False)
    waiting: Count
    contributors: pydantic.conint(strict=True, ge=0, le=1_000_000)


class AdapterRecord(_Record):
    """A learner's announcement of the newest adapter version it holds and serves.

    ``ancestors`` are the sha256 of the versions before it, newest first (``ancestors[0]`` is the parent), as far
    back as the learner remembers (at most ``MAX_ANCESTORS``): a follower holding an older version checks that the
    new one descends from it even when it skipped versions in between.
    """

    version: Count
    sha256: Sha256
    parent_sha256: pydantic.constr(strict=True, regex=r"([0-9a-f]{64})?\Z")
    ancestors: pydantic.conlist(Sha256, max_items=MAX_ANCESTORS)
    size: BlobSize
    providers: Providers
    created: Timestamp
    learner: PeerId
    demand: Demand | None = None  # None: not yet measured (its first versions, or a learner that has not led)

    _distinct_providers = pydantic.validator("providers", allow_reuse=True)(lambda v: _unique(v, "providers") or v)

    @pydantic.root_validator(skip_on_failure=True)
    def _lineage(cls, values: dict[str, Any]) -> dict[str, Any]:
        if (values["version"] == 0) != (values["parent_sha256"] == ""):
            raise ValueError("parent_sha256 must be empty for version 0 and a sha256 for every later version")
        if values["parent_sha256"] == values["sha256"]:
            raise ValueError("an adapter cannot be its own parent")
        ancestors = values["ancestors"]
        if len(ancestors) > values["version"] or (ancestors and ancestors[0] != values["parent_sha256"]):
            raise ValueError("ancestors must start with the parent and be at most as many as the versions before")
        return values


class HolderRecord(_Record):
    """A peer that fetched adapter ``version`` (``sha256``, ``size`` bytes), verified it, and serves it: a fetcher
    asks such holders before the announcing learners (docs/blobs.md, "Spreading adapters"). A claim anyone can make:
    a fetcher checks the bytes' sha256 as from any provider, and tries a bounded number of holders."""

    peer_id: PeerId
    version: Count
    sha256: Sha256
    size: BlobSize
    created: Timestamp


# ---------------------------------------------------------------------------------------------------- groups


class Completion(_Model):
    """One sampled completion: its token ids and the behaviour log-prob of each token, as 4-byte little-endian."""

    token_ids: pydantic.conbytes(strict=True, min_length=4, max_length=4 * MAX_COMPLETION_TOKENS)
    logprobs: pydantic.conbytes(strict=True, min_length=4, max_length=4 * MAX_COMPLETION_TOKENS)

    @pydantic.validator("token_ids")
    def _whole_tokens(cls, value: bytes) -> bytes:
        decode_tokens(value)
        return value

    @pydantic.validator("logprobs")
    def _logprobs(cls, value: bytes) -> bytes:
        if not all_finite_nonpositive(value):
            raise ValueError("log-probs must all be finite and <= 0")
        return value

    @pydantic.root_validator(skip_on_failure=True)
    def _aligned(cls, values: dict[str, Any]) -> dict[str, Any]:
        if len(values["token_ids"]) != len(values["logprobs"]):
            raise ValueError(f"{len(values['token_ids']) // 4} token ids but {len(values['logprobs']) // 4} log-probs")
        return values

    @classmethod
    def of(cls, token_ids: list[int], logprobs: list[float]) -> "Completion":
        """Build from plain lists."""
        return cls(token_ids=encode_tokens(token_ids), logprobs=encode_floats(logprobs))

    def tokens(self) -> list[int]:
        return decode_tokens(self.token_ids)

    def behaviour_logprobs(self) -> list[float]:
        return decode_floats(self.logprobs)


class GroupRecord(_Record):
    """A GRPO group: G completions of one prompt, sampled with adapter ``version``, scored, unmodified since.

    ``(task_seed, task_index)`` names the example so a learner regenerates the prompt and its answer; ``rewards``
    are the producer's claim (learners recompute them). ``(producer, version, seq)`` identifies the group.
    """

    max_packed_bytes: ClassVar[int] = MAX_GROUP_BYTES
    max_containers: ClassVar[int] = 2 * MAX_GROUP_SIZE + 8  # the record, completions and rewards, each completion

    version: Count
    adapter_sha256: Sha256
    producer: PeerId
    seq: Count
    task_seed: Seed
    task_index: Count
    prompt_ids: pydantic.conbytes(strict=True, min_length=4, max_length=4 * MAX_PROMPT_TOKENS)
    completions: pydantic.conlist(Completion, min_items=2, max_items=MAX_GROUP_SIZE)
    rewards: pydantic.conlist(Fraction, min_items=2, max_items=MAX_GROUP_SIZE)
    created: Timestamp

    @pydantic.validator("prompt_ids")
    def _whole_tokens(cls, value: bytes) -> bytes:
        decode_tokens(value)
        return value

    @pydantic.root_validator(skip_on_failure=True)
    def _one_reward_each(cls, values: dict[str, Any]) -> dict[str, Any]:
        if len(values["rewards"]) != len(values["completions"]):
            raise ValueError(f"{len(values['completions'])} completions but {len(values['rewards'])} rewards")
        return values

    def prompt_tokens(self) -> list[int]:
        return decode_tokens(self.prompt_ids)


class GroupBatch(_Record):
    """Groups of one version with consecutive seqs, as one bucket entry holds them (and a pointer's blob packs)."""

    max_packed_bytes: ClassVar[int] = MAX_GROUP_BATCH_BYTES
    max_containers: ClassVar[int] = MAX_GROUPS_PER_ENTRY * (2 * MAX_GROUP_SIZE + 8) + 8

    groups: pydantic.conlist(GroupRecord, min_items=1, max_items=MAX_GROUPS_PER_ENTRY)

    @pydantic.validator("groups")
    def _consecutive(cls, value: list[GroupRecord]) -> list[GroupRecord]:
        _check_consecutive(value)
        return value


def _check_consecutive(groups: list[GroupRecord]) -> None:
    first = groups[0]
    for i, group in enumerate(groups):
        if (group.version, group.seq) != (first.version, first.seq + i):
            raise ValueError(
                f"groups of one entry must share a version and have consecutive seqs: group {i} is "
                f"{group.version}.{group.seq}, expected {first.version}.{first.seq + i}"
            )


class BlobPointer(_Record):
    """Where to fetch a content-addressed blob: its sha256, size, who serves it, and what it is."""

    sha256: Sha256
    size: BlobSize
    providers: Providers
    kind: Literal["group", "adapter", "model-file"]

    _distinct_providers = pydantic.validator("providers", allow_reuse=True)(lambda v: _unique(v, "providers") or v)

    @pydantic.root_validator(skip_on_failure=True)
    def _group_size(cls, values: dict[str, Any]) -> dict[str, Any]:
        if values["kind"] == "group" and values["size"] > MAX_GROUP_BATCH_BYTES:
            raise ValueError(f"a group batch blob is at most {MAX_GROUP_BATCH_BYTES} bytes, got {values['size']}")
        return values


def fits_inline(groups: GroupRecord | list[GroupRecord]) -> bool:
    """Whether ``groups`` are small enough to travel inside one bucket entry (else: a blob and a pointer)."""
    groups = [groups] if isinstance(groups, GroupRecord) else groups
    return sum(len(pack(g)) for g in groups) <= MAX_INLINE_GROUP_BYTES


def split_batches(groups: list[GroupRecord], budget: int = MAX_INLINE_GROUP_BYTES) -> list[list[GroupRecord]]:
    """Split groups (sorted by version, seq) into runs of one version and consecutive seqs, each at most
    ``MAX_GROUPS_PER_ENTRY`` groups and — where the groups allow — ``budget`` packed bytes."""
    out: list[list[GroupRecord]] = []
    size = 0
    for group in sorted(groups, key=lambda g: (g.version, g.seq)):
        n = len(pack(group))
        last = out[-1][-1] if out else None
        if (
            last is None
            or (group.version, group.seq) != (last.version, last.seq + 1)
            or len(out[-1]) >= MAX_GROUPS_PER_ENTRY
            or size + n > budget
        ):
            out.append([group])
            size = n
        else:
            out[-1].append(group)
            size += n
    return out


InlineBatch = pydantic.conbytes(strict=True, min_length=1, max_length=MAX_INLINE_BATCH_BYTES)


class BucketEntry(_Record):
    """One entry of a bucket: ``count`` groups of ``version`` with seqs ``seq .. seq + count - 1``, as their packed
    :class:`GroupBatch` inline, or a pointer to that batch as a blob; never both.

    ``version``, ``seq`` and ``count`` repeat the groups' (and the subkey's, which the DHT validator checks) so that
    an entry can be filtered, counted and deduplicated before its groups are parsed or fetched. The groups are
    bytes to the DHT either way: only a learner parses them (:func:`groups_of`), once, where it checks them anyway;
    every DHT node that stores or is pushed the entry checks its size, its fields and its signer, not each group's
    schema (a GroupRecord parse of a demo batch of 8 took ~2 ms, on every replica and every learner's node).
    """

    version: Count
    seq: Count
    count: pydantic.conint(strict=True, ge=1, le=MAX_GROUPS_PER_ENTRY)
    inline: InlineBatch | None = pydantic.Field(...)
    pointer: BlobPointer | None = pydantic.Field(...)

    @pydantic.root_validator(skip_on_failure=True)
    def _one_payload(cls, values: dict[str, Any]) -> dict[str, Any]:
        inline, pointer = values["inline"], values["pointer"]
        if (inline is None) == (pointer is None):
            raise ValueError("a bucket entry holds exactly one of inline or pointer")
        if pointer is not None and pointer.kind != "group":
            raise ValueError(f"a bucket entry must point to a group blob, got kind {pointer.kind!r}")
        return values

    @classmethod
    def of_groups(cls, groups: list[GroupRecord]) -> "BucketEntry":
        """The entry holding ``groups`` inline (one version, consecutive seqs; check :func:`fits_inline` first)."""
        data = pack(GroupBatch(groups=list(groups)))
        if len(data) > MAX_INLINE_BATCH_BYTES:
            raise ValueError(
                f"the inline groups are {len(data)} bytes packed, over {MAX_INLINE_BATCH_BYTES}; "
                "publish them as a blob"
            )
        return cls(version=groups[0].version, seq=groups[0].seq, count=len(groups), inline=data, pointer=None)

    @classmethod
    def of_group(cls, group: GroupRecord) -> "BucketEntry":
        return cls.of_groups([group])

    @classmethod
    def of_pointer(cls, pointer: BlobPointer, version: int, seq: int, count: int = 1) -> "BucketEntry":
        """The entry pointing to the blob of the ``count`` groups from ``version.seq`` (a packed GroupBatch)."""
        return cls(version=version, seq=seq, count=count, inline=None, pointer=pointer)


def groups_of(data: bytes, version: int, seq: int, count: int) -> list[GroupRecord]:
    """The groups of a packed :class:`GroupBatch` (an entry's ``inline`` bytes, or its pointer's blob), checked to be
    the ``count`` groups from ``version.seq`` that the entry says; :class:`RecordError` if they are not."""
    batch = unpack(GroupBatch, data)
    first = batch.groups[0]
    if (first.version, first.seq, len(batch.groups)) != (version, seq, count):
        raise RecordError(
            f"the groups are {first.version}.{first.seq}+{len(batch.groups)}, "
            f"but their entry says {version}.{seq}+{count}"
        )
    return batch.groups


# ---------------------------------------------------------------------------------------------------- access


class AccessRecord(_Record):
    """A private run's revoked invites, signed by the run's invite issuer (see :mod:`peer.network.access`)."""

    issuer: pydantic.constr(strict=True, regex=r"[0-9a-f]{64}\Z")  # the issuer's Ed25519 public key, hex
    revoked: pydantic.conlist(pydantic.constr(strict=True, regex=r"[0-9a-f]{16}\Z"), max_items=MAX_REVOKED)
    created: Timestamp
    signature: pydantic.constr(strict=True, regex=r"[0-9a-f]{128}\Z")  # Ed25519 over the revocation payload


class LearnerRecord(_Record):
    """A learner's admission to the run: the certificate the coordinator signed for a learner credential, and
    the credential holder's signature binding it to this record's signer and to ``peer_id`` (its libp2p id).

    Only signers with a valid admission write the lineage (adapter announcements) and take part in the learners'
    team; see :mod:`peer.network.admission`, which builds and checks both byte strings.
    """

    peer_id: PeerId
    certificate: pydantic.conbytes(strict=True, min_length=1, max_length=MAX_CERTIFICATE_BYTES)
    binding: pydantic.conbytes(strict=True, min_length=64, max_length=64)  # Ed25519
    created: Timestamp


# ---------------------------------------------------------------------------------------------------- metrics


FINGERPRINT_PATTERN = r"[0-9a-f]{16}\Z"  # key_fingerprint: 16 hex of a signing key
Fingerprint = pydantic.constr(strict=True, regex=FINGERPRINT_PATTERN)


class PeerTally(_Model):
    """What one learner did with one producer's groups: used in an update, or refused by verification."""

    accepted: Count
    rejected: Count


class MetricsRecord(_Record):
    """A learner's running summary, for status: what it accepted, dropped and rejected, and how it is doing."""

    learner: PeerId
    version: Count
    groups_accepted: Count
    groups_dropped_stale: Count
    groups_rejected: dict[ShortName, Count]
    staleness_mean: NonNegative
    staleness_max: Count
    reward_mean: Fraction
    exact_match: Fraction | None = pydantic.Field(...)
    step_seconds: NonNegative
    banned: pydantic.conlist(Fingerprint, max_items=MAX_BANNED)
    per_peer: dict[Fingerprint, PeerTally] = pydantic.Field(default_factory=dict)
    reward_history: pydantic.conlist(Fraction, max_items=MAX_HISTORY) = pydantic.Field(default_factory=list)
    created: Timestamp

    _peers_bounded = pydantic.validator("per_peer", allow_reuse=True)(lambda v: _check_bounded_dict(v, MAX_TALLIED))
    _reasons_bounded = pydantic.validator("groups_rejected", allow_reuse=True)(
        lambda v: _check_bounded_dict(v, MAX_REASONS)
    )


# ---------------------------------------------------------------------------------------------------- credit


CreditCount = pydantic.conint(strict=True, ge=0, le=MAX_CREDIT)
REASON_PATTERN = r"[a-z][a-z_]{0,15}\Z"  # a refusal reason of the intake
Reason = pydantic.constr(strict=True, regex=REASON_PATTERN)


class Credit(_Model):
    """One contributor's credit over the whole run, as one learner counts it (see :class:`CreditRecord`).

    ``used``: its groups that went into an update; ``refused``: its groups the intake refused, all reasons together,
    and ``reasons`` the largest of them by name (at most ``MAX_CREDIT_REASONS``, so they may add up to less);
    ``stale``: its groups too old to use when read or while they waited; ``no_signal``: verified groups whose rewards
    were all equal (nothing to learn from them); ``since``: when the learners first counted one of its groups;
    ``name``: its latest ``--name`` the learner saw in its heartbeat.
    """

    name: PeerName | None = pydantic.Field(...)
    used: CreditCount
    refused: CreditCount
    reasons: dict[Reason, CreditCount]
    stale: CreditCount
    no_signal: CreditCount
    since: Timestamp

    _reasons_bounded = pydantic.validator("reasons", allow_reuse=True)(
        lambda v: _check_bounded_dict(v, MAX_CREDIT_REASONS)
    )

    @pydantic.root_validator(skip_on_failure=True)
    def _reasons_within_refused(cls, values: dict[str, Any]) -> dict[str, Any]:
        listed = sum(values["reasons"].values())
        if listed > values["refused"]:
            raise ValueError(f"the reasons add up to {listed}, more than the {values['refused']} groups refused")
        return values


class CreditRecord(_Record):
    """A learner's credit table: per contributor (the key fingerprint that signs its groups), what the run did with
    its groups over the whole run — its top ``MAX_CREDITED`` by groups used. Counts only grow (a learner keeps them
    in its checkpoint and journal, and merges the admitted learners' records by maximum when it starts or takes a
    team over); readers take records of admitted learners only. ``groups_used`` counts every contributor's, the
    ones not listed too; ``contributors_known`` how many the learner counts (it lists at most ``MAX_CREDITED``).
    """

    learner: PeerId
    version: Count
    groups_used: Count
    contributors_known: Count
    contributors: dict[Fingerprint, Credit]
    created: Timestamp

    _contributors_bounded = pydantic.validator("contributors", allow_reuse=True)(
        lambda v: _check_bounded_dict(v, MAX_CREDITED)
    )

    @pydantic.root_validator(skip_on_failure=True)
    def _totals(cls, values: dict[str, Any]) -> dict[str, Any]:
        contributors = values["contributors"]
        used = sum(c.used for c in contributors.values())
        if used > values["groups_used"]:
            raise ValueError(f"its contributors used {used} groups, more than its groups_used {values['groups_used']}")
        if len(contributors) > values["contributors_known"]:
            raise ValueError(f"it lists {len(contributors)} contributors but knows {values['contributors_known']}")
        return values
