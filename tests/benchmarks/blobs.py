"""Benchmark: blob transfer (``fetch_blob``) against raw hivemind binary streams of the same bytes.

    python -m tests.benchmarks.blobs [--size-mb 50] [--repeats 9] [--out bench.json]

Two processes on this machine, each a ``hivemind.DHT`` peer on loopback with a ``BlobService``. The serving
process holds one random blob, serves it with its BlobServer, and also registers two bare stream handlers that
send the same bytes from memory behind a single length: no frames, no header, no hashing. The fetching process
times, in rotating order:

- ``raw``: the tuned bare stream: 1 MiB writes with a drain each; the reader takes 1 MiB pieces and discards them.
  The transport's ceiling, and the baseline of the target ratio.
- ``raw_api``: hivemind's own ``P2P.send_raw_data`` / ``P2P.receive_raw_data`` (one buffer in, one bytes out), as
  hivemind code moves a payload; for context.
- ``blob``: ``BlobService.fetch`` into an empty cache (framed, written to disk, sha256-verified, renamed into place).

One untimed warm-up of each, then ``--repeats`` rounds. The table shows median throughput of each kind and the
ratio blob / raw (target: >= 0.8) as the median over rounds: on a shared machine the load drifts, and the
transfers of one round see nearly the same load. Not a test: numbers depend on the machine; docs/blobs.md records
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RAW_PROTOCOL = "hivegrpo.blob.bench.raw"
RAW_API_PROTOCOL = "hivegrpo.blob.bench.raw-api"
_RAW_PIECE = 1 << 20


def _dht(initial_peers=()):
    import hivemind

    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_relay=False,
        use_auto_relay=False,
        start=True,
    )


def serve(size: int) -> None:
    """The serving process: print one JSON line (maddrs, peer id, sha256, size), serve until SIGTERM/orphaned."""
    from peer.network.blobs import BlobCache, BlobService

    stop = threading.Event()
    parent = os.getppid()
    data = os.urandom(size)
    with tempfile.TemporaryDirectory(prefix="blobs-bench-serve-") as tmp:
        cache = BlobCache(Path(tmp))
        sha256 = cache.put_bytes(data)
        dht = _dht()
        try:
            with BlobService(dht, cache) as service:

                async def raw_handler(_info, reader, writer):
                    try:
                        view = memoryview(data)
                        writer.write(len(data).to_bytes(8, "big"))
                        for offset in range(0, len(data), _RAW_PIECE):
                            writer.write(view[offset : offset + _RAW_PIECE])
                            await writer.drain()
                        await asyncio.wait_for(reader.read(1), 10)  # as BlobServer: close after the reader did
                    finally:
                        writer.close()

                async def raw_api_handler(_info, reader, writer):
                    from hivemind.p2p import P2P

                    try:
                        await P2P.send_raw_data(data, writer)
                        await asyncio.wait_for(reader.read(1), 10)
                    finally:
                        writer.close()

                service.run_coroutine(lambda p2p: p2p.add_binary_stream_handler(RAW_PROTOCOL, raw_handler))
                service.run_coroutine(lambda p2p: p2p.add_binary_stream_handler(RAW_API_PROTOCOL, raw_api_handler))
                for signum in (signal.SIGTERM, signal.SIGINT):  # after the DHT forked: it keeps the defaults
                    signal.signal(signum, lambda *_: stop.set())
                maddrs = [str(m) for m in dht.get_visible_maddrs()]
                print(json.dumps({"maddrs": maddrs, "peer": dht.peer_id.to_base58(), "sha256": sha256, "size": size}))
                sys.stdout.flush()
                while not stop.wait(0.5) and os.getppid() == parent:
                    pass
        finally:
            dht.shutdown()


async def _raw_read(p2p, peer) -> int:
    _, reader, writer = await p2p.call_binary_stream_handler(peer, RAW_PROTOCOL)
    try:
        total = int.from_bytes(await reader.readexactly(8), "big")
        got = 0
        while got < total:
            got += len(await reader.readexactly(min(_RAW_PIECE, total - got)))
        return got
    finally:
        writer.close()


async def _raw_api_read(p2p, peer) -> int:
    _, reader, writer = await p2p.call_binary_stream_handler(peer, RAW_API_PROTOCOL)
    try:
        return len(await p2p.receive_raw_data(reader))
    finally:
        writer.close()


def _start_server(size: int, timeout: float = 60.0) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.benchmarks.blobs", "--serve", "--size-mb", str(size / 2**20)],
        stdout=subprocess.PIPE,
        text=True,
    )
    box: dict = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box.get("line"):
        _stop(proc)
        raise RuntimeError(f"the serving process printed no address within {timeout:g} s (exit code {proc.poll()})")
    return proc, json.loads(box["line"])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(size: int, repeats: int) -> dict:
    from hivemind.p2p import PeerID

    from peer.network.blobs import BlobCache, BlobService

    proc, info = _start_server(size)
    try:
        peer = PeerID.from_base58(info["peer"])
        dht = _dht(info["maddrs"])
        try:
            with (
                tempfile.TemporaryDirectory(prefix="blobs-bench-fetch-") as tmp,
                BlobService(dht, BlobCache(Path(tmp)), serve=False) as service,
            ):

                def timed(read) -> float:
                    start = time.perf_counter()
                    got = service.run_coroutine(lambda p2p: read(p2p, peer))
                    elapsed = time.perf_counter() - start
                    assert got == size, f"a raw stream delivered {got} of {size} bytes"
                    return elapsed

                def blob() -> float:
                    service.cache.remove(info["sha256"])
                    start = time.perf_counter()
                    path = service.fetch(info["sha256"], size, [peer])
                    elapsed = time.perf_counter() - start
                    assert path.stat().st_size == size
                    return elapsed

                kinds = {"raw": lambda: timed(_raw_read), "raw_api": lambda: timed(_raw_api_read), "blob": blob}
                for fn in kinds.values():  # warm-up: connections, page cache, allocator
                    fn()
                times: dict[str, list[float]] = {name: [] for name in kinds}
                names = list(kinds)
                for i in range(repeats):
                    for name in names[i % 3 :] + names[: i % 3]:
                        times[name].append(kinds[name]())
                with open(service.cache.path(info["sha256"]), "rb") as f:
                    verified = hashlib.file_digest(f, "sha256").hexdigest() == info["sha256"]
        finally:
            dht.shutdown()
    finally:
        _stop(proc)
    mib = size / 2**20
    result = {"size_bytes": size, "repeats": repeats, "cpus": os.cpu_count(), "verified": verified}
    for name, values in times.items():
        result[f"{name}_s"] = values
        result[f"{name}_mib_s"] = mib / statistics.median(values)
    result["round_ratios"] = [r / b for r, b in zip(times["raw"], times["blob"], strict=True)]
    result["ratio"] = statistics.median(result["round_ratios"])
    result["ratio_vs_raw_api"] = statistics.median(
        [r / b for r, b in zip(times["raw_api"], times["blob"], strict=True)]
    )
    return result


def _table(r: dict) -> str:
    mib = r["size_bytes"] / 2**20
    rows = [
        ("raw stream, tuned (no framing/hashing)", r["raw_s"]),
        ("raw stream, P2P.send/receive_raw_data", r["raw_api_s"]),
        ("fetch_blob (framed, hashed, on disk)", r["blob_s"]),
    ]
    title = f"{mib:.0f} MiB between 2 processes, {r['repeats']} rounds"
    lines = [f"{title:<42} {'median MiB/s':>12} {'min':>8} {'max':>8}"]
    for name, times in rows:
        speeds = [mib / t for t in times]
        lines.append(f"{name:<42} {mib / statistics.median(times):>12.0f} {min(speeds):>8.0f} {max(speeds):>8.0f}")
    ratios = r["round_ratios"]
    label = "ratio fetch_blob / tuned raw (target 0.8)"
    lines.append(f"{label:<42} {r['ratio']:>12.2f} {min(ratios):>8.2f} {max(ratios):>8.2f}")
    lines.append(f"{'ratio fetch_blob / P2P raw_data API':<42} {r['ratio_vs_raw_api']:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.blobs", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=50.0, help="blob size in MiB (default 50)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds, one transfer of each kind (default 9)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the serving process
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    size = int(args.size_mb * 2**20)
    if args.serve:
        serve(size)
        return
    result = run(size, args.repeats)
    print(_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
