"""Serving blobs from a BlobCache to other peers over a hivemind P2P binary stream handler.

One stream carries one request (see ``peer.network.blobs_wire`` for the frames). The server answers every request
with a header: an unknown blob, a range outside the blob, a refused peer or a full server all get ``ok: False``
and a reason, never a silent hang, so the client moves on to its next provider at once.
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
from peer.network.blobs_wire import (
    CHUNK_SIZE,
    MAX_CHUNK,
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
    requests: int = 0
    served: int = 0
    refused: int = 0
    failed: int = 0
    bytes_sent: int = 0


class BlobServer:
    """Answers blob requests on ``p2p`` from ``cache``; ``await start()`` registers the handler, ``stop()`` removes it.

    :param authorize: called with the remote peer's id and its request's invite for every request; a reason
      refuses it (default: allow all). A private swarm plugs its invite check in here: the DHT authorizer does
      not cover custom P2P handlers.
    :param transform: fault injection for tests and benchmarks only (see ``ChunkTransform``); logs a warning.
    :param max_streams: requests served at once; more are answered "busy" so clients try another provider.
    :param timeout: seconds a client may take to send its request, or leave our writes unread, before we drop it.
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
        max_streams: int = 8,
        timeout: float = 30.0,
        linger: float = 10.0,
        protocol: str = PROTOCOL,
    ):
        if not 0 < chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK}, got {chunk_size}")
        self.p2p, self.cache, self.protocol = p2p, cache, protocol
        self.authorize, self.transform = authorize, transform
        self.chunk_size, self.max_streams, self.timeout, self.linger = chunk_size, max_streams, timeout, linger
        self.stats = ServerStats()
        self._active = 0
        self._started = False
        if transform is not None:
            logger.warning(f"blob server {p2p.peer_id} runs with fault injection {transform!r}: tests only")

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
        try:
            if self._active >= self.max_streams:
                await self._refuse(writer, f"busy: serving {self._active} streams already; try another provider")
                await self._linger(reader)
                return
            self._active += 1
            try:
                complete = await self._serve(peer, reader, writer)
            finally:
                self._active -= 1
            if complete:
                await self._linger(reader)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            self.stats.failed += 1
            logger.debug(f"blob stream with {peer} ended early: {type(e).__name__}: {e}")
        except Exception:
            self.stats.failed += 1
            logger.exception(f"blob server failed on a request from {peer}")
        finally:
            writer.close()

    async def _linger(self, reader: asyncio.StreamReader) -> None:
        """Wait (bounded) for the client to close its side before closing ours.

        Closing right after the last write can lose the tail of the data: p2pd then tears the libp2p stream down
        while the end of it may still be in flight. The client closes as soon as it has read the end frame (or the
        error header), so this normally returns within a round trip.
        """
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(1), self.linger)

    async def _serve(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the stream must be dropped at once (fault injection's truncation)."""
        try:
            request = BlobRequest.from_wire(await asyncio.wait_for(read_header(reader), self.timeout))
        except ProtocolError as e:
            await self._refuse(writer, f"bad request: {e}")
            return True
        refused = self.authorize(peer, request.invite)
        if refused is not None:
            logger.info(f"refused blob {request.sha256[:12]}… to unauthorized peer {peer}: {refused}")
            await self._refuse(writer, f"not authorized ({refused}): this peer serves blobs to its swarm's peers only")
            return True
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
            write_header(writer, BlobResponse(ok=True, size=size, length=end - request.offset).to_wire())
            if not await self._send_range(f, request.offset, end, writer):
                return False
        write_end(writer)
        await asyncio.wait_for(writer.drain(), self.timeout)
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
            # zero-copy from the page cache to the daemon's socket (asyncio falls back to read/write elsewhere)
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
