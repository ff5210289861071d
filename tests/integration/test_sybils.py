"""Many keys against the per-signer bounds that a public swarm's readers depend on, with real processes.

Keys are free: a bound per signer is a bound per sybil. Here one process (tests/procs/identity_flood.py) signs
records with hundreds of fresh RSA keys and stores them on the run's nodes, as that many peers would; what must
hold is what a newcomer needs from the run.
"""

import hashlib
import json
from pathlib import Path

import pytest

from tests.helpers.swarm import start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

FLOOD = str(Path(__file__).parents[1] / "procs" / "identity_flood.py")
FAKES = 300  # fake "coordinators": a random fetch order asks 8 providers, so the host would be among them 2.6 %


@pytest.mark.timeout(240)
def test_fake_coordinator_heartbeats_do_not_keep_a_newcomer_from_the_hosts_model_files(tmp_path, procs, reader):
    from peer.network.heartbeat import blob_providers, live_peers
    from peer.run.basemodel import fetch_from
    from peer.run.spec import read_manifest

    host, info = start_host(procs, tmp_path, "sybilbeats")
    out = tmp_path / "flood.json"
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    flooder = procs.start_argv(
        "flooder", [FLOOD, str(out), "--run-id", info["run_id"], "--heartbeats", "--identities", str(FAKES), *peers]
    )
    wait_until(out.exists, f"the flood of {FAKES} fake heartbeats", 180, [flooder, host])
    flood = json.loads(out.read_text())
    assert flood["taken"] >= FAKES, flood

    swarm, blobs = reader(info["run_id"], info["initial_peers"])  # a newcomer
    manifest, _ = read_manifest(swarm, info["coordinator"])
    claimed = {p.record.peer_id for p in live_peers(swarm) if p.record.role == "coordinator"}
    assert len(claimed & set(flood["peer_ids"])) >= FAKES * 0.9, "the fakes are live heartbeats when it joins"
    providers = lambda: blob_providers(swarm, trusted=[manifest.coordinator])  # noqa: E731 (the session's order)
    assert providers()[0].to_base58() == manifest.coordinator, "the peer the manifest names is asked first"
    assert len(providers()) <= 33, "and a bounded number of the others"
    fetch = fetch_from(blobs, providers)
    for file in manifest.model.files:
        path = fetch(file.sha256, file.size, lambda done, total: None)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == file.sha256, file.path
    assert host.poll() is None


JUNK_LEARNERS = 1300  # junk admissions of ~1.7 KB: the learners' key on a node holds 2 MiB


@pytest.mark.timeout(300)
def test_a_learner_is_admitted_on_a_node_whose_learners_key_strangers_filled(tmp_path, procs, reader):
    """The review's H3: first come, first kept, so ~1,300 strangers' junk admissions filled the learners' key on a
    node and no learner admitted later could store its admission there. A node that knows the run's coordinator
    (``Swarm.set_standing``, as every session and host tells theirs) keeps a record that verifies, evicting junk."""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.network.admission import issue_credential, publish_admission
    from peer.network.quota import quota_stats
    from peer.protocol import learners_key, owner_subkey

    run = "sybillearners"
    host_key = RSAPrivateKey()
    node, _ = reader(run)  # the node under attack: it knows the coordinator's key, as a run's peers do
    node.set_standing(host_key.get_public_key().to_bytes())
    maddrs = [str(m) for m in node.dht.get_visible_maddrs()]
    out = tmp_path / "flood.json"
    peers = [a for m in maddrs for a in ("--initial-peers", m)]
    flooder = procs.start_argv(
        "flooder", [FLOOD, str(out), "--run-id", run, "--learners", "--identities", str(JUNK_LEARNERS), *peers]
    )
    wait_until(out.exists, f"the flood of {JUNK_LEARNERS} junk admissions", 240, [flooder])
    flood = json.loads(out.read_text())
    held = node.local_dict(learners_key(run))
    refused = node.dht.run_coroutine(quota_stats)["refused"].get("learners", 0)
    assert refused > 0 and len(held) < JUNK_LEARNERS, (flood["taken"], len(held), "the key is full")

    learner, _ = reader(run, maddrs)
    credential = issue_credential(host_key, run)
    assert publish_admission(learner, credential)
    kept = wait_until(
        lambda: owner_subkey(learner.public_key) in node.local_dict(learners_key(run)),
        "the learner's admission kept on the flooded node",
        30,
    )
    assert kept
    assert node.dht.run_coroutine(quota_stats)["evicted"] >= 1, "junk made room"
