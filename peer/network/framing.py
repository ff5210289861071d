"""Length-prefixed frames on a libp2p stream: the bottom layer of every stream protocol of the project.

A frame is a 4-byte big-endian length followed by that many bytes. p2pd does not pass a half-close
(``write_eof``) through to the other side, so a receiver learns where the data ends from the frames alone: data
frames carry 1 to ``MAX_CHUNK`` bytes (``CHUNK_SIZE`` by default; p2pd caps a frame at 4 MiB), and one zero-length
frame, ``END``, ends the data.

Blob transfer (:mod:`peer.network.blobs.wire`) and request/answer calls (:mod:`peer.network.rpc`) are both built
on these frames. A length is checked against its limit before a byte of the frame is read: everything received
is untrusted, and a violation raises :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio

PREFIX_BYTES = 4  # the length prefix of every frame
CHUNK_SIZE = 1 << 20
MAX_CHUNK = 4 << 20
_ORDER = "big"
END = (0).to_bytes(PREFIX_BYTES, _ORDER)


class ProtocolError(ValueError):
    """The other side sent something this protocol does not allow."""


def frame_prefix(n: int) -> bytes:
    """The length prefix of a data frame of ``n`` bytes (1..MAX_CHUNK: an empty frame would end the data)."""
    if not 0 < n <= MAX_CHUNK:
        raise ValueError(f"data frames carry 1..{MAX_CHUNK} bytes, got {n}")
    return n.to_bytes(PREFIX_BYTES, _ORDER)


def length_prefix(n: int) -> bytes:
    """The length prefix of a frame of ``n`` bytes, unchecked (a header frame's: its protocol bounds it)."""
    return n.to_bytes(PREFIX_BYTES, _ORDER)


def write_chunk(writer: asyncio.StreamWriter, chunk: bytes | memoryview) -> None:
    """Queue one data frame (the caller drains)."""
    writer.write(frame_prefix(len(chunk)))
    writer.write(chunk)


def write_end(writer: asyncio.StreamWriter) -> None:
    """Queue the end frame (the caller drains)."""
    writer.write(END)


async def read_length(reader: asyncio.StreamReader) -> int:
    """The length prefix of the next frame, unchecked (the caller checks it before reading the frame)."""
    return int.from_bytes(await reader.readexactly(PREFIX_BYTES), _ORDER)


async def read_chunk_length(reader: asyncio.StreamReader) -> int:
    """The length of the next data frame, at most ``MAX_CHUNK`` (ProtocolError otherwise); 0 is the end frame."""
    n = await read_length(reader)
    if n > MAX_CHUNK:
        raise ProtocolError(f"data frame of {n} bytes exceeds {MAX_CHUNK}")
    return n


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """Read one data frame; b"" means the end of the data."""
    n = await read_chunk_length(reader)
    return await reader.readexactly(n) if n else b""


__all__ = [
    "CHUNK_SIZE",
    "END",
    "MAX_CHUNK",
    "PREFIX_BYTES",
    "ProtocolError",
    "frame_prefix",
    "length_prefix",
    "read_chunk",
    "read_chunk_length",
    "read_length",
    "write_chunk",
    "write_end",
]
