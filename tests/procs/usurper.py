"""A stranger that tries to take a public run's lineage over, and reports what it got.

Usage: python tests/procs/usurper.py OUT.json --run-id ID --coordinator FP --initial-peers MADDR... [--hold S]

It joins like any peer (a fresh signing key, no credential of the run's host) and, in this order:

1. publishes a learner admission under a credential it signed itself (a coordinator of its own making);
2. announces adapter v(newest + 1000) whose blob is junk, with a matching sha256, and serves that blob;
3. heartbeats as a ``learner`` and serves the team protocol, answering every probe "leading, at v10**6";
4. asks the run's learners for work (``op: work``), as a helper would, and records their answers;
5. announces a *well-formed* adapter of the run's shape (random weights) as v(newest + 1001), and serves it.

It then holds for ``--hold`` seconds and writes ``{"newest_seen", "announced", "work_answers", "fingerprint",
"peer_id"}`` to ``OUT.json`` and exits 0 (also on SIGTERM).
"""

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--initial-peers", action="append", required=True)
    parser.add_argument("--hold", type=float, default=20.0)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save as st_save

    from peer.network.admission import issue_credential, publish_admission
    from peer.network.blobs import BlobCache, BlobService
    from peer.network.heartbeat import Heartbeat, live_peers
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import key_fingerprint
    from peer.roles.learner.team import lead as team
    from peer.run.adapters import announce_adapter, announcements, newest_announcement
    from peer.run.spec import read_manifest

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    swarm = join(NetworkConfig.loopback(args.initial_peers), args.run_id)
    cache = Path(os.environ.get("TMPDIR", "/tmp")) / f"usurper-{os.getpid()}"
    blobs = BlobService(swarm.dht, BlobCache(cache / "blobs"))
    report = {"fingerprint": key_fingerprint(swarm.public_key), "peer_id": str(swarm.peer_id), "announced": []}
    try:
        read_manifest(swarm, args.coordinator)
        # 1. an admission under a credential of its own making
        publish_admission(swarm, issue_credential(swarm.signing_key, args.run_id, "usurper"))
        newest = newest_announcement(announcements(swarm))
        top = newest.version if newest else 0
        report["newest_seen"] = top
        # 2. junk with a matching sha256, far ahead
        junk = os.urandom(4096)
        announce_adapter(swarm, blobs, top + 1000, junk, newest.sha256 if newest else "0" * 64)
        report["announced"].append(top + 1000)
        # 3. a learner heartbeat and a team that claims to lead
        heartbeat = Heartbeat(swarm, "learner", interval=2.0).start()
        heartbeat.update(state="running", adapter_version=10**6)
        lead = team.Lead(str(swarm.peer_id))
        lead.lead(10**6, "f" * 64)
        team.serve(blobs, lead)
        # 4. ask the run's learners for work, as a helper
        client = team.TeamClient(blobs, None)
        answers = {}
        for peer in {p.record.peer_id for p in live_peers(swarm, "learner")} - {str(swarm.peer_id)}:
            try:
                answers[peer] = client.work(peer, top, newest.sha256 if newest else "0" * 64)
            except Exception as e:  # noqa: BLE001 - what the stranger got is the report
                answers[peer] = {"exception": f"{type(e).__name__}: {e}"}
        report["work_answers"] = {p: {k: str(v)[:200] for k, v in a.items()} for p, a in answers.items()}
        # 5. a well-formed adapter: the newest real one's tensors, randomised
        real = newest_announcement([(k, r) for k, r in announcements(swarm) if r.version < top + 1000])
        from safetensors.torch import load as st_load

        from peer.run.adapters import fetch_adapter

        blob = fetch_adapter(blobs, real.sha256, real.size, real.providers, None, 30.0)
        forged = {k: torch.randn_like(v) for k, v in st_load(blob).items()}
        header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
        announce_adapter(swarm, blobs, top + 1001, st_save(forged, metadata=header.get("__metadata__")), real.sha256)
        report["announced"].append(top + 1001)
        stop.wait(args.hold)
        heartbeat.stop(leaving=False)
    finally:
        Path(args.out).write_text(json.dumps(report))
        blobs.close()
        swarm.shutdown()


if __name__ == "__main__":
    main()
