"""Records to bytes and back: msgpack only, strict, never pickle.

* :func:`pack` / :func:`unpack` — a record as a msgpack map of its fields (bytes stay bytes), for blobs such as a
  group too large to go inline.
* :func:`to_dht_value` / :func:`from_dht_value` — the plain value handed to ``hivemind.DHT.store`` (a dict of
  builtins; hivemind msgpacks it) and read back from ``DHT.get``. :func:`to_dht_value` measures the value exactly
  as the DHT will serialize it and refuses it, before it reaches hivemind, when it is over the DHT limit.
* :func:`owned_records` — the ``(owner, record)`` pairs of a DHT dictionary whose subkeys are owner subkeys.

Reading is as strict as every peer's DHT validator: a record must carry this peer's protocol version, every field
(optional ones as ``None``), no unknown field, and values that need no type conversion (``3.0`` is not an int,
``1`` is not a float, ``"ab"`` is not bytes). Anything else raises :class:`RecordError` with one sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack
import pydantic.v1 as pydantic

from peer.protocol.errors import RecordError
from peer.protocol.keys import parse_owner_subkey
from peer.protocol.limits import MAX_DHT_VALUE_BYTES, check_value_size
from peer.protocol.version import check_protocol_version

R = TypeVar("R", bound=pydantic.BaseModel)


def pack(record: pydantic.BaseModel) -> bytes:
    """The record as msgpack bytes (a map of its fields, nested records as maps, bytes as msgpack bin)."""
    return msgpack.packb(record.dict(), use_bin_type=True, strict_types=True)


def unpack(cls: type[R], data: bytes) -> R:
    """Parse msgpack ``data`` as a ``cls`` record; :class:`RecordError` on malformed data or a schema violation."""
    what = cls.__name__
    if not isinstance(data, bytes):
        raise RecordError(f"a packed {what} must be bytes, got {type(data).__name__}.")
    limit = getattr(cls, "max_packed_bytes", MAX_DHT_VALUE_BYTES)
    if len(data) > limit:
        raise RecordError(f"the packed {what} is {len(data)} bytes, over its {limit}-byte limit, so it is refused.")
    limit = getattr(cls, "max_containers", MAX_CONTAINERS)
    count = ContainerBudget(limit)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            list_hook=count,
            object_hook=count,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except TooManyContainers:
        raise RecordError(f"the packed {what} holds over {limit} lists and maps, more than any valid one") from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        detail = str(error) or type(error).__name__
        raise RecordError(f"the packed {what} is not valid msgpack ({detail}), so it is refused.") from None
    return from_dht_value(cls, obj)


def to_dht_value(record: pydantic.BaseModel) -> dict[str, Any]:
    """The plain value to pass to ``hivemind.DHT.store`` for ``record``, after checking its serialized size.

    Raises :class:`RecordTooLarge` when hivemind's serialization of it is over ``MAX_DHT_VALUE_BYTES``.
    """
    # hivemind's package __init__ imports torch; import the serializer only when a value is really bound for a DHT.
    from hivemind.utils.serializer import MSGPackSerializer

    value = record.dict()
    check_value_size(MSGPackSerializer.dumps(value), type(record).__name__)
    return value


def from_dht_value(cls: type[R], value: Any) -> R:
    """Parse a value read from the DHT (or unpacked from msgpack) as a ``cls`` record; :class:`RecordError` if bad."""
    what = cls.__name__
    if not isinstance(value, dict):
        raise RecordError(f"a {what} must be a map of fields, got {type(value).__name__}, so it is refused.")
    odd = next((key for key in value if not isinstance(key, str)), None)
    if odd is not None:  # pydantic would raise TypeError ("keywords must be strings"), not a validation error
        raise RecordError(f"a {what} must be a map of named fields, got a {type(odd).__name__} key; it is refused.")
    if "protocol_version" in cls.__fields__:
        check_protocol_version(value.get("protocol_version"), what)
    try:
        record = cls.parse_obj(value)
    except pydantic.ValidationError as error:
        raise RecordError(f"the {what} record is invalid: {_describe(error)}; it is refused.") from None
    difference = _first_difference(record.dict(), value, "")
    if difference is not None:
        raise RecordError(
            f"the {what} record is invalid: {difference} needs a type conversion to match the schema "
            "(e.g. 3.0 for an int), which the protocol does not allow; it is refused."
        )
    return record


def owned_records(found: Mapping, cls: type[R]) -> list[tuple[bytes, R]]:
    """``(owner public key, record)`` of every entry of ``found`` (a DHT dictionary, owner subkey → value with
    expiration) whose subkey is an owner subkey and whose value is a well-formed ``cls``; the others are skipped
    (every peer's validator refuses them on store, a reader skips what still slips through)."""
    out = []
    for subkey, item in found.items():
        try:
            out.append((parse_owner_subkey(subkey), from_dht_value(cls, item.value)))
        except (RecordError, ValueError):
            continue
    return out


MAX_CONTAINERS = 1024  # arrays and maps in one packed record (a GroupBatch allows more: its max_containers)
MAX_ARRAY_LEN = 1024  # the longest list of any record (MAX_REVOKED invite ids)
MAX_MAP_LEN = 256  # the largest map of any record (MAX_TALLIED producers; records have ~20 fields)


class TooManyContainers(ValueError):
    """msgpack built more arrays and maps than a :class:`ContainerBudget` allows."""


class ContainerBudget:
    """A ``list_hook`` / ``object_hook`` for ``msgpack.unpackb`` that counts the arrays and maps it builds: an
    empty one is 1 byte packed and ~60 in memory, so bytes from the network could make a reader allocate ~50x
    their size before any schema looks at them; past ``limit``, unpacking stops (:class:`TooManyContainers`)."""

    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, obj):
        self.left -= 1
        if self.left < 0:
            raise TooManyContainers
        return obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _describe(error: pydantic.ValidationError) -> str:
    problems = error.errors()
    first = problems[0]
    where = ".".join(str(part) for part in first["loc"] if part != "__root__")
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"{where + ': ' if where else ''}{first['msg'].rstrip('.')}{more}"


def _first_difference(parsed: Any, raw: Any, path: str) -> str | None:
    """Where ``parsed`` (what the schema made of ``raw``) differs from ``raw`` in type or value, or None."""
    if type(parsed) is not type(raw):
        return path or "the record"
    if isinstance(raw, dict):
        if parsed.keys() != raw.keys():
            return path or "the record"
        for key in raw:
            found = _first_difference(parsed[key], raw[key], f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(raw, list):
        if len(parsed) != len(raw):
            return path
        for index, (left, right) in enumerate(zip(parsed, raw, strict=True)):
            found = _first_difference(left, right, f"{path}.{index}")
            if found is not None:
                return found
        return None
    return None if parsed == raw else path
