"""Fetching a blob from whichever provider can deliver it, verified before it enters the cache.

Order of sources: the local cache first; then the providers in random order (so that many fetchers spread over
many providers), skipping this peer itself. Each provider gets one attempt: its stream is written into a
temporary file while being hashed (in a worker thread, overlapping the next network read), and the attempt is
rejected on an error answer, an announced size other than the expected one, too many or too few bytes, a sha256
mismatch, ``timeout`` seconds without progress, or a transfer slower than ``MIN_RATE`` over the whole blob (a
provider that answers and then drips a byte now and then would otherwise hold a fetch for ever: every attempt has
a deadline of ``timeout + size / MIN_RATE``). At most ``MAX_PROVIDERS_TRIED`` providers are asked, so one fetch
ends within their deadlines whatever the providers do. Rejections are logged with the provider and the reason; the
partial file is deleted, so nothing unverified ever becomes visible in the cache. When every provider failed,
``BlobUnavailable`` says what each one did.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from peer.log import get_logger
from peer.network.blobs.cache import BlobCache, PendingBlob, check_sha256
from peer.network.blobs.errors import BlobCorrupt, BlobUnavailable
from peer.network.blobs.wire import (
    LATER,
    PROTOCOL,
    BlobRequest,
    BlobResponse,
    ProtocolError,
    read_chunk,
    read_header,
    write_header,
)

logger = get_logger(__name__)

Progress = Callable[[int, int], None]
DEFAULT_TIMEOUT = 30.0
MIN_RATE = 128 * 1024  # bytes/s a provider must average over a whole blob (a 1 GiB model file: 2.3 h at worst)
MAX_PROVIDERS_TRIED = 8  # providers one fetch asks at most


def attempt_deadline(size: int, timeout: float) -> float:
    """Seconds one provider gets for a blob of ``size`` bytes: ``timeout`` plus the time at ``MIN_RATE``."""
    return timeout + size / MIN_RATE


_ANSWERED_LATER = tuple(f"answered: {prefix}" for prefix in LATER)  # ProviderFailed's text for such a refusal


def answered_later(reason: str) -> bool:
    """Whether a provider's failure (as ``BlobUnavailable.reasons`` gives it) was a refusal meaning "another
    provider, or again soon": a full server, or a learner sending a new version to a couple of peers first."""
    return reason.startswith(_ANSWERED_LATER)


class ProviderFailed(Exception):
    """One provider could not deliver; the message is the reason shown to the user; ``hints``: peers it named as
    holding the blob (see ``BlobResponse``)."""

    def __init__(self, message: str, hints: tuple[str, ...] = ()):
        super().__init__(message)
        self.hints = hints


async def fetch_blob(
    p2p: P2P,
    sha256: str,
    size: int,
    providers: Sequence[PeerID],
    cache: BlobCache,
    *,
    progress: Progress | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    shuffle: bool = True,
    protocol: str = PROTOCOL,
    invite: str | None = None,
) -> Path:
    """Return the cached path of blob ``sha256`` of ``size`` bytes, fetching it from ``providers`` if needed.

    :param progress: called as ``progress(done_bytes, total_bytes)`` after every chunk received (on the event loop
      thread; keep it cheap). ``done_bytes`` restarts from 0 when the fetch moves on to another provider.
    :param timeout: seconds a provider may stay silent (opening the stream, answering, or between two chunks)
      before it is abandoned; a large blob from a live provider never times out.
    :param shuffle: try providers in random order (default) or in the order given.
    :param invite: this peer's invite, in a private swarm (providers refuse requests without a valid one).
    :raises BlobUnavailable: no provider delivered the right bytes; the message lists what each one did.
    """
    check_sha256(sha256)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    loop = asyncio.get_running_loop()
    if await loop.run_in_executor(None, cache.has, sha256):  # may re-hash a changed file: keep the loop free
        return cache.path(sha256)
    free = shutil.disk_usage(cache.root).free
    if free < size:
        raise BlobUnavailable(
            f"Not enough disk space for blob {sha256[:12]}… ({_mib(size)}): {cache.root} has {_mib(free)} free; "
            "free some space or point the cache elsewhere."
        )
    order = [p for p in dict.fromkeys(providers) if p != p2p.peer_id]
    if shuffle:
        random.shuffle(order)
    order = order[:MAX_PROVIDERS_TRIED]
    deadline = attempt_deadline(size, timeout)
    failures: list[str] = []
    reasons: dict[str, str] = {}
    hints: list[str] = []
    for peer in order:
        try:
            with cache.incoming(sha256, size) as pending:
                request = BlobRequest(sha256, 0, size, invite)
                receiving = _receive(p2p, peer, request, pending, progress, timeout, protocol, size)
                started = loop.time()
                try:
                    await asyncio.wait_for(receiving, deadline)
                except TimeoutError:
                    if loop.time() - started < deadline:
                        raise  # silent for ``timeout`` s (between two chunks): said below
                    raise ProviderFailed(
                        f"was too slow: not done after {deadline:.0f} s (under {MIN_RATE // 1024} KiB/s on average)"
                    ) from None
                path = pending.commit()
        except ProviderFailed as e:
            reason = str(e)
            hints += e.hints
        except BlobCorrupt as e:
            reason = f"sent bytes that do not match: {e}"
        except TimeoutError:
            reason = f"was silent for {timeout:g} s"
        except (P2PDaemonError, P2PHandlerError) as e:
            reason = f"could not be reached ({type(e).__name__}: {str(e)[:200]})"
        except ConnectionError as e:
            reason = f"lost the connection ({type(e).__name__}: {str(e)[:200]})"
        except ProtocolError as e:
            reason = f"broke the protocol ({e})"
        else:
            logger.info(f"fetched blob {sha256[:12]}… ({_mib(size)}) from {peer}")
            return path
        log = logger.debug if answered_later(reason) else logger.warning  # expected, not a fault
        log(f"provider {peer} failed to deliver blob {sha256[:12]}…: {reason}")
        failures.append(f"{_short(peer)} {reason}")
        reasons[peer.to_base58()] = reason
    if not order:
        detail = "no provider other than this peer is known"
    else:
        detail = "; ".join(failures)
    raise BlobUnavailable(
        f"Could not fetch blob {sha256[:12]}… ({_mib(size)}) from any of {len(order)} provider(s): {detail}; "
        "check that those peers are online and still hold it, retry later, or place the file in the local cache.",
        reasons,
        hints,
    )


async def read_blob_range(
    p2p: P2P,
    peer: PeerID,
    sha256: str,
    offset: int,
    length: int,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    protocol: str = PROTOCOL,
    invite: str | None = None,
) -> bytes:
    """Read ``length`` bytes at ``offset`` of a blob from one provider, unverified (e.g. a file header).

    :raises ProviderFailed: on an error answer or a short read (plus the network errors of ``fetch_blob``).
    """
    check_sha256(sha256)
    sink = _Buffer()
    await _receive(p2p, peer, BlobRequest(sha256, offset, length, invite), sink, None, timeout, protocol)
    return bytes(sink.data)


class _Buffer:
    def __init__(self):
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


async def _receive(
    p2p: P2P,
    peer: PeerID,
    request: BlobRequest,
    sink: PendingBlob | _Buffer,
    progress: Progress | None,
    timeout: float,
    protocol: str,
    whole_size: int | None = None,
) -> None:
    """One request on one stream: header out, header in, then frames into ``sink`` until the end frame."""
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, protocol), timeout)
    loop = asyncio.get_running_loop()
    pending_write, done = None, 0
    try:
        write_header(writer, request.to_wire())
        await asyncio.wait_for(writer.drain(), timeout)
        response = BlobResponse.from_wire(await asyncio.wait_for(read_header(reader), timeout))
        if not response.ok:
            raise ProviderFailed(f"answered: {response.error or 'error without a reason'}", response.hints)
        if whole_size is not None and response.size != whole_size:
            raise ProviderFailed(f"announced a blob of {response.size} bytes where {whole_size} were expected")
        if request.length is not None and response.length != request.length:
            raise ProviderFailed(f"announced {response.length} bytes where {request.length} were requested")
        while True:
            chunk = await asyncio.wait_for(read_chunk(reader), timeout)
            if not chunk:
                break
            if done + len(chunk) > response.length:
                raise ProviderFailed(f"sent more than the {response.length} bytes announced")
            if pending_write is not None:
                await pending_write
            pending_write = loop.run_in_executor(None, sink.write, chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, response.length)
        if pending_write is not None:
            await pending_write
            pending_write = None
        if done != response.length:
            raise ProviderFailed(f"ended the data after {done} of {response.length} bytes")
    except asyncio.IncompleteReadError:
        raise ProviderFailed(f"dropped the stream after {done} bytes") from None
    finally:
        if pending_write is not None:  # never close the file under a running write
            await asyncio.gather(pending_write, return_exceptions=True)
        writer.close()


def _short(peer: PeerID) -> str:
    text = peer.to_base58()
    return f"{text[:6]}…{text[-4:]}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
