"""Content-addressed blob transfer over hivemind P2P streams: base model files, adapters, large rollout groups.

A blob is named by the sha256 of its bytes. The DHT holds only pointers (sha256, size, provider peer ids); the
bytes move over libp2p streams on protocol ``hivegrpo.blob.v1`` and are verified before anything uses them.

- ``BlobCache``: the on-disk store (atomic writes, hash checked before a file counts as present).
- ``BlobServer``: answers requests from a cache on a P2P instance (with an ``authorize(peer_id)`` hook).
- ``fetch_blob``: async; cache first, then providers in random order, each attempt verified; ``BlobUnavailable``.
- ``BlobService``: the same for synchronous code holding a ``hivemind.DHT`` (background event loop thread).

docs/blobs.md describes the wire format, the cache layout and the measured throughput.
"""

import importlib

_WHERE = {  # name -> submodule: loaded when first used, so that the cache alone (a manifest's model files) needs
    # neither hivemind nor torch
    "BlobCache": "cache",
    "PendingBlob": "cache",
    "check_sha256": "cache",
    "sha256_file": "cache",
    "BlobCorrupt": "errors",
    "BlobUnavailable": "errors",
    "ProviderFailed": "fetch",
    "fetch_blob": "fetch",
    "read_blob_range": "fetch",
    "BlobServer": "server",
    "ServerStats": "server",
    "allow_all": "server",
    "drip": "server",
    "flip_bytes": "server",
    "truncate_after": "server",
    "BlobService": "service",
    "CHUNK_SIZE": "wire",
    "PROTOCOL": "wire",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "CHUNK_SIZE",
    "PROTOCOL",
    "BlobCache",
    "BlobCorrupt",
    "BlobServer",
    "BlobService",
    "BlobUnavailable",
    "PendingBlob",
    "ProviderFailed",
    "ServerStats",
    "allow_all",
    "check_sha256",
    "fetch_blob",
    "drip",
    "flip_bytes",
    "read_blob_range",
    "sha256_file",
    "truncate_after",
]
