"""Many signing identities flood one key: a version's bucket with the largest inline entries the schema allows, the
run's heartbeats with fake "coordinators", or the learners' admissions with junk.

Usage: python tests/procs/identity_flood.py OUT.json --run-id ID (--version V | --heartbeats | --learners)
       --identities N --initial-peers MADDR...

It joins the run's DHT (a plain hivemind node with the run's validators), makes ``N`` RSA keys (1024-bit: any size
verifies, and they are quick to make), and for each one signs a schema-valid record under that key's own subkey:
a bucket entry of version ``V`` (one group of ~40 KB, inline); with ``--heartbeats`` a heartbeat claiming the role
``coordinator``, running and reachable, with a made-up libp2p peer id that nobody answers for; with ``--learners``
an admission record of the largest size, its certificate signed by nobody. It sends each straight to every node it
knows (the DHT's own store request, no lookup), as a swarm of ``N`` peers would, and writes ``{"sent", "taken",
"identities", "seconds", "peer_ids"}`` to ``OUT.json`` (``taken``: stores some node accepted; ``peer_ids``: the
fake ones, for heartbeats and admissions) and exits 0.
"""

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def entry_value(version: int, producer: str) -> dict:
    """A bucket entry as large as one inline group gets: a 2000-token prompt and four 1000-token completions."""
    from peer.protocol import BucketEntry, to_dht_value
    from tests.helpers.records import make_group

    group = make_group(
        version=version,
        seq=0,
        producer=producer,
        prompt=[1] * 2000,
        completions=[[1] * 1000] * 4,
        rewards=[0.0] * 4,
        created=time.time(),
    )
    return to_dht_value(BucketEntry.of_group(group))


def heartbeat_value(peer_id: str) -> dict:
    """A fake heartbeat: a "coordinator", running and reachable, at ``peer_id``."""
    from peer.protocol import PeerRecord, to_dht_value

    now = time.time()
    return to_dht_value(
        PeerRecord(
            peer_id=peer_id, role="coordinator", adapter_version=0, throughput=1.0, hardware="cpu", reachable=True,
            maddrs=[], started=now, last_seen=now, state="running", stats={},
        )
    )  # fmt: skip


def learner_value(peer_id: str) -> dict:
    """A junk admission record of the largest size the schema allows: a certificate nobody signed."""
    from peer.protocol import LearnerRecord, to_dht_value

    record = LearnerRecord(peer_id=peer_id, certificate=os.urandom(1024), binding=os.urandom(64), created=time.time())
    return to_dht_value(record)


def fake_peer_id() -> str:
    """A well-formed libp2p peer id (an identity multihash of an Ed25519 key) that no peer holds."""
    from hivemind.p2p import PeerID

    return PeerID(b"\x00\x24\x08\x01\x12\x20" + os.urandom(32)).to_base58()


async def flood(run_id: str, version: int | None, n: int, producer: str, what: str, _dht, node) -> dict:
    import asyncio

    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.dht.crypto import DHTRecord, RSASignatureValidator
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.protocol import bucket_key, group_subkey, learners_key, owner_subkey, peers_key

    heartbeats = version is None
    key = {"heartbeats": peers_key, "learners": learners_key}.get(what)
    key_id = DHTID.generate(source=key(run_id) if key else bucket_key(run_id, version))
    peers = list(node.protocol.routing_table.uid_to_peer_id.values())
    serializer = node.protocol.serializer
    entry = None if heartbeats else serializer.dumps(entry_value(version, producer))  # the pipe here is small
    sent = taken = 0
    fakes = []
    for _ in range(n):
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        public = key.get_public_key().to_bytes()
        if heartbeats:
            fakes.append(fake_peer_id())
            make = learner_value if what == "learners" else heartbeat_value
            subkey, value_bytes = owner_subkey(public), serializer.dumps(make(fakes[-1]))
        else:
            subkey, value_bytes = group_subkey(public, version, 0), entry
        expiration = get_dht_time() + {"heartbeats": 25, "learners": 250}.get(what, 600)
        record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
        signed = RSASignatureValidator(key).sign_value(record)
        answers = await asyncio.gather(
            *(
                node.protocol.call_store(
                    peer, keys=[key_id], values=[signed], expiration_time=[expiration], subkeys=[subkey]
                )
                for peer in peers
            )
        )
        sent += len(peers)
        taken += sum(1 for a in answers if a and a[0])
    return {"sent": sent, "taken": taken, "peers": len(peers), "peer_ids": fakes}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--run-id", required=True)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--version", type=int)
    what.add_argument("--heartbeats", action="store_true")
    what.add_argument("--learners", action="store_true")
    parser.add_argument("--identities", type=int, default=1000)
    parser.add_argument("--initial-peers", action="append", required=True)
    args = parser.parse_args()

    import hivemind

    from peer.network.swarm import load_signing_key
    from peer.protocol.validators import make_validators

    dht = hivemind.DHT(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_relay=False,
        use_auto_relay=False,
        record_validators=make_validators(args.run_id, load_signing_key(None)),
        start=True,
    )
    try:
        start = time.perf_counter()
        producer = dht.peer_id.to_base58()
        kind = "learners" if args.learners else "heartbeats" if args.heartbeats else "bucket"
        result = dht.run_coroutine(partial(flood, args.run_id, args.version, args.identities, producer, kind))
        result.update(identities=args.identities, seconds=time.perf_counter() - start)
        Path(args.out).write_text(json.dumps(result))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
