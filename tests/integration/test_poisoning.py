"""A poisoner in real processes: its groups pass every check a learner makes at reading (prompt, rewards recomputed
as right) and claim the adapter's own log-probs, but every right completion carries a payload the reward never reads
(``<unk>`` after the answer: tests/helpers/poison.py, ``tests/procs/liar_rollout.py poison``).

What must hold: the learner (log-prob spot checks off, so nothing but the update's own forward can tell) bans the
poisoner for ``improbable`` groups within its first poisoned groups used, the honest peer is never banned, and the
honest peer's groups keep making versions after the ban.
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
def test_a_poisoner_whose_groups_pass_every_check_is_banned_by_the_updates_own_forward(tmp_path, procs):
    host, info = start_host(procs, tmp_path, "poisoning", "--groups-per-version", "4")
    net = join_args(info)
    ids = {name: tmp_path / f"{name}.id" for name in ("honest", "poisoner")}
    fp = {name: fingerprint(path) for name, path in ids.items()}
    ledger = tmp_path / "ledger.jsonl"
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--check-rate", "0",
        "--ledger", str(ledger), "--json",
    )  # fmt: skip
    rollout = ["--batch-size", "4", "--json"]
    honest = procs.start(
        "honest", "join", *net, "--cache-dir", str(tmp_path / "h"), "--identity", str(ids["honest"]), *rollout
    )
    poisoner = procs.start_argv(
        "poisoner",
        [str(ROOT / "procs" / "liar_rollout.py"), "poison", "join", *net, "--cache-dir", str(tmp_path / "p"),
         "--identity", str(ids["poisoner"]), *rollout],
    )  # fmt: skip
    everyone = [learner, honest]

    def used(name: str, after: int = 0) -> int:
        lines = [line for line in read_ledger(ledger) if line.get("version", 0) > after]
        return sum(1 for line in lines for i in line.get("ids", []) if i[0] == fp[name])

    def banned_at() -> int | None:
        return next((ln["version"] for ln in read_ledger(ledger) if fp["poisoner"] in ln.get("banned", [])), None)

    wait_until(lambda: banned_at() is not None, "the poisoner banned", 200, everyone)
    ban = banned_at()
    wait_until(lambda: used("honest", after=ban) >= 16, "16 honest groups used after the ban", 120, everyone)
    for proc in (honest, poisoner, learner):
        proc.send_signal(signal.SIGTERM)
    out, _ = learner.communicate(timeout=90)
    assert learner.returncode == 0, procs.log(learner)[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    for proc in (honest, poisoner):
        proc.communicate(timeout=90)
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=90)

    assert "poisoned" in procs.log(poisoner), "the poisoner wrote its groups"
    assert fp["poisoner"] in summary["banned"] and fp["honest"] not in summary["banned"], summary["banned"]
    assert summary["groups_rejected"].get("improbable", 0) >= 1, summary["groups_rejected"]
    assert used("poisoner", after=ban) == 0, "nothing of the poisoner's after its ban"
