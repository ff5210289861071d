"""What a DHT node of the run keeps: bounded life, bounded entries per signer, bounded bytes per key.

hivemind answers a get with the whole dictionary under a key, in one message, and p2pd caps a message at 4 MiB:
without a bound, ~160 manifest-sized records under fresh keys made the run's manifest key unreadable for everyone,
and 1,000 signing identities could do the same to a version's bucket. Writers also chose their records' expiry
freely. The record validators cannot help: a validator sees one record, not the dictionary it joins, and it must
answer the same at every moment on every node (hivemind drops a *whole* fetched dictionary when one entry fails
validation, so a time-dependent validator would let a record valid on one node poison reads on another).

So the bound lives where records are kept: :func:`install` wraps ``store_subkey`` of the node's local storage, in
the DHT's own process, and every record stored there (by this peer or any other) passes :class:`KeyQuota` first:

* **expiry**: at most ``MAX_TTL[field] + CLOCK_SKEW`` ahead of this node's clock (a record already held keeps
  its expiry; a refused one is simply not kept here);
* **entries per signer**: buckets hold at most ``MAX_ENTRIES_PER_SIGNER`` entries of one signer per key (every
  other key has one subkey per signer by its schema);
* **bytes per key**: ``MAX_KEY_BYTES`` (values and subkeys) — well under p2pd's message limit. A full bucket
  makes room by dropping its entries of the oldest versions (stale for every learner) when the new entry is of a
  newer version; otherwise, and for every other key, a new subkey is refused while an existing one may still be
  replaced by a record of no larger size (a coordinator refreshing its manifest, a learner its announcement).

Records stored before a flood stay (first come, first kept): the coordinator's manifest, stored when the run starts and
refreshed in place, outlives any number of later strangers. But keys are free: ~2,000 strangers' junk records filled
the small keys that only the coordinator and the run's learners need (``STANDING_FIELDS``), and then no new learner
could store its admission and no announcement could grow. So on those keys a **signer with standing** — the
coordinator, a learner whose admission record verifies against the coordinator's key on this node, or one the peer's
own reading admitted (:func:`set_standing`) — makes room in a full key by evicting records of signers without standing,
soonest-expiring first. A stranger's record never evicts anything. Every node enforces this for itself, so any node's
answer for a run key fits one message whatever writers do. Written against hivemind 1.1.12's
``DHTLocalStorage.store_subkey`` and ``DictionaryDHTValue``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from peer.protocol.keys import (
    ACCESS_FIELD,
    ADAPTER_FIELD,
    BUCKET_FIELD_PREFIX,
    CORE_PEERS_FIELD,
    CREDIT_FIELD,
    GROUP_SUBKEY_RE,
    HOLDERS_FIELD_PREFIX,
    LEARNERS_FIELD,
    MANIFEST_FIELD,
    METRICS_FIELD,
    OWNER_SUBKEY_RE,
    PEERS_FIELD,
    field_key,
    schema_fields,
)

CLOCK_SKEW = 300.0  # s a writer's clock may run ahead of this node's
MAX_TTL = {  # s: the longest life a writer of each key gives a record (the key table in docs/protocol.md)
    MANIFEST_FIELD: 3600.0,
    ACCESS_FIELD: 3600.0,
    ADAPTER_FIELD: 3600.0,  # v0, announced by the host with the manifest's life; learners use 600 s
    METRICS_FIELD: 600.0,
    PEERS_FIELD: 60.0,
    CORE_PEERS_FIELD: 60.0,
    LEARNERS_FIELD: 300.0,
    CREDIT_FIELD: 600.0,  # a learner re-stores its credit record every minute at least (peer.run.credit)
    BUCKET_FIELD_PREFIX: 600.0,
    HOLDERS_FIELD_PREFIX: 60.0,  # holders say so for seconds (peer.network.holders)
}
STANDING_FIELDS = (
    LEARNERS_FIELD,
    ADAPTER_FIELD,
    CORE_PEERS_FIELD,
    CREDIT_FIELD,
    METRICS_FIELD,
    MANIFEST_FIELD,
    ACCESS_FIELD,
)
"""Keys whose honest writers are the coordinator and admitted learners: one with standing evicts strangers there."""
MAX_KEY_BYTES = 2 << 20  # values + subkeys under one key on one node: half of p2pd's 4 MiB message
MAX_HOLDERS_KEY_BYTES = 64 << 10  # a holder slot: every fetcher reads it once per version (honest: ~10 entries)
MAX_ENTRIES_PER_SIGNER = 256  # bucket entries of one signer under one key (honest: a few dozen per version)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""
    evict: tuple = ()  # subkeys to drop first (a full bucket's oldest versions)


class KeyQuota:
    """The rule for one run key; :meth:`check` decides on one record given the key's current dictionary."""

    def __init__(self, field: str, max_bytes: int = MAX_KEY_BYTES, per_signer: int = MAX_ENTRIES_PER_SIGNER):
        self.field = field
        self.bucket = field.startswith(BUCKET_FIELD_PREFIX)
        holders = field.startswith(HOLDERS_FIELD_PREFIX)
        self.max_ttl = MAX_TTL[BUCKET_FIELD_PREFIX if self.bucket else HOLDERS_FIELD_PREFIX if holders else field]
        if holders:
            max_bytes = min(max_bytes, MAX_HOLDERS_KEY_BYTES)
        self.max_bytes, self.per_signer = max_bytes, per_signer

    def check(self, items: dict, subkey, value: bytes, expiration: float, now: float, standing=None) -> Verdict:
        """``items``: the key's live ``{subkey: (value, expiration)}`` on this node; ``standing(owner key)``: whether
        a signer has standing (module docstring; None: nobody has)."""
        if expiration > now + self.max_ttl + CLOCK_SKEW:
            return Verdict(False, f"expires {expiration - now:.0f} s ahead, over {self.max_ttl:.0f} s")
        if not isinstance(subkey, bytes):
            return Verdict(False, "a subkey that is not bytes")  # the validators refuse these too
        size = len(subkey) + len(value)
        used = sum(len(k) + len(v) for k, (v, _) in items.items() if isinstance(k, bytes))
        if subkey in items:
            old = items[subkey][0]
            if used - len(subkey) - len(old) + size <= self.max_bytes or size <= len(subkey) + len(old):
                return Verdict(True)
            return self._make_room(
                items, subkey, used - len(subkey) - len(old) + size, standing, "a larger replacement"
            )
        if self.bucket:
            return self._bucket(items, subkey, size, used)
        if used + size > self.max_bytes:
            return self._make_room(items, subkey, used + size, standing, f"the key holds {used} bytes already;")
        return Verdict(True)

    def _make_room(self, items: dict, subkey: bytes, needed: int, standing, why: str) -> Verdict:
        """Evict records of signers without standing (soonest-expiring first) for a signer with standing."""
        owner = owner_of(subkey)
        if self.field not in STANDING_FIELDS or standing is None or owner is None or not standing(owner):
            return Verdict(False, f"{why} in a full key")
        evict, freed = [], 0
        strangers = [k for k in items if isinstance(k, bytes) and k != subkey and not _has(standing, owner_of(k))]
        for k in sorted(strangers, key=lambda k: items[k][1]):
            if needed - freed <= self.max_bytes:
                break
            evict.append(k)
            freed += len(k) + len(items[k][0])
        if needed - freed > self.max_bytes:
            return Verdict(False, f"{why} in a key full of signers with standing")
        return Verdict(True, evict=tuple(evict))

    def _bucket(self, items: dict, subkey: bytes, size: int, used: int) -> Verdict:
        parsed = _group_subkey(subkey)
        if parsed is None:
            return Verdict(False, "not a bucket subkey")
        owner, version = parsed
        entries = [(k, _group_subkey(k)) for k in items if isinstance(k, bytes)]
        if sum(1 for _, p in entries if p is not None and p[0] == owner) >= self.per_signer:
            return Verdict(False, f"its signer has {self.per_signer} entries under this key")
        if used + size <= self.max_bytes:
            return Verdict(True)
        evict, freed = [], 0
        for k, p in sorted(entries, key=lambda e: e[1][1] if e[1] else -1):
            if used + size - freed <= self.max_bytes:
                break
            if p is not None and p[1] >= version:
                break  # never drop entries of this version or newer for it
            evict.append(k)
            freed += len(k) + len(items[k][0])
        if used + size - freed > self.max_bytes:
            return Verdict(False, f"the bucket holds {used} bytes of versions up to this one's")
        return Verdict(True, evict=tuple(evict))


def _has(standing, owner: bytes | None) -> bool:
    return owner is not None and standing(owner)


class Standing:
    """Inside the DHT process: the signers with standing on this node (module docstring)."""

    MAX_VERIFIED = 4096  # learner signers whose admission verified here (an honest run has a few)

    def __init__(self):
        self.coordinator: bytes | None = None
        self.admitted: frozenset[bytes] = frozenset()  # pushed by the peer process (its Admitted)
        self.verified: dict[bytes, float] = {}  # learner signer -> its credential's expiry (0: never)
        self._tried: dict[bytes, bool] = {}  # digest of (signer, value) -> whether it verified

    def __call__(self, owner: bytes) -> bool:
        if owner == self.coordinator or owner in self.admitted:
            return True
        expires = self.verified.get(owner)
        return expires is not None and (expires == 0 or expires > time.time())

    def learner_record(self, run_id: str, owner: bytes, record_value) -> None:
        """Note ``owner``'s admission record (the stored value, its signature stripped) if it verifies."""
        import hashlib

        import msgpack

        if self.coordinator is None or not isinstance(record_value, bytes):
            return
        digest = hashlib.sha256(owner + b"\0" + record_value).digest()
        if digest in self._tried:
            return
        self._tried[digest] = False
        if len(self._tried) > 4 * self.MAX_VERIFIED:
            self._tried.pop(next(iter(self._tried)))
        from peer.network.admission import CredentialError, check_binding, verify_certificate
        from peer.protocol import LearnerRecord, RecordError, from_dht_value

        try:
            record = from_dht_value(LearnerRecord, msgpack.unpackb(record_value, max_bin_len=4096, max_str_len=4096))
            certificate = verify_certificate(record.certificate, self.coordinator, run_id)
        except (RecordError, CredentialError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
            return
        if check_binding(certificate, record.binding, run_id, owner, record.peer_id):
            self._tried[digest] = True
            self.verified[owner] = certificate.expires
            while len(self.verified) > self.MAX_VERIFIED:
                self.verified.pop(next(iter(self.verified)))


def _group_subkey(subkey: bytes) -> tuple[bytes, int] | None:
    match = GROUP_SUBKEY_RE.match(subkey)
    return None if match is None else (match.group(1), int(match.group(2)))


def owner_of(subkey: bytes) -> bytes | None:
    match = OWNER_SUBKEY_RE.match(subkey) or GROUP_SUBKEY_RE.match(subkey)
    return None if match is None else match.group(1)


def quotas(run_id: str) -> dict[bytes, KeyQuota]:
    """The quota of every run key, by the key's DHT id bytes (what the node's storage is keyed by)."""
    from hivemind.dht.routing import DHTID

    return {DHTID.generate(source=field_key(run_id, f)).to_bytes(): KeyQuota(f) for f in schema_fields()}


class QuotaStats:
    def __init__(self):
        self.refused: dict[str, int] = {}
        self.evicted = 0


async def install(run_id: str, _dht, node) -> bool:
    """Runs inside the DHT process (``dht.run_coroutine(partial(install, run_id))``): wrap the node's storage."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils import get_dht_time

    storage = node.protocol.storage
    if getattr(storage, "_hivegrpo_quota", None) is not None:
        return False
    rules, stats, standing = quotas(run_id), QuotaStats(), Standing()
    original = storage.store_subkey
    validator = node.protocol.record_validator

    def store_subkey(key, subkey, value, expiration_time) -> bool:
        rule = rules.get(key.to_bytes())
        if rule is None:
            return original(key, subkey, value, expiration_time)
        if rule.field == LEARNERS_FIELD and isinstance(subkey, bytes) and (owner := owner_of(subkey)) is not None:
            from hivemind.dht.crypto import DHTRecord

            stripped = validator.strip_value(DHTRecord(key.to_bytes(), subkey, value, expiration_time))
            standing.learner_record(run_id, owner, stripped)
        held = storage.get(key)
        items = {}
        if held is not None and isinstance(held.value, DictionaryDHTValue):
            items = {k: (v.value, v.expiration_time) for k, v in held.value.items()}
        verdict = rule.check(items, subkey, value, expiration_time, get_dht_time(), standing)
        if not verdict.ok:
            stats.refused[rule.field] = stats.refused.get(rule.field, 0) + 1
            return False
        for k in verdict.evict:
            del held.value[k]
            stats.evicted += 1
        return original(key, subkey, value, expiration_time)

    storage.store_subkey = store_subkey
    storage._hivegrpo_quota = stats
    storage._hivegrpo_standing = standing
    return True


async def set_standing(coordinator_key: bytes, admitted: frozenset[bytes], _dht, node) -> None:
    """Inside the DHT process (``dht.run_coroutine(partial(set_standing, key, admitted))``): the run's coordinator
    key (from the manifest this peer pinned) and the learners this peer's reading admitted have standing here."""
    standing = getattr(node.protocol.storage, "_hivegrpo_standing", None)
    if standing is not None:
        standing.coordinator, standing.admitted = coordinator_key, frozenset(admitted)


async def quota_stats(_dht, node) -> dict:
    """Inside the DHT process: what the quota refused (by key field) and evicted on this node."""
    stats = getattr(node.protocol.storage, "_hivegrpo_quota", None)
    return {} if stats is None else {"refused": dict(stats.refused), "evicted": stats.evicted}


__all__ = [
    "CLOCK_SKEW",
    "MAX_ENTRIES_PER_SIGNER",
    "MAX_KEY_BYTES",
    "MAX_TTL",
    "STANDING_FIELDS",
    "KeyQuota",
    "Standing",
    "install",
    "quota_stats",
    "set_standing",
]
