"""Following adapter versions: read the learners' announcements, pick the newest, prefetch its blob.

Learners announce under ``{run}_adapter`` (one owner subkey each) the newest version they hold: its number,
sha256, size and the peers that serve it. :func:`newest_announcement` picks the highest version; when announcers
disagree about that version's bytes, the sha256 announced by the most signers wins (ties: the earliest). An
:class:`AdapterFollower` thread polls the table and fetches the blob of anything newer than what the peer runs,
so that the sampling loop only has to copy tensors between two batches. The blob is verified (sha256) by the
transfer and again, after the swap, by hashing the adapter the model actually holds (see
:mod:`peer.roles.rollout.peer`).

Announcements are also pushed: a learner sends each one to the DHT nodes of the run's live rollout peers and
observers (at most ``MAX_PUSHED``, from their heartbeats) as it stores it (in the background: the store waits for
every replica, a follower need not). The store is a narrow one (:mod:`peer.network.near_store`): the key is the
same for every version, so its nearest nodes are looked up once and reused; a lookup per version (hivemind's
store) also brought back the key's records from every node asked, and was the most frequent call of the learner's
DHT process (docs/protocol.md, "Search width"). An :class:`AdapterFollower`
waits on its own node's copy between two reads of the network: its DHT process answers when a record is stored
there (:meth:`~peer.network.swarm.Swarm.wait_local`, at most ``local_every`` seconds a call), not when asked again.
A newer version seen there (from an admitted learner) makes it take the announcements at once, from that copy, not
at its next read of the network: a new version reaches a pushed follower as soon as the push does, not half of its
poll interval plus a read. The copy is held by the follower's own node, which validated each record as a replica
does, and is judged as a network read is: admitted learners only, the newest of each.

Only admitted learners write the lineage (:mod:`peer.network.admission`): :func:`announcements` given the run's
:class:`~peer.network.admission.Admitted` drops every other signer's record, and the coordinator's except v0. A
version whose blob fails to load or check is *refused* (:meth:`AdapterFollower.refuse`): remembered by sha256,
logged once, never fetched again; the peer goes on with what it holds.

An adapter is fetched from the peers that list themselves as its holders first (:mod:`peer.network.holders`), then
from the learners that announced it, then from any other live peer of the run (:func:`fetch_adapter`). A learner
serves a new version to a couple of peers only (:class:`~peer.network.blobs.server.Seeding`), and every peer that
fetched it serves it and, while few are listed, says so (:func:`fetch_version`): the learner's upload per version
stays about two adapters whatever the number of peers (docs/blobs.md, "Spreading adapters"). Every peer keeps the
versions it followed in its blob cache and serves them, so a version outlives the learner that made it (a learner
killed and restarted, or a rollout peer joining meanwhile, finds it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from peer.errors import UserError
from peer.log import get_logger
from peer.network.holders import HOLDERS_WANTED, BadHolders, HolderUse, advertise, read_holders
from peer.protocol import (
    MAX_PROVIDERS,
    AdapterRecord,
    Demand,
    RecordError,
    adapter_key,
    from_dht_value,
    owner_subkey,
    parse_owner_subkey,
    to_dht_value,
)

logger = get_logger(__name__)

HOLDERS_TRIED = 4  # listed holders one round of a fetch asks (then the announcers)
MAX_HINTED = 16  # peers named by refusals that a fetch keeps to ask
HOLDER_TIMEOUT = 10.0  # s a round's providers may stay silent (a made-up holder must not hold a fetch for long;
# a holder at the least --max-upload sends a 1-MiB chunk in about 4 s)
RETRY_EVERY = 0.1  # s before the second round while providers answer "seeded" or "busy"; doubling, jittered, to 1 s
PATIENCE = 5.0  # s a fetch keeps trying rounds: past the learner's seeding grace (3 s), it serves anyone
MAX_POLL = 2.0  # s between two reads of the announcements at most, when versions come slowly (see poll_every)
REDEMAND_EVERY = 2.0  # s between a waiting learner's re-announcements of its version (a fresh demand: alive)
MAX_PUSHED = 32  # followers an announcement is pushed to at most (a sample of them when more are alive)
LOCAL_EVERY = 0.5  # s a follower's wait on its own DHT node's copy of the announcements lasts at most
MAX_LOCAL_SEEN = 4096  # records of that copy a follower remembers having looked at (a full key: ~3,200 at most)


ANNOUNCEMENT_TTL = 600.0


def announce_adapter(
    swarm,
    blobs,
    version: int,
    blob: bytes,
    parent_sha256: str,
    ttl: float = ANNOUNCEMENT_TTL,
    ancestors=(),
    demand: Demand | None = None,
    exempt: Sequence[str] | None = None,
    push_to: Sequence[str] = (),
    replicate: bool = True,
) -> AdapterRecord:
    """Serve ``blob`` from this peer's cache and announce it as adapter ``version`` under this peer's subkey;
    ``ancestors``: the sha256 of the versions before it, newest first (the parent first), as far as known;
    ``demand``: what this learner consumes (rollout peers pace to it). The blob is *seeded*: served to a couple
    of peers, then to the peers ``exempt`` names (the run's other learners) and, for a few seconds, nobody else
    (see :class:`~peer.network.blobs.server.Seeding`). ``push_to``: the followers whose DHT nodes get the
    announcement too, at once (at most ``MAX_PUSHED`` of them; the module docstring). ``replicate=False``: the
    followers' nodes only, when one of them takes it (else the key's replicas too, as always); the caller stores it
    on the replicas later (:func:`store_announcement`), as :class:`~peer.roles.learner.io.Announcer` does."""
    sha = blobs.cache.put_bytes(blob)
    if getattr(blobs, "seeding", None) is not None:
        blobs.seeding.seed(sha, exempt)
    record = AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256=parent_sha256,
        ancestors=list(ancestors) or ([parent_sha256] if parent_sha256 else []),
        size=len(blob),
        providers=[str(swarm.peer_id)],
        created=time.time(),
        learner=str(swarm.peer_id),
        demand=demand,
    )
    key, subkey, value = adapter_key(swarm.run_id), owner_subkey(swarm.public_key), to_dht_value(record)
    followers = list(push_to)
    if len(followers) > MAX_PUSHED:
        followers = random.sample(followers, MAX_PUSHED)
    if not replicate and followers:
        item = (key, subkey, value, time.time() + ttl)
        if swarm.deliver([item], followers, "adapter announcement")[0]:
            return record
        followers = []  # none took it: the replicas, now
    store_announcement(swarm, record, ttl, push_to=followers)
    return record


def store_announcement(swarm, record: AdapterRecord, ttl: float = ANNOUNCEMENT_TTL, push_to: Sequence[str] = ()):
    """Store this peer's announcement ``record`` on the adapter key's replicas (and push it to ``push_to``)."""
    key, subkey, value = adapter_key(swarm.run_id), owner_subkey(swarm.public_key), to_dht_value(record)
    followers = list(push_to)
    for attempt in range(4):  # a store can come back refused under load; the retry expires later, so it wins
        also = tuple(followers) if attempt == 0 else ()  # pushed once, in the background; they read the key anyway
        item = (key, subkey, value, time.time() + ttl)
        if swarm.store_many([item], "adapter announcement", narrow=True, also=also)[0]:
            break
        time.sleep(0.25 * 2**attempt)
    else:
        raise UserError(
            f"no DHT node accepted the announcement of adapter v{record.version}; check this peer's connection"
        )


@dataclass(frozen=True)
class Announcement:
    version: int
    sha256: str
    size: int
    providers: tuple[str, ...]  # base58 peer ids
    announcers: int
    parent_sha256: str = ""
    created: float = 0.0  # wall time of the earliest announcement of these bytes (as its signer's clock says)
    demand: Demand | None = None  # of the latest announcement of these bytes
    demand_created: float = 0.0  # that announcement's time (a learner re-announces while it waits for groups)


def announcements(swarm, admitted=None, local: bool = False) -> list[tuple[bytes, AdapterRecord]]:
    """Every well-formed adapter announcement of the run with the key that signed it; with ``admitted`` (an
    :class:`~peer.network.admission.Admitted`) only those of admitted learners (and the coordinator's v0);
    ``local``: those this peer's own DHT node holds (pushed to it, or as a replica), without a network read."""
    key = adapter_key(swarm.run_id)
    out = []
    for subkey, item in (swarm.local_dict(key) if local else swarm.get_dict(key)).items():
        try:
            signer, record = parse_owner_subkey(subkey), from_dht_value(AdapterRecord, item.value)
        except (RecordError, ValueError):
            continue
        if admitted is not None and (why := admitted.admits_announcement(signer, record)) is not None:
            admitted.refuse(signer, f"its announcement of adapter v{record.version} was ignored: {why}")
            continue
        out.append((signer, record))
    return out


def descends(record: AdapterRecord, held_version: int, held_sha: str) -> bool | None:
    """Whether ``record`` descends from the version this peer holds: True, False (another lineage), or None (too
    far ahead for its ancestors to tell, or not newer)."""
    gap = record.version - held_version
    if gap < 1 or held_version < 0:
        return None
    if gap == 1:
        return record.parent_sha256 == held_sha
    return record.ancestors[gap - 1] == held_sha if gap - 1 < len(record.ancestors) else None


def newest_announcement(
    records: list[tuple[bytes, AdapterRecord]], held: tuple[int, str] | None = None
) -> Announcement | None:
    """The highest version announced (the sha256 most signers announced for it). With ``held`` (version, sha256
    this peer holds), a version that provably descends from it wins over any that provably does not: another
    lineage is taken only once no announcement of a newer version continues the held one (every admitted learner
    left it: a fork resolved among them)."""
    if not records:
        return None
    if held is not None:
        newer = [(k, r) for k, r in records if r.version > held[0]]
        verdicts = [(k, r, descends(r, *held)) for k, r in newer]
        kept = [(k, r) for k, r, d in verdicts if d is not False]
        if kept and len(kept) < len(newer):
            records = kept
        elif newer and not kept:
            logger.warning(
                "every newer adapter announced is of another lineage than v%d (%s…) held here: following it",
                held[0],
                held[1][:12],
            )
    top = max(r.version for _, r in records)
    by_sha: dict[tuple[str, int], list[AdapterRecord]] = defaultdict(list)
    for _, record in records:
        if record.version == top:
            by_sha[(record.sha256, record.size)].append(record)
    (sha, size), chosen = max(by_sha.items(), key=lambda kv: (len(kv[1]), -min(r.created for r in kv[1])))
    providers = tuple(dict.fromkeys(p for r in sorted(chosen, key=lambda r: r.created) for p in r.providers))
    first = min(chosen, key=lambda r: r.created)
    measured = [r for r in chosen if r.demand is not None]  # the leader's (a helper serving it says none)
    latest = max(measured, key=lambda r: r.created) if measured else None
    return Announcement(
        top,
        sha,
        size,
        providers[:MAX_PROVIDERS],
        len(chosen),
        first.parent_sha256,
        first.created,
        latest.demand if latest else None,
        latest.created if latest else 0.0,
    )


def _retry_later(reason: str) -> bool:
    """A provider that may deliver if asked again soon: it seeds the blob to others first, its slots are full, or it
    does not have the blob yet (a holder named a moment before it stored it)."""
    from peer.network.blobs.fetch import answered_later

    return answered_later(reason) or reason.startswith("answered: does not have")


def fetch_adapter(
    blobs,
    sha256: str,
    size: int,
    announced: Sequence[str],
    others: Callable[[], Sequence] | None,
    timeout: float,
    progress=None,
    *,
    holders: Callable[[], Sequence[str]] | None = None,
    bad=None,
    refused: Callable[[], None] | None = None,
    patience: float = PATIENCE,
    clock=time.monotonic,
    sleep=time.sleep,
) -> bytes:
    """The bytes of adapter ``sha256``.

    In rounds: up to ``HOLDERS_TRIED`` holders — first the peers earlier refusals named as having it (a server
    that answers "seeded" or "busy" names whom it gave the blob to lately: the spread grows like a tree without a
    DHT record per holder), then those ``holders()`` lists (base58 ids, in random order) — then the peers that
    announced it (in random order). While some provider answers "seeded" or "busy" (a learner sends a
    new version to a couple of peers first), ``holders()`` is read again after ``RETRY_EVERY`` seconds, doubling
    to 1 s with ±50 % jitter (all of a swarm's fetchers read the same holders key at once), for up to ``patience``
    seconds. In these rounds a provider may stay silent ``HOLDER_TIMEOUT`` seconds at most. A
    provider that failed otherwise is not asked again, and a holder that failed is added to ``bad`` (a
    :class:`~peer.network.holders.BadHolders`: not asked for a while, by any fetch). Then the peers ``others()``
    names (PeerIDs: the run's live peers). ``progress(done, total)`` is called as bytes arrive (``done`` restarts
    at 0 with each provider). ``refused()`` is called after each round in which a provider answered "later".

    :raises BlobUnavailable: nobody delivered; the message says what each provider did.
    """
    from hivemind.p2p import PeerID

    from peer.network.blobs import BlobUnavailable

    failed: set[str] = set()
    failure: BlobUnavailable | None = None  # the last round's
    hinted: list[str] = []  # peers the refusals named as holding it: asked first
    deadline = clock() + patience
    wait = RETRY_EVERY
    while True:
        listed = [
            h
            for h in (holders() if holders is not None else ())
            if h not in failed and h not in announced and (bad is None or h not in bad)
        ]
        random.shuffle(listed)
        usable = [h for h in hinted if h not in failed and h not in announced and (bad is None or h not in bad)]
        listed = list(dict.fromkeys(usable + listed))
        first = [p for p in announced if p not in failed]
        random.shuffle(first)
        asked = listed[:HOLDERS_TRIED]
        order = [PeerID.from_base58(p) for p in asked + first]
        if not order:
            break
        try:
            return blobs.fetch(
                sha256, size, order, progress=progress, timeout=min(timeout, HOLDER_TIMEOUT), shuffle=False
            ).read_bytes()
        except BlobUnavailable as e:
            failure = e
            hinted = list(dict.fromkeys(e.hints + hinted))[:MAX_HINTED]
            later = {p for p, why in e.reasons.items() if _retry_later(why)}
            failed |= set(e.reasons) - later
            if later and refused is not None:
                refused()
            if bad is not None:
                bad.add(p for p in asked if p in failed)
            if not later or clock() >= deadline:
                break
        sleep(wait * random.uniform(0.5, 1.5))
        wait = min(1.0, 2 * wait)
    tried = set(announced) | failed
    rest = [p for p in (others() if others is not None else []) if p.to_base58() not in tried]
    if not rest:
        if failure is not None:
            raise failure
        raise BlobUnavailable(f"Could not fetch adapter {sha256[:12]}…: no peer is known to serve it; retry later.")
    logger.info("no holder or announcer delivered adapter %s…; asking %d other peer(s)", sha256[:12], len(rest))
    random.shuffle(rest)
    return blobs.fetch(sha256, size, rest, progress=progress, timeout=timeout, shuffle=False).read_bytes()


def serves(swarm, blobs) -> bool:
    """Whether other peers can fetch blobs from this one (it runs a blob server and is not in client mode)."""
    return getattr(blobs, "server", None) is not None and not getattr(swarm.config, "client_mode", False)


def fetch_version(
    swarm,
    blobs,
    found: Announcement,
    others: Callable[[], Sequence] | None,
    timeout: float,
    progress=None,
    bad=None,
    *,
    list_self: bool = True,
    use: HolderUse | None = None,
) -> tuple[bytes, int | None]:
    """:func:`fetch_adapter` of an announced version, its listed holders first (``bad``: see there); the blob, and
    how many holders were listed when it came (None: not read). With ``list_self``, this peer then lists itself
    (:func:`say_held`). With ``use`` (a follower's :class:`~peer.network.holders.HolderUse`), the holders are read
    first only as it says, or once a provider refused this fetch, and the refusal is told to it."""
    listed: list[str] = []
    read = [False]  # whether the holders key was read in this fetch
    told: list[bool] = []

    def holders() -> list[str]:
        if use is not None and not use.first(found.version):
            return []  # the announcers first: no provider refused this follower lately (nor in this fetch)
        read[0] = True
        try:
            listed[:] = read_holders(swarm, found.version, found.sha256, found.size)
        except Exception as e:  # the network boundary: fetch from the announcers then
            logger.debug("could not read the holders of v%d: %s", found.version, e)
        return listed

    def refused() -> None:
        if use is not None and not told:
            told.append(True)
            use.refused(found.version)

    blob = fetch_adapter(
        blobs,
        found.sha256,
        found.size,
        found.providers,
        others,
        timeout,
        progress,
        holders=holders,
        bad=bad,
        refused=refused,
    )
    if getattr(blobs, "seeding", None) is not None:
        blobs.seeding.pass_on(found.sha256)  # served to a couple of peers at a time (see Seeding)
    count = len(listed) if read[0] else None
    if list_self:
        say_held(swarm, blobs, found, count)
    return blob, count


def say_held(swarm, blobs, found: Announcement, listed: int | None) -> None:
    """List this peer as a holder of ``found`` if it serves blobs and fewer than ``HOLDERS_WANTED`` were listed
    (``listed`` None: the holders were not read, nobody refused this follower lately, so nobody reads them)."""
    if serves(swarm, blobs) and listed is not None and listed < HOLDERS_WANTED:
        try:
            advertise(swarm, found.version, found.sha256, found.size)
        except Exception as e:  # the network boundary: the version still spreads from the others
            logger.debug("could not say this peer holds v%d: %s", found.version, e)


class Received:
    """Counts the bytes of blob transfers from ``progress(done, total)`` calls (``done`` restarts with each
    provider, so bytes of refused or cut transfers count too): what a follower moved over the network."""

    def __init__(self):
        self.bytes = 0
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        self.bytes += done - self._done if done >= self._done else done
        self._done = done

    def next_transfer(self) -> None:
        self._done = 0


class AdapterFollower:
    """Poll the announcements every ``interval`` seconds; prefetch the blob of a version newer than ``held``.

    ``others``: the peers to ask for a blob its announcers do not deliver (see :func:`fetch_adapter`);
    ``admitted``: whose announcements count (see :func:`announcements`; None: everyone's, for tests of the parts).
    """

    def __init__(
        self,
        swarm,
        blobs,
        held_version: int,
        *,
        interval: float = 0.5,
        local_every: float = LOCAL_EVERY,
        fetch_timeout: float = 30.0,
        others: Callable[[], Sequence] | None = None,
        admitted=None,
        check: Callable[[bytes], str | None] | None = None,
        held_sha: str = "",
    ):
        self.swarm = swarm
        self.blobs = blobs
        self.others = others
        self.admitted = admitted
        self.refused: dict[str, str] = {}  # sha256 of versions refused -> why (bounded)
        self.check = check  # blob -> None if this model can load it, else why not
        self.interval = interval
        self.local_every = local_every  # s one wait on this node's own copy lasts (0: never; the module docstring)
        self._local_seen: dict = {}  # subkey -> expiration of the records of this node's copy already looked at
        self._local_since = -1  # the DHT process's number of its latest store when the copy was last read
        self.version_interval = 0.0  # s between versions, a moving average of what was announced (0: not known)
        self.fetch_timeout = fetch_timeout
        self.held_version = held_version
        self.held_sha = held_sha  # what this peer holds at held_version ("" : unknown, no descent check)
        self.latest_seen: Announcement | None = None
        self.demand: Demand | None = None  # of the newest announcement: what the learners consume (pacing)
        self.demand_seen = 0.0  # monotonic time the newest version (or its latest re-announcement) came here
        self._demand_of: tuple[int, str, float] | None = None
        self.received = Received()  # adapter bytes fetched over the network
        self.bad = BadHolders()  # holders that failed this peer lately
        self.holder_use = HolderUse()  # whether to read a version's holders first (and list itself): after refusals
        self.fetches = 0  # adapter versions fetched
        self.fetched_at: tuple[int, float] = (-1, 0.0)  # (version, wall time) of the newest fetch made ready
        self._ready: tuple[Announcement, bytes] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-follower", daemon=True)

    def start(self) -> AdapterFollower:
        self._thread.start()
        return self

    def take(self) -> tuple[Announcement, bytes] | None:
        """The newest prefetched (announcement, blob) not yet taken, if any."""
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, or less if a newer version gets ready (for a waiting sampler)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def mark_held(self, version: int, sha: str = "") -> None:
        with self._lock:
            if version >= self.held_version:
                self.held_version, self.held_sha = version, sha

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.fetch_timeout + 5)

    def refuse(self, sha256: str, why: str) -> None:
        """Never take adapter ``sha256`` again (its blob would not load, or the model then held other bytes)."""
        with self._lock:
            if sha256 not in self.refused:
                logger.warning("refused adapter %s…: %s", sha256[:12], why)
            self.refused[sha256] = why
            while len(self.refused) > 256:
                self.refused.pop(next(iter(self.refused)))

    def poll(self, network: bool = True) -> None:
        """One look at the table (the thread calls this; tests may too): the network's and this node's own copy
        (``network=False``: the own copy only, right after it showed a newer version)."""
        records = [(k, r) for k, r in self.records(network) if r.sha256 not in self.refused]
        with self._lock:
            held = (self.held_version, self.held_sha) if self.held_sha else None
        found = newest_announcement(records, held)
        if found is None:
            return
        heard = (found.version, found.sha256, found.demand_created)
        if heard != self._demand_of:  # a new version, or the same re-announced: a live learner; when it came
            self._demand_of, self.demand_seen = heard, time.monotonic()
        self.demand = found.demand  # the newest version's learner says what it consumes (None: not yet measured)
        with self._lock:
            known = self._newest_known()
        if found.version <= known:
            return
        if self.latest_seen is None or self.latest_seen.version < found.version:
            if self.latest_seen is not None and found.created > self.latest_seen.created:
                gap = (found.created - self.latest_seen.created) / (found.version - self.latest_seen.version)
                self.version_interval = gap if not self.version_interval else 0.8 * self.version_interval + 0.2 * gap
            self.latest_seen = found
            logger.debug(  # once per version: a rollout peer's progress line says which it holds
                "adapter version %d announced (%s…, %d announcer(s))",
                found.version,
                found.sha256[:12],
                found.announcers,
            )
        self.received.next_transfer()
        blob, listed = fetch_version(
            self.swarm,
            self.blobs,
            found,
            self.others,
            self.fetch_timeout,
            self.received,
            self.bad,
            list_self=False,
            use=self.holder_use,
        )
        self.fetches += 1
        if self.check is not None and (why := self.check(blob)) is not None:
            self.refuse(found.sha256, f"adapter v{found.version} {why}")
            return
        with self._lock:
            if found.version > self._newest_known():
                self._ready = (found, blob)
                self.fetched_at = (found.version, time.time())
        self._wake.set()
        say_held(self.swarm, self.blobs, found, listed)  # after the sampler has it: this store takes a while

    def records(self, network: bool = True) -> list[tuple[bytes, AdapterRecord]]:
        """The network's announcements and this node's own copy's, the newest of each signer."""
        found = announcements(self.swarm, self.admitted) if network else []
        if self.local_every > 0:
            try:
                found += announcements(self.swarm, self.admitted, local=True)
            except Exception as e:  # the DHT process is busy or gone: the network's are enough
                logger.debug("could not read this node's announcements: %s", e)
        newest: dict[bytes, AdapterRecord] = {}
        for signer, record in found:
            held = newest.get(signer)
            if held is None or (record.version, record.created) > (held.version, held.created):
                newest[signer] = record
        return list(newest.items())

    def _newest_known(self) -> int:
        """The newest version held or waiting to be taken (call with the lock held)."""
        return max(self.held_version, self._ready[0].version if self._ready else -1)

    def _run(self) -> None:
        network = True
        while not self._stop.is_set():
            try:
                self.poll(network)
            except Exception as e:  # the network boundary: a bad announcement or a failed fetch; try again
                logger.warning("could not follow the newest adapter: %s", e)
                self._stop.wait(min(5.0, 4 * self.interval))
            network = not self._watch(self.poll_every())

    def _watch(self, seconds: float) -> bool:
        """Wait ``seconds`` for the next read of the network, waiting on this node's own copy of the announcements
        meanwhile (at most ``local_every`` s a call); return True early when it holds a version newer than this peer
        knows."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.local_every <= 0:
                self._stop.wait(left)
                return False
            newer = self._look(min(self.local_every, left))
            if newer is None:  # the DHT process is busy or gone: the network read comes anyway
                self._stop.wait(min(self.local_every, left))
            elif newer:
                return True
        return False

    def local_newer(self) -> bool:
        """Whether this node's own copy of the announcements (what learners pushed to it, or holds as a replica)
        names a version newer than this peer holds or waits to take, announced by an admitted learner. Only records
        not looked at before are parsed; a stranger's pushed records are read once and never followed."""
        return bool(self._look(0.0))

    def _look(self, wait: float) -> bool | None:
        """:meth:`local_newer`, once the copy changed since the last look or ``wait`` s passed (0: at once); None if
        the DHT process did not answer."""
        key = adapter_key(self.swarm.run_id)
        try:
            self._local_since, found = self.swarm.wait_local({key: ()}, self._local_since if wait > 0 else -1, wait)
        except Exception as e:  # the DHT process is busy or gone
            logger.debug("could not read this node's announcements: %s", e)
            return None
        with self._lock:
            known = self._newest_known()
        newer = False
        for subkey, item in found[key].items():
            if self._local_seen.get(subkey) == item.expiration_time:
                continue
            self._local_seen[subkey] = item.expiration_time
            try:
                signer, record = parse_owner_subkey(subkey), from_dht_value(AdapterRecord, item.value)
            except (RecordError, ValueError):
                continue
            if self.admitted is not None and self.admitted.admits_announcement(signer, record) is not None:
                continue
            newer = newer or (record.version > known and record.sha256 not in self.refused)
        while len(self._local_seen) > MAX_LOCAL_SEEN:  # the oldest looked at are forgotten first (every node
            # bounds a key to 2 MiB, peer.network.quota: a record and its subkey are ~660 bytes at least)
            self._local_seen.pop(next(iter(self._local_seen)))
        return newer

    def poll_every(self) -> float:
        """Seconds until the next read of the announcements: ``interval``, or a quarter of the time between versions
        when that is longer (at most ``MAX_POLL``). Every peer reads the same key, so its nodes serve N reads per
        poll; with slow versions (a real model's) fewer reads cost a version at most a quarter of its interval."""
        return max(self.interval, min(MAX_POLL, self.version_interval / 4))
