"""A real swarm peer for multi-process tests: joins, publishes groups, heartbeats, and reports what it sees.

Usage: python tests/procs/bucket_peer.py DIR NAME [--initial-peers MADDR ...] [--groups N] [--expect N]
[--expect-groups N] [--big N] [--liar] [--wide-every S] [--wait-go]. Writes DIR/NAME.addr (its multiaddrs) once
joined and DIR/NAME.json once it has seen groups from ``--expect`` owners (and ``--expect-groups`` groups in all),
then waits for DIR/stop and shuts down cleanly.
``--big`` publishes that many groups too large for the DHT (they travel as blobs). ``--liar`` runs a DHT
*without* the run's validators and stores a wrong-schema entry and an entry under another peer's owner subkey, to
check that honest peers refuse them.
``--wide-every`` sets how often its bucket reads search wide (``inf``: narrow reads only); ``--wait-go`` publishes
only once DIR/go exists, and until then keeps the peer ids of its routing table in DIR/NAME.table (the test
creates DIR/go once every peer has every other in its table).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RUN = "procs-run"


def make_group(peer_id: str, version: int, seq: int, completion_tokens: int = 5):
    """Eight completions of ``completion_tokens`` tokens; the first one's token is ``3 + seq % 10`` (the test reads
    it back to tell whose group arrived)."""
    from tests.helpers.records import make_group

    completions = [[3 + (i + seq) % 10] * completion_tokens for i in range(8)]
    return make_group(version=version, seq=seq, producer=peer_id, completions=completions, created=time.time())


def write_json(path: Path, value) -> None:
    """Write ``path`` whole or not at all (the test polls for it)."""
    part = path.with_name(path.name + ".tmp")
    part.write_text(json.dumps(value))
    part.rename(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("name")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--big", type=int, default=0)
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--expect-groups", type=int, default=0, help="report once this many groups are seen")
    parser.add_argument("--forge", default=None, help="owner key (hex) whose subkey the liar writes under")
    parser.add_argument("--liar", action="store_true")
    parser.add_argument("--wide-every", type=float, default=5.0)
    parser.add_argument("--wait-go", action="store_true")
    args = parser.parse_args()
    out = Path(args.dir)
    if args.liar:
        return liar(out, args)

    from peer.network.blobs import BlobCache, BlobService
    from peer.network.buckets import DHTBucketStore
    from peer.network.heartbeat import Heartbeat, live_peers
    from peer.network.swarm import NetworkConfig, join
    from tests.helpers.swarm import routing_table

    swarm = join(NetworkConfig.loopback(args.initial_peers), RUN)
    blobs = BlobService(swarm.dht, BlobCache(out / f"{args.name}-blobs"))
    try:
        heartbeat = Heartbeat(swarm, "rollout", interval=1.0).start()
        address = {"maddrs": swarm.visible_maddrs(), "owner": swarm.public_key.hex(), "peer_id": str(swarm.peer_id)}
        write_json(out / f"{args.name}.addr", address)
        store = DHTBucketStore(swarm, blobs, wide_every=args.wide_every)
        pid = str(swarm.peer_id)
        while args.wait_go and not (out / "go").exists():
            write_json(out / f"{args.name}.table", sorted(routing_table(swarm)))  # the test waits for a full mesh
            time.sleep(0.2)
        for seq in range(args.groups):
            store.publish(make_group(pid, seq % 2, seq))
        for seq in range(args.groups, args.groups + args.big):
            store.publish(make_group(pid, 0, seq, completion_tokens=1000))
        deadline = time.time() + 90
        while True:
            fetched = store.fetch(0, 1)
            owners = {f.owner for f in fetched if f.group is not None}
            groups = {(f.owner, f.version, f.seq) for f in fetched if f.group is not None}
            peers = live_peers(swarm)
            if len(owners) >= args.expect and len(peers) >= args.expect and len(groups) >= args.expect_groups:
                break
            if time.time() > deadline:
                raise SystemExit(
                    f"saw {len(owners)} owners, {len(peers)} peers and {len(groups)} groups, expected "
                    f"{args.expect}, {args.expect} and {args.expect_groups}"
                )
            time.sleep(0.2)
        report = {
            "groups": sorted(
                [f.owner.hex(), f.version, f.seq, f.group.completions[0].tokens()]
                for f in fetched
                if f.group is not None
            ),
            "errors": [[f.owner.hex(), f.version, f.seq, f.error] for f in fetched if f.group is None],
            "peers": sorted(p.record.peer_id for p in peers),
            "rollout_peers": len(live_peers(swarm, role="rollout")),
            "learner_peers": len(live_peers(swarm, role="learner")),
        }
        write_json(out / f"{args.name}.json", report)
        while not (out / "stop").exists():
            time.sleep(0.1)
        heartbeat.stop()
    finally:
        blobs.close()
        swarm.shutdown()


def liar(out: Path, args):
    """A peer without the run's validators that stores records honest peers must refuse."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time

    from peer.protocol import BucketEntry, bucket_key, group_subkey, peers_key

    dht = hivemind.DHT(
        initial_peers=args.initial_peers,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_relay=False,
        use_auto_relay=False,
        record_validators=[RSASignatureValidator()],
    )  # signs its own subkeys, checks no schema
    try:
        own = RSASignatureValidator().local_public_key[len(b"[owner:") : -1]
        expires = get_dht_time() + 300
        good = BucketEntry.of_group(make_group(str(dht.peer_id), 0, 900)).dict()
        bad_schema = dict(good, version="zero")
        results = {
            "bad_schema": dht.store(bucket_key(RUN, 0), bad_schema, expires, subkey=group_subkey(own, 0, 901)),
            "bad_peer_record": dht.store(peers_key(RUN), {"role": "king"}, expires, subkey=b"[owner:" + own + b"]"),
        }
        if args.forge:
            victim = bytes.fromhex(args.forge)
            lie = make_group(str(dht.peer_id), 0, 0)
            forged = BucketEntry.of_group(lie.copy(update={"rewards": [1.0] * 8})).dict()
            # the subkey names the victim's key, but the signature can only be the liar's own (or none)
            results["forged"] = dht.store(bucket_key(RUN, 0), forged, expires, subkey=group_subkey(victim, 0, 0))
        write_json(out / f"{args.name}.json", results)
        while not (out / "stop").exists():
            time.sleep(0.1)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
