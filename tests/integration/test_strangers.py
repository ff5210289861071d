"""A stranger on a public swarm tries to take the lineage over (tests/procs/usurper.py), against real processes.

The run: a host, one rollout peer and one learner admitted by the host's credential. The stranger has no
credential of the host's: it publishes an admission under a coordinator of its own making, announces a junk
adapter 1000 versions ahead (sha256 matching), heartbeats as a learner whose team "leads at v10**6", asks the
learner for work, and announces a well-formed adapter of random weights. What must hold: no process exits, the
learner keeps making versions (it neither follows nor takes the stranger as a helper), nobody samples or trains
with the stranger's adapters, and ``hivegrpo status`` names the stranger as refused.
"""

import json
from pathlib import Path

import psutil
import pytest

from tests.helpers.swarm import join_args, learn_args, read_ledger, start_host, status
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

USURPER = str(Path(__file__).parents[1] / "procs" / "usurper.py")


@pytest.mark.timeout(300)
def test_a_stranger_cannot_announce_versions_lead_the_team_or_help_it(tmp_path, procs):
    host, info = start_host(procs, tmp_path, "strangers", "--groups-per-version", "4")
    rollout_ledger, ledger = tmp_path / "rollout.jsonl", tmp_path / "learner.jsonl"
    rollout = procs.start(
        "rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4",
        "--ledger", str(rollout_ledger),
    )  # fmt: skip
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--ledger", str(ledger)
    )
    wait_until(lambda: len(read_ledger(ledger)) >= 3, "the learner's first 3 versions", 180, [learner, rollout])

    rss_before = psutil.Process(learner.pid).memory_info().rss
    out = tmp_path / "usurper.json"
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    usurper = procs.start_argv(
        "usurper", [USURPER, str(out), "--run-id", info["run_id"], "--coordinator",
                    info["coordinator"], *peers, "--hold", "20"],
    )  # fmt: skip
    wait_until(out.exists, "the stranger's report", 150, [usurper, learner, rollout])
    report = json.loads(out.read_text())
    attacked_at = len(read_ledger(ledger))  # lines: versions made, and groups used up without signal
    assert report["announced"] == [report["newest_seen"] + 1000, report["newest_seen"] + 1001], report
    wait_until(
        lambda: len(read_ledger(ledger)) >= attacked_at + 5,
        "5 more versions after the attack",
        120,
        [learner, rollout],
    )

    assert all(p.poll() is None for p in (host, rollout, learner)), "a stranger's announcement made a peer exit"
    grown = psutil.Process(learner.pid).memory_info().rss - rss_before
    assert grown < 64 << 20, f"the learner grew {grown / 2**20:.0f} MiB during the attack"
    made = [line["version"] for line in read_ledger(ledger) if not line.get("no_signal")]
    assert made == list(range(1, len(made) + 1)) and max(made) < 1000, "the learner's lineage went on, its own"
    swaps = [line for line in read_ledger(rollout_ledger) if line.get("kind") == "swap"]
    assert swaps and max(s["version"] for s in swaps) < 1000, "the rollout peer sampled with a stranger's adapter"
    assert report["work_answers"], "the stranger found the learner to ask"
    for answer in report["work_answers"].values():
        assert "not an admitted learner" in str(answer), answer  # the rpc layer raises the answer's error
    seen = status(info["run_id"], info["initial_peers"], "--coordinator", info["coordinator"])
    refused = {r["fingerprint"]: r["why"] for r in seen["refused"]}
    assert report["fingerprint"] in refused, seen["refused"]
    assert seen["adapter_version"] < 1000, "status shows the lineage, not the stranger's claim"
    assert all(p["fingerprint"] != report["fingerprint"] for p in seen["peers"]), "its learner claim is not listed"


FLOOD = str(Path(__file__).parents[1] / "procs" / "identity_flood.py")


@pytest.mark.slow  # ~2 min on 2 cores: the quota's rule is in the default run (tests/unit/test_quota_units.py)
@pytest.mark.timeout(420)
def test_a_thousand_identities_flooding_one_bucket_leave_it_readable_and_the_run_learning(tmp_path, procs, reader):
    from peer.network.quota import quota_stats
    from peer.protocol import bucket_key

    host, info = start_host(procs, tmp_path, "flood", "--groups-per-version", "4")
    ledger = tmp_path / "learner.jsonl"
    rollout = procs.start("rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4")
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--ledger", str(ledger)
    )
    wait_until(lambda: len(read_ledger(ledger)) >= 2, "the learner's first versions", 180, [learner, rollout])
    swarm, _ = reader(info["run_id"], info["initial_peers"])  # one of the run's nodes, with its quota
    rss_before = psutil.Process(learner.pid).memory_info().rss
    version = len(read_ledger(ledger)) + 1  # what the rollout peer samples with next: its bucket
    out = tmp_path / "flood.json"
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    flooder = procs.start_argv(
        "flooder",
        [FLOOD, str(out), "--run-id", info["run_id"], "--version", str(version), "--identities", "1000", *peers],
    )
    wait_until(out.exists, "the flood of 1,000 identities", 300, [flooder, learner, rollout])
    flood = json.loads(out.read_text())
    flooded_at = len(read_ledger(ledger))
    wait_until(
        lambda: len(read_ledger(ledger)) >= flooded_at + 3, "3 more versions after the flood", 120, [learner, rollout]
    )
    from hivemind.utils.serializer import MSGPackSerializer

    entries = swarm.get_dict(bucket_key(info["run_id"], version))
    size = len(MSGPackSerializer.dumps({k: v.value for k, v in entries.items()}))
    stats = swarm.dht.run_coroutine(quota_stats)
    assert flood["sent"] >= 1000 and 0 < flood["taken"] < flood["sent"], flood
    assert entries and size < 4 << 20, f"the flooded bucket must stay readable: {len(entries)} entries, {size} bytes"
    assert stats["refused"].get(f"bucket_{version % 64}", 0) > 0, stats
    assert all(p.poll() is None for p in (host, rollout, learner))
    grown = psutil.Process(learner.pid).memory_info().rss - rss_before
    assert grown < 64 << 20, f"the learner grew {grown / 2**20:.0f} MiB during the flood"
    seen = status(info["run_id"], info["initial_peers"], "--coordinator", info["coordinator"])
    assert seen["adapter_version"] >= flooded_at + 3
