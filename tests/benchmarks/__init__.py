"""Benchmarks: each measures side by side in one run, prints a table and can write JSON. Never run as tests."""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path


def json_lines(path: Path) -> list[dict]:
    """The JSON lines of a ledger (none if it does not exist); a line cut by a kill -9 is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def mean(values: list[float], digits: int = 4) -> float | None:
    return round(statistics.fmean(values), digits) if values else None
