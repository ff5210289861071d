"""The ``hivegrpo`` command as a user runs it: real subprocesses, the bundled model, JSON outputs."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

_NO_RUN = SimpleNamespace(to_json=dict)  # what a role's run returns, for the CLI to print (nothing ran)


def hivegrpo(*args, check=True, timeout=240):
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"hivegrpo {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out


def test_eval_bundled_is_about_thirty_percent():
    result = json.loads(hivegrpo("eval", "--model", "bundled", "--n", "500", "--json").stdout)
    assert result["n"] == 500 and result["quantization"] == "nf4"
    assert 0.22 <= result["exact_match"] <= 0.38, result


def test_demo_refuses_a_bad_flag_before_starting_anything():
    out = hivegrpo("demo", "--target", "1.5", check=False)
    assert out.returncode == 2 and "--target" in out.stderr and "1.5" in out.stderr
    assert "--rollout-peers" in hivegrpo("demo", "--help").stdout


def test_allow_task_reaches_the_rollout_and_learner_sessions(monkeypatch):
    from click.testing import CliRunner

    from peer.cli import main
    from peer.network.admission import issue_credential
    from peer.network.swarm import load_signing_key
    from peer.roles.learner import peer as learner
    from peer.roles.rollout import peer as rollout

    seen = []
    monkeypatch.setattr(rollout, "run_rollout", lambda config, on_ready: seen.append(config) or _NO_RUN)
    monkeypatch.setattr(learner, "run_learner", lambda config, on_ready: seen.append(config) or _NO_RUN)
    allow = ["--allow-task", "mypkg.tasks", "--allow-task", "other"]
    credential = ["--learner-credential", issue_credential(load_signing_key(None), "r").token]
    for run in (["join", "--run-id", "r"], ["learn", "--run-id", "r", *credential]):
        out = CliRunner().invoke(main, [*run, *allow, "--json"])
        assert out.exit_code == 0, out.output
        assert seen[-1].session_config().allowed_tasks == ("mypkg.tasks", "other")
        out = CliRunner().invoke(main, [*run, "--json"])
        assert out.exit_code == 0 and seen[-1].session_config().allowed_tasks == (), "nothing allowed by default"
        out = CliRunner().invoke(main, [*run, "--allow-task", "mypkg.tasks:MyTask"])
        assert out.exit_code == 2 and "give the module only" in out.output
