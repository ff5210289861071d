"""The DHT record validators every peer of a run installs, so that bad records are refused at store time.

:func:`make_validators` returns hivemind's two validators, configured for a run:

1. ``RSASignatureValidator(private_key)`` — signs what this peer stores under its own ``[owner:KEY]`` subkeys and
   verifies, on every store and every fetched record, that a record under an owner subkey is signed by that key.
   hivemind signs ``(key id, subkey, value, expiration)``: a record cannot be altered, moved to another subkey or
   given a longer life by anyone else. It runs first (priority 10) and strips the signature before the next. It
   remembers the signatures it accepted, so a record fetched again is not verified again.
2. ``SchemaValidator(RunSchema, allow_extra_keys=False, prefix=run_id)`` — the run's keys
   (:mod:`peer.protocol.keys`) must hold dictionary values whose subkeys are owner-signed and whose values match
   their record schema (:mod:`peer.protocol.records`) without type conversion; any other key is refused. It
   remembers what it accepted, so a record fetched again is not parsed again. Both answer False, never raise, on
   anything a remote peer can send (a list subkey made hivemind's raise "unhashable type").

On top of the schemas, bucket slots check that an entry's version maps to the slot (``version % BUCKET_RING``) and
that the subkey's ``<version>.<seq>`` equals the entry's; holder slots that an entry's version maps to the slot
(``version % HOLDER_RING``). Single-entry keys (manifest, peers, core peers, adapter, metrics, access, learners,
credit, holders) take exactly ``[owner:KEY]`` as subkey. A value stored without a subkey under a run key is refused
too.

What the validators cannot check, readers must: that a heartbeat's ``peer_id`` is the signer's (the DHT's RSA key
is not the libp2p identity), that a manifest comes from the coordinator's key and names this run, time-dependent
facts (a validator must give the same answer on every peer at every moment: hivemind drops a whole dictionary
fetched from a peer if any one of its entries fails validation).

hivemind copies validators to the DHT's process (``DHT.add_validators`` pickles them), so everything here is a
module-level name. This module imports hivemind (and hivemind imports torch); the rest of ``peer.protocol`` does not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from peer.protocol.keys import (
    ACCESS_FIELD,
    ADAPTER_FIELD,
    BUCKET_FIELD_PREFIX,
    CORE_PEERS_FIELD,
    CREDIT_FIELD,
    HOLDERS_FIELD_PREFIX,
    LEARNERS_FIELD,
    MANIFEST_FIELD,
    METRICS_FIELD,
    PEERS_FIELD,
    bucket_field,
    check_run_id,
    holders_field,
    parse_group_subkey,
    parse_owner_subkey,
)
from peer.protocol.limits import BUCKET_RING, HOLDER_RING
from peer.protocol.records import (
    AccessRecord,
    AdapterRecord,
    BucketEntry,
    CreditRecord,
    HolderRecord,
    LearnerRecord,
    ManifestRecord,
    MetricsRecord,
    PeerRecord,
)

__all__ = ["GroupSubkey", "OwnerSubkey", "RunSchema", "make_validators"]


def _strict_bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"a subkey must be bytes, got {type(value).__name__}")
    return value


class _ShapedSubkey(BytesWithPublicKey):
    """hivemind's ``BytesWithPublicKey`` plus: strictly bytes, and of the shape the subclass's ``_parse`` accepts."""

    @classmethod
    def __get_validators__(cls):
        yield _strict_bytes
        yield from super().__get_validators__()
        yield cls._shape

    @classmethod
    def _shape(cls, value: bytes) -> bytes:
        cls._parse(value)
        return value


class OwnerSubkey(_ShapedSubkey):
    """A subkey that is exactly ``[owner:ssh-rsa ...]`` (a strict case of hivemind's ``BytesWithPublicKey``)."""

    _parse = staticmethod(parse_owner_subkey)


class GroupSubkey(_ShapedSubkey):
    """A bucket subkey ``[owner:ssh-rsa ...]<version>.<seq>`` (a strict case of ``BytesWithPublicKey``)."""

    _parse = staticmethod(parse_group_subkey)


def _check_bucket(cls, value: dict[bytes, BucketEntry] | None, field: Any) -> dict[bytes, BucketEntry] | None:
    """Each entry of slot ``bucket_<slot>`` has ``version % BUCKET_RING == slot`` and the subkey's version/seq."""
    if value is None:
        return value
    slot = int(field.name.removeprefix(BUCKET_FIELD_PREFIX))
    for subkey, entry in value.items():
        _, version, seq = parse_group_subkey(subkey)
        if entry.version % BUCKET_RING != slot:
            raise ValueError(f"an entry of version {entry.version} belongs in slot {entry.version % BUCKET_RING}")
        if (version, seq) != (entry.version, entry.seq):
            raise ValueError(f"subkey says {version}.{seq} but the entry is {entry.version}.{entry.seq}")
    return value


def _check_holders(cls, value: dict[bytes, HolderRecord] | None, field: Any) -> dict[bytes, HolderRecord] | None:
    """Each entry of slot ``holders_<slot>`` is of a version with ``version % HOLDER_RING == slot``."""
    if value is None:
        return value
    slot = int(field.name.removeprefix(HOLDERS_FIELD_PREFIX))
    for entry in value.values():
        if entry.version % HOLDER_RING != slot:
            raise ValueError(f"a holder of version {entry.version} belongs in slot {entry.version % HOLDER_RING}")
    return value


def _digest(*fields: bytes) -> bytes:
    """A digest of the fields that no other split of the same bytes into fields shares (each is length-prefixed)."""
    return hashlib.sha256(b"".join(len(f).to_bytes(8, "big") + f for f in fields)).digest()


class _TotalRSASignatureValidator(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` that refuses, instead of raising on, an ``[owner:...]`` marker around
    something that is not an RSA public key (``ValueError: Invalid line format``): a remote peer can send one.

    It remembers the records whose signature it accepted (a digest of key, subkey, signed value and expiration: all
    the signature covers), as :class:`_RememberingSchemaValidator` does their schemas: hivemind verifies every
    record of every dictionary it fetches, on every get, and a learner reads the same buckets again every second.
    The answer for the same bytes cannot change; refusals are not remembered."""

    REMEMBER = 16384  # digests (32 bytes each)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accepted: OrderedDict[bytes, None] = OrderedDict()

    def validate(self, record) -> bool:
        digest = _digest(record.key, record.subkey, record.value, repr(record.expiration_time).encode())
        accepted = self._accepted
        if digest in accepted:
            accepted.move_to_end(digest)
            return True
        try:
            if not super().validate(record):
                return False
        except Exception:  # noqa: BLE001 - a validator answers, never raises
            return False
        accepted[digest] = None
        if len(accepted) > self.REMEMBER:
            accepted.popitem(last=False)
        return True


class _RunSchemaConfig(pydantic.BaseConfig):
    # An own config class: SchemaValidator sets `schema.Config.extra`, which without one is pydantic's global default.
    extra = pydantic.Extra.forbid


_BUCKET_FIELDS = tuple(bucket_field(slot) for slot in range(BUCKET_RING))
_HOLDER_FIELDS = tuple(holders_field(slot) for slot in range(HOLDER_RING))

RunSchema = pydantic.create_model(
    "RunSchema",
    __config__=_RunSchemaConfig,
    __module__=__name__,
    __validators__={
        "_check_bucket": pydantic.validator(*_BUCKET_FIELDS, allow_reuse=True)(_check_bucket),
        "_check_holders": pydantic.validator(*_HOLDER_FIELDS, allow_reuse=True)(_check_holders),
    },
    **{
        MANIFEST_FIELD: (dict[OwnerSubkey, ManifestRecord] | None, None),
        PEERS_FIELD: (dict[OwnerSubkey, PeerRecord] | None, None),
        CORE_PEERS_FIELD: (dict[OwnerSubkey, PeerRecord] | None, None),
        ADAPTER_FIELD: (dict[OwnerSubkey, AdapterRecord] | None, None),
        METRICS_FIELD: (dict[OwnerSubkey, MetricsRecord] | None, None),
        ACCESS_FIELD: (dict[OwnerSubkey, AccessRecord] | None, None),
        LEARNERS_FIELD: (dict[OwnerSubkey, LearnerRecord] | None, None),
        CREDIT_FIELD: (dict[OwnerSubkey, CreditRecord] | None, None),
        **{name: (dict[GroupSubkey, BucketEntry] | None, None) for name in _BUCKET_FIELDS},
        **{name: (dict[OwnerSubkey, HolderRecord] | None, None) for name in _HOLDER_FIELDS},
    },
)
RunSchema.__doc__ = "Every key of a run (field ``f`` is key ``{run_id}_f``) and the dictionary value it holds."


class _RememberingSchemaValidator(SchemaValidator):
    """A :class:`SchemaValidator` that remembers the records it accepted (by a digest of key, subkey and value).

    hivemind validates every record of every dictionary it fetches, on every get: a learner or rollout peer that
    polls a bucket re-parsed every group of it with pydantic each time, and that was about half the CPU of a
    local swarm (docs/demo.md). The answer for the same bytes cannot change (schemas are only ever added by a
    merge, which can widen what is accepted, never narrow it), so an accepted record is not parsed again; refusals
    are not remembered.
    """

    REMEMBER = 16384  # digests (32 bytes each)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accepted: OrderedDict[bytes, None] = OrderedDict()

    def validate(self, record) -> bool:
        digest = _digest(record.key, record.subkey, record.value)
        accepted = self._accepted
        if digest in accepted:
            accepted.move_to_end(digest)
            return True
        try:
            if not super().validate(record):
                return False
        except Exception:  # noqa: BLE001 - e.g. a list subkey: "unhashable"; a validator answers, never raises
            return False
        accepted[digest] = None
        if len(accepted) > self.REMEMBER:
            accepted.popitem(last=False)
        return True


def make_validators(
    run_id: str, private_key: RSAPrivateKey, *, allow_extra_keys: bool = False
) -> list[RecordValidatorBase]:
    """The record validators for run ``run_id``: pass them to ``hivemind.DHT(record_validators=...)``.

    ``private_key`` is this peer's DHT signing key; its public key is the owner in every subkey it writes. With the
    default ``allow_extra_keys=False`` this peer refuses to store any key outside the run's schema. A DHT shared
    with ``hivemind.Optimizer`` needs ``True``: the averager's matchmaking keys are not in the schema (and the
    Optimizer's own progress SchemaValidator, which allows extra keys, turns it on when merged with this one).
    """
    check_run_id(run_id)
    if not isinstance(private_key, RSAPrivateKey):
        raise TypeError(f"private_key must be a hivemind RSAPrivateKey, got {type(private_key).__name__}.")
    return [
        _TotalRSASignatureValidator(private_key),
        _RememberingSchemaValidator(RunSchema, allow_extra_keys=allow_extra_keys, prefix=run_id),
    ]
