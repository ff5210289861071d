"""Stable seed derivation shared by every task.

Peers on different machines must agree on which problem ``(seed, index)`` names, so every random choice in this
package starts from :func:`derive_seed`: a SHA-256 over a length-prefixed, type-tagged encoding of its parts.
Python's ``hash()`` is salted per process (``PYTHONHASHSEED``) and is never used.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63


def encode_part(part: int | str | bytes) -> bytes:
    """Type-tagged, length-prefixed bytes for one part, so ``("ab", "c")`` and ``("a", "bc")`` never collide."""
    if isinstance(part, bool | int):
        tag, raw = b"i", str(int(part)).encode("ascii")
    elif isinstance(part, str):
        tag, raw = b"s", part.encode("utf-8")
    elif isinstance(part, bytes | bytearray | memoryview):
        tag, raw = b"b", bytes(part)
    else:
        raise TypeError(f"derive_seed parts must be int, str or bytes, got {type(part).__name__}")
    return tag + len(raw).to_bytes(8, "big") + raw


def derive_seed(*parts: int | str | bytes) -> int:
    """A stable non-negative 63-bit integer from the SHA-256 of ``parts`` (same value on every machine).

    Booleans count as the integers 0 and 1.
    """
    digest = hashlib.sha256(b"".join(encode_part(p) for p in parts)).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
