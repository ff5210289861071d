"""Token ids and log-probs as bytes: little-endian uint32 / float32, decoded with the stdlib only.

A rollout group carries its prompt and completions as token-id bytes and its behaviour log-probs as float32
bytes: 4 bytes a token instead of msgpack's 1-9 bytes per int or 9 per float, and a fixed, explicit byte order so
peers on any machine read the same numbers. No numpy or torch here: validators run this on every store.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable

_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
MAX_TOKEN_ID = 2**32 - 1


def encode_tokens(ids: Iterable[int]) -> bytes:
    """Token ids (ints in [0, 2**32)) as little-endian uint32 bytes."""
    ids = list(ids)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"token ids must be ints in [0, {MAX_TOKEN_ID}], got {token!r}.")
    values = array(_U32, ids)
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """The token ids in little-endian uint32 ``data``; :class:`ValueError` if its length is not a multiple of 4."""
    return _decode(_U32, data, "token ids").tolist()


def encode_floats(values: Iterable[float]) -> bytes:
    """Numbers as little-endian float32 bytes (rounded to float32)."""
    values = list(values)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected numbers, got {value!r}.")
    floats = array("f", values)
    if _BIG_ENDIAN:
        floats.byteswap()
    return floats.tobytes()


def decode_floats(data: bytes) -> list[float]:
    """The numbers in little-endian float32 ``data``; :class:`ValueError` if its length is not a multiple of 4."""
    return _decode("f", data, "float32 values").tolist()


def all_finite_nonpositive(data: bytes) -> bool:
    """Whether every float32 in ``data`` is finite and <= 0 (what a log-probability must be)."""
    floats = _decode("f", data, "log-probs")
    return all(math.isfinite(value) and value <= 0.0 for value in floats)


def _decode(code: str, data: bytes, what: str) -> array:
    if not isinstance(data, bytes):
        raise ValueError(f"{what} must be bytes, got {type(data).__name__}.")
    if len(data) % 4:
        raise ValueError(f"{what} take 4 bytes each, but got {len(data)} bytes (not a multiple of 4).")
    values = array(code)
    values.frombytes(data)
    if _BIG_ENDIAN:
        values.byteswap()
    return values
