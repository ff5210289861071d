"""The building blocks of the record strategies: field values within their bounds, lists drawn at any
length cheaply, values just out of bounds, and :class:`Kind` with the mutations its rules are written with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.codec import MAX_TOKEN_ID
from peer.protocol.limits import (
    MAX_CREDIT,
    MAX_DHT_VALUE_BYTES,
    MAX_INT,
    MAX_JSON_CHARS,
    MAX_NAME_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_PEER_NAME_CHARS,
    MAX_PROVIDERS,
    MAX_RUN_ID_LEN,
)
from peer.protocol.records import peer_name_problem

BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
HEX = "0123456789abcdef"
TINY = math.ulp(0.0)  # the smallest positive float: -TINY is the largest float below zero (-0.0 is not)
FLOAT32_TINY = 2.0**-149  # the smallest positive float32


@st.composite
def sized(draw, elements, max_size: int, min_size: int = 0, distinct: Callable[[Any, int], Any] | None = None):
    """A list of ``min_size .. max_size`` items cycled from up to four drawn ``elements``; ``distinct(item, i)``
    makes item ``i`` unique where the schema wants distinct items."""
    n = draw(st.integers(min_size, max_size))
    if n == 0:
        return []
    pool = draw(st.lists(elements, min_size=1, max_size=min(n, 4)))
    items = [pool[i % len(pool)] for i in range(n)]
    return [distinct(item, i) for i, item in enumerate(items)] if distinct else items


def base58(number: int, width: int) -> str:
    digits = ""
    for _ in range(width):
        number, digit = divmod(number, 58)
        digits = BASE58[digit] + digits
    return digits


def distinct_peer_id(peer_id: str, i: int) -> str:
    # equal lengths mean equal prefix lengths, so the fixed-width suffixes tell any two apart
    return peer_id[: MAX_PEER_ID_CHARS - 4] + base58(i, 4)


def distinct_hex(value: str, i: int) -> str:
    return value[:-4] + f"{i:04x}"


def distinct_name(name: str, i: int, limit: int = 64) -> str:
    return (f"{i:03d}" + name)[:limit]


# ---------------------------------------------------------------------------------------------------- fields

peer_ids = st.text(BASE58, min_size=1, max_size=MAX_PEER_ID_CHARS)
sha256s = st.text(HEX, min_size=64, max_size=64)
fingerprints = st.text(HEX, min_size=16, max_size=16)
timestamps = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
fractions = st.floats(min_value=0.0, max_value=1.0)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
counts = st.integers(0, MAX_INT)
short_names = st.text(min_size=1, max_size=64)
# printable characters (str.isprintable: no control, format, private, unassigned or separator characters but the
# ASCII space), so that the filter only drops names of spaces alone
_printable = st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")) | st.just(" ")
peer_names = st.text(_printable, min_size=1, max_size=MAX_PEER_NAME_CHARS).filter(
    lambda n: peer_name_problem(n) is None
)
reasons = st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True)
credit_counts = st.integers(0, MAX_CREDIT)
names = st.text(min_size=1, max_size=MAX_NAME_CHARS)
RUN_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"
run_ids = st.text(RUN_ID_CHARS, min_size=1, max_size=MAX_RUN_ID_LEN)
token_ids = st.integers(0, MAX_TOKEN_ID)
logprobs = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
path_parts = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"), min_size=1, max_size=60
).filter(lambda part: part not in (".", ".."))

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
_json_values = st.recursive(
    _json_scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
json_objects = (
    st.dictionaries(st.text(max_size=8), _json_values, max_size=4)
    .map(lambda obj: json.dumps(obj, ensure_ascii=False))
    .filter(lambda text: len(text) <= MAX_JSON_CHARS)
)


# ---------------------------------------------------------------------------------------------------- paths


def at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def put(data: Any, path: tuple, value: Any) -> None:
    at(data, path[:-1])[path[-1]] = value


def nodes(data: Any, prefix: tuple = ()) -> list[tuple]:
    """The path of every value inside ``data`` (its fields, list items and dict values), nested ones included."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found.append(prefix + (key,))
        found.extend(nodes(value, prefix + (key,)))
    return found


# ---------------------------------------------------------------------------------------------------- out of range

OVER = MAX_DHT_VALUE_BYTES + 1024  # characters or bytes that alone put a value over the DHT limit


def bad_counts() -> st.SearchStrategy[int]:
    return st.integers(-(2**63), -1) | st.integers(MAX_INT + 1, 2**64 - 1)


def negative_floats() -> st.SearchStrategy[float]:
    return st.floats(max_value=-TINY, allow_nan=False, allow_infinity=False)


def bad_fractions() -> st.SearchStrategy[float]:
    return negative_floats() | st.floats(min_value=1.0, exclude_min=True, allow_infinity=False, allow_nan=False)


@st.composite
def bad_hex(draw, value: str) -> str:
    """``value`` (a fixed-length lowercase hex string) one character short or long, or with a foreign character."""
    how = draw(st.sampled_from(["short", "long", "foreign", "newline"]))
    if how == "short":
        return value[:-1]
    if how == "long":
        return value + draw(st.sampled_from(HEX))
    if how == "newline":
        return value + "\n"
    i = draw(st.integers(0, len(value) - 1))
    return value[:i] + draw(st.sampled_from("ABCDEFgxz -")) + value[i + 1 :]


@st.composite
def bad_peer_ids(draw, value: str) -> str:
    how = draw(st.sampled_from(["empty", "long", "foreign"]))
    if how == "empty":
        return ""
    if how == "long":
        return (value * (MAX_PEER_ID_CHARS + 1))[: MAX_PEER_ID_CHARS + 1]
    i = draw(st.integers(0, len(value) - 1))
    return value[:i] + draw(st.sampled_from("0OIl +/_")) + value[i + 1 :]


def bad_string(limit: int, empty_ok: bool = False) -> st.SearchStrategy[str]:
    too_long = st.text(min_size=1, max_size=8).map(lambda s: (s * (limit + 1))[: limit + 1 + len(s) % 3])
    return too_long if empty_ok else too_long | st.just("")


def bad_peer_names() -> st.SearchStrategy[str]:
    """Names a peer must not show: empty, too long, only spaces, or with a control or format character."""
    controls = st.sampled_from(["\x1b[2J", "\n", "\x00", "\u202e", "\u200b", "\x7f"])
    inside = st.tuples(st.text(max_size=8), controls, st.text(max_size=8)).map("".join)
    return bad_string(MAX_PEER_NAME_CHARS) | st.sampled_from([" ", "   "]) | inside


def bad_json() -> st.SearchStrategy[str]:
    return st.sampled_from(
        ["[1, 2]", "3", '"text"', "null", "{", '{"a": NaN}', '{"a": Infinity}', "", '{"a": 1} x']
    ) | st.just(json.dumps({"k": "v" * MAX_JSON_CHARS}))


# ---------------------------------------------------------------------------------------------------- kinds


@dataclass(frozen=True)
class Kind:
    """One record type stored in the DHT: how to make valid ones, where it lives, how to put it out of range."""

    name: str
    cls: type
    valid: st.SearchStrategy
    key: Callable[[str, Any], str]
    subkey: Callable[[bytes, Any], bytes]
    field: Callable[[Any], str]
    out_of_range: dict[str, Callable]  # label -> mutate(data, draw), in place
    oversize: Callable[[dict, Any], None]  # puts the value over MAX_DHT_VALUE_BYTES, in place
    also: tuple[str, ...] = ()  # other fields whose key holds this record too (a learner's heartbeat: core_peers)


def owner_subkey(pub: bytes, _record) -> bytes:
    return keys.owner_subkey(pub)


def single_field(field: str) -> dict:
    return dict(key=lambda run, _record: keys.field_key(run, field), subkey=owner_subkey, field=lambda _record: field)


def set_at(path: tuple, strategy_of: Callable[[Any], st.SearchStrategy]) -> Callable:
    """A mutation setting the value at ``path`` (``"*"`` picks an item) to one drawn from ``strategy_of(old)``."""

    def mutate(data, draw):
        concrete = []
        for part in path:
            if part == "*":
                container = at(data, tuple(concrete))
                part = draw(st.integers(0, len(container) - 1)) if container else None
                if part is None:
                    return False
            concrete.append(part)
        put(data, tuple(concrete), draw(strategy_of(at(data, tuple(concrete)))))
        return True

    return mutate


def fixed(value: Any) -> Callable[[Any], st.SearchStrategy]:
    return lambda _old: st.just(value)


def grow(path: tuple, limit: int, item: Callable[[Any, int], Any]) -> Callable:
    """A mutation making the list or dict at ``path`` one item longer than ``limit`` (distinct items)."""

    def mutate(data, draw):
        container = at(data, path)
        extra = draw(st.integers(1, 3))
        if isinstance(container, dict):
            put(data, path, {f"k{i:04d}": item(container, i) for i in range(limit + extra)})
        else:
            put(data, path, [item(container, i) for i in range(limit + extra)])
        return True

    return mutate


def provider_rules(at_path: tuple) -> dict:
    """The rules of a provider list at ``at_path`` (an adapter's, a blob pointer's)."""
    return {
        "no providers": set_at(at_path, fixed([])),
        "too many providers": grow(at_path, MAX_PROVIDERS, lambda _p, i: "Qm" + base58(i, 4)),
        "duplicate providers": lambda d, draw: at(d, at_path).append(at(d, at_path)[0]) or True,
        "provider id": set_at(at_path + ("*",), bad_peer_ids),
    }
