"""Blob transfer between real processes: a child process runs hivemind DHT peers with BlobServices (one honest,
one serving corrupt bytes, one truncating, one refusing everybody); this process joins them and fetches.

Run as a script (``python tests/integration/test_blobs.py serve CONFIG``) this file is that child process.
"""

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.p2p import P2P_KW
from tests.helpers.waiting import wait_until_async

ROOT = Path(__file__).resolve().parents[2]
BIG = 50 * 2**20
SMALL = 3 * 2**20 + 12345  # several chunks, the last one partial
DRIP_DELAY = 2.0  # s between two chunks of the dripping provider: under the per-chunk timeout the tests use
DHT_KW = dict(**P2P_KW, start=True)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


# --- the child process ---------------------------------------------------------------------------------------------


def serve(config: dict) -> None:
    """Start one DHT peer + BlobService per entry of ``config["peers"]``, print their addresses as one JSON line,
    and serve until SIGTERM or until this process's parent is gone."""
    import hivemind

    from peer.network.blobs import BlobCache, BlobService, drip, flip_bytes, truncate_after

    stop = threading.Event()
    parent = os.getppid()
    transforms = {None: None, "flip": flip_bytes, "truncate": truncate_after(SMALL // 2), "drip": drip(DRIP_DELAY)}
    dhts, services, out = [], [], {}
    try:
        for name, spec in config["peers"].items():
            cache = BlobCache(Path(config["root"]) / name)
            for blob in spec["blobs"]:
                if spec.get("adopt"):
                    cache.adopt(blob)  # served in place, as the coordinator seeds the bundled model
                else:
                    cache.put_file(blob)
            dht = hivemind.DHT(**DHT_KW)
            dhts.append(dht)
            authorize = (lambda peer_id, invite: "denied") if spec.get("deny") else (lambda peer_id, invite: None)
            services.append(BlobService(dht, cache, transform=transforms[spec.get("transform")], authorize=authorize))
            out[name] = {"maddrs": [str(m) for m in dht.get_visible_maddrs()], "peer": dht.peer_id.to_base58()}
        # only now: the forked DHT processes must keep the default SIGTERM action
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(json.dumps(out), flush=True)
        while not stop.wait(0.2) and os.getppid() == parent:
            pass
    finally:
        for service in services:
            service.close()
        for dht in dhts:
            dht.shutdown()


# --- the test process ----------------------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _readline_within(proc: subprocess.Popen, seconds: float) -> str:
    box = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    if not box.get("line"):
        raise AssertionError(f"serving child printed no addresses within {seconds:g} s (exit code {proc.poll()})")
    return box["line"]


def _end(proc: subprocess.Popen) -> None:
    """End the child and everything it started, by PID: SIGTERM (it shuts its DHTs down), then SIGKILL."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """The child's peers (name -> PeerID), the blobs (name -> bytes), and this process's DHT + BlobService."""
    import hivemind
    from hivemind.p2p import PeerID

    from peer.network.blobs import BlobCache, BlobService

    tmp = tmp_path_factory.mktemp("blobs")
    blobs = {"big": os.urandom(BIG), "small": os.urandom(SMALL)}
    files = {}
    for name, data in blobs.items():
        files[name] = str(tmp / f"{name}.bin")
        Path(files[name]).write_bytes(data)
    config = {
        "root": str(tmp / "child"),
        "peers": {
            "good": {"blobs": [files["big"], files["small"]], "adopt": True},
            "corrupt": {"blobs": [files["small"]], "transform": "flip"},
            "truncated": {"blobs": [files["small"]], "transform": "truncate"},
            "private": {"blobs": [files["small"]], "deny": True},
            "dripping": {"blobs": [files["small"]], "transform": "drip"},
        },
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, "serve", json.dumps(config)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    dht = service = None
    try:
        peers_info = json.loads(_readline_within(proc, 90))
        peers = {name: PeerID.from_base58(info["peer"]) for name, info in peers_info.items()}
        dht = hivemind.DHT(initial_peers=[m for info in peers_info.values() for m in info["maddrs"]], **DHT_KW)
        service = BlobService(dht, BlobCache(tmp / "parent"))
        maddrs = {name: info["maddrs"] for name, info in peers_info.items()}
        yield {"peers": peers, "maddrs": maddrs, "blobs": blobs, "service": service, "tmp": tmp}
    finally:
        if service is not None:
            service.close()
        if dht is not None:
            dht.shutdown()
        _end(proc)


def _fetch(swarm, cache, blob: str, providers: list[str], *, size=None, timeout=10.0):
    """fetch_blob on the service's event loop, into ``cache``, from the named providers in the given order."""
    from peer.network.blobs import fetch_blob

    data = swarm["blobs"][blob]
    ids = [swarm["peers"][p] for p in providers]
    return swarm["service"].run_coroutine(
        lambda p2p: fetch_blob(
            p2p, _sha(data), len(data) if size is None else size, ids, cache, timeout=timeout, shuffle=False
        )
    )


def _stored(cache) -> list[Path]:
    return sorted(p for sub in ("objects", "tmp") for p in (cache.root / sub).rglob("*") if p.is_file())


@pytest.fixture
def cache(tmp_path):
    from peer.network.blobs import BlobCache

    return BlobCache(tmp_path / "cache")


def test_fetch_50mb_from_another_process(swarm):
    """Handlers on a DHT replica are reachable from another process; the blob arrives verified, with progress."""
    service, data = swarm["service"], swarm["blobs"]["big"]
    calls = []
    start = time.monotonic()
    path = service.fetch(_sha(data), len(data), [swarm["peers"]["good"]], progress=lambda d, t: calls.append((d, t)))
    elapsed = time.monotonic() - start
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == _sha(data)
    assert path.parent.parent == service.cache.root / "objects"
    assert calls[-1] == (BIG, BIG)
    assert len(calls) >= BIG // (2 << 20), "progress should be reported chunk by chunk"
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:], strict=False))
    # a second fetch is served by the cache: no provider needed
    assert service.fetch(_sha(data), len(data), []) == path
    print(f"50 MiB in {elapsed:.2f} s")


def test_corrupt_provider_is_rejected_and_the_next_one_used(swarm, cache, caplog):
    data = swarm["blobs"]["small"]
    path = _fetch(swarm, cache, "small", ["corrupt", "good"])
    assert path.read_bytes() == data
    assert _stored(cache) == [path], "nothing but the verified blob may be left in the cache"
    rejected = [r.getMessage() for r in caplog.records if "failed to deliver" in r.getMessage()]
    assert len(rejected) == 1 and str(swarm["peers"]["corrupt"]) in rejected[0] and "hashes to" in rejected[0]


def test_truncated_provider_is_rejected(swarm, cache, caplog):
    path = _fetch(swarm, cache, "small", ["truncated", "good"])
    assert path.read_bytes() == swarm["blobs"]["small"]
    rejected = [r.getMessage() for r in caplog.records if "failed to deliver" in r.getMessage()]
    assert len(rejected) == 1 and str(swarm["peers"]["truncated"]) in rejected[0]
    # the provider cut the stream after SMALL // 2 bytes; what was still in flight may be lost with it
    dropped = re.search(r"dropped the stream after (\d+) bytes", rejected[0])
    assert dropped and int(dropped.group(1)) <= SMALL // 2, rejected[0]


def test_all_providers_bad_raises_blob_unavailable(swarm, cache):
    from peer.errors import UserError
    from peer.network.blobs import BlobUnavailable

    with pytest.raises(BlobUnavailable) as info:
        _fetch(swarm, cache, "small", ["corrupt", "truncated", "private"])
    message = str(info.value)
    assert isinstance(info.value, UserError)
    assert "3 provider(s)" in message and "hashes to" in message and "bytes" in message
    assert "not authorized" in message and "retry later" in message
    assert _stored(cache) == [], "no corrupt or partial bytes may enter the cache"
    assert not cache.has(_sha(swarm["blobs"]["small"]))


def test_unknown_blob_fails_cleanly(swarm, cache):
    from peer.network.blobs import BlobUnavailable, fetch_blob

    start = time.monotonic()
    with pytest.raises(BlobUnavailable, match="does not have blob"):
        swarm["service"].run_coroutine(
            lambda p2p: fetch_blob(p2p, "0" * 64, 10, [swarm["peers"]["good"]], cache, timeout=10)
        )
    assert time.monotonic() - start < 5, "an unknown blob must be refused at once, not time out"
    assert _stored(cache) == []


def test_size_mismatch_is_rejected(swarm, cache):
    from peer.network.blobs import BlobUnavailable

    with pytest.raises(BlobUnavailable, match=f"announced a blob of {SMALL} bytes where {SMALL - 1} were expected"):
        _fetch(swarm, cache, "small", ["good"], size=SMALL - 1)
    with pytest.raises(BlobUnavailable, match=f"range 0\\+{SMALL + 1} is outside {SMALL} bytes"):
        _fetch(swarm, cache, "small", ["good"], size=SMALL + 1)
    assert _stored(cache) == []


def test_unreachable_provider_times_out_and_the_next_one_is_used(swarm, cache, caplog):
    from hivemind.p2p import PeerID

    from peer.network.blobs import fetch_blob

    data = swarm["blobs"]["small"]
    nobody = PeerID.from_base58("12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")
    start = time.monotonic()
    path = swarm["service"].run_coroutine(
        lambda p2p: fetch_blob(
            p2p, _sha(data), len(data), [nobody, swarm["peers"]["good"]], cache, timeout=3, shuffle=False
        )
    )
    assert path.read_bytes() == data
    assert time.monotonic() - start < 30
    assert any(str(nobody) in r.getMessage() for r in caplog.records if "failed to deliver" in r.getMessage())


def test_a_dripping_provider_is_dropped_at_its_deadline_and_the_next_one_used(swarm, cache, caplog, monkeypatch):
    from peer.network.blobs import fetch as blobs_fetch
    from peer.network.blobs import fetch_blob

    data = swarm["blobs"]["small"]  # 4 chunks, DRIP_DELAY apart: ~8 s from the dripping provider, never silent 3 s
    monkeypatch.setattr(blobs_fetch, "MIN_RATE", 1 << 20)  # a deadline of 3 + 3.0 s for this blob
    start = time.monotonic()
    path = swarm["service"].run_coroutine(
        lambda p2p: fetch_blob(
            p2p, _sha(data), len(data), [swarm["peers"]["dripping"], swarm["peers"]["good"]], cache, timeout=3,
            shuffle=False,
        )
    )  # fmt: skip
    assert path.read_bytes() == data
    took = time.monotonic() - start
    assert took < 4 * DRIP_DELAY, f"waited out the whole drip ({took:.1f} s)"
    reasons = [r.getMessage() for r in caplog.records if "failed to deliver" in r.getMessage()]
    assert any(str(swarm["peers"]["dripping"]) in m and "too slow" in m for m in reasons), reasons


def test_range_read(swarm):
    from peer.network.blobs import ProviderFailed, read_blob_range

    data, good = swarm["blobs"]["small"], swarm["peers"]["good"]

    async def read(p2p, offset, length):
        return await read_blob_range(p2p, good, _sha(data), offset, length, timeout=10)

    service = swarm["service"]
    assert service.run_coroutine(lambda p2p: read(p2p, 2**20 - 10, 2**20 + 20)) == data[2**20 - 10 : 2**21 + 10]
    assert service.run_coroutine(lambda p2p: read(p2p, SMALL, 0)) == b""
    with pytest.raises(ProviderFailed, match="outside"):
        service.run_coroutine(lambda p2p: read(p2p, SMALL - 5, 10))


def test_concurrent_fetches_share_one_transfer(swarm, caplog):
    from concurrent.futures import ThreadPoolExecutor

    caplog.set_level(logging.INFO, logger="hivegrpo")
    data = swarm["blobs"]["small"]
    service = swarm["service"]
    service.cache.remove(_sha(data))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: service.fetch(_sha(data), len(data), [swarm["peers"]["good"]]), range(4)))
    assert len(set(paths)) == 1 and paths[0].read_bytes() == data
    assert len([r for r in caplog.records if r.getMessage().startswith("fetched blob")]) == 1


def _with_other_peer(swarm, provider: str, scenario):
    """Run ``scenario(p2p, other)`` on the service's event loop: ``p2p`` is the service's, ``other`` a second P2P
    daemon of this process (another peer id) joined to the child's ``provider``, shut down at the end."""
    from hivemind.p2p import P2P

    async def run(p2p):
        other = await P2P.create(initial_peers=swarm["maddrs"][provider], **P2P_KW)
        try:
            return await scenario(p2p, other)
        finally:
            await other.shutdown()

    return swarm["service"].run_coroutine(run)


def test_silent_streams_of_a_stranger_leave_the_provider_to_others(swarm, cache):
    """A stranger opens 10 streams to a provider and never sends a request. They hold no serving slot (4 wait for
    their request, the others are closed at once), so another peer's fetch is served at once, not after the
    stranger's streams time out; the 4 are dropped at the request timeout."""
    from peer.network.blobs import PROTOCOL, fetch_blob
    from peer.network.blobs.server import MAX_WAITING_PER_PEER, REQUEST_TIMEOUT

    data, good = swarm["blobs"]["small"], swarm["peers"]["good"]

    async def scenario(p2p, stranger):
        loop = asyncio.get_running_loop()
        streams = [await stranger.call_binary_stream_handler(good, PROTOCOL) for _ in range(10)]
        opened = loop.time()
        closed = [asyncio.ensure_future(reader.read(1)) for _, reader, _ in streams]  # b"" when the server closes
        try:
            over_cap = 10 - MAX_WAITING_PER_PEER
            await wait_until_async(
                lambda: sum(c.done() for c in closed) >= over_cap, "the streams over the cap closed", 2
            )
            closed_at_once = sum(c.done() for c in closed)
            started = loop.time()
            path = await fetch_blob(p2p, _sha(data), len(data), [good], cache, timeout=30)
            took = loop.time() - started
            assert path.read_bytes() == data
            assert closed_at_once == over_cap, "only the streams over the cap should be closed at once"
            await asyncio.wait(closed, timeout=REQUEST_TIMEOUT + 5)
            assert all(c.done() and c.result() == b"" for c in closed), "silent streams are dropped, unanswered"
            return took, loop.time() - opened
        finally:
            for c in closed:
                c.cancel()
            for _, _, writer in streams:
                writer.close()

    took, all_closed = _with_other_peer(swarm, "good", scenario)
    assert took < 10, f"the fetch waited {took:.1f} s behind the stranger's silent streams"
    assert REQUEST_TIMEOUT - 1 < all_closed < REQUEST_TIMEOUT + 5, all_closed


def test_one_peer_is_served_at_most_max_streams_per_peer_at_once(swarm):
    """Four reads at once from one peer of a provider that takes 2 s a chunk: 2 are served, 2 answered "busy";
    another peer is served meanwhile (the provider's other slots stay open to it)."""
    from peer.network.blobs import ProviderFailed, read_blob_range
    from peer.network.blobs.server import MAX_STREAMS_PER_PEER

    data, dripping = swarm["blobs"]["small"], swarm["peers"]["dripping"]

    async def scenario(p2p, other):
        def read(client):
            return read_blob_range(client, dripping, _sha(data), 0, 1, timeout=10)

        mine = asyncio.gather(*[read(p2p) for _ in range(4)], return_exceptions=True)
        theirs = asyncio.gather(read(other), return_exceptions=True)
        return await mine, await theirs

    mine, theirs = _with_other_peer(swarm, "dripping", scenario)
    assert theirs == [data[:1]]
    served = [o for o in mine if isinstance(o, bytes)]
    refused = [str(o) for o in mine if isinstance(o, ProviderFailed)]
    assert served == [data[:1]] * MAX_STREAMS_PER_PEER, mine
    assert len(refused) == 4 - MAX_STREAMS_PER_PEER and all("the most one peer gets" in r for r in refused), mine


def test_authorize_sees_the_requesting_peer_and_its_invite_and_a_full_server_says_busy(tmp_path):
    """In one process: three P2P daemons; the server admits only one of the two clients, then only 0 streams."""
    from hivemind.p2p import P2P

    from peer.network.blobs import BlobCache, BlobServer, BlobUnavailable, fetch_blob

    kw = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)

    async def scenario():
        server_p2p = await P2P.create(**kw)
        clients = []
        try:
            for _ in range(2):
                clients.append(await P2P.create(initial_peers=await server_p2p.get_visible_maddrs(), **kw))
            invited, stranger = clients
            store = BlobCache(tmp_path / "server")
            data = os.urandom(100_000)
            sha = store.put_bytes(data)
            asked = []

            def authorize(pid, invite):
                asked.append((pid, invite))
                return None if pid == invited.peer_id and invite == "welcome" else "no invite"

            server = BlobServer(server_p2p, store, authorize=authorize)
            async with server:
                path = await fetch_blob(
                    invited, sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / "a"), invite="welcome"
                )
                assert path.read_bytes() == data
                with pytest.raises(BlobUnavailable, match=r"not authorized \(no invite\)"):
                    await fetch_blob(stranger, sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / "b"))
                assert asked == [(invited.peer_id, "welcome"), (stranger.peer_id, None)]
                server.max_streams = 0
                with pytest.raises(BlobUnavailable, match="busy"):
                    await fetch_blob(
                        invited, sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / "c"), invite="welcome"
                    )
            assert server.stats.served == 1 and server.stats.refused == 2
        finally:
            for p2p in [*clients, server_p2p]:
                await p2p.shutdown()

    asyncio.run(scenario())


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python tests/integration/test_blobs.py serve CONFIG_JSON")
    serve(json.loads(sys.argv[2]))
