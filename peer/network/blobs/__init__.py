"""Content-addressed blob transfer over hivemind P2P streams: base model files, adapters, large rollout groups.

A blob is named by the sha256 of its bytes. The DHT holds only pointers (sha256, size, provider peer ids); the
bytes move over libp2p streams on protocol ``hivegrpo.blob.v1`` and are verified before anything uses them.

- ``BlobCache``: the on-disk store (atomic writes, hash checked before a file counts as present).
- ``BlobServer``: answers requests from a cache on a P2P instance (with an ``authorize(peer_id)`` hook).
- ``fetch_blob``: async; cache first, then providers in random order, each attempt verified; ``BlobUnavailable``.
- ``BlobService``: the same for synchronous code holding a ``hivemind.DHT`` (background event loop thread).

docs/blobs.md describes the wire format, the cache layout and the measured throughput.
"""

from peer.network.blobs.cache import BlobCache, PendingBlob, check_sha256, sha256_file
from peer.network.blobs.errors import BlobCorrupt, BlobUnavailable
from peer.network.blobs.fetch import ProviderFailed, fetch_blob, read_blob_range
from peer.network.blobs.server import BlobServer, ServerStats, allow_all, drip, flip_bytes, truncate_after
from peer.network.blobs.service import BlobService
from peer.network.blobs.wire import CHUNK_SIZE, PROTOCOL

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
