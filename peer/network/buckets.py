"""Buckets: where rollout groups wait for learners, keyed by ``(run, adapter version)``, one entry per batch.

A rollout peer publishes each run of consecutive groups (up to 64) under ``bucket_key(run, version)`` with the
subkey ``[owner:ITS_KEY]<version>.<seq>`` (its first group's seq): the DHT's validators make sure only the owner of
that key can write it and that the entry matches its schema. Small groups ride inline in the entry, packed as one
batch; larger ones are put in the producer's blob cache and the entry holds a pointer (sha256, size, provider),
fetched over a P2P stream when a learner wants it. Either way the groups are bytes until a reader parses them
(:func:`~peer.protocol.groups_of`): the DHT nodes check the entry, not each group.
Entries expire by themselves (``expiration`` seconds: a rollout peer's last as long as 62 versions take, at least
60 s and at most 600 s), so buckets clean up.
Stores and reads search narrowly (the key's nearest replicas, one round of requests: ``Swarm``'s "search width");
every ``wide_every`` seconds a read of a version's bucket searches as wide as hivemind does by default, so an entry a
writer with a stale routing table put on nodes a little off the nearest ones is still found. A writer with
``push_to`` (a rollout peer: the admitted learners, from their heartbeats) delivers each entry to those peers' nodes
first, and stores on the key's nearest nodes only what none of them took within a second (a learner down, hung or
refusing); a reader with ``network_every`` (a learner) reads its own DHT node's copy every time and the network only
that often: an entry reaches the learner in one request however large the swarm, and costs the swarm that request
alone. The replicas hold the entries no learner took, for the learners a writer does not know yet.

A reader asks for every group in a version range it has not seen yet and gets, per entry, either the group and
its owner key (the verified signer — the identity bans attach to) or the reason it was refused. Nothing read is
trusted beyond its schema: learners still re-derive prompts and recompute rewards.

:class:`BucketStore` is the interface; :class:`DHTBucketStore` is the swarm backend and
:class:`MemoryBucketStore` an in-memory one for unit tests of the logic above it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from peer.errors import UserError
from peer.log import get_logger
from peer.network.swarm import subkey_tag
from peer.protocol import (
    BUCKET_RING,
    MAX_GROUPS_PER_ENTRY,
    BlobPointer,
    BucketEntry,
    GroupBatch,
    GroupRecord,
    RecordError,
    bucket_key,
    fits_inline,
    from_dht_value,
    group_subkey,
    groups_of,
    pack,
    parse_group_subkey,
    split_batches,
    to_dht_value,
    unpack,
)

logger = get_logger(__name__)

FETCH_WORKERS = 4  # a learner's threads fetching group blobs (each transfer bounded by its deadline)
NETWORK_EVERY = 2.0  # s between a learner's network reads of a bucket; rollout peers push entries to it between
REPLICAS = 2  # nearest nodes a bucket entry is stored on, besides the learners it is pushed to (docs/protocol.md)
GroupId = tuple[bytes, int, int]  # (owner public key, version, seq)


@dataclass(frozen=True)
class Fetched:
    """One bucket entry as read: the group, or why it was refused (``group`` is None then). ``unavailable``: its
    groups are a blob this reader could not fetch (the producer did not answer, or not in time), not bytes that
    failed to parse: no proof against the signer."""

    owner: bytes
    version: int
    seq: int
    group: GroupRecord | None
    error: str | None = None
    unavailable: bool = False

    @property
    def id(self) -> GroupId:
        return (self.owner, self.version, self.seq)


class BucketStore(abc.ABC):
    """Publish this peer's groups; fetch everyone's groups in a version range."""

    @abc.abstractmethod
    def publish(self, group: GroupRecord) -> None:
        """Make ``group`` visible to every reader of its version's bucket."""

    def publish_many(self, groups: list[GroupRecord]) -> None:
        """Publish several groups (backends may do it concurrently); raises if any could not be published."""
        self.store_entries(self.entries_of(groups))

    def entries_of(self, groups: list[GroupRecord]) -> list:
        """The part of :meth:`publish_many` that needs no network: ``groups`` made into what
        :meth:`store_entries` stores (plain, picklable values; a rollout peer makes them in another process)."""
        return list(groups)

    def store_entries(self, entries: list) -> None:
        """Store what :meth:`entries_of` made; raises if any could not be stored."""
        for group in entries:
            self.publish(group)

    @abc.abstractmethod
    def fetch(
        self,
        min_version: int,
        max_version: int,
        seen: Container[GroupId] = (),
        skip: Container[bytes] = (),
        *,
        wait: float = 0.0,
        network_from: int | None = None,
        newcomers: Container[bytes] = (),
    ) -> list[Fetched]:
        """Entries of versions ``min_version..max_version`` (inclusive) whose id is not in ``seen``, and not signed
        by a key in ``skip`` (banned or muted signers: their entries are neither parsed nor fetched); the blobs of
        ``newcomers`` (signers with little verified history) share at most half the fetch workers. Versions below
        ``network_from`` are read from what was pushed to this reader alone (a store without such a copy: not
        read). ``wait``: a store that :attr:`waits` answers once something new arrived there, or after that long."""

    waits = False  # whether fetch(wait=...) waits for new entries (a store that does not returns at once)

    def count(self, min_version: int, max_version: int) -> int:
        """How many entries the range holds now (a cheap upper bound for backpressure)."""
        return len(self.fetch(min_version, max_version))


def _versions(min_version: int, max_version: int) -> range:
    if min_version < 0 or max_version < min_version:
        return range(0)
    # one ring slot per version; a range longer than the ring would read slots twice
    return range(max(min_version, max_version - BUCKET_RING + 1), max_version + 1)


class MemoryBucketStore(BucketStore):
    """In-process buckets for unit tests; stores share ``entries`` to see each other, like peers of one swarm."""

    def __init__(self, owner: bytes, entries: dict | None = None, clock=time.time):
        self.owner = owner
        self.entries: dict[GroupId, tuple[float, bytes]] = {} if entries is None else entries
        self.expiration = 600.0
        self._clock = clock

    def publish(self, group: GroupRecord) -> None:
        self.entries[(self.owner, group.version, group.seq)] = (self._clock() + self.expiration, pack(group))

    def fetch(
        self,
        min_version: int,
        max_version: int,
        seen: Container[GroupId] = (),
        skip: Container[bytes] = (),
        *,
        wait: float = 0.0,
        network_from: int | None = None,
        newcomers: Container[bytes] = (),
    ) -> list[Fetched]:
        now, versions, out = self._clock(), _versions(min_version, max_version), []
        if network_from is not None:  # the entries stand for the network's: nothing was pushed to this reader
            versions = range(max(versions.start, network_from), versions.stop)
        for (owner, version, seq), (expires, data) in list(self.entries.items()):
            if version in versions and expires > now and (owner, version, seq) not in seen and owner not in skip:
                out.append(_parse_packed(owner, version, seq, data))
        return out


class DHTBucketStore(BucketStore):
    """Buckets in the swarm's DHT; large groups as blobs served by their producer (``blobs``: a BlobService)."""

    def __init__(
        self,
        swarm,
        blobs=None,
        *,
        expiration: float | Callable[[], float] = 600.0,
        fetch_timeout: float = 30.0,
        store_attempts: int = 4,
        narrow: bool = True,
        wide_every: float = 5.0,
        push_to=None,
        network_every: float = 0.0,
        fetch_workers: int = 0,
        replicas: int = REPLICAS,
        clock=time.monotonic,
    ):
        """``fetch_workers`` > 0: group blobs are fetched on that many threads, off the reader's path — a
        :meth:`fetch` returns the inline entries at once and the blobs that arrived since its last call (a provider
        that drips holds one worker until its deadline, not the reader); each blob is removed from the cache once
        read (this peer does not serve other producers' groups). 0: fetched in the call, and kept."""
        self.swarm = swarm
        self.store_attempts = store_attempts
        self.blobs = blobs
        self.expiration = expiration  # s an entry lives, or a callable giving them at each store
        self.fetch_timeout = fetch_timeout
        self.narrow = narrow  # False: every store and read searches as wide as hivemind's default
        self.wide_every = wide_every
        self.push_to = push_to  # callable -> peer ids every entry is delivered to first (the learners); narrow only
        self.network_every = network_every  # > 0: read this node's own copy always, the network this often
        self.replicas = replicas  # nearest nodes each entry is stored on (narrow stores)
        self._clock = clock
        self._network_at: dict[int, float] = {}  # version -> when its bucket was last read from the network
        self._wide_at: dict[int, float] = {}  # version -> when a read of its bucket last searched wide
        self._read_out: dict[int, set[int]] = {}  # version -> subkey tags of entries the caller had all groups of
        self._since: dict[int, int] = {}  # version -> the DHT process's latest store when its copy was last read
        self.fetch_workers = fetch_workers
        self._pool = None
        self._inflight: dict[GroupId, object] = {}  # first id of a pointer entry being fetched -> its future

    def publish(self, group: GroupRecord) -> None:
        self.publish_many([group])

    def entries_of(self, groups: list[GroupRecord]) -> list[tuple[str, bytes, dict]]:
        """The groups as few bucket entries (runs of consecutive seqs): ``(key, subkey, value)`` each."""
        return [self._item(b) for b in split_batches(groups)]

    def store_entries(self, entries: list[tuple[str, bytes, dict]]) -> None:
        """Deliver the entries to the learners ``push_to`` names; store those none of them took on the key's nearest
        nodes, concurrently; retry what no node took."""
        pending = dict(enumerate(entries))
        life = self.expiration() if callable(self.expiration) else self.expiration  # one life for every attempt
        learners = tuple(self.push_to()) if self.push_to is not None and self.narrow else ()
        if learners:
            items = [(k, sk, v, time.time() + life) for k, sk, v in entries]
            for i, took in enumerate(self.swarm.deliver(items, learners, "bucket entry")):
                if took:
                    del pending[i]
            if not pending:
                return
        for attempt in range(self.store_attempts):
            keys = list(pending)
            # hivemind's DHT time is wall-clock time; a retry may extend, never shorten, an entry's life
            items = [(k, sk, v, time.time() + life) for k, sk, v in (pending[i] for i in keys)]
            stored = self.swarm.store_many(
                items, "bucket entry", all_replicas=False, narrow=self.narrow, replicas=self.replicas
            )
            for i, ok in zip(keys, stored, strict=True):
                if ok:
                    del pending[i]
            if not pending:
                return
            logger.info("no DHT node took %d bucket entries (attempt %d); retrying", len(pending), attempt + 1)
            time.sleep(0.5 * 2**attempt)
        first = ", ".join(_label(subkey) for _, subkey, _ in list(pending.values())[:3])
        raise UserError(
            f"no DHT node accepted the groups from {first} after {self.store_attempts} attempts; check that this "
            "peer still reaches the swarm (its log shows the DHT's errors)"
        )

    def _item(self, batch: list[GroupRecord]) -> tuple[str, bytes, dict]:
        first = batch[0]
        if len(batch) > 1 or fits_inline(batch):  # split_batches keeps a run of several groups within the budget
            entry = BucketEntry.of_groups(batch)
        else:
            if self.blobs is None:
                raise UserError(
                    f"groups {first.version}.{first.seq}+{len(batch)} are too large to publish inline and this peer "
                    "has no blob service"
                )
            data = pack(GroupBatch(groups=batch))
            sha = self.blobs.cache.put_bytes(data)
            pointer = BlobPointer(sha256=sha, size=len(data), providers=[str(self.swarm.peer_id)], kind="group")
            entry = BucketEntry.of_pointer(pointer, first.version, first.seq, len(batch))
        key = bucket_key(self.swarm.run_id, first.version)
        subkey = group_subkey(self.swarm.public_key, first.version, first.seq)
        return key, subkey, to_dht_value(entry)

    @property
    def waits(self) -> bool:
        """A reader of its own node's copy (``network_every``) waits there for new entries: its DHT process answers
        when one is stored (:meth:`~peer.network.swarm.Swarm.wait_local`)."""
        return self.network_every > 0

    def fetch(
        self,
        min_version: int,
        max_version: int,
        seen: Container[GroupId] = (),
        skip: Container[bytes] = (),
        *,
        wait: float = 0.0,
        network_from: int | None = None,
        newcomers: Container[bytes] = (),
    ) -> list[Fetched]:
        out = []
        for version, entries in self._entries_of(_versions(min_version, max_version), wait, network_from).items():
            for subkey, item in entries.items():
                try:
                    owner, v, seq = parse_group_subkey(subkey)
                except (RecordError, UserError, ValueError):
                    continue  # the validators refuse such subkeys; nothing to attribute it to
                if v != version or owner in skip:  # another version sharing this ring slot; a banned or muted
                    # signer (an entry written while muted is never read): not even sent through the pipe again
                    self._read_out.setdefault(version, set()).add(subkey_tag(subkey))
                    continue
                count = _count_of(item.value)
                if all((owner, v, seq + i) in seen for i in range(count)):
                    self._read_out.setdefault(version, set()).add(subkey_tag(subkey))  # not sent again
                    continue
                if self.fetch_workers and _is_pointer(item.value):
                    self._submit(owner, v, seq, item.value, newcomers)
                    continue
                out.extend(f for f in self._read(owner, v, seq, item.value) if f.id not in seen)
        if self.fetch_workers:  # after the read: what arrived while it waited comes with it
            out.extend(self._arrived(seen))
        return out

    MAX_INFLIGHT_PER_WORKER = 4
    MAX_INFLIGHT_PER_OWNER = 4  # one signer's blobs in flight at most: a stranger's unanswered ones hold a quarter

    def _submit(self, owner: bytes, version: int, seq: int, value, newcomers: Container[bytes] = ()) -> None:
        """Fetch a pointer entry's blob on a worker (once; at most ``MAX_INFLIGHT_PER_WORKER`` per worker queued,
        ``MAX_INFLIGHT_PER_OWNER`` of one signer's, and half the workers' worth of all ``newcomers``' together —
        signers with little verified history, whatever their number of keys: so proven producers' blobs always have
        workers free; beyond, the entry is left for a later read)."""
        from concurrent.futures import ThreadPoolExecutor

        key = (owner, version, seq)
        if key in self._inflight or len(self._inflight) >= self.MAX_INFLIGHT_PER_WORKER * self.fetch_workers:
            return
        if sum(o == owner for o, _, _ in self._inflight) >= self.MAX_INFLIGHT_PER_OWNER:
            return
        if owner in newcomers and sum(o in newcomers for o, _, _ in self._inflight) >= max(1, self.fetch_workers // 2):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.fetch_workers, thread_name_prefix="group-blob")
        self._inflight[key] = self._pool.submit(self._read, owner, version, seq, value, evict=True)

    def _arrived(self, seen: Container[GroupId]) -> list[Fetched]:
        """What the workers fetched since the last call (a worker's error is a refusal of the entry's groups)."""
        out = []
        for key, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[key]
            try:
                out.extend(f for f in future.result() if f.id not in seen)
            except Exception as e:  # noqa: BLE001 - the network boundary: refuse the entry's groups, say why
                out.extend(f for f in _refused(*key, 1, f"group blob unavailable: {e}", True) if f.id not in seen)
        return out

    def close(self) -> None:
        """Stop the fetch workers (those on a transfer end at its deadline)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def count(self, min_version: int, max_version: int) -> int:
        """Groups in the range by the entries' counts alone: no parsing, no blob fetch (cheap enough per batch)."""
        total = 0
        for version, entries in self._entries_of(_versions(min_version, max_version), 0.0, None, skips=False).items():
            for subkey, item in entries.items():
                try:
                    if parse_group_subkey(subkey)[1] == version:
                        total += _count_of(item.value)
                except (RecordError, UserError, ValueError):
                    continue
        return total

    def _entries_of(self, versions: range, wait: float, network_from: int | None, skips: bool = True) -> dict:
        """Each version's bucket entries. With ``network_every``: this node's own copy of all of them (what writers
        pushed to it), in one call to the DHT process, which waits up to ``wait`` s for a store into one of them if
        none came since they were last read (not for a version read first); each copy but for the entries that
        :attr:`_read_out` tags (:func:`~peer.network.swarm.subkey_tag`: a fetch's caller had every group of them;
        ``skips=False``: all). Then the network's, from ``network_from`` on, for a version whose bucket was not read
        from it for ``network_every`` s (first reads: the copy alone). From the network: a narrow search, but a wide
        one if this version's bucket had none for ``wide_every`` seconds (each version on its own clock: a reader
        may read old versions rarely)."""
        run, now = self.swarm.run_id, self._clock()
        keys = {version: bucket_key(run, version) for version in versions}
        found: dict[int, dict] = {version: {} for version in versions}
        if self.network_every > 0 and versions:
            known = [self._since.get(version) for version in versions]
            since = -1 if wait <= 0 or None in known else min(known)
            read_out = {keys[v]: (self._read_out.get(v, ()) if skips else ()) for v in versions}
            count, local = self.swarm.wait_local(read_out, since, wait)
            for version in versions:
                found[version], self._since[version] = local[keys[version]], count
        for version in versions:
            if network_from is not None and version < network_from:
                continue
            if self.network_every > 0:
                if now - self._network_at.setdefault(version, now) < self.network_every:
                    continue
                self._network_at[version] = now
            narrow = self.narrow and now - self._wide_at.setdefault(version, now) < self.wide_every
            if not narrow:
                self._wide_at[version] = now
            found[version] = {**self.swarm.get_dict(keys[version], narrow=narrow), **found[version]}
        for held in (self._wide_at, self._network_at, self._read_out, self._since):
            if len(held) > 2 * BUCKET_RING:
                for old in sorted(held)[:BUCKET_RING]:
                    del held[old]
        return found

    def _read(self, owner: bytes, version: int, seq: int, value, evict: bool = False) -> list[Fetched]:
        count = _count_of(value)
        try:
            entry = from_dht_value(BucketEntry, value)
        except RecordError as e:
            return _refused(owner, version, seq, count, str(e))
        if entry.inline is not None:
            data = entry.inline
        elif self.blobs is None:
            return _refused(
                owner, version, seq, entry.count, "the groups are a blob and this reader has no blob service", True
            )
        else:
            from hivemind.p2p import PeerID

            pointer = entry.pointer
            try:
                providers = [PeerID.from_base58(p) for p in pointer.providers]
                path = self.blobs.fetch(pointer.sha256, pointer.size, providers, timeout=self.fetch_timeout)
            except (UserError, ValueError) as e:
                return _refused(owner, version, seq, entry.count, f"group blob unavailable: {e}", True)
            try:
                data = path.read_bytes()
            finally:
                if evict:  # used or refused, the learner is done with it: the cache holds no one else's groups
                    self.blobs.cache.remove(pointer.sha256)
        try:
            groups = groups_of(data, version, seq, entry.count)
        except RecordError as e:
            return _refused(owner, version, seq, entry.count, str(e))
        return [Fetched(owner, version, g.seq, g) for g in groups]


def _label(subkey: bytes) -> str:
    """``version.seq`` of one of this peer's own entries, for messages."""
    _, version, seq = parse_group_subkey(subkey)
    return f"{version}.{seq}"


def _is_pointer(value) -> bool:
    """Whether a stored entry (not yet parsed) points to a blob."""
    return isinstance(value, dict) and value.get("pointer") is not None


def _count_of(value) -> int:
    """The entry's group count as stored (1 when unreadable: the parse then reports what is wrong)."""
    count = value.get("count") if isinstance(value, dict) else None
    return (
        count if isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= MAX_GROUPS_PER_ENTRY else 1
    )


def _refused(owner: bytes, version: int, seq: int, count: int, error: str, unavailable: bool = False) -> list[Fetched]:
    return [Fetched(owner, version, seq + i, None, error, unavailable) for i in range(count)]


def _parse_packed(owner: bytes, version: int, seq: int, data: bytes) -> Fetched:
    try:
        group = unpack(GroupRecord, data)
    except RecordError as e:
        return Fetched(owner, version, seq, None, str(e))
    if (group.version, group.seq) != (version, seq):
        return Fetched(owner, version, seq, None, f"group says {group.version}.{group.seq}, its entry {version}.{seq}")
    return Fetched(owner, version, seq, group)


def ids(fetched: Iterable[Fetched]) -> set[GroupId]:
    return {f.id for f in fetched}
