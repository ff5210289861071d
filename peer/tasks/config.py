"""Task configs are plain JSON.

A task travels between peers as ``{"name": ..., "config": {...}}``, so its config must survive a JSON round trip
unchanged: string keys, finite numbers, strings, booleans, ``None``, lists and nested objects. :func:`normalize_config`
checks that and returns a fresh, canonical copy (tuples become lists); :func:`config_key` is its canonical text, used
for equality, hashing and seed derivation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from peer.tasks.errors import TaskError


def _check(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TaskError(f"Task config value {where} is {value!r}; use a finite number.")
        return value
    if isinstance(value, list | tuple):
        return [_check(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TaskError(f"Task config key {key!r} in {where} is not a string; JSON objects need string keys.")
            out[key] = _check(v, f"{where}.{key}")
        return out
    raise TaskError(
        f"Task config value {where} has type {type(value).__name__}, which is not JSON; "
        "use numbers, strings, booleans, null, lists or objects."
    )


def normalize_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A fresh JSON-compatible copy of ``config`` (``None`` means empty), or :class:`TaskError` saying why not."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise TaskError(f"A task config must be a mapping of option names to values, got {type(config).__name__}.")
    return _check(config, "config")


def config_key(config: Mapping[str, Any]) -> str:
    """Canonical JSON text of a normalized config (sorted keys, no spaces)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
