"""Stopping what a role started, newest first, even when one of the steps fails."""

from __future__ import annotations

from collections.abc import Callable

from peer.log import get_logger

logger = get_logger(__name__)


class Closers:
    """A stack of stop functions: :meth:`add` as things start, :meth:`close` runs them newest first (once each),
    logging a failure and going on with the rest."""

    def __init__(self) -> None:
        self._stack: list[Callable[[], object]] = []

    def add(self, closer: Callable[[], object]) -> None:
        self._stack.append(closer)

    def close(self) -> None:
        while self._stack:
            closer = self._stack.pop()
            try:
                closer()
            except Exception as e:  # shutting down: say it, go on with the rest
                logger.warning("while stopping: %s", e)
