"""What one call into a peer's DHT process costs: hivemind's pipe (``DHT.run_coroutine``) against the side channel
(``Swarm.call``, :mod:`peer.network.calls`), side by side in one run, on one real DHT on loopback.

Each round makes ``--calls`` calls of a function that does nothing but return the node's peer id, first through the
pipe, then through the channel, and reports per call: the wall time, the CPU time of the calling process and the
CPU time of the DHT process (user + system, from psutil)::

    python -m tests.benchmarks.calls --rounds 3 --calls 500
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


async def peer_id_of(_dht, node) -> str:
    return str(node.peer_id)


def _cpu(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def per_call(fn, calls: int, me, dht) -> dict:
    """Wall, caller CPU and DHT-process CPU per call, in milliseconds."""
    caller, helper, wall = _cpu(me), _cpu(dht), time.perf_counter()
    for _ in range(calls):
        fn()
    return {
        "wall_ms": round((time.perf_counter() - wall) / calls * 1e3, 4),
        "caller_cpu_ms": round((_cpu(me) - caller) / calls * 1e3, 4),
        "dht_cpu_ms": round((_cpu(dht) - helper) / calls * 1e3, 4),
    }


def main() -> None:
    import psutil

    from peer.network.swarm import NetworkConfig, join

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    swarm = join(NetworkConfig.loopback(), "bench")
    try:
        me, dht = psutil.Process(), psutil.Process(swarm.dht.pid)
        rounds = []
        for _ in range(args.rounds):
            pipe = per_call(lambda: swarm.dht.run_coroutine(peer_id_of), args.calls, me, dht)
            channel = per_call(lambda: swarm.call(peer_id_of), args.calls, me, dht)
            rounds.append({"pipe": pipe, "channel": channel})
            print(f"pipe {pipe}  channel {channel}", flush=True)
        print(json.dumps({"calls": args.calls, "rounds": rounds}))
    finally:
        swarm.shutdown()


if __name__ == "__main__":
    main()
