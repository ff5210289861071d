"""The ``hivegrpo`` command as a user runs it: real subprocesses, the bundled model, JSON outputs."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


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


def test_train_local_then_eval_the_saved_adapter(tmp_path):
    adapter, report = tmp_path / "a.safetensors", tmp_path / "r.json"
    out = hivegrpo(
        "train-local",
        "--max-steps",
        "3",
        "--eval-n",
        "100",
        "--eval-every",
        "1000",
        "--save-adapter",
        str(adapter),
        "--report",
        str(report),
        "--json",
    )
    result = json.loads(out.stdout)
    assert result["steps"] == 3 and [p["step"] for p in result["curve"]] == [0, 3]
    assert json.loads(report.read_text()) == result
    scored = json.loads(hivegrpo("eval", "--adapter", str(adapter), "--n", "100", "--json").stdout)
    assert scored["adapter_sha256"] == result["adapter_sha256"]
    assert scored["exact_match"] == pytest.approx(result["final_exact_match"])  # same held-out set, greedy


def test_user_errors_are_one_clear_line():
    out = hivegrpo("eval", "--task", "no_such_task", "--n", "5", check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "no_such_task" in out.stderr and "addition" in out.stderr
    out = hivegrpo("eval", "--task-config", "{not json", "--n", "5", check=False)
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    out = hivegrpo("eval", "--model", "/nonexistent/model/dir", "--n", "5", check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "/nonexistent/model/dir" in out.stderr


def test_demo_refuses_a_bad_flag_before_starting_anything():
    out = hivegrpo("demo", "--target", "1.5", check=False)
    assert out.returncode == 2 and "--target" in out.stderr and "1.5" in out.stderr
    assert "--rollout-peers" in hivegrpo("demo", "--help").stdout


def test_allow_task_reaches_the_rollout_and_learner_sessions(monkeypatch):
    from click.testing import CliRunner

    from peer.cli import main
    from peer.roles import learner, rollout

    seen = []
    monkeypatch.setattr(rollout, "run_rollout", lambda config, on_ready: seen.append(config) or {})
    monkeypatch.setattr(learner, "run_learner", lambda config, on_ready: seen.append(config) or {})
    allow = ["--allow-task", "mypkg.tasks", "--allow-task", "other"]
    for command in ("join", "learn"):
        out = CliRunner().invoke(main, [command, "--run-id", "r", *allow, "--json"])
        assert out.exit_code == 0, out.output
        assert seen[-1].session_config().allowed_tasks == ("mypkg.tasks", "other")
        out = CliRunner().invoke(main, [command, "--run-id", "r", "--json"])
        assert out.exit_code == 0 and seen[-1].session_config().allowed_tasks == (), "nothing allowed by default"
        out = CliRunner().invoke(main, [command, "--run-id", "r", "--allow-task", "mypkg.tasks:MyTask"])
        assert out.exit_code == 2 and "give the module only" in out.output
