"""Request/response calls between peers over a hivemind P2P binary stream: one msgpack map each way per stream.

A message is the msgpack bytes of one map, sent as the data frames of :mod:`peer.network.framing` (at most
``MAX_CHUNK`` bytes each: p2pd caps a frame at 4 MiB) and the end frame. Everything received is untrusted, and is
checked before it can cost the receiver anything:

1. **who** — the server's ``precheck(peer_id)`` (optional; e.g. "is this an admitted learner?") runs before a
   single byte of the request is read: a peer it refuses gets ``{"error": why}`` and its request is never read
   (the server drops at most ``LINGER_DISCARD`` bytes of it unparsed while the caller reads the refusal);
2. **how much** — a message over ``limit`` bytes is refused once its frame headers say so, before the frame that
   would cross the limit is read (a server passes the limit of its largest request, not of its answers);
3. **what shape** — msgpack unpacks with its length limits taken from the message's own size (no string, bin,
   array or map longer than the message, no ext type at all) and, with ``max_containers``, a budget of maps and
   arrays: an empty list is one byte of msgpack and ~60 bytes of Python, so a message made of them would expand
   ~38x (measured: two 16 MiB messages took a learner from 527 to 1,743 MiB); a request whose schema has a few
   maps cannot be made of millions;
4. **what it means** — the caller's schema (e.g. :mod:`peer.roles.learner.team.messages`); here only "a map with string
   keys".

    async def handler(peer_id, request: dict) -> dict: ...
    await serve(p2p, "hivegrpo.team.v2", handler, limit=1 << 20, precheck=admits, max_containers=16)
    answer = await call(p2p, peer_id, "hivegrpo.team.v2", {"op": "work"}, timeout=10, limit=64 << 20)

A handler that raises answers ``{"error": "..."}`` (a :class:`ProtocolError` as ``"bad request: ..."``); :func:`call`
raises :class:`RemoteError` for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgpack
from hivemind.p2p import P2P, PeerID

from peer.log import get_logger
from peer.network.framing import CHUNK_SIZE, ProtocolError, read_chunk_length, write_chunk, write_end
from peer.protocol.serialization import ContainerBudget, TooManyContainers

logger = get_logger(__name__)

Handler = Callable[[PeerID, dict], Awaitable[dict]]
Precheck = Callable[[PeerID], "str | None"]  # run in an executor: it may block (a DHT read)
MAX_ERROR_CHARS = 300
LINGER_DISCARD = 64 << 10  # bytes a server drops unread while it waits for the caller to read its answer


class RemoteError(RuntimeError):
    """The other peer answered with an error (its sentence is the message)."""


def write_message(writer: asyncio.StreamWriter, obj: dict) -> None:
    """Queue ``obj`` as data frames and the end frame (the caller drains)."""
    data = memoryview(msgpack.packb(obj, use_bin_type=True))
    for start in range(0, len(data), CHUNK_SIZE):
        write_chunk(writer, data[start : start + CHUNK_SIZE])
    write_end(writer)


async def read_message(reader: asyncio.StreamReader, limit: int, max_containers: int | None = None) -> dict:
    """Read one message of at most ``limit`` bytes (a frame that would cross it is not read) and unpack it within
    the bounds of the module docstring; ProtocolError on anything but a map with string keys."""
    parts, size = [], 0
    while True:
        n = await read_chunk_length(reader)
        if n == 0:
            break
        if size + n > limit:
            raise ProtocolError(f"message of over {limit} bytes")
        parts.append(await reader.readexactly(n))
        size += n
    return unpack_message(b"".join(parts), max_containers)


def unpack_message(data: bytes, max_containers: int | None = None) -> dict:
    """``data`` (one message's msgpack bytes) as a map with string keys, unpacked within bounds (module docstring)."""
    n = len(data)
    budget = None if max_containers is None else ContainerBudget(max_containers)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,  # no ext type (timestamps included) is part of a message
            **({} if budget is None else {"list_hook": budget, "object_hook": budget}),
        )
    except TooManyContainers:
        raise ProtocolError(f"more than {max_containers} maps and arrays") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message ({type(e).__name__}: {e})"[:MAX_ERROR_CHARS]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is a {type(obj).__name__}, not a map")
    return obj


async def _linger(reader: asyncio.StreamReader, timeout: float = 5.0) -> None:
    """Wait (at most ``timeout`` s) for the caller to close its end, as it does once it has read the answer: a
    stream closed here first can lose the answer in p2pd. What the caller still sends (the rest of a request refused
    unread, or read only up to the limit) is dropped as it comes, at most LINGER_DISCARD bytes: never kept, never
    parsed; a caller still sending after that has its stream closed."""

    async def until_closed() -> None:
        left = LINGER_DISCARD
        while left > 0 and (data := await reader.read(min(left, 1 << 14))):
            left -= len(data)

    with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
        await asyncio.wait_for(until_closed(), timeout)


async def call(
    p2p: P2P,
    peer: PeerID,
    protocol: str,
    request: dict,
    *,
    timeout: float,
    limit: int,
    max_containers: int | None = None,
) -> dict:
    """Send ``request`` to ``peer``'s handler of ``protocol`` and return its answer (all within ``timeout``); the
    answer is bounded by ``limit`` bytes and ``max_containers`` maps and arrays as a request is (module docstring)."""

    async def exchange() -> dict:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, protocol)
        try:
            write_message(writer, request)
            await writer.drain()
            answer = await read_message(reader, limit, max_containers)
        finally:
            writer.close()
        if "error" in answer:
            raise RemoteError(str(answer["error"])[:MAX_ERROR_CHARS])
        return answer

    return await asyncio.wait_for(exchange(), timeout)


async def serve(
    p2p: P2P,
    protocol: str,
    handler: Handler,
    *,
    limit: int,
    precheck: Precheck | None = None,
    max_containers: int | None = None,
    read_timeout: float = 30.0,
) -> None:
    """Register ``handler`` for ``protocol`` on ``p2p`` (remove it with ``p2p.remove_binary_stream_handler``).

    ``limit`` and ``max_containers`` bound a request (module docstring); ``precheck(peer_id)``, when given, runs in
    an executor before anything is read and returns None (go on) or the sentence the refused peer gets."""

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refused = None
        try:
            try:
                if precheck is not None:
                    refused = await asyncio.get_running_loop().run_in_executor(None, precheck, info.peer_id)
                if refused is not None:
                    answer = {"error": str(refused)[:MAX_ERROR_CHARS]}
                else:
                    request = await asyncio.wait_for(read_message(reader, limit, max_containers), read_timeout)
                    answer = await handler(info.peer_id, request)
            except ProtocolError as e:
                answer = {"error": f"bad request: {e}"[:MAX_ERROR_CHARS]}
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                raise
            except Exception as e:  # the handler's own failure: say it to the caller, keep serving
                logger.exception(f"{protocol} handler failed on a request from {info.peer_id}")
                answer = {"error": f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]}
            write_message(writer, answer)
            await writer.drain()
            await _linger(reader)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug(f"{protocol} stream with {info.peer_id} ended early: {type(e).__name__}: {e}")
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(protocol, handle)


__all__ = ["ProtocolError", "RemoteError", "call", "read_message", "serve", "unpack_message", "write_message"]
