"""A peer that serves corrupt copies of everything it holds: the run's base-model files and every adapter version.

Usage: python tests/procs/corrupt_mirror.py MODE --run-id ID --coordinator FP --initial-peers MADDR... [--identity F]
       [--learner-credential TOKEN]

It joins the run like a rollout peer (a heartbeat of role ``rollout``, so other peers take it for a source of the
base model), fetches the base-model files honestly, and then, every half second, fetches the newest announced
adapter honestly and announces it again under its own key with itself as the provider — so peers that follow
adapters ask it too. Only admitted learners' announcements count, so it needs a learner credential of the run's
host to be asked (an admitted learner whose blob service is broken). Everything it serves goes through MODE:
``flip`` (one byte of every chunk inverted) or ``truncate`` (the stream dropped after 1000 bytes). It never
samples. SIGTERM ends it (exit 0).
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
    parser.add_argument("mode", choices=["flip", "truncate"])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--initial-peers", action="append", default=[])
    parser.add_argument("--identity", default=None)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--learner-credential", default=None)
    args, _ = parser.parse_known_args()

    from hivemind.p2p import PeerID

    from peer.network.blobs import BlobCache, BlobService, flip_bytes, truncate_after
    from peer.network.heartbeat import Heartbeat, live_peers
    from peer.network.swarm import NetworkConfig, join
    from peer.run.adapters import announce_adapter, announcements, newest_announcement
    from peer.run.basemodel import fetch_from, resolve_base
    from peer.run.spec import read_manifest

    transform = {"flip": flip_bytes, "truncate": truncate_after(1000)}[args.mode]
    cache_dir = Path(args.cache_dir)
    swarm = join(NetworkConfig.loopback(args.initial_peers, identity_path=args.identity), args.run_id)
    blobs = BlobService(swarm.dht, BlobCache(cache_dir / "blobs"), transform=transform)
    heartbeat = Heartbeat(swarm, "rollout").start()
    if args.learner_credential:
        from peer.network.admission import keep_admitted, parse_credential

        keep_admitted(swarm, heartbeat, parse_credential(args.learner_credential))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def others():
        me = str(swarm.peer_id)
        return [PeerID.from_base58(p.record.peer_id) for p in live_peers(swarm) if p.record.peer_id != me]

    try:
        manifest, _ = read_manifest(swarm, args.coordinator)
        resolve_base(manifest.model, blobs.cache, cache_dir / "models", fetch_from(blobs, others))
        print(f"holding the base model: {len(manifest.model.files)} files", file=sys.stderr, flush=True)
        mirrored = -1
        while not stop.wait(0.5):
            found = newest_announcement(announcements(swarm))
            if found is None or found.version <= mirrored or found.version == 0:
                continue
            try:
                providers = [PeerID.from_base58(p) for p in found.providers]
                blob = blobs.fetch(found.sha256, found.size, providers, timeout=10.0).read_bytes()
                announce_adapter(swarm, blobs, found.version, blob, found.parent_sha256)
            except Exception as e:  # a peer that does this for a living shrugs it off
                print(f"could not mirror v{found.version}: {e}", file=sys.stderr, flush=True)
                continue
            mirrored = found.version
            heartbeat.update(adapter_version=found.version)
    finally:
        heartbeat.stop(leaving=True)
        blobs.close()
        swarm.shutdown()


if __name__ == "__main__":
    main()
