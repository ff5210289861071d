"""A volunteer's progress: the line ``hivegrpo join`` shows every ~10 s.

It says what the volunteer's machine gives the run: the adapter version it samples with, its groups per second over
the last interval, the groups it made, how many of them the learners **used** in an update and how many they
**refused** (by reason), found **stale** or **without signal** — its own row of the learners' credit records
(:mod:`peer.run.credit`: the admitted learners' records, merged by maximum, read at most once per interval on
this thread, one DHT get) — and its **lag**: how many versions behind the newest announced one its groups were
sampled, on average over the interval (0 when it keeps up).

On a terminal (``sys.stderr.isatty()``) it is one live line (rich), redrawn every second below the log; otherwise
one log line per interval, e.g.::

  progress: v12 · 3.20 groups/s · made 480 · used 352 (73%) · refused 4 (surplus 4) · stale 20 · no signal 96 · lag 0.4

Nothing here runs on the sampling loop: the loop only adds to counters the thread reads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from peer.log import get_logger

logger = get_logger(__name__)

PROGRESS_EVERY = 10.0  # s between two lines (and two reads of the credit records)


@dataclass(frozen=True)
class Counters:
    """What the rollout peer counted so far (the loop adds, this thread reads)."""

    version: int  # the adapter version it samples with now
    made: int  # groups sampled since it started
    lag_sum: float = 0.0  # sum over its groups of (newest announced version - version sampled with)
    lag_groups: int = 0  # groups in lag_sum


@dataclass(frozen=True)
class OwnCredit:
    """This peer's row of the learners' credit records (None fields: no admitted learner published one yet)."""

    records: int  # admitted learners' records read
    used: int = 0
    refused: int = 0
    reasons: tuple[tuple[str, int], ...] = ()
    stale: int = 0
    no_signal: int = 0


def progress_line(now: Counters, rate: float, credit: OwnCredit | None, lag: float | None) -> str:
    """One progress line (pure)."""
    parts = [f"v{now.version}", f"{rate:.2f} groups/s", f"made {now.made}"]
    if credit is None or credit.records == 0:
        parts.append("used - (no learner's credit record yet)")
    else:
        # used counts the key's whole run; made, this process's: a share only where the second can hold the first
        share = f" ({credit.used / now.made:.0%})" if now.made > 0 and credit.used <= now.made else ""
        parts.append(f"used {credit.used}{share}")
        reasons = ", ".join(f"{reason} {n}" for reason, n in credit.reasons)
        parts.append(f"refused {credit.refused}" + (f" ({reasons})" if reasons else ""))
        parts.append(f"stale {credit.stale}")
        parts.append(f"no signal {credit.no_signal}")
    parts.append("lag -" if lag is None else f"lag {lag:.1f}")
    return "progress: " + " · ".join(parts)


class Progress:
    """Shows :func:`progress_line` every ``every`` seconds from a thread (see the module docstring).

    ``counters()`` returns the peer's :class:`Counters`; ``read_credit()`` its :class:`OwnCredit` (a DHT read:
    called at most once per ``every`` seconds, on this thread; an exception keeps the last one). ``live``: a live
    line on the terminal (default: when stderr is one).
    """

    def __init__(
        self,
        counters: Callable[[], Counters],
        read_credit: Callable[[], OwnCredit],
        *,
        every: float = PROGRESS_EVERY,
        live: bool | None = None,
        clock=time.monotonic,
    ):
        if not every > 0:
            raise ValueError(f"the progress interval must be positive, got {every}")
        self.counters, self.read_credit = counters, read_credit
        self.every, self.clock = every, clock
        self.live = sys.stderr.isatty() if live is None else live
        self.credit: OwnCredit | None = None
        self.lines = 0
        self._window: deque[tuple[float, Counters]] = deque()  # (time, counters) of the last ``every`` seconds
        self._credit_at = -float("inf")
        self._display = None
        self._streams: list[tuple[logging.StreamHandler, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> Progress:
        self._window.append((self.clock(), self.counters()))
        if self.live:
            self._start_display()
        self._thread.start()
        return self

    def line(self) -> str:
        """The line now: the rate and the lag over the last ``every`` seconds; the credit read when due."""
        now, counters = self.clock(), self.counters()
        window = self._window
        window.append((now, counters))
        while len(window) > 2 and window[1][0] <= now - self.every:
            window.popleft()
        if now - self._credit_at >= self.every:
            self._credit_at = now
            try:
                self.credit = self.read_credit()
            except Exception as e:  # the network boundary: show the last credit read, try again next interval
                logger.debug("could not read the learners' credit records: %s", e)
        then, before = window[0]
        rate = (counters.made - before.made) / (now - then) if now > then else 0.0
        lagged = counters.lag_groups - before.lag_groups
        lag = (counters.lag_sum - before.lag_sum) / lagged if lagged else None
        return progress_line(counters, rate, self.credit, lag)

    def _run(self) -> None:
        step = 1.0 if self.live else self.every
        while not self._stop.wait(step):
            try:
                text = self.line()
                if self._display is not None:
                    from rich.text import Text

                    self._display.update(Text(text))
                else:
                    logger.info("%s", text)
                self.lines += 1
            except Exception as e:  # a progress line is never worth stopping the peer for
                logger.debug("progress line failed: %s", e)

    def _start_display(self) -> None:
        """A live line at the bottom of the terminal; the project's and hivemind's log lines go above it (their
        handlers write to the display's stderr while it runs)."""
        from rich.console import Console
        from rich.live import Live

        self._display = Live(console=Console(stderr=True), refresh_per_second=1, transient=True)
        self._display.start()
        for name in ("hivegrpo", "hivemind"):
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stderr__:
                    self._streams.append((handler, handler.setStream(sys.stderr)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every + 5)
        if self._display is not None:
            for handler, stream in self._streams:
                handler.setStream(stream)
            self._display.stop()
            self._display = None


__all__ = ["PROGRESS_EVERY", "Counters", "OwnCredit", "Progress", "progress_line"]
