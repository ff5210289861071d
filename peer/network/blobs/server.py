"""Serving blobs from a BlobCache to other peers over a hivemind P2P binary stream handler.

One stream carries one request (see ``peer.network.blobs.wire`` for the frames). The server answers every request
with a header: an unknown blob, a range outside the blob, a refused peer or a full server all get ``ok: False``
and a reason, never a silent hang, so the client moves on to its next provider at once.

What a stream may hold, so that strangers cannot starve the swarm's own peers:

1. **A stream waiting for its request** holds no serving slot. The request (a few hundred bytes, its length
   capped before it is read) must arrive within ``request_timeout`` seconds; at most ``max_waiting`` streams wait
   at once, ``max_waiting_per_peer`` from one remote peer, and a stream beyond either cap is closed at once,
   unanswered. The same tally covers a stream while it is being refused and while it lingers after its last frame.
2. **Serving slots** are taken only by a well-formed, authorized request: ``max_streams`` in all and
   ``max_streams_per_peer`` for one remote peer id; beyond, the answer is "busy" (the client tries another
   provider).
3. **Seeding** (a learner's new adapter versions, :class:`Seeding`): the first ``copies`` requests for a blob marked
   with :meth:`Seeding.seed` are served, later ones answered "seeded" until ``grace`` seconds after the first, so the
   other peers fetch it from those that hold it (docs/blobs.md, "Spreading adapters"): the learner's upload per
   version stays about ``copies`` blobs whatever the number of peers.
4. **Upload rate** (``max_upload`` bytes/s, a volunteer's ``--max-upload``): every stream's data goes through one
   token bucket, and the serving slots shrink so that each stream still gets twice ``MIN_RATE``.
5. **A transfer** ends when the client leaves our writes unread for ``timeout`` seconds, and in any case after
   ``attempt_deadline(length, timeout)`` (the client's own deadline: ``timeout`` plus the time at ``MIN_RATE``),
   so a reader that keeps taking a byte now and then cannot hold a slot for ever.

``ServerStats`` counts the streams and every refusal by its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from peer.log import get_logger
from peer.network.blobs.cache import BlobCache
from peer.network.blobs.fetch import MIN_RATE, attempt_deadline
from peer.network.blobs.wire import (
    CHUNK_SIZE,
    LATER,
    MAX_CHUNK,
    MAX_HINTS,
    MAX_REQUEST,
    PROTOCOL,
    BlobRequest,
    BlobResponse,
    ProtocolError,
    frame_prefix,
    read_header,
    write_chunk,
    write_end,
    write_header,
)

logger = get_logger(__name__)

MAX_STREAMS = 8  # requests served at once
MAX_STREAMS_PER_PEER = 2  # requests of one remote peer served at once
REQUEST_TIMEOUT = 5.0  # seconds a new stream may take to send its request (a few hundred bytes)
MAX_WAITING = 64  # streams held without a serving slot (waiting for their request, being refused, lingering)
MAX_WAITING_PER_PEER = 4  # the same, from one remote peer
SEED_COPIES = 2  # requests served for a newly seeded blob before "seeded" answers
SEED_GRACE = 3.0  # s after the first of them: then it is served to anyone (holders did not deliver in time)
PER_ADAPTER_STREAMS = 2  # transfers of one adapter a peer that passes it on serves at once (a tree, not a star)
MIN_UPLOAD = 2 * MIN_RATE  # bytes/s: the least --max-upload (one stream at twice a fetch's slowest allowed rate)

Authorize = Callable[[PeerID, "str | None"], "str | None"]
"""``(remote peer id, the invite its request carries) -> None`` to serve it, or the reason it is refused."""
ChunkTransform = Callable[[int, bytes], "bytes | None | Awaitable[bytes | None]"]
"""Fault injection, for tests and benchmarks only: ``(offset, chunk) -> bytes to send instead``, or None to drop
the stream right there without the end frame (a truncation, like a peer that died mid-transfer); it may be a
coroutine function (a slow provider)."""


def allow_all(peer_id: PeerID, invite: str | None) -> str | None:
    return None


def flip_bytes(offset: int, chunk: bytes) -> bytes:
    """A ChunkTransform that flips one byte in every chunk: a provider that serves corrupt data (tests only)."""
    corrupted = bytearray(chunk)
    corrupted[len(corrupted) // 2] ^= 0xFF
    return bytes(corrupted)


def truncate_after(n_bytes: int) -> ChunkTransform:
    """A ChunkTransform that sends the first ``n_bytes`` of the range, then drops the stream (tests only)."""

    def transform(offset: int, chunk: bytes) -> bytes | None:
        return chunk[: n_bytes - offset] if offset < n_bytes else None

    return transform


def drip(delay: float) -> ChunkTransform:
    """A ChunkTransform that sends every chunk whole but ``delay`` seconds apart: a provider that answers and then
    trickles, never silent long enough for the per-chunk timeout (tests only)."""

    async def transform(offset: int, chunk: bytes) -> bytes:
        await asyncio.sleep(delay)
        return chunk

    return transform


class Seeding:
    """Which blobs this server seeds, and how many requests each got: see the module docstring, point 3.

    :meth:`seed` marks a blob (a learner's newly announced adapter; the newest ``remember`` are kept). For such a
    blob, :meth:`admit` lets ``copies`` requests through, then answers why not until ``grace`` seconds after the
    first one, except to peers in ``exempt`` (base58 ids: the run's other learners, which fetch from their leader).
    Called from the learner's thread (:meth:`seed`) and the server's event loop (:meth:`admit`).

    :meth:`pass_on` marks a blob this peer passes on (an adapter version it fetched): the server sends it to at most
    ``PER_ADAPTER_STREAMS`` peers at once and answers the others "busy", naming whom it gave it to. Spreading one
    blob is bound by upload, so a holder that sends it to 2 peers at a time lets the number of holders grow by
    about 1.7x per transfer time, against 1.3x when it sends it to 8 at once (docs/scale.md).
    """

    def __init__(self, copies: int = SEED_COPIES, grace: float = SEED_GRACE, remember: int = 64, clock=time.monotonic):
        if copies < 1 or grace < 0:
            raise ValueError(f"copies must be >= 1 and grace >= 0, got {copies} and {grace}")
        self.copies, self.grace, self.remember, self._clock = copies, grace, remember, clock
        self.exempt: frozenset[str] = frozenset()
        self._blobs: OrderedDict[str, list] = OrderedDict()  # sha256 -> [time of the first copy or None, copies]
        self._passed: OrderedDict[str, None] = OrderedDict()  # adapters passed on (the newest ``remember``)
        self._lock = threading.Lock()

    def seed(self, sha256: str, exempt: Collection[str] | None = None) -> None:
        with self._lock:
            if exempt is not None:
                self.exempt = frozenset(exempt)
            if sha256 not in self._blobs:
                self._blobs[sha256] = [None, 0]
                while len(self._blobs) > self.remember:
                    self._blobs.popitem(last=False)

    def pass_on(self, sha256: str) -> None:
        with self._lock:
            self._passed[sha256] = None
            self._passed.move_to_end(sha256)
            while len(self._passed) > self.remember:
                self._passed.popitem(last=False)

    def passes_on(self, sha256: str) -> bool:
        with self._lock:
            return sha256 in self._passed

    def admit(self, peer: str, sha256: str) -> str | None:
        """None to serve ``peer`` blob ``sha256`` now (counted as a copy), else why not."""
        with self._lock:
            entry = self._blobs.get(sha256)
            if entry is None or peer in self.exempt:
                return None
            now = self._clock()
            if entry[0] is not None and now - entry[0] >= self.grace:
                return None
            if entry[1] >= self.copies:
                return (
                    f"seeded: blob {sha256[:12]}… went to {entry[1]} peers already; fetch it from a peer that holds "
                    f"it, or from here after {self.grace:g} s"
                )
            entry[0] = now if entry[0] is None else entry[0]
            entry[1] += 1
            return None

    def copies_of(self, sha256: str) -> int:
        with self._lock:
            entry = self._blobs.get(sha256)
            return 0 if entry is None else entry[1]


class UploadLimit:
    """A token bucket shared by every stream: ``rate`` bytes/s on average, bursts of one second's worth."""

    def __init__(self, rate: float, clock=time.monotonic):
        if not rate > 0:
            raise ValueError(f"an upload limit must be > 0 bytes/s, got {rate}")
        self.rate, self._clock = float(rate), clock
        self._tokens, self._at = self.rate, clock()

    def delay(self, n: int) -> float:
        """Take ``n`` bytes' worth of tokens; the seconds to wait before sending them (0 when within the rate)."""
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate) - n
        self._at = now
        return max(0.0, -self._tokens / self.rate)

    async def take(self, n: int) -> None:
        if (wait := self.delay(n)) > 0:
            await asyncio.sleep(wait)


@dataclass
class ServerStats:
    """Counters since start. ``refused`` counts every refusal answered with a header; the reason counters below
    it say why (an unknown blob or a range outside it has none of its own); ``crowded`` and ``header_timeout``
    streams are dropped unanswered."""

    requests: int = 0  # streams opened by remote peers
    served: int = 0
    refused: int = 0
    failed: int = 0  # streams that ended early: lost connection, a client silent while we wrote, an error
    bytes_sent: int = 0
    busy: int = 0  # refused: all ``max_streams`` slots were taken
    peer_limit: int = 0  # refused: that peer already held ``max_streams_per_peer`` slots
    seeded: int = 0  # refused: a seeded blob that went to its ``copies`` peers already (see ``Seeding``)
    unauthorized: int = 0  # refused by ``authorize``
    bad_request: int = 0  # refused: a malformed or oversized request
    header_timeout: int = 0  # dropped: no request within ``request_timeout``
    crowded: int = 0  # dropped at once: too many streams waiting without a slot (in all or from that peer)
    too_slow: int = 0  # dropped: the transfer was not done by its deadline


class _Tally:
    """Streams counted against one pair of caps: in all and per remote peer."""

    def __init__(self):
        self.total = 0
        self._by_peer: dict[PeerID, int] = {}

    def of(self, peer: PeerID) -> int:
        return self._by_peer.get(peer, 0)

    def add(self, peer: PeerID) -> _Tally:
        self.total += 1
        self._by_peer[peer] = self.of(peer) + 1
        return self

    def remove(self, peer: PeerID) -> None:
        self.total -= 1
        left = self.of(peer) - 1
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]


class BlobServer:
    """Answers blob requests on ``p2p`` from ``cache``; ``await start()`` registers the handler, ``stop()`` removes it.

    :param authorize: called with the remote peer's id and its request's invite for every request; a reason
      refuses it (default: allow all). A private swarm plugs its invite check in here: the DHT authorizer does
      not cover custom P2P handlers. It runs before the request takes a serving slot.
    :param transform: fault injection for tests and benchmarks only (see ``ChunkTransform``); logs a warning.
    :param max_streams: requests served at once; more are answered "busy" so clients try another provider.
    :param max_streams_per_peer: requests of one remote peer id served at once; more are answered "busy" too.
    :param timeout: seconds a client may leave our writes unread before we drop it; with the transfer's length it
      also sets the transfer's deadline (``attempt_deadline``).
    :param request_timeout: seconds a new stream may take to send its request before we drop it.
    :param max_waiting: streams held without a serving slot at once (see the module's docstring); more are closed.
    :param max_waiting_per_peer: the same for one remote peer id.
    :param linger: after the last frame, seconds to wait for the client to close first (see ``_linger``).
    :param seeding: blobs served to a few peers first (see :class:`Seeding`); None: every blob to anyone.
    :param max_upload: bytes/s all streams together send at most (None: no limit); at least ``MIN_UPLOAD``. The
      serving slots become ``max_upload / MIN_UPLOAD`` if that is fewer than ``max_streams``.

    Lookups run in a worker thread: the first request for a blob whose file changed re-hashes it (see BlobCache),
    which must not stall the other streams on this event loop.
    """

    def __init__(
        self,
        p2p: P2P,
        cache: BlobCache,
        *,
        authorize: Authorize = allow_all,
        transform: ChunkTransform | None = None,
        chunk_size: int = CHUNK_SIZE,
        max_streams: int = MAX_STREAMS,
        max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
        timeout: float = 30.0,
        request_timeout: float = REQUEST_TIMEOUT,
        max_waiting: int = MAX_WAITING,
        max_waiting_per_peer: int = MAX_WAITING_PER_PEER,
        linger: float = 10.0,
        protocol: str = PROTOCOL,
        seeding: Seeding | None = None,
        max_upload: float | None = None,
    ):
        if not 0 < chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK}, got {chunk_size}")
        if max_upload is not None:
            if not max_upload >= MIN_UPLOAD:
                raise ValueError(f"max_upload must be at least {MIN_UPLOAD} bytes/s, got {max_upload}")
            max_streams = max(1, min(max_streams, int(max_upload // MIN_UPLOAD)))
            max_streams_per_peer = min(max_streams_per_peer, max_streams)
        self.seeding = seeding
        self.upload = None if max_upload is None else UploadLimit(max_upload)
        self._gave: OrderedDict[str, deque] = OrderedDict()  # sha256 -> peers that got the whole blob lately
        self._per_blob: dict[str, int] = {}  # sha256 -> streams serving it now
        self.p2p, self.cache, self.protocol = p2p, cache, protocol
        self.authorize, self.transform = authorize, transform
        self.chunk_size, self.timeout, self.linger = chunk_size, timeout, linger
        self.max_streams, self.max_streams_per_peer = max_streams, max_streams_per_peer
        self.request_timeout = request_timeout
        self.max_waiting, self.max_waiting_per_peer = max_waiting, max_waiting_per_peer
        self.stats = ServerStats()
        self._serving = _Tally()  # streams holding a serving slot
        self._waiting = _Tally()  # every other open stream
        self._started = False
        if transform is not None:
            logger.warning(f"blob server {p2p.peer_id} runs with fault injection {transform!r}: tests only")

    @property
    def serving(self) -> int:
        """Serving slots taken now."""
        return self._serving.total

    @property
    def waiting(self) -> int:
        """Streams held now without a serving slot."""
        return self._waiting.total

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.protocol, self._handle)
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self.p2p.remove_binary_stream_handler(self.protocol)

    async def __aenter__(self) -> BlobServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.requests += 1
        peer = info.peer_id
        held: _Tally | None = None  # what this stream counts against now
        try:
            if self._waiting.total >= self.max_waiting or self._waiting.of(peer) >= self.max_waiting_per_peer:
                self.stats.crowded += 1
                logger.debug(
                    f"closed a blob stream from {peer} at once: {self._waiting.of(peer)} of its streams and "
                    f"{self._waiting.total} in all are held without a serving slot already"
                )
                return
            held = self._waiting.add(peer)
            try:
                wire = await asyncio.wait_for(read_header(reader, MAX_REQUEST), self.request_timeout)
            except TimeoutError:
                self.stats.header_timeout += 1
                logger.debug(f"dropped a blob stream from {peer}: no request within {self.request_timeout:g} s")
                return
            except ProtocolError as e:
                request, refusal = None, f"bad request: {e}"
                self.stats.bad_request += 1
            else:
                request, refusal = self._admit(peer, wire)
            if refusal is not None:
                hints = self._hints(request.sha256, peer) if request and refusal.startswith(LATER) else ()
                await self._refuse(writer, refusal, hints)
                await self._linger(reader)
                return
            self._waiting.remove(peer)
            held = self._serving.add(peer)
            sha = request.sha256
            self._per_blob[sha] = self._per_blob.get(sha, 0) + 1
            try:
                complete = await self._serve(peer, request, writer)
            finally:
                self._per_blob[sha] -= 1
                if not self._per_blob[sha]:
                    del self._per_blob[sha]
            self._serving.remove(peer)
            held = self._waiting.add(peer)  # past the caps: it was admitted already, and lingers briefly
            if complete:
                await self._linger(reader)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            self.stats.failed += 1
            logger.debug(f"blob stream with {peer} ended early: {type(e).__name__}: {e}")
        except Exception:
            self.stats.failed += 1
            logger.exception(f"blob server failed on a request from {peer}")
        finally:
            if held is not None:
                held.remove(peer)
            writer.close()

    def _admit(self, peer: PeerID, wire: dict) -> tuple[BlobRequest | None, str | None]:
        """``(request, None)`` if it may take a serving slot now, else ``(request or None, why not)``."""
        try:
            request = BlobRequest.from_wire(wire)
        except ProtocolError as e:
            self.stats.bad_request += 1
            return None, f"bad request: {e}"
        refused = self.authorize(peer, request.invite)
        if refused is not None:
            self.stats.unauthorized += 1
            logger.info(f"refused blob {request.sha256[:12]}… to unauthorized peer {peer}: {refused}")
            return request, f"not authorized ({refused}): this peer serves blobs to its swarm's peers only"
        if self._serving.of(peer) >= self.max_streams_per_peer:
            self.stats.peer_limit += 1
            return request, (
                f"busy: serving {self._serving.of(peer)} streams of your peer already, the most one peer gets; "
                "try another provider"
            )
        if self._serving.total >= self.max_streams:
            self.stats.busy += 1
            return request, f"busy: serving {self._serving.total} streams already; try another provider"
        serving_it = self._per_blob.get(request.sha256, 0)
        if self.seeding is not None and serving_it >= PER_ADAPTER_STREAMS and self.seeding.passes_on(request.sha256):
            self.stats.busy += 1
            return request, f"busy: sending this blob to {serving_it} peers already; ask the peers named here"
        if self.seeding is not None and (why := self.seeding.admit(str(peer), request.sha256)) is not None:
            self.stats.seeded += 1
            return request, why
        return request, None

    async def _linger(self, reader: asyncio.StreamReader) -> None:
        """Wait (bounded) for the client to close its side before closing ours.

        Closing right after the last write can lose the tail of the data: p2pd then tears the libp2p stream down
        while the end of it may still be in flight. The client closes as soon as it has read the end frame (or the
        error header), so this normally returns within a round trip.
        """
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(1), self.linger)

    async def _serve(self, peer: PeerID, request: BlobRequest, writer: asyncio.StreamWriter) -> bool:
        """Answer one admitted request; False when the stream must be dropped at once (fault injection's truncation,
        or a transfer past its deadline)."""
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.cache.has, request.sha256):
            await self._refuse(writer, f"does not have blob {request.sha256[:12]}…")
            return True
        with await loop.run_in_executor(None, self.cache.open, request.sha256) as f:
            size = f.seek(0, 2)
            end = size if request.length is None else request.offset + request.length
            if request.offset > size or end > size:
                await self._refuse(writer, f"range {request.offset}+{end - request.offset} is outside {size} bytes")
                return True
            deadline = attempt_deadline(end - request.offset, self.timeout)
            try:
                async with asyncio.timeout(deadline) as within:
                    write_header(writer, BlobResponse(ok=True, size=size, length=end - request.offset).to_wire())
                    if not await self._send_range(f, request.offset, end, writer):
                        return False
                    write_end(writer)
                    await asyncio.wait_for(writer.drain(), self.timeout)
            except TimeoutError:
                if not within.expired():
                    raise  # our writes sat unread for ``timeout`` s
                self.stats.too_slow += 1
                logger.info(
                    f"dropped a transfer of blob {request.sha256[:12]}… to {peer}: not done after {deadline:.0f} s"
                )
                return False
        self.stats.served += 1
        if request.offset == 0 and end == size:
            self._remember(request.sha256, peer)
        return True

    def _remember(self, sha256: str, peer: PeerID) -> None:
        """``peer`` got all of blob ``sha256``: a refusal of it names such peers (see ``BlobResponse.hints``)."""
        gave = self._gave.pop(sha256, None) or deque(maxlen=2 * MAX_HINTS)
        gave.append(peer.to_base58())
        self._gave[sha256] = gave
        while len(self._gave) > 64:
            self._gave.popitem(last=False)

    def _hints(self, sha256: str, asking: PeerID) -> tuple[str, ...]:
        others = [p for p in self._gave.get(sha256, ()) if p != asking.to_base58()]
        return tuple(random.sample(others, min(MAX_HINTS, len(others))))

    async def _send_range(self, f, offset: int, end: int, writer: asyncio.StreamWriter) -> bool:
        """Send [offset, end) of ``f`` as data frames; False if fault injection cut the stream."""
        if self.transform is not None:
            return await self._send_transformed(f, offset, end, writer)
        loop = asyncio.get_running_loop()
        while offset < end:
            n = min(self.chunk_size, end - offset)
            if self.upload is not None:
                await self.upload.take(n)
            writer.write(frame_prefix(n))
            # zero-copy from the page cache to the daemon's socket (asyncio falls back to read/write elsewhere);
            # it first waits for what is queued to be written, so a client that stops reading stalls it here
            sent = await asyncio.wait_for(loop.sendfile(writer.transport, f, offset, n), self.timeout)
            if sent != n:
                raise OSError(f"blob file shrank while being served (at byte {offset + sent})")
            offset += n
            self.stats.bytes_sent += n
        return True

    async def _send_transformed(self, f, offset: int, end: int, writer: asyncio.StreamWriter) -> bool:
        f.seek(offset)
        while offset < end:
            chunk = f.read(min(self.chunk_size, end - offset))
            if not chunk:
                raise OSError(f"blob file shrank while being served (at byte {offset})")
            payload = self.transform(offset, chunk)
            if inspect.isawaitable(payload):
                payload = await payload
            if payload is None:
                return False
            if payload:
                if self.upload is not None:
                    await self.upload.take(len(payload))
                write_chunk(writer, payload)
                await asyncio.wait_for(writer.drain(), self.timeout)
                self.stats.bytes_sent += len(payload)
            offset += len(chunk)
        return True

    async def _refuse(self, writer: asyncio.StreamWriter, reason: str, hints: tuple[str, ...] = ()) -> None:
        self.stats.refused += 1
        write_header(writer, BlobResponse(ok=False, error=reason, hints=hints).to_wire())
        await asyncio.wait_for(writer.drain(), self.timeout)
