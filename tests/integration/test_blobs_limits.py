"""What one stream may hold on a BlobServer, between real P2P daemons in this process: a stream waiting for its
request or refused holds no serving slot, one peer id gets at most ``max_streams_per_peer`` slots, and a slow
reader is dropped at its transfer's deadline. Each refusal is counted by its reason in ``ServerStats``."""

import asyncio
import os
import time

import msgpack
import pytest

from peer.network.blobs import PROTOCOL, BlobCache, BlobServer, BlobUnavailable, drip, fetch_blob
from peer.network.blobs import fetch as blobs_fetch
from peer.network.blobs.wire import BlobRequest
from tests.helpers.p2p import with_peers
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def open_streams(client, server_p2p, n: int) -> list:
    """``n`` streams to the blob protocol that send nothing (their writers, to close at the end)."""
    writers = []
    for _ in range(n):
        _, _, writer = await client.call_binary_stream_handler(server_p2p.peer_id, PROTOCOL)
        writers.append(writer)
    return writers


def close_all(writers) -> None:
    for writer in writers:
        writer.close()


def test_streams_waiting_for_their_request_are_capped_and_dropped_at_the_request_timeout(tmp_path):
    """A silent stream holds no serving slot; beyond the waiting caps (per peer, then in all) a stream is closed at
    once, unanswered; the silent ones are dropped when the request timeout passes."""
    store = BlobCache(tmp_path / "server")
    data = os.urandom(100_000)
    sha = store.put_bytes(data)

    async def scenario(server_p2p, clients):
        stranger, sybil, honest = clients
        server = BlobServer(server_p2p, store, request_timeout=4.0, max_waiting=5, max_waiting_per_peer=3)

        async def fetch(name: str):
            return await fetch_blob(honest, sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / name))

        writers = []
        async with server:
            try:
                opened = time.monotonic()
                writers += await open_streams(stranger, server_p2p, 4)
                await wait_until_async(lambda: server.stats.requests == 4, "the server saw the stranger's 4 streams")
                assert (server.waiting, server.stats.crowded, server.serving) == (3, 1, 0)
                assert (await fetch("a")).read_bytes() == data, "3 silent streams must not keep a peer out"
                # the honest stream lingers briefly after its transfer, held without a slot like the silent ones
                await wait_until_async(lambda: server.waiting == 3, "the honest stream's linger ended")
                writers += await open_streams(sybil, server_p2p, 3)
                await wait_until_async(lambda: server.stats.requests == 8, "the server saw the sybil's 3 streams")
                assert (server.waiting, server.stats.crowded) == (5, 2)
                with pytest.raises(BlobUnavailable, match="dropped the stream after 0 bytes"):
                    await fetch("b")  # the cap in all: closed at once, unanswered
                assert server.stats.crowded == 3
                await wait_until_async(lambda: server.stats.header_timeout == 5, "the 5 silent streams timed out", 12)
                assert time.monotonic() - opened >= 4.0
                await wait_until_async(lambda: server.waiting == 0, "no stream held any more")
                assert (await fetch("c")).read_bytes() == data
            finally:
                close_all(writers)
        assert (server.stats.served, server.stats.refused, server.stats.busy, server.stats.peer_limit) == (2, 0, 0, 0)

    asyncio.run(with_peers(3, scenario))


def _request_frame(request: BlobRequest) -> bytes:
    body = msgpack.packb(request.to_wire(), use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def test_an_unauthorized_request_never_takes_a_serving_slot(tmp_path):
    """A stranger's requests to a private server with 2 slots, sent slowly and then refused and left open, never
    hold a slot: an invited peer is served all along."""
    store = BlobCache(tmp_path / "server")
    data = os.urandom(100_000)
    sha = store.put_bytes(data)

    async def scenario(server_p2p, clients):
        stranger, invited = clients
        server = BlobServer(
            server_p2p,
            store,
            authorize=lambda peer_id, invite: None if invite == "welcome" else "no invite",
            max_streams=2,
            max_streams_per_peer=2,
        )

        async def fetch(name: str):
            cache = BlobCache(tmp_path / name)
            return await fetch_blob(invited, sha, len(data), [server_p2p.peer_id], cache, invite="welcome")

        frame = _request_frame(BlobRequest(sha, invite="forged"))
        async with server:
            writers = await open_streams(stranger, server_p2p, 2)
            try:
                for writer in writers:  # all of a request but its last byte: the server waits for the rest
                    writer.write(frame[:-1])
                    await writer.drain()
                await wait_until_async(lambda: server.stats.requests == 2, "the server saw the stranger's streams")
                assert (await fetch("a")).read_bytes() == data, "a slot was held by a request not read yet"
                # the invited fetch's own stream lingers until its client closes it: under load, a moment later
                await wait_until_async(lambda: server.waiting == 2, "the invited fetch's stream closed")
                for writer in writers:  # now whole: refused, and the stranger neither reads nor closes
                    writer.write(frame[-1:])
                    await writer.drain()
                await wait_until_async(lambda: server.stats.unauthorized == 2, "the stranger's requests were refused")
                assert server.waiting == 2, "the refused streams should still be open (lingering)"
                assert (await fetch("b")).read_bytes() == data, "a slot was held by an unauthorized request"
            finally:
                close_all(writers)
        s = server.stats
        assert (s.served, s.unauthorized, s.refused, s.busy, s.peer_limit, s.header_timeout) == (2, 2, 2, 0, 0, 0)

    asyncio.run(with_peers(2, scenario))


def test_one_peer_gets_at_most_its_share_of_the_slots_and_each_refusal_is_counted(tmp_path):
    """Slots held by a slow transfer (1 byte, 2 s): a peer asking 3 at once gets 2 and "busy"; another peer then
    gets the last slot of 3 and "busy" once the server is full."""
    from peer.network.blobs import ProviderFailed, read_blob_range

    store = BlobCache(tmp_path / "server")
    sha = store.put_bytes(os.urandom(1000))

    async def scenario(server_p2p, clients):
        first, second = clients
        server = BlobServer(server_p2p, store, transform=drip(2.0), max_streams=3, max_streams_per_peer=2)

        def read(client):
            return asyncio.ensure_future(read_blob_range(client, server_p2p.peer_id, sha, 0, 1, timeout=10))

        async with server:
            reads = [read(first) for _ in range(3)]
            await wait_until_async(lambda: (server.serving, server.stats.peer_limit) == (2, 1), "2 served, 1 refused")
            reads += [read(second) for _ in range(2)]
            await wait_until_async(lambda: (server.serving, server.stats.busy) == (3, 1), "3 served, 1 busy")
            outcomes = await asyncio.gather(*reads, return_exceptions=True)
            # a stream is let go once its client closed it too (the server lingers for that, briefly)
            await wait_until_async(lambda: (server.serving, server.waiting) == (0, 0), "every stream let go")
        served = [o for o in outcomes if isinstance(o, bytes)]
        refused = [str(o) for o in outcomes if isinstance(o, ProviderFailed)]
        assert len(served) == 3 and len(refused) == 2, outcomes
        assert sum("the most one peer gets" in r for r in refused) == 1, refused
        assert all("busy" in r for r in refused), refused
        s = server.stats
        assert (s.requests, s.served, s.refused, s.peer_limit, s.busy, s.unauthorized) == (5, 3, 2, 1, 1, 0)

    asyncio.run(with_peers(2, scenario))


def test_a_reader_slower_than_min_rate_is_dropped_at_the_transfer_deadline(tmp_path, monkeypatch):
    """A client that keeps reading, but slowly, never leaves our writes unread for ``timeout`` s; the transfer's
    deadline (``attempt_deadline``: timeout + size / MIN_RATE, as for the client) drops it and frees its slot."""
    size = 64 << 20
    monkeypatch.setattr(blobs_fetch, "MIN_RATE", 32 << 20)  # a deadline of 2 + 2 s for this blob
    deadline = blobs_fetch.attempt_deadline(size, 2.0)
    store = BlobCache(tmp_path / "server")
    sha = store.put_bytes(os.urandom(size))

    async def scenario(server_p2p, clients):
        (client,) = clients
        server = BlobServer(server_p2p, store, timeout=2.0)
        async with server:
            _, reader, writer = await client.call_binary_stream_handler(server_p2p.peer_id, PROTOCOL)
            try:
                writer.write(_request_frame(BlobRequest(sha)))
                await writer.drain()
                started, received = time.monotonic(), 0
                while server.stats.too_slow == 0 and time.monotonic() - started < deadline + 4:
                    received += len(await asyncio.wait_for(reader.read(64 << 10), 1))  # ~1.3 MiB/s
                    await asyncio.sleep(0.05)
                took = time.monotonic() - started
            finally:
                writer.close()
            assert server.stats.too_slow == 1, f"still serving after {took:.1f} s ({received} bytes read)"
            assert deadline - 0.5 <= took <= deadline + 2, f"dropped after {took:.1f} s, deadline {deadline:.1f} s"
            assert received < size
            await wait_until_async(lambda: server.serving == 0 and server.waiting == 0, "the slot given back")
        assert (server.stats.served, server.stats.failed) == (0, 0), server.stats

    asyncio.run(with_peers(1, scenario))


def test_an_oversized_request_is_refused_from_its_length_alone(tmp_path):
    """A request's length prefix over MAX_REQUEST is answered "bad request" at once: the server does not wait for
    (or read) the body, and the stream never takes a slot."""
    from peer.network.blobs.wire import MAX_REQUEST, BlobResponse, read_header

    store = BlobCache(tmp_path / "server")

    async def scenario(server_p2p, clients):
        (client,) = clients
        server = BlobServer(server_p2p, store)
        async with server:
            _, reader, writer = await client.call_binary_stream_handler(server_p2p.peer_id, PROTOCOL)
            try:
                writer.write((MAX_REQUEST + 1).to_bytes(4, "big"))
                await writer.drain()
                response = BlobResponse.from_wire(await asyncio.wait_for(read_header(reader), 3))
            finally:
                writer.close()
        assert not response.ok and f"bad request: header of {MAX_REQUEST + 1} bytes exceeds {MAX_REQUEST}" in (
            response.error
        )
        s = server.stats
        assert (s.bad_request, s.refused, s.served, s.header_timeout) == (1, 1, 0, 0)

    asyncio.run(with_peers(1, scenario))


def test_a_client_that_stops_reading_is_dropped_after_timeout(tmp_path):
    """A client asks for a large blob and reads nothing: once the buffers on the way are full, our writes sit
    unread, and after ``timeout`` s the stream is dropped and its slot given back (long before its deadline)."""
    size = 64 << 20
    store = BlobCache(tmp_path / "server")
    sha = store.put_bytes(os.urandom(size))

    async def scenario(server_p2p, clients):
        (client,) = clients
        server = BlobServer(server_p2p, store, timeout=1.0)
        assert blobs_fetch.attempt_deadline(size, 1.0) > 60
        async with server:
            _, _, writer = await client.call_binary_stream_handler(server_p2p.peer_id, PROTOCOL)
            try:
                writer.write(_request_frame(BlobRequest(sha)))
                await writer.drain()
                await wait_until_async(lambda: server.stats.failed == 1, "the stalled stream dropped", 15)
                await wait_until_async(lambda: server.serving == 0 and server.waiting == 0, "the slot given back")
            finally:
                writer.close()
        assert (server.stats.served, server.stats.too_slow) == (0, 0)
        assert server.stats.bytes_sent < size

    asyncio.run(with_peers(1, scenario))
