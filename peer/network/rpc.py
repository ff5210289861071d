"""Request/response calls between peers over a hivemind P2P binary stream: one msgpack map each way per stream.

A message is the msgpack bytes of one map, sent as the data frames of :mod:`peer.network.blobs_wire` (at most
``MAX_CHUNK`` bytes each: p2pd caps a frame at 4 MiB) and the end frame. Both sides cap what they read
(``limit``) and treat it as untrusted: the receiver gets a plain ``dict`` with string keys, or a
:class:`~peer.network.blobs_wire.ProtocolError`.

    async def handler(peer_id, request: dict) -> dict: ...
    await serve(p2p, "hivegrpo.team.v1", handler, limit=64 << 20)
    answer = await call(p2p, peer_id, "hivegrpo.team.v1", {"op": "work"}, timeout=10, limit=64 << 20)

A handler that raises answers ``{"error": "..."}``; :func:`call` raises :class:`RemoteError` for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgpack
from hivemind.p2p import P2P, PeerID

from peer.log import get_logger
from peer.network.blobs_wire import CHUNK_SIZE, ProtocolError, read_chunk, write_chunk, write_end

logger = get_logger(__name__)

Handler = Callable[[PeerID, dict], Awaitable[dict]]
MAX_ERROR_CHARS = 300


class RemoteError(RuntimeError):
    """The other peer answered with an error (its sentence is the message)."""


def write_message(writer: asyncio.StreamWriter, obj: dict) -> None:
    """Queue ``obj`` as data frames and the end frame (the caller drains)."""
    data = memoryview(msgpack.packb(obj, use_bin_type=True))
    for start in range(0, len(data), CHUNK_SIZE):
        write_chunk(writer, data[start : start + CHUNK_SIZE])
    write_end(writer)


async def read_message(reader: asyncio.StreamReader, limit: int) -> dict:
    """Read one message of at most ``limit`` bytes; ProtocolError on anything but a map with string keys."""
    parts, size = [], 0
    while chunk := await read_chunk(reader):
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"message of over {limit} bytes")
        parts.append(chunk)
    try:
        obj = msgpack.unpackb(b"".join(parts), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is a {type(obj).__name__}, not a map")
    return obj


async def call(p2p: P2P, peer: PeerID, protocol: str, request: dict, *, timeout: float, limit: int) -> dict:
    """Send ``request`` to ``peer``'s handler of ``protocol`` and return its answer (all within ``timeout``)."""

    async def exchange() -> dict:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, protocol)
        try:
            write_message(writer, request)
            await writer.drain()
            answer = await read_message(reader, limit)
        finally:
            writer.close()
        if "error" in answer:
            raise RemoteError(str(answer["error"])[:MAX_ERROR_CHARS])
        return answer

    return await asyncio.wait_for(exchange(), timeout)


async def serve(p2p: P2P, protocol: str, handler: Handler, *, limit: int, read_timeout: float = 30.0) -> None:
    """Register ``handler`` for ``protocol`` on ``p2p`` (remove it with ``p2p.remove_binary_stream_handler``)."""

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await asyncio.wait_for(read_message(reader, limit), read_timeout)
                answer = await handler(info.peer_id, request)
            except ProtocolError as e:
                answer = {"error": f"bad request: {e}"}
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                raise
            except Exception as e:  # the handler's own failure: say it to the caller, keep serving
                logger.exception(f"{protocol} handler failed on a request from {info.peer_id}")
                answer = {"error": f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]}
            write_message(writer, answer)
            await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):  # let the caller read the tail first
                await asyncio.wait_for(reader.read(1), 5.0)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug(f"{protocol} stream with {info.peer_id} ended early: {type(e).__name__}: {e}")
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(protocol, handle)


__all__ = ["RemoteError", "call", "read_message", "serve", "write_message"]
