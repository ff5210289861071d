"""A private swarm in real processes: `hivegrpo host --private`, invited `join` and `learn`, `hivegrpo invite`.

Strangers — no invite, or one signed by another key — are refused: `join` ends with one clear error, and a peer
that keeps trying can read no manifest, get no record into anyone's DHT and no blob out of anyone. Revoking an
invite stops the peer that uses it, and that invite cannot join again.
"""

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.swarm import LOOPBACK, join_args, learn_args, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

STRANGER = str(Path(__file__).parents[1] / "procs" / "stranger.py")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


def status(info: dict, invite: str, maddrs=None) -> dict:
    peers = [a for m in (maddrs or info["initial_peers"]) for a in ("--initial-peers", m)]
    out = cli("status", "--run-id", info["run_id"], *peers, *LOOPBACK, "--invite", invite, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def forged_invite(run_id: str) -> str:
    """A well-formed invite to the same run id, signed by a key that is not the host's."""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.network.access import issue_invite, issuer_key

    return issue_invite(issuer_key(RSAPrivateKey()), run_id, "forger").token


@pytest.mark.timeout(480)
def test_invited_peers_work_strangers_are_refused_and_a_revoked_invite_stops(tmp_path, procs):
    from peer.model.loading import bundled_path
    from peer.protocol import key_fingerprint

    identity = str(tmp_path / "host.id")
    host, info = start_host(procs, tmp_path, "priv1", "--private", "--identity", identity, "--groups-per-version", "4")
    assert info["invite"], "a private host prints an invite in its join lines"
    made = cli("invite", "--identity", identity, "--run-id", "priv1", "--name", "rollout-1", "--json")
    assert made.returncode == 0, made.stderr
    rollout_invite = json.loads(made.stdout)
    cache = ("--cache-dir", str(tmp_path / "r"))
    rollout = procs.start(
        "rollout", "join", *join_args(info), *cache, "--batch-size", "4", "--invite", rollout_invite["invite"]
    )
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--invite", info["invite"]
    )

    def learning():
        s = status(info, info["invite"])
        rollouts = [p for p in s["peers"] if p["role"] == "rollout"]
        return s if s["adapter_version"] >= 2 and rollouts and rollouts[0]["accepted"] > 0 else None

    s = wait_until(learning, "versions made from the invited rollout peer's groups", 180, [host, rollout, learner])
    assert s["manifest"]["access"] == "private" and s["roles"] == {"coordinator": 1, "learner": 1, "rollout": 1}
    swarm_maddrs = [m for p in s["peers"] for m in p["maddrs"]]

    # a stranger's `join`: one clear error, non-zero exit; the same with an invite signed by another key
    tries = (("uninvited", (), "--invite"), ("forged", ("--invite", forged_invite("priv1")), "invite"))
    with ThreadPoolExecutor(2) as pool:  # side by side: each waits on the network more than it computes
        joins = list(
            pool.map(
                lambda t: cli("join", *join_args(info), "--cache-dir", str(tmp_path / t[0]), *t[1], timeout=180), tries
            )
        )
    for (name, _, says), out in zip(tries, joins, strict=True):
        assert out.returncode == 1, (name, out.stderr[-2000:])
        assert len(errors(out.stderr)) == 1 and says in errors(out.stderr)[0], (name, out.stderr[-2000:])
        assert not (tmp_path / name / "models").exists() or not any((tmp_path / name / "models").iterdir())

    # a stranger that keeps trying gets nothing: no manifest, no record into the swarm, no blob
    weights = bundled_path() / "model.safetensors"
    sha, size = hashlib.sha256(weights.read_bytes()).hexdigest(), weights.stat().st_size
    strangers = {}
    kinds = (("plain", ()), ("forger", ("--invite", forged_invite("priv1"))))

    def attempt(kind):
        name, extra = kind
        out = tmp_path / f"stranger-{name}.json"
        argv = [sys.executable, STRANGER, "priv1", str(out), sha, str(size), *swarm_maddrs, *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180), out

    with ThreadPoolExecutor(2) as pool:
        attempts = list(pool.map(attempt, kinds))
    for (name, _), (run, out) in zip(kinds, attempts, strict=True):
        assert run.returncode == 0, run.stderr[-3000:]
        strangers[name] = report = json.loads(out.read_text())
        assert report["manifest_entries"] == 0, report
        providers = {m.rsplit("/p2p/", 1)[1] for m in swarm_maddrs}
        assert report["blob"].count("not authorized") == len(providers) == 3, report
    later = status(info, info["invite"])
    seen = {p["fingerprint"] for p in later["peers"]}
    for name, report in strangers.items():
        assert key_fingerprint(bytes.fromhex(report["owner"])) not in seen, f"the {name} stranger's heartbeat got in"
    assert later["roles"] == {"coordinator": 1, "learner": 1, "rollout": 1}

    # revoking the rollout peer's invite: the peer is told and stops; the invite cannot join again
    revoked = cli("invite", "--identity", identity, "--run-id", "priv1", "--revoke", rollout_invite["id"])
    assert revoked.returncode == 0, revoked.stderr
    _, err = rollout.communicate(timeout=120)
    assert rollout.returncode == 1, procs.log(rollout)[-3000:]
    log = procs.log(rollout)
    assert "Error:" in log and "revoked" in log.split("Error:")[-1], log[-2000:]
    again = cli("join", *join_args(info), "--cache-dir", str(tmp_path / "again"), "--invite", rollout_invite["invite"])
    assert again.returncode == 1 and len(errors(again.stderr)) == 1, again.stderr[-2000:]
    assert "revoked" in errors(again.stderr)[0], again.stderr[-2000:]
    listed = json.loads(cli("invite", "--identity", identity, "--run-id", "priv1", "--list", "--json").stdout)
    assert {e["id"]: e["state"] for e in listed["invites"]}[rollout_invite["id"]] == "revoked"

    # the learner and the host were not disturbed
    assert learner.poll() is None and host.poll() is None
    for p in (learner, host):
        p.terminate()
        p.communicate(timeout=90)
        assert p.returncode == 0, procs.log(p)[-3000:]
