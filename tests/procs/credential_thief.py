"""A peer that binds a copied learner credential to its own key and keeps it bound, as a thief of the secret would.

Usage: python tests/procs/credential_thief.py TOKEN --run-id ID --initial-peers MADDR...

It joins the run, publishes an admission under the credential (the certificate and a binding signed with the
copied holder secret, to its own DHT key and peer id) and re-stores it with a learner heartbeat every 2 s, as a
learner does. It announces nothing: what is tested is whether the credential's rightful learner, running at the same
time, is still admitted. SIGTERM ends it (exit 0).
"""

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("credential")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", action="append", required=True)
    args = parser.parse_args()

    from peer.network.admission import keep_admitted, parse_credential
    from peer.network.heartbeat import Heartbeat
    from peer.network.swarm import NetworkConfig, join

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    swarm = join(NetworkConfig.loopback(args.initial_peers), args.run_id)
    heartbeat = Heartbeat(swarm, "learner", interval=2.0)
    keep_admitted(swarm, heartbeat, parse_credential(args.credential))
    heartbeat.update(state="running")
    heartbeat.start()
    print("bound", flush=True)
    try:
        stop.wait()
    finally:
        heartbeat.stop(leaving=True)
        swarm.shutdown()


if __name__ == "__main__":
    main()
