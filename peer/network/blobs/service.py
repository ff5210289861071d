"""Blob serving and fetching for synchronous peer code that holds a ``hivemind.DHT``.

``hivemind.DHT`` runs its node (and its p2pd daemon) in a separate process. ``BlobService`` starts one daemon
thread with its own asyncio event loop, connects a P2P *replica* to the DHT's daemon from there (same peer id,
same addresses: the DHT peer id is the provider id other peers see in announcements), registers a ``BlobServer``
on it, and exposes blocking calls::

    dht = hivemind.DHT(initial_peers=..., start=True)
    with BlobService(dht, BlobCache("~/.cache/hivegrpo/blobs")) as blobs:
        sha = blobs.cache.put_file("adapter.safetensors")       # now served to every peer that asks
        path = blobs.fetch(other_sha, other_size, providers)    # blocks; verified; from the local cache if there
    dht.shutdown()                                              # after the service: the replica needs the daemon

The replica is private to this service (made with ``P2P.replicate`` on the DHT daemon's control socket, which
``DHT.run_coroutine`` reports) rather than ``DHT.replicate_p2p()``'s shared one: that one is cached per process,
so its stream handlers would live on whichever event loop created it first, and closing it here would break
other users. Handlers registered on a replica are reachable by remote peers exactly like the DHT's own (the
daemon forwards inbound streams to the replica's socket; tests/integration/test_blobs.py checks it across processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from peer.log import get_logger
from peer.network.blobs.cache import BlobCache
from peer.network.blobs.fetch import DEFAULT_TIMEOUT, Progress, fetch_blob
from peer.network.blobs.server import MAX_STREAMS, Authorize, BlobServer, ChunkTransform, Seeding, allow_all

logger = get_logger(__name__)
T = TypeVar("T")


async def _daemon_listen_maddr(_dht: DHT, node: DHTNode) -> Multiaddr:
    """Runs inside the DHT process: where its p2pd listens for control clients."""
    return node.p2p.daemon_listen_maddr


class BlobService:
    """A BlobServer plus blocking ``fetch`` on a background event loop, sharing the DHT's libp2p identity.

    :param dht: a started ``hivemind.DHT``; the service must be closed before it is shut down
    :param cache: the blob store to serve from and fetch into
    :param serve: register the server (False: fetch only, e.g. a read-only status client)
    :param authorize: per-request check of the remote peer id and invite (see ``BlobServer``)
    :param access: a private swarm's :class:`~peer.network.access.Access`: served requests must carry a valid
      invite, and this peer's fetches carry its own (it replaces ``authorize``)
    :param transform: fault injection for tests and benchmarks only (see ``BlobServer``)
    :param max_streams: requests served at once (see ``BlobServer`` for the other limits, per peer and per stream)
    :param start_timeout: seconds to wait for the replica and the handler registration
    :param max_upload: bytes/s the server sends at most, all streams together (None: no limit; see ``BlobServer``)

    :attr:`seeding` (see :class:`~peer.network.blobs.server.Seeding`): a learner marks its new adapter versions
    there. :attr:`fetched_bytes` counts the bytes received from other peers (refused and cut transfers too) and
    :attr:`served_bytes` the bytes sent: a peer's heartbeat reports both.
    """

    def __init__(
        self,
        dht: DHT,
        cache: BlobCache,
        *,
        serve: bool = True,
        authorize: Authorize = allow_all,
        transform: ChunkTransform | None = None,
        max_streams: int = MAX_STREAMS,
        start_timeout: float = 30.0,
        access=None,
        max_upload: float | None = None,
    ):
        self.cache = cache
        self.seeding = Seeding()
        self.fetched_bytes = 0
        self.invite = None if access is None else access.invite.token
        if access is not None:
            authorize = lambda peer_id, invite: access.check(invite)  # noqa: E731
        self.server: BlobServer | None = None
        self.p2p: P2P | None = None
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hivegrpo-blobs", daemon=True)
        self._thread.start()
        try:
            daemon_maddr = dht.run_coroutine(_daemon_listen_maddr)
            self.p2p = self._call(P2P.replicate(daemon_maddr), start_timeout)
            if serve:
                server = BlobServer(
                    self.p2p,
                    cache,
                    authorize=authorize,
                    transform=transform,
                    max_streams=max_streams,
                    seeding=self.seeding,
                    max_upload=max_upload,
                )
                self._call(server.start(), start_timeout)
                self.server = server
        except BaseException:
            self.close()
            raise

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    @property
    def served_bytes(self) -> int:
        return 0 if self.server is None else self.server.stats.bytes_sent

    def counters(self) -> dict[str, float]:
        """What a heartbeat reports of this peer's blob traffic (cumulative bytes)."""
        return {"served_bytes": float(self.served_bytes), "fetched_bytes": float(self.fetched_bytes)}

    def fetch(
        self,
        sha256: str,
        size: int,
        providers: Sequence[PeerID],
        *,
        progress: Progress | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        shuffle: bool = True,
    ) -> Path:
        """Blocking ``fetch_blob`` into this service's cache (see there). Concurrent fetches of one blob share
        one transfer; ``progress`` then reports only to the caller that started it. Raises BlobUnavailable."""
        return self._call(self._fetch_shared(sha256, size, list(providers), progress, timeout, shuffle))

    def run_coroutine(self, fn: Callable[[P2P], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``fn(p2p)`` on the service's event loop and block for its result (for other network code)."""
        return self._call(fn(self.p2p), timeout)

    def close(self) -> None:
        """Remove the handler, cancel fetches in flight, close the replica and stop the loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._aclose(), timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BlobService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _fetch_shared(self, sha256, size, providers, progress, timeout, shuffle=True) -> Path:
        key = (sha256, size)
        task = self._inflight.get(key)
        if task is None:
            progress = self._counting(progress)
            task = asyncio.ensure_future(
                fetch_blob(
                    self.p2p,
                    sha256,
                    size,
                    providers,
                    self.cache,
                    progress=progress,
                    timeout=timeout,
                    shuffle=shuffle,
                    invite=self.invite,
                )
            )
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(task)

    def _counting(self, progress: Progress | None) -> Progress:
        """``progress`` (or nothing) that also adds the bytes received to :attr:`fetched_bytes` (``done`` restarts
        at 0 with each provider)."""
        last = 0

        def count(done: int, total: int) -> None:
            nonlocal last
            self.fetched_bytes += done - last if done >= last else done
            last = done
            if progress is not None:
                progress(done, total)

        return count

    async def _aclose(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        if self.server is not None:
            with contextlib.suppress(Exception):  # the daemon may be gone already (DHT shut down first)
                await asyncio.wait_for(self.server.stop(), 5)
        if self.p2p is not None:
            await self.p2p.shutdown()

    def _call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        if self._closed and not self._loop.is_running():
            if asyncio.iscoroutine(coro):
                coro.close()  # never started: no "was never awaited" warning
            raise RuntimeError("this BlobService is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"blob service call did not finish within {timeout} s") from None
        except BaseException:
            future.cancel()
            raise
