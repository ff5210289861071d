"""Edits of a record's value known to make it invalid (see ``VALUE_MUTATIONS``)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pydantic.v1 as pydantic
from hypothesis import strategies as st

from peer.protocol.version import PROTOCOL_VERSION
from tests.helpers.strategies.common import Kind, at, nodes, put


def model_paths(obj: Any, prefix: tuple = ()) -> dict[tuple, type]:
    """``{path: model class}`` of every record and sub-record (``()`` is the record itself) inside ``obj``."""
    found = {}
    if isinstance(obj, pydantic.BaseModel):
        found[prefix] = type(obj)
        for name in obj.__fields__:
            found.update(model_paths(getattr(obj, name), prefix + (name,)))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found.update(model_paths(item, prefix + (i,)))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            found.update(model_paths(item, prefix + (key,)))
    return found


def wrong_type(value: Any, draw) -> Any:
    """A value of a type the schema never takes where ``value`` is (strict types: 3.0 is no int, 1 no float)."""
    if isinstance(value, bool):
        options = [int(value), "true"]
    elif isinstance(value, int):
        options = [float(value), str(value), [value]]
    elif isinstance(value, float):
        options = [int(value) if abs(value) < 2**63 else 0, str(value), True]
    elif isinstance(value, str):
        options = [value.encode(), 0, [value]]
    elif isinstance(value, bytes):
        options = [value.decode("latin-1"), 0, list(value[:4])]
    elif value is None:  # an optional field: anything but None and its own type
        options = [b"\x00", 0]
    elif isinstance(value, list):
        options = [tuple(value), {}, 0]
    else:
        options = [[], 0, "x"]
    return draw(st.sampled_from(options))


def _missing(record, data, draw) -> str:
    fields = [path + (name,) for path, cls in model_paths(record).items() for name in cls.__fields__]
    path = draw(st.sampled_from(fields))
    del at(data, path[:-1])[path[-1]]
    return "/".join(map(str, path))


def _extra(record, data, draw) -> str:
    path, cls = draw(st.sampled_from(sorted(model_paths(record).items(), key=lambda item: str(item[0]))))
    name = draw(st.text(min_size=1, max_size=16).filter(lambda n: n not in cls.__fields__))
    at(data, path)[name] = draw(st.none() | st.integers(-5, 5) | st.text(max_size=4))
    return "/".join(map(str, path + (name,)))


def _wrong_type(record, data, draw) -> str:
    models = set(model_paths(record))
    free_dicts = [p for p in nodes(data) if isinstance(at(data, p), dict) and at(data, p) and p not in models]
    if free_dicts and draw(st.booleans()):  # a key of a free dict (stats, reasons, per-producer tallies)
        path = draw(st.sampled_from(free_dicts))
        container = at(data, path)
        key = draw(st.sampled_from(sorted(container)))
        container[key.encode()] = container.pop(key)
        return "/".join(map(str, path)) + " key"
    path = draw(st.sampled_from(nodes(data)))
    put(data, path, wrong_type(at(data, path), draw))
    return "/".join(map(str, path))


def _non_finite(record, data, draw) -> str:
    numbers = [p for p in nodes(data) if isinstance(at(data, p), float)]
    numbers = numbers or [p for p in nodes(data) if isinstance(at(data, p), int)]
    path = draw(st.sampled_from(numbers))
    put(data, path, draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    return "/".join(map(str, path))


def _protocol(record, data, draw) -> str:
    paths = [path for path, cls in model_paths(record).items() if "protocol_version" in cls.__fields__]
    path = draw(st.sampled_from(paths)) + ("protocol_version",)
    put(data, path, draw(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION)))
    return "/".join(map(str, path))


VALUE_MUTATIONS = {
    "missing field": _missing,
    "extra field": _extra,
    "wrong type": _wrong_type,
    "non-finite number": _non_finite,
    "other protocol version": _protocol,
}
"""name -> mutate(record, data, draw): edits ``data`` (a copy of the record's value) in place, returns where."""


def mutated_value(kind: Kind, record, name: str, draw) -> tuple[dict, str]:
    """A copy of ``record``'s value broken by the mutation ``name`` (one of ``VALUE_MUTATIONS`` or ``"over the size
    limit"``), and where it was changed."""
    data = copy.deepcopy(record.dict())
    if name == "over the size limit":
        kind.oversize(data, draw)
        return data, name
    return data, VALUE_MUTATIONS[name](record, data, draw)


def out_of_range(kind: Kind, record, label: str, draw) -> dict | None:
    """A copy of ``record``'s value with the part ``label`` names out of range, or None where this record cannot
    take that mutation (e.g. a seq gap in an entry of one group)."""
    data = copy.deepcopy(record.dict())
    return data if kind.out_of_range[label](data, draw) else None
