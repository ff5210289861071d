"""A swarm member that only holds its share of the DHT: joins, prints its multiaddrs, runs until SIGTERM."""

import os
import signal
import sys
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str]) -> None:
    from peer.network.swarm import NetworkConfig, join

    run_id, initial = argv[0], argv[1:]
    stop = threading.Event()
    with join(NetworkConfig.loopback(initial), run_id) as swarm:
        # set only now: the DHT's forked processes keep the default action and die with their parent's shutdown
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(" ".join(swarm.visible_maddrs()), flush=True)
        stop.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
