"""A mixed-precision swarm in real processes: honest rollout peers sampling in bfloat16 and in float16, a learner
verifying in float32 that recomputes the behaviour log-probs of every group (``--check-rate 1``), and a forger.

What must hold: neither honest peer is banned and their groups make the versions (every one of them recomputed);
the forger, whose log-probs claim the model was sure (-0.01 per token), is banned for it.
"""

import json
import signal
from pathlib import Path

import pytest

from tests.helpers.swarm import fingerprint, join_args, learn_args, read_ledger, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[1]  # tests/


@pytest.mark.timeout(300)
def test_bf16_and_fp16_peers_pass_an_fp32_learners_checks_and_a_forger_is_banned(tmp_path, procs):
    host, info = start_host(procs, tmp_path, "precision", "--groups-per-version", "4")
    net = join_args(info)
    ids = {name: tmp_path / f"{name}.id" for name in ("bf16", "fp16", "forger")}
    fp = {name: fingerprint(path) for name, path in ids.items()}
    ledger = tmp_path / "ledger.jsonl"
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--check-rate", "1",
        "--ledger", str(ledger), "--json",
    )  # fmt: skip
    honest = {
        name: procs.start(
            name,
            "join",
            *net,
            "--cache-dir",
            str(tmp_path / name),
            "--identity",
            str(ids[name]),
            "--dtype",
            dtype,
            "--batch-size",
            "4",
            "--json",
        )  # fmt: skip
        for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16"))
    }
    forger = procs.start_argv(
        "forger",
        [str(ROOT / "procs" / "liar_rollout.py"), "forge", "join", *net, "--cache-dir", str(tmp_path / "f"),
         "--identity", str(ids["forger"]), "--batch-size", "4", "--max-groups", "8", "--json"],
    )  # fmt: skip
    everyone = [learner, *honest.values()]

    def used(name: str) -> int:
        return sum(1 for line in read_ledger(ledger) for i in line.get("ids", []) if i[0] == fp[name])

    def done() -> bool:
        banned = {b for line in read_ledger(ledger) for b in line.get("banned", [])}
        return fp["forger"] in banned and used("bf16") >= 24 and used("fp16") >= 24

    wait_until(done, "the forger banned and 24 groups of each honest peer used", 240, everyone)
    for proc in [*honest.values(), forger, learner]:
        proc.send_signal(signal.SIGTERM)
    out, _ = learner.communicate(timeout=90)
    assert learner.returncode == 0, procs.log(learner)[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    for proc in [*honest.values(), forger]:
        proc.communicate(timeout=90)
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=90)

    assert fp["forger"] in summary["banned"], summary["banned"]
    assert fp["bf16"] not in summary["banned"] and fp["fp16"] not in summary["banned"], summary["banned"]
    assert summary["groups_rejected"].get("logprobs", 0) >= 1, summary["groups_rejected"]
    # at check rate 1 every group taken was recomputed first: the honest ones all passed
    assert summary["logprob_checks"] >= used("bf16") + used("fp16"), summary
