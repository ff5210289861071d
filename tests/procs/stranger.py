"""A peer that tries to use a private swarm without a valid invite, and reports what it got.

Usage: python tests/procs/stranger.py RUN_ID OUT.json SHA256 SIZE MADDR... [--invite TOKEN]

It starts a DHT with the run's validators and, unlike ``join``, does not give up when nobody answers its
bootstrap (``ensure_bootstrap_success=False``): then it tries what a stranger would — read the manifest, store a
heartbeat under its own key, fetch the blob ``SHA256`` of ``SIZE`` bytes from the peers it was given — and writes
the outcomes to ``OUT.json``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_id")
    parser.add_argument("out")
    parser.add_argument("sha256")
    parser.add_argument("size", type=int)
    parser.add_argument("maddrs", nargs="+")
    parser.add_argument("--invite", default=None)
    args = parser.parse_args()

    import hivemind
    from hivemind.p2p import PeerID

    from peer.network.access import Access, parse_invite
    from peer.network.blobs import BlobCache, BlobService, BlobUnavailable
    from peer.network.heartbeat import Heartbeat
    from peer.network.swarm import NetworkConfig, Swarm, load_signing_key
    from peer.protocol import manifest_key
    from peer.protocol.validators import make_validators

    key = load_signing_key(None)
    access = Access(parse_invite(args.invite), args.run_id) if args.invite else None
    kwargs = {"authorizer": access.authorizer(key)} if access else {}
    dht = hivemind.DHT(
        initial_peers=args.maddrs,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_relay=False,
        use_auto_relay=False,
        record_validators=make_validators(args.run_id, key),
        ensure_bootstrap_success=False,
        start=True,
        **kwargs,
    )
    swarm = Swarm(dht, args.run_id, key, NetworkConfig.loopback(args.maddrs), access)
    blobs = BlobService(dht, BlobCache(Path(args.out).parent / "stranger-blobs"), access=access)
    report = {"owner": swarm.public_key.hex()}
    try:
        report["manifest_entries"] = len(swarm.get_dict(manifest_key(args.run_id)))
        report["heartbeat_stored"] = Heartbeat(swarm, "rollout").beat()
        providers = [PeerID.from_base58(m.rsplit("/p2p/", 1)[1]) for m in args.maddrs]
        try:
            blobs.fetch(args.sha256, args.size, providers, timeout=20)
            report["blob"] = "fetched"
        except BlobUnavailable as e:
            report["blob"] = str(e)
        report["time"] = time.time()
    finally:
        blobs.close()
        dht.shutdown()
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
