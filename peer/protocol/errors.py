"""Errors raised by the protocol layer; each message is one sentence saying what was wrong and what to do."""

from peer.errors import UserError


class RecordError(UserError, ValueError):
    """A record (from the network or a blob) is malformed, has the wrong schema, or breaks a protocol rule."""


class ProtocolVersionError(RecordError):
    """A record was written under another protocol version than the one this peer speaks."""


class RecordTooLarge(UserError, ValueError):
    """A record would exceed the DHT value limit; it must not reach ``hivemind.DHT.store``."""


class KeyFormatError(UserError, ValueError):
    """A run id, DHT key or subkey does not have the shape the protocol defines."""
