"""A learner credential copied, then revoked, live: a host, learner and rollout peer (real processes on loopback).

First a thief binds a copy of the learner's credential to its own key while the learner runs: within a minute
`hivegrpo status` names the credential as bound to 2 live keys and refuses both, and the rollout peer takes no
version from either; once the thief stops, the learner is admitted again. Then `hivegrpo invite --revoke`: within
a minute status names the learner as refused because its credential was revoked, and the rollout peer never samples
with a version the learner made after that (the learner itself does not know: it keeps making versions nobody
takes).
"""

import json
import time
from pathlib import Path

import pytest

from peer.network.admission import parse_credential
from tests.helpers.swarm import fingerprint, join_args, learn_args, read_ledger, start_host, status
from tests.helpers.waiting import wait_until
from tests.integration.test_private import cli

pytestmark = pytest.mark.integration


THIEF = str(Path(__file__).parents[1] / "procs" / "credential_thief.py")


@pytest.mark.timeout(480)
def test_a_copied_or_revoked_credential_is_ignored_by_rollout_peers_and_status_within_a_minute(tmp_path, procs):
    identity = str(tmp_path / "host.id")
    host, info = start_host(procs, tmp_path, "revoke1", "--identity", identity, "--groups-per-version", "4")
    rollout_ledger, ledger, learner_id = tmp_path / "rollout.jsonl", tmp_path / "learner.jsonl", tmp_path / "l.id"
    rollout = procs.start(
        "rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4",
        "--ledger", str(rollout_ledger),
    )  # fmt: skip
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--ledger", str(ledger),
        "--identity", str(learner_id),
    )  # fmt: skip
    me = fingerprint(learner_id)

    def swapped() -> list[int]:
        return [line["version"] for line in read_ledger(rollout_ledger) if line.get("kind") == "swap"]

    wait_until(lambda: max(swapped(), default=0) >= 2, "the rollout peer on version 2", 180, [learner, rollout])
    before = status(info["run_id"], info["initial_peers"], "--coordinator", info["coordinator"])
    assert all(r["fingerprint"] != me for r in before["refused"]), before["refused"]
    credential_id = parse_credential(info["learner_credential"]).certificate.credential_id

    def swarm_status() -> dict:
        return status(info["run_id"], info["initial_peers"], "--coordinator", info["coordinator"])

    def made() -> list[int]:  # the learner's ledger: a line per version made (and per batch used up without signal)
        return [line["version"] for line in read_ledger(ledger) if not line.get("no_signal")]

    # a thief binds a copy of the credential to its own key while the learner runs: neither is admitted
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    thief = procs.start_argv("thief", [THIEF, info["learner_credential"], "--run-id", info["run_id"], *peers])
    started = time.monotonic()

    def shared() -> list[str]:
        return [p for p in swarm_status()["problems"] if f"{credential_id} is bound to 2 live keys" in p]

    wait_until(shared, "status naming the credential bound to 2 live keys", 60, [host, learner, rollout, thief])
    shared_after = time.monotonic() - started
    assert any(r["fingerprint"] == me for r in swarm_status()["refused"]), "the rightful learner is refused too"
    time.sleep(8)  # a follower that read the admissions just before the thief's record reads them again within 5 s
    held = max(swapped())
    wait_until(lambda: max(made()) > held + 1, "the learner past the rollout peer's version", 90, [learner])
    time.sleep(3)  # a follower swaps within a second of an announcement it takes
    assert max(swapped()) == held, f"the rollout peer went on from v{held} to v{max(swapped())} on a shared credential"
    thief.terminate()
    thief.communicate(timeout=30)
    wait_until(lambda: max(swapped()) > held, "the rollout peer following the learner again", 120, [learner, rollout])
    readmitted_after = time.monotonic() - started

    # then the host revokes the credential
    revoked = cli("invite", "--identity", identity, "--run-id", info["run_id"], "--revoke", credential_id)
    assert revoked.returncode == 0, revoked.stderr
    started = time.monotonic()

    def refused_by_status() -> str | None:
        seen = status(info["run_id"], info["initial_peers"], "--coordinator", info["coordinator"])
        return next((r["why"] for r in seen["refused"] if r["fingerprint"] == me), None)

    why = wait_until(refused_by_status, "status refusing the revoked learner", 60, [host, learner, rollout])
    took = time.monotonic() - started
    assert "revoked by the host" in why and credential_id in why, why
    assert took <= 60

    time.sleep(8)  # a follower that read the admissions just before the list arrived reads them again within 5 s
    held = max(swapped())
    wait_until(lambda: max(made()) > held + 1, "the revoked learner past the rollout peer's version", 90, [learner])
    time.sleep(3)  # a follower swaps within a second of an announcement it takes
    assert max(swapped()) == held, f"the rollout peer went on from v{held} to v{max(swapped())}: the revoked learner's"
    assert all(p.poll() is None for p in (host, learner, rollout))
    print(
        json.dumps(
            {
                "status_shared_after_s": round(shared_after, 1),
                "readmitted_after_s": round(readmitted_after, 1),
                "status_refused_after_s": round(took, 1),
                "rollout_held": held,
                "made": max(made()),
            }
        )
    )
