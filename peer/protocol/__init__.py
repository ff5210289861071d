"""The swarm's wire protocol: every DHT key, every record schema, the limits and the protocol version. No torch.

* :mod:`~peer.protocol.keys` — key and subkey builders (``{run}_manifest``, ``{run}_bucket_{v % 64}``, owner
  subkeys) and their parsers; the only place a key is spelled.
* :mod:`~peer.protocol.records` — the record schemas (manifest, heartbeat, adapter, group, blob pointer, bucket
  entry, metrics, credit) as strict pydantic v1 models, and :func:`pack` / :func:`unpack` / :func:`to_dht_value`.
* :mod:`~peer.protocol.limits` — every size limit, and :func:`check_value_size`, called before ``DHT.store``.
* :mod:`~peer.protocol.version` — :data:`PROTOCOL_VERSION` and the rule for records of other versions.
* :mod:`~peer.protocol.codec` — token ids and log-probs as little-endian 4-byte arrays.
* :mod:`~peer.protocol.validators` — the hivemind record validators built from the above. Import it explicitly:
  it needs hivemind, which imports torch; nothing else here does.

Publishing a group, in short::

    entry = BucketEntry.of_groups(groups) if fits_inline(groups) else BucketEntry.of_pointer(pointer, v, seq, n)
    dht.store(bucket_key(run, v), to_dht_value(entry), expiration_time=..., subkey=group_subkey(pub, v, seq))

(``groups``: consecutive seqs ``seq .. seq + n - 1`` of one version; the pointer's blob is a packed ``GroupBatch``)

and reading one back: ``from_dht_value(BucketEntry, item.value)`` for each subkey, keeping entries whose
``version`` is the one wanted, then ``groups_of(entry.inline or blob, entry.version, entry.seq, entry.count)``.
Everything read is untrusted: parse it, never unpickle it. See docs/protocol.md.
"""

from peer.protocol.errors import KeyFormatError, ProtocolVersionError, RecordError, RecordTooLarge
from peer.protocol.keys import (
    access_key,
    adapter_key,
    bucket_key,
    bucket_slot,
    check_run_id,
    core_peers_key,
    credit_key,
    group_subkey,
    holders_key,
    key_fingerprint,
    learners_key,
    manifest_key,
    metrics_key,
    owner_subkey,
    parse_group_subkey,
    parse_owner_subkey,
    peers_key,
)
from peer.protocol.limits import (
    BUCKET_RING,
    HOLDER_RING,
    MAX_BLOB_BYTES,
    MAX_COMPLETION_TOKENS,
    MAX_DHT_VALUE_BYTES,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_BYTES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_ENTRY,
    MAX_INLINE_BATCH_BYTES,
    MAX_INLINE_GROUP_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_PROVIDERS,
    MAX_RUN_ID_LEN,
    check_value_size,
)
from peer.protocol.records import (
    AccessRecord,
    AdapterRecord,
    BlobPointer,
    BucketEntry,
    Completion,
    Credit,
    CreditRecord,
    Demand,
    GroupBatch,
    GroupRecord,
    HolderRecord,
    LearnerRecord,
    ManifestRecord,
    MetricsRecord,
    ModelFile,
    ModelSpec,
    PeerName,
    PeerRecord,
    PeerTally,
    TaskSpec,
    decode_floats,
    decode_tokens,
    encode_floats,
    encode_tokens,
    fits_inline,
    from_dht_value,
    groups_of,
    owned_records,
    pack,
    peer_name_problem,
    split_batches,
    to_dht_value,
    unpack,
)
from peer.protocol.version import PROTOCOL_VERSION, check_protocol_version

__all__ = [
    "BUCKET_RING",
    "HOLDER_RING",
    "MAX_BLOB_BYTES",
    "MAX_COMPLETION_TOKENS",
    "MAX_DHT_VALUE_BYTES",
    "MAX_GROUP_BATCH_BYTES",
    "MAX_GROUP_BYTES",
    "MAX_GROUPS_PER_ENTRY",
    "MAX_GROUP_SIZE",
    "MAX_INLINE_BATCH_BYTES",
    "MAX_INLINE_GROUP_BYTES",
    "MAX_PROMPT_TOKENS",
    "MAX_PROVIDERS",
    "MAX_RUN_ID_LEN",
    "PROTOCOL_VERSION",
    "AccessRecord",
    "AdapterRecord",
    "Demand",
    "BlobPointer",
    "BucketEntry",
    "Completion",
    "Credit",
    "CreditRecord",
    "GroupBatch",
    "GroupRecord",
    "HolderRecord",
    "KeyFormatError",
    "LearnerRecord",
    "ManifestRecord",
    "MetricsRecord",
    "ModelFile",
    "ModelSpec",
    "PeerRecord",
    "PeerName",
    "PeerTally",
    "ProtocolVersionError",
    "RecordError",
    "RecordTooLarge",
    "TaskSpec",
    "access_key",
    "adapter_key",
    "bucket_key",
    "bucket_slot",
    "check_protocol_version",
    "check_run_id",
    "check_value_size",
    "core_peers_key",
    "credit_key",
    "decode_floats",
    "decode_tokens",
    "encode_floats",
    "encode_tokens",
    "fits_inline",
    "groups_of",
    "from_dht_value",
    "group_subkey",
    "holders_key",
    "key_fingerprint",
    "learners_key",
    "manifest_key",
    "metrics_key",
    "owned_records",
    "owner_subkey",
    "pack",
    "split_batches",
    "parse_group_subkey",
    "parse_owner_subkey",
    "peer_name_problem",
    "peers_key",
    "to_dht_value",
    "unpack",
]
