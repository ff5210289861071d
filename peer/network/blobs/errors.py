"""Errors of the blob layer that a user (or a remote peer's data) can cause."""

from __future__ import annotations

from peer.errors import UserError


class BlobCorrupt(UserError, ValueError):
    """Bytes offered to the cache do not have the sha256 (or the size) they were announced with."""


class BlobUnavailable(UserError, RuntimeError):
    """No source could deliver a blob: the message lists what each provider did and what to try next;
    ``reasons`` maps each provider asked (base58 peer id) to what it did; ``hints``: peers they named as holding it."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None, hints=()):
        super().__init__(message)
        self.reasons = dict(reasons or {})
        self.hints = list(dict.fromkeys(hints))
