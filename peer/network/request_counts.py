"""Counting the requests a DHT process sends, by kind: a diagnostic for benchmarks, off unless asked for.

With ``HIVEGRPO_COUNT_REQUESTS=DIR`` in a peer's environment, its DHT process (``peer.network.calls.serve``) wraps
its node's ``call_store``, ``call_find`` and ``call_ping`` and counts each request it sends under the side-channel
call that caused it and the kind of key that call was about (``out:call_find<_store_file:holders_N``: a lookup
before a holder record's store; ``<hivemind``: hivemind's own, such as routing-table refreshes). Every second it
writes the counts so far, with its parent's command line and name, to ``DIR/<pid>.json``. Every request a node
sends is one that another node serves, so the outgoing counts of all processes are the swarm's whole DHT traffic.
``python -m tests.benchmarks.requests`` runs the demo so and prints the table (docs/benchmarks.md).
"""

from __future__ import annotations

import contextvars
import json
import os
import re
from collections import Counter
from pathlib import Path

ENV = "HIVEGRPO_COUNT_REQUESTS"
DUMP_EVERY = 1.0  # s between two writes of the counts

_tag: contextvars.ContextVar[str] = contextvars.ContextVar("hivegrpo_request_tag", default="hivemind")
_counts: Counter = Counter()
_tasks: list = []  # the dumping task, referenced while the event loop runs


def folder() -> Path | None:
    """Where the counts go, or None (not counting)."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def kind_of(key: str) -> str:
    """A DHT key's kind: the run's name taken off, numbers as N (``demo_bucket_12`` → ``bucket_N``)."""
    return re.sub(r"\d+", "N", key.split("_", 1)[-1]) if "_" in key else re.sub(r"\d+", "N", key)


def tag_call(function) -> None:
    """Name what the side channel runs next (``function``: a ``functools.partial``), for the requests it sends."""
    inner = getattr(function, "func", function)
    name = getattr(inner, "__name__", type(inner).__name__)
    kinds: set[str] = set()
    for arg in getattr(function, "args", ()):
        if isinstance(arg, str) and arg.endswith(".msgpack"):  # a spool file of records to store or push
            try:
                from hivemind.utils.serializer import MSGPackSerializer

                kinds.update(kind_of(str(item[0])) for item in MSGPackSerializer.loads(Path(arg).read_bytes()))
            except (OSError, ValueError, TypeError, IndexError):
                kinds.add("?")
            break
        if isinstance(arg, str):  # a key
            kinds.add(kind_of(arg))
            break
        if isinstance(arg, dict) and arg and all(isinstance(k, str) for k in arg):  # keys to wait on
            kinds.update(kind_of(k) for k in arg)
            break
    _tag.set(f"{name}:{','.join(sorted(kinds))}" if kinds else name)
    _counts[f"call:{_tag.get()}"] += 1


def install(node, out: Path) -> None:
    """Count ``node``'s outgoing requests, and write the counts to ``out/<pid>.json`` every ``DUMP_EVERY`` s."""
    import asyncio

    protocol = node.protocol
    for name in ("call_store", "call_find", "call_ping"):
        original = getattr(protocol, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            _counts[f"out:{_name}<{_tag.get()}"] += 1
            return _original(*args, **kwargs)

        setattr(protocol, name, counted)
    out.mkdir(parents=True, exist_ok=True)
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
        parent_name = Path(f"/proc/{os.getppid()}/comm").read_text(errors="replace").strip()
    except OSError:
        parent, parent_name = [], ""

    async def dump() -> None:
        path, tmp = out / f"{os.getpid()}.json", out / f".{os.getpid()}.json.tmp"
        while True:
            await asyncio.sleep(DUMP_EVERY)
            tmp.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "parent": [p for p in parent if p],
                        "parent_name": parent_name,
                        "counts": _counts,
                    }
                )
            )
            tmp.replace(path)

    _tasks.append(asyncio.ensure_future(dump()))


__all__ = ["ENV", "folder", "install", "kind_of", "tag_call"]
