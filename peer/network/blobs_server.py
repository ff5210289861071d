"""Serving blobs from a BlobCache to other peers over a hivemind P2P binary stream handler.

One stream carries one request (see ``peer.network.blobs_wire`` for the frames). The server answers every request
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
3. **A transfer** ends when the client leaves our writes unread for ``timeout`` seconds, and in any case after
   ``attempt_deadline(length, timeout)`` (the client's own deadline: ``timeout`` plus the time at ``MIN_RATE``),
   so a reader that keeps taking a byte now and then cannot hold a slot for ever.

``ServerStats`` counts the streams and every refusal by its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from peer.log import get_logger
from peer.network.blobs_cache import BlobCache
from peer.network.blobs_fetch import attempt_deadline
from peer.network.blobs_wire import (
    CHUNK_SIZE,
    MAX_CHUNK,
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
    ):
        if not 0 < chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK}, got {chunk_size}")
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
                await self._refuse(writer, refusal)
                await self._linger(reader)
                return
            self._waiting.remove(peer)
            held = self._serving.add(peer)
            complete = await self._serve(peer, request, writer)
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
        return True

    async def _send_range(self, f, offset: int, end: int, writer: asyncio.StreamWriter) -> bool:
        """Send [offset, end) of ``f`` as data frames; False if fault injection cut the stream."""
        if self.transform is not None:
            return await self._send_transformed(f, offset, end, writer)
        loop = asyncio.get_running_loop()
        while offset < end:
            n = min(self.chunk_size, end - offset)
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
                write_chunk(writer, payload)
                await asyncio.wait_for(writer.drain(), self.timeout)
                self.stats.bytes_sent += len(payload)
            offset += len(chunk)
        return True

    async def _refuse(self, writer: asyncio.StreamWriter, reason: str) -> None:
        self.stats.refused += 1
        write_header(writer, BlobResponse(ok=False, error=reason).to_wire())
        await asyncio.wait_for(writer.drain(), self.timeout)
