"""The one way a test waits: for a condition, with a deadline, failing with what it waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
LOG_TAIL = 3000  # characters of a dead process's log in a failure message


def wait_until(
    condition: Callable[[], T],
    what: str,
    timeout: float = 90.0,
    watched_processes: Iterable = (),
    interval: float = 0.2,
) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy, and return that.

    Raises AssertionError after ``timeout`` seconds, or as soon as one of ``watched_processes`` (``Popen`` objects)
    exits first: the message names ``what`` was awaited, the seconds waited, the condition's last value, and the
    tail of each exited process's log (the file :class:`tests.helpers.swarm.Procs` gave it, or its piped stderr).
    """
    watched = list(watched_processes)
    started = time.monotonic()
    while True:
        value = condition()
        if value:
            return value
        waited = time.monotonic() - started
        dead = [p for p in watched if p.poll() is not None]
        if dead:
            value = condition()  # it may have come true as the process finished
            if value:
                return value
            raise AssertionError(_message(what, waited, value, "a watched process exited first", dead))
        if waited > timeout:
            raise AssertionError(_message(what, waited, value, f"not within {timeout:g} s", []))
        time.sleep(interval)


def children(swarm_children: Iterable) -> list:
    """The processes of local-swarm children (:class:`peer.demo.swarm.Child`), each with its log named, to pass as
    ``watched_processes``: a benchmark's swarm waits as a test's processes do."""
    out = []
    for child in swarm_children:
        child.process.log_path = child.log
        out.append(child.process)
    return out


def _message(what: str, waited: float, value, why: str, dead: list) -> str:
    lines = [f"waited {waited:.1f} s for {what}: {why}; the condition last gave {_short(value)}"]
    for p in dead:
        lines.append(f"--- {_name(p)} exited with {p.returncode}; the end of its log:\n{log_tail(p)}")
    return "\n".join(lines)


def log_tail(process, chars: int = LOG_TAIL) -> str:
    """The last ``chars`` characters of what ``process`` logged: its log file, else its piped stderr."""
    log = getattr(process, "log_path", None)
    if log is not None and Path(log).exists():
        return Path(log).read_text(errors="replace")[-chars:]
    stream = getattr(process, "stderr", None)
    if stream is not None and process.poll() is not None:
        text = stream.read()
        return (text.decode(errors="replace") if isinstance(text, bytes) else text)[-chars:]
    return "(no log)"


def _name(process) -> str:
    log = getattr(process, "log_path", None)
    return f"process {process.pid} ({Path(log).stem})" if log is not None else f"process {process.pid}"


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def wait_until_async(condition: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.05) -> T:
    """:func:`wait_until` from a coroutine: it polls on a worker thread, so the event loop (and the daemons and
    servers on it that make ``condition`` true) runs on meanwhile."""
    return await asyncio.to_thread(wait_until, condition, what, timeout, (), interval)
