"""The wire format of blob transfer (protocol ``hivegrpo.blob.v1``), one request per libp2p stream.

Every frame is a 4-byte big-endian length followed by that many bytes (:mod:`peer.network.framing`, which this
module re-exports): p2pd does not pass a half-close (``write_eof``) through to the other side, so the receiver must
know where the data ends.

    client -> server   header frame: msgpack {"sha256": hex, "offset": int, "length": int | None}
    server -> client   header frame: msgpack {"ok": bool, "size": int, "length": int, "error": str | None,
                                              "hints": [peer id, ...] (optional)}
                       then, if ok, data frames of at most MAX_CHUNK bytes (CHUNK_SIZE by default)
                       then one zero-length frame: the end of the data

``size`` is the whole blob's size, ``length`` the number of bytes that follow (the requested range; ``length``
None in a request means "to the end"). Both sides treat everything received as untrusted: headers are capped at
MAX_HEADER bytes (a request at MAX_REQUEST) before they are read, and checked field by field, data frames at
MAX_CHUNK bytes, and the client checks the byte count and the sha256 itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgpack

from peer.network.access import MAX_INVITE_CHARS
from peer.network.blobs.cache import check_sha256
from peer.network.framing import (
    CHUNK_SIZE,
    END,
    MAX_CHUNK,
    ProtocolError,
    frame_prefix,
    length_prefix,
    read_chunk,
    read_length,
    write_chunk,
    write_end,
)

PROTOCOL = "hivegrpo.blob.v1"
MAX_HEADER = 4096
MAX_REQUEST = 1024  # a request header: a sha256, two integers and an invite of at most MAX_INVITE_CHARS (~640 B)
MAX_ERROR_CHARS = 300
LATER = ("seeded", "busy")  # how a refusal that means "another provider, or again soon" begins (it may carry hints)
MAX_HINTS = 4  # peer ids a refusal may name as holding the blob (whom this server gave it lately)
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


@dataclass(frozen=True)
class BlobRequest:
    sha256: str
    offset: int = 0
    length: int | None = None
    invite: str | None = None  # a private swarm's invite (see peer.network.access); None in a public one

    def to_wire(self) -> dict:
        return {"sha256": self.sha256, "offset": self.offset, "length": self.length, "invite": self.invite}

    @classmethod
    def from_wire(cls, obj: dict) -> BlobRequest:
        try:
            sha256 = check_sha256(obj.get("sha256"))
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        offset, length = obj.get("offset", 0), obj.get("length")
        if not _is_count(offset) or not (length is None or _is_count(length)):
            raise ProtocolError(f"offset and length must be non-negative integers, got {offset!r:.40}, {length!r:.40}")
        invite = obj.get("invite")
        if invite is not None and (not isinstance(invite, str) or len(invite) > MAX_INVITE_CHARS):
            raise ProtocolError(f"an invite is a string of at most {MAX_INVITE_CHARS} characters")
        return cls(sha256, offset, length, invite)


@dataclass(frozen=True)
class BlobResponse:
    """``hints``: with a refusal ("seeded", "busy"), peers this server gave the blob to lately (they may serve it);
    a reader that does not know the field ignores it."""

    ok: bool
    size: int = 0
    length: int = 0
    error: str | None = None
    hints: tuple[str, ...] = ()

    def to_wire(self) -> dict:
        error = None if self.error is None else self.error[:MAX_ERROR_CHARS]
        wire = {"ok": self.ok, "size": self.size, "length": self.length, "error": error}
        if self.hints:
            wire["hints"] = list(self.hints[:MAX_HINTS])
        return wire

    @classmethod
    def from_wire(cls, obj: dict) -> BlobResponse:
        ok, size, length, error = obj.get("ok"), obj.get("size", 0), obj.get("length", 0), obj.get("error")
        if not isinstance(ok, bool) or not _is_count(size) or not _is_count(length):
            raise ProtocolError(f"malformed response header {obj!r:.200}")
        if error is not None and not isinstance(error, str):
            raise ProtocolError(f"malformed error in response header {error!r:.80}")
        hints = obj.get("hints", [])
        if not isinstance(hints, list) or len(hints) > MAX_HINTS or not all(_is_peer_id(h) for h in hints):
            raise ProtocolError(f"malformed hints in response header {hints!r:.120}")
        return cls(ok, size, length, None if error is None else error[:MAX_ERROR_CHARS], tuple(hints))


def _is_peer_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128 and set(value) <= _BASE58


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_header(writer: asyncio.StreamWriter, obj: dict) -> None:
    """Queue one msgpack header frame (the caller drains)."""
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_HEADER:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER}")
    writer.write(length_prefix(len(data)) + data)


async def read_header(reader: asyncio.StreamReader, limit: int = MAX_HEADER) -> dict:
    """Read one msgpack header frame of at most ``limit`` bytes (checked before reading it); raises ProtocolError on
    anything but a small map with string keys."""
    n = await read_length(reader)
    if n > limit:
        raise ProtocolError(f"header of {n} bytes exceeds {limit}")
    data = await reader.readexactly(n)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"header is a {type(obj).__name__}, not a map")
    return obj


__all__ = [
    "CHUNK_SIZE",
    "END",
    "LATER",
    "MAX_CHUNK",
    "MAX_ERROR_CHARS",
    "MAX_HEADER",
    "MAX_HINTS",
    "MAX_REQUEST",
    "PROTOCOL",
    "BlobRequest",
    "BlobResponse",
    "ProtocolError",
    "frame_prefix",
    "read_chunk",
    "read_header",
    "write_chunk",
    "write_end",
    "write_header",
]
