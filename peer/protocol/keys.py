"""Every DHT key and subkey of a run, built here and nowhere else.

Keys
----
A run ``R`` uses these keys (all hold *dictionary* values: subkey → value):

=====================  ==========================================  ============================
key                    subkey                                      value
=====================  ==========================================  ============================
``R_manifest``         :func:`owner_subkey` of the coordinator     ``ManifestRecord``
``R_peers``            :func:`owner_subkey` of each peer           ``PeerRecord`` (heartbeat)
``R_core_peers``       :func:`owner_subkey` of learners, the host  ``PeerRecord`` (their heartbeat again)
``R_adapter``          :func:`owner_subkey` of each learner        ``AdapterRecord``
``R_metrics``          :func:`owner_subkey` of each learner        ``MetricsRecord``
``R_access``           :func:`owner_subkey` of the coordinator     ``AccessRecord`` (private runs)
``R_learners``         :func:`owner_subkey` of each learner        ``LearnerRecord`` (its admission)
``R_credit``           :func:`owner_subkey` of each learner        ``CreditRecord`` (credit per contributor)
``R_bucket_<slot>``    :func:`group_subkey` (owner, version, seq)  ``BucketEntry``
``R_holders_<slot>``   :func:`owner_subkey` of each holder         ``HolderRecord`` (serves version v)
=====================  ==========================================  ============================

The names follow hivemind's ``SchemaValidator(schema, prefix=R)``, which maps a schema field ``f`` to the raw key
``R + "_" + f``: a schema built with ``prefix=run_id`` (see :mod:`peer.protocol.validators`) covers exactly these
keys, and with ``allow_extra_keys=False`` nothing else can be stored under them.

The bucket ring
---------------
Groups sampled with adapter version ``v`` go to ``bucket_key(R, v)`` = ``R_bucket_{v % BUCKET_RING}``. A ring,
not one key per version, because hivemind's SchemaValidator only knows a fixed set of key names (it matches the
hash of each field's key). Reusing a slot is safe: bucket entries expire after the staleness window (a few
versions' worth of time), so an entry is long gone before its slot comes round again ``BUCKET_RING`` versions
later. The version inside each entry is authoritative — the validator checks it maps to the slot and equals the
subkey's — and readers filter by it.

Holders of adapter version ``v`` (peers that fetched and verified it and serve it, besides the learners that
announced it) say so under ``holders_key(R, v)`` = ``R_holders_{v % HOLDER_RING}``, one entry per holder (its owner
subkey: a peer's entry in a slot is replaced when it holds version ``v + HOLDER_RING``). Entries live
seconds (``peer.network.holders``), so a slot holds the few newest versions that map to it.

Subkeys and ownership
---------------------
hivemind's ``RSASignatureValidator`` protects any record whose *subkey* contains ``[owner:<RSA public key>]``:
only the holder of that key can sign it, and every peer checks the signature on store. (It cannot protect a
*key*: the DHT only ever sees a key's hash.) Every subkey here starts with the writer's owner marker, so a peer
can only write its own entries. ``owner_public_key`` is the serialized public key,
``private_key.get_public_key().to_bytes()`` (``b"ssh-rsa AAAA..."``), not the bracketed marker.
"""

from __future__ import annotations

import hashlib
import re

from peer.protocol.errors import KeyFormatError
from peer.protocol.limits import BUCKET_RING, HOLDER_RING, MAX_INT, MAX_OWNER_KEY_BYTES, MAX_RUN_ID_LEN, RUN_ID_PATTERN

MANIFEST_FIELD = "manifest"
PEERS_FIELD = "peers"
CORE_PEERS_FIELD = "core_peers"
ADAPTER_FIELD = "adapter"
METRICS_FIELD = "metrics"
ACCESS_FIELD = "access"
LEARNERS_FIELD = "learners"
CREDIT_FIELD = "credit"
BUCKET_FIELD_PREFIX = "bucket_"
HOLDERS_FIELD_PREFIX = "holders_"

OWNER_PREFIX = b"[owner:"
OWNER_SUFFIX = b"]"

_OWNER_KEY = rb"ssh-rsa [A-Za-z0-9+/]+={0,2}"
_NUMBER = rb"0|[1-9][0-9]{0,18}"
OWNER_SUBKEY_RE = re.compile(rb"\[owner:(" + _OWNER_KEY + rb")\]\Z")
GROUP_SUBKEY_RE = re.compile(rb"\[owner:(" + _OWNER_KEY + rb")\](" + _NUMBER + rb")\.(" + _NUMBER + rb")\Z")


FINGERPRINT_CHARS = 16


def key_fingerprint(public_key: bytes) -> str:
    """A short, pasteable name of a signing key (``owner_public_key``): the first 16 hex digits of its sha256."""
    return hashlib.sha256(public_key).hexdigest()[:FINGERPRINT_CHARS]


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run id, else raise :class:`KeyFormatError` saying what is allowed."""
    if not isinstance(run_id, str) or RUN_ID_PATTERN.match(run_id) is None:
        raise KeyFormatError(
            f"invalid run id {run_id!r}: use 1 to {MAX_RUN_ID_LEN} characters from letters, digits, '_' and '-'."
        )
    return run_id


def bucket_field(slot: int) -> str:
    """The schema field name of bucket slot ``slot`` (``bucket_<slot>``)."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < BUCKET_RING:
        raise KeyFormatError(f"bucket slot must be an int in [0, {BUCKET_RING}), got {slot!r}.")
    return f"{BUCKET_FIELD_PREFIX}{slot}"


def holders_field(slot: int) -> str:
    """The schema field name of holder slot ``slot`` (``holders_<slot>``)."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < HOLDER_RING:
        raise KeyFormatError(f"holder slot must be an int in [0, {HOLDER_RING}), got {slot!r}.")
    return f"{HOLDERS_FIELD_PREFIX}{slot}"


def schema_fields() -> tuple[str, ...]:
    """Every field name of the run schema, in key-table order; key ``R_<field>`` exists for each."""
    return (
        (
            MANIFEST_FIELD,
            PEERS_FIELD,
            CORE_PEERS_FIELD,
            ADAPTER_FIELD,
            METRICS_FIELD,
            ACCESS_FIELD,
            LEARNERS_FIELD,
            CREDIT_FIELD,
        )
        + tuple(bucket_field(slot) for slot in range(BUCKET_RING))
        + tuple(holders_field(s) for s in range(HOLDER_RING))
    )


def field_key(run_id: str, field: str) -> str:
    """The raw DHT key of schema field ``field`` in run ``run_id``, as ``SchemaValidator(prefix=run_id)`` names it."""
    return f"{check_run_id(run_id)}_{field}"


def manifest_key(run_id: str) -> str:
    """Key of the run manifest, written by the coordinator under its owner subkey."""
    return field_key(run_id, MANIFEST_FIELD)


def peers_key(run_id: str) -> str:
    """Key of the heartbeats, one owner subkey per peer."""
    return field_key(run_id, PEERS_FIELD)


def core_peers_key(run_id: str) -> str:
    """Key of the learners' and the coordinator's heartbeats again (also under ``peers_key``): the few peers every
    rollout peer looks up, readable without reading every peer's heartbeat."""
    return field_key(run_id, CORE_PEERS_FIELD)


def adapter_key(run_id: str) -> str:
    """Key of the adapter announcements, one owner subkey per learner."""
    return field_key(run_id, ADAPTER_FIELD)


def metrics_key(run_id: str) -> str:
    """Key of the learners' summaries for status, one owner subkey per learner."""
    return field_key(run_id, METRICS_FIELD)


def access_key(run_id: str) -> str:
    """Key of a private run's revocation list, under the coordinator's owner subkey."""
    return field_key(run_id, ACCESS_FIELD)


def learners_key(run_id: str) -> str:
    """Key of the learners' admissions (the coordinator's certificate bound to each learner), one owner subkey each."""
    return field_key(run_id, LEARNERS_FIELD)


def credit_key(run_id: str) -> str:
    """Key of the learners' credit tables (groups used and refused per contributor over the run), one owner subkey
    per learner."""
    return field_key(run_id, CREDIT_FIELD)


def bucket_slot(version: int) -> int:
    """The ring slot of adapter version ``version``: ``version % BUCKET_RING``."""
    _check_number(version, "version")
    return version % BUCKET_RING


def bucket_key(run_id: str, version: int) -> str:
    """Key of the bucket holding groups sampled with adapter ``version``: ``{run}_bucket_{version % BUCKET_RING}``."""
    return field_key(run_id, bucket_field(bucket_slot(version)))


def holders_key(run_id: str, version: int) -> str:
    """Key of the peers that hold adapter ``version`` and serve it: ``{run}_holders_{version % HOLDER_RING}``."""
    _check_number(version, "version")
    return field_key(run_id, holders_field(version % HOLDER_RING))


def owner_subkey(owner_public_key: bytes) -> bytes:
    """The subkey of a peer's single entry under a key (heartbeat, adapter announcement, metrics, manifest)."""
    return OWNER_PREFIX + _check_owner_key(owner_public_key) + OWNER_SUFFIX


def group_subkey(owner_public_key: bytes, version: int, seq: int) -> bytes:
    """The subkey of one bucket entry: the producer's owner marker, then ``"{version}.{seq}"``."""
    _check_number(version, "version")
    _check_number(seq, "seq")
    return owner_subkey(owner_public_key) + f"{version}.{seq}".encode()


def parse_owner_subkey(subkey: bytes) -> bytes:
    """The serialized public key in an :func:`owner_subkey`; :class:`KeyFormatError` on anything else."""
    match = OWNER_SUBKEY_RE.match(subkey) if isinstance(subkey, bytes) else None
    if match is None or len(match.group(1)) > MAX_OWNER_KEY_BYTES:
        raise KeyFormatError(f"{_preview(subkey)} is not an owner subkey ([owner:ssh-rsa ...]).")
    return match.group(1)


def parse_group_subkey(subkey: bytes) -> tuple[bytes, int, int]:
    """``(owner_public_key, version, seq)`` from a :func:`group_subkey`; :class:`KeyFormatError` on anything else.

    Numbers must be canonical (no sign, no leading zeros), so one (owner, version, seq) has exactly one subkey.
    """
    match = GROUP_SUBKEY_RE.match(subkey) if isinstance(subkey, bytes) else None
    if match is None or len(match.group(1)) > MAX_OWNER_KEY_BYTES:
        raise KeyFormatError(f"{_preview(subkey)} is not a bucket subkey ([owner:ssh-rsa ...]<version>.<seq>).")
    version, seq = int(match.group(2)), int(match.group(3))
    if version > MAX_INT or seq > MAX_INT:
        raise KeyFormatError(f"{_preview(subkey)} has a version or seq over {MAX_INT}.")
    return match.group(1), version, seq


def _check_owner_key(owner_public_key: bytes) -> bytes:
    if not isinstance(owner_public_key, bytes):
        raise KeyFormatError(f"an owner public key must be bytes, got {type(owner_public_key).__name__}.")
    if owner_public_key.startswith(OWNER_PREFIX):
        raise KeyFormatError(
            "pass the serialized public key (private_key.get_public_key().to_bytes()), not the [owner:...] marker."
        )
    if re.fullmatch(_OWNER_KEY, owner_public_key) is None or len(owner_public_key) > MAX_OWNER_KEY_BYTES:
        raise KeyFormatError(
            f"{_preview(owner_public_key)} is not an OpenSSH RSA public key (b'ssh-rsa AAAA...', at most "
            f"{MAX_OWNER_KEY_BYTES} bytes)."
        )
    return owner_public_key


def _check_number(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise KeyFormatError(f"{name} must be an int in [0, {MAX_INT}], got {value!r}.")


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
