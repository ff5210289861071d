"""The project's one logger factory.

Libraries call :func:`get_logger`; only the command line calls :func:`configure`, once. hivemind's own loggers
are left alone so users can still report what the network layer said.
"""

from __future__ import annotations

import logging
import os

_ROOT = "hivegrpo"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def get_logger(name: str) -> logging.Logger:
    """A logger under the project's namespace (``hivegrpo.<name>``)."""
    short = name.removeprefix("peer.").removeprefix("coordinator.")
    return logging.getLogger(f"{_ROOT}.{short}")


def configure(level: str | None = None) -> None:
    """Send the project's logs to stderr; level from the argument, ``HIVEGRPO_LOG_LEVEL``, or INFO."""
    level = (level or os.environ.get("HIVEGRPO_LOG_LEVEL") or "INFO").upper()
    if level not in LEVELS:
        raise ValueError(f"the log level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
