"""Every size limit of the protocol, in one place.

The limits are part of the protocol: every peer's DHT validator enforces them, so a record over a limit is refused
when it is stored, not discovered by whoever reads it. Writers check them first, with :func:`check_value_size`,
because one limit protects the writer itself: hivemind's ``DHT.store`` sends the value to the DHT's background
process through a non-blocking pipe, and a value over about 64 KB kills that process and hangs the caller.

* :data:`MAX_DHT_VALUE_BYTES` — the msgpack-serialized value handed to ``DHT.store``. 48 KiB leaves 16 KiB of
  the ~64 KB pipe for the key, the subkey (which holds a ~400-byte public key) and the pipe's own framing.
* :data:`MAX_GROUP_SIZE` — G, the completions in one rollout group.
* :data:`MAX_PROMPT_TOKENS` / :data:`MAX_COMPLETION_TOKENS` — tokens of a group's prompt / of each completion.
* :data:`BUCKET_ENTRY_OVERHEAD_BYTES` — what a bucket entry adds around an inline group (its version, seq and
  field names take under 100 bytes; the rest is slack).
* :data:`MAX_INLINE_GROUP_BYTES` — packed groups up to this size in all travel inline in their bucket entry; more
  are stored as a blob and the entry holds a pointer (sha256, size, providers). It is the DHT value budget
  minus the entry overhead, so an inline entry always fits. The entry holds them packed as one batch
  (:data:`MAX_INLINE_BATCH_BYTES`: the groups plus the batch's own ~30 bytes).
* :data:`MAX_GROUP_BYTES` — the largest packed group at all (G, prompt and completion caps at their maximum come
  to about 540 KB); a group blob announced as larger is refused without fetching it.
* :data:`MAX_GROUPS_PER_ENTRY` — groups one bucket entry carries (a rollout peer publishes a batch at a time: one
  DHT store, and one entry for every other peer to validate, per batch instead of per group).
* :data:`MAX_GROUP_BATCH_BYTES` — a packed batch of groups published as a blob (a pointer entry).
* :data:`MAX_BLOB_BYTES` — any blob: base-model files, adapters, groups. 16 GiB fits a 7B model in bf16 per file.
* :data:`MAX_PROVIDERS` — peer ids listed as providers of one blob or adapter.
* :data:`MAX_RUN_ID_LEN` / :data:`RUN_ID_PATTERN` — run ids are 1-64 characters of ``[A-Za-z0-9_-]``: they
  become DHT key prefixes and directory names, so nothing that needs quoting.
* :data:`BUCKET_RING` — the number of bucket keys per run (see :mod:`peer.protocol.keys`).
* :data:`HOLDER_RING` — the number of holder keys per run (who serves an adapter version besides its announcers).
* :data:`MAX_MODEL_FILES` / :data:`MAX_PATH_CHARS` — files in the manifest's base model / each file's path.
* :data:`MAX_JSON_CHARS` — each JSON document in the manifest (task config, GRPO and LoRA hyperparameters).
* :data:`MAX_PEER_ID_CHARS`, :data:`MAX_MADDRS`, :data:`MAX_MADDR_CHARS`, :data:`MAX_STATS`, :data:`MAX_NAME_CHARS`,
  :data:`MAX_REASONS`, :data:`MAX_BANNED`, :data:`MAX_TALLIED`, :data:`MAX_HISTORY`, :data:`MAX_REVOKED`,
  :data:`MAX_CERTIFICATE_BYTES` — fields of the heartbeat, metrics, access, learner and other small records.
* :data:`MAX_OWNER_KEY_BYTES` — the serialized RSA public key in an owner subkey (a 2048-bit key takes ~380).
* :data:`MAX_PEER_NAME_CHARS` — a volunteer's ``--name`` (heartbeat, credit record).
* :data:`MAX_CREDITED`, :data:`MAX_CREDIT_REASONS`, :data:`MAX_CREDIT` — a learner's credit record: the contributors
  it lists (its top by groups used), the refusal reasons listed per contributor (the largest), and the cap of every
  count in it. At every bound a contributor packs to ~400 bytes, so a record stays under ~41 KB, below
  :data:`MAX_DHT_VALUE_BYTES` (docs/protocol.md, "Credit").
* :data:`MAX_INT` — every integer fits a signed 64-bit msgpack int.
"""

from __future__ import annotations

import re

from peer.protocol.errors import RecordTooLarge

MAX_DHT_VALUE_BYTES = 48 * 1024
MAX_GROUP_SIZE = 64
MAX_PROMPT_TOKENS = 2048
MAX_COMPLETION_TOKENS = 1024
BUCKET_ENTRY_OVERHEAD_BYTES = 1024
MAX_INLINE_GROUP_BYTES = MAX_DHT_VALUE_BYTES - BUCKET_ENTRY_OVERHEAD_BYTES
MAX_INLINE_BATCH_BYTES = MAX_INLINE_GROUP_BYTES + 64  # the packed GroupBatch around them adds ~30 bytes
MAX_GROUP_BYTES = 1024 * 1024
MAX_GROUPS_PER_ENTRY = 64
MAX_GROUP_BATCH_BYTES = 4 * MAX_GROUP_BYTES
MAX_BLOB_BYTES = 16 * 1024**3
MAX_PROVIDERS = 32
MAX_RUN_ID_LEN = 64
RUN_ID_PATTERN = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_RUN_ID_LEN}}}\Z")
BUCKET_RING = 64
HOLDER_RING = 16
MAX_MODEL_FILES = 64
MAX_JSON_CHARS = 4096
MAX_PEER_ID_CHARS = 128
MAX_MADDRS = 16
MAX_MADDR_CHARS = 256
MAX_STATS = 32
MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 256
MAX_REASONS = 16
MAX_BANNED = 64  # key fingerprints a learner lists in its metrics (the most recent bans)
MAX_TALLIED = 128  # producers a learner's metrics count groups for (the most recent)
MAX_HISTORY = 32  # reward means of a learner's most recent versions, in its metrics
MAX_REVOKED = 1024  # invite ids a private run's revocation list holds
MAX_ANCESTORS = 16  # sha256 of the versions before an announced one, newest first (a follower checks descent)
MAX_CERTIFICATE_BYTES = 1024  # a learner's certificate from the coordinator (payload + RSA signature: ~400)
MAX_OWNER_KEY_BYTES = 1024
MAX_PEER_NAME_CHARS = 32  # a volunteer's --name
MAX_CREDITED = 100  # contributors one credit record lists (the learner's top 100 by groups used)
MAX_CREDIT_REASONS = 8  # refusal reasons listed per contributor in a credit record (its largest)
MAX_CREDIT = 2**32 - 1  # every count of a credit record saturates here (a uint32: 5 bytes packed)
MAX_INT = 2**63 - 1


def check_value_size(serialized: bytes, what: str, limit: int = MAX_DHT_VALUE_BYTES) -> None:
    """Raise :class:`RecordTooLarge` if ``serialized`` (the msgpack bytes of a DHT value) is over ``limit``.

    Call it before anything reaches hivemind: past ~64 KB, ``DHT.store`` crashes the DHT process instead of failing.
    """
    size = len(serialized)
    if size > limit:
        raise RecordTooLarge(
            f"the {what} record is {size} bytes, over the {limit}-byte DHT limit; store large data as a blob and "
            "publish a pointer to it (BlobPointer), or shrink the record (fewer or shorter entries)."
        )
