"""What leaves a live swarm (`hivegrpo host` + `join` + `learn` on loopback, real processes): each peer's metrics,
and the run's adapter exported as a PEFT folder and as a merged model. One swarm serves both checks.

`--metrics-port`: each peer serves on a free port (``--metrics-port 0``) and says where in its log; the test reads
the URL there, parses what it serves with prometheus_client's own parser, and checks that every documented name is
served and that the counters move while the swarm runs. The host's /metrics (prometheus_client too) keeps its names
and labels. A peer asked for a port already in use (the host's page) stops at once with one line saying what to do.
"""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peer.metrics import LEARNER_METRICS, ROLLOUT_METRICS
from peer.model.peft_folder import read_adapter
from tests.helpers.swarm import join_args, learn_args, read_ledger, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


def _url(procs, p) -> str:
    found = wait_until(lambda: re.search(r"metrics at (http://\S+/metrics)", procs.log(p)), "the metrics URL", 60, [p])
    return found.group(1)


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of what ``url`` serves, parsed as Prometheus does."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def _export(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli", "export", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(420)
def test_peers_serve_metrics_that_move_and_the_runs_adapter_exports_as_peft_and_merged_model(tmp_path, procs):
    host, info = start_host(procs, tmp_path, "metrics1", "--groups-per-version", "4", "--web-port", "0")
    taken = int(info["web"].rstrip("/").rsplit(":", 1)[1])  # the host's status page listens there
    clash = procs.start("clash", "join", *join_args(info), "--metrics-port", str(taken))
    rollout = procs.start(
        "rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4",
        "--metrics-port", "0", new_session=True,
    )  # fmt: skip
    ledger = tmp_path / "learner.jsonl"
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--metrics-port", "0",
        "--ledger", str(ledger),
    )  # fmt: skip
    running = [host, rollout, learner]
    learner_url, rollout_url = _url(procs, learner), _url(procs, rollout)
    assert learner_url != rollout_url and learner_url.startswith("http://127.0.0.1:"), (learner_url, rollout_url)

    made, used = "hivegrpo_learner_versions_made_total", "hivegrpo_learner_groups_used_total"
    first = wait_until(lambda: _value(s := _scrape(learner_url), made) and s, "a version made", 120, running)
    second = wait_until(
        lambda: _value(s := _scrape(learner_url), made) > _value(first, made) and s,
        "versions made growing between two scrapes",
        60,
        running,
    )
    # every documented learner metric is served (refusals by reason only once a group is refused)
    documented = {f"hivegrpo_learner_{name}" for _, name, _ in LEARNER_METRICS}
    assert documented - {"hivegrpo_learner_groups_refused_total"} <= _names(second), documented - _names(second)
    (info_labels,) = [dict(labels) for name, labels in second if name == "hivegrpo_learner_info"]
    assert info_labels["run"] == "metrics1" and len(info_labels["signer"]) == 16, info_labels
    assert _value(second, "hivegrpo_learner_adapter_version") >= _value(second, made)
    assert _value(second, used) > _value(first, used) and _value(second, used) % 4 == 0, "4 groups per version"
    assert _value(second, "hivegrpo_learner_phase_seconds_total", phase="update") > 0
    assert _value(second, "hivegrpo_learner_takes_short_total", cause="groups") is not None
    assert _value(second, "hivegrpo_learner_banned_peers") == 0

    swaps, published = "hivegrpo_rollout_adapter_swaps_total", "hivegrpo_rollout_groups_published_total"
    r1 = wait_until(lambda: _value(s := _scrape(rollout_url), swaps) and s, "the rollout peer swapping", 60, running)
    r2 = wait_until(
        lambda: _value(s := _scrape(rollout_url), published) > _value(r1, published) and s,
        "groups published growing between two scrapes",
        60,
        running,
    )
    documented = {f"hivegrpo_rollout_{name}" for _, name, _ in ROLLOUT_METRICS}
    paced = {"hivegrpo_rollout_pace_groups_per_second"}  # only while paced to a learner's demand
    assert documented - paced <= _names(r2), documented - _names(r2)
    assert _value(r2, "hivegrpo_rollout_adapter_version") >= 1 and _value(r2, "hivegrpo_rollout_batch_size") == 4
    assert _value(r2, "hivegrpo_rollout_completions_total") == 8 * _value(r2, "hivegrpo_rollout_groups_sampled_total")
    assert _value(r2, "hivegrpo_rollout_adapter_fetches_total") >= 1

    # the host's /metrics: the swarm's names, every sample labelled with the run
    def host_sees_both():
        s = _scrape(info["web"] + "metrics")
        peers = {dict(labels)["role"]: v for name, labels in s if name == "hivegrpo_peers" for v in [s[name, labels]]}
        return s if peers.get("rollout") == 1 and peers.get("learner") == 1 else None

    swarm = wait_until(host_sees_both, "the host's /metrics counting a rollout peer and a learner", 60, running)
    assert all(dict(labels).get("run") == "metrics1" for _, labels in swarm)
    assert {"hivegrpo_adapter_version", "hivegrpo_groups_accepted_total", "hivegrpo_peer_adapter_version"} <= set(
        _names(swarm)
    )

    # the port in use: one line saying what to do, no traceback, before joining anything
    clash.communicate(timeout=60)
    log = procs.log(clash)
    assert clash.returncode == 1 and "Traceback" not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == (
        f"Error: cannot serve metrics on 127.0.0.1:{taken} (Address already in use); pass another --metrics-port, "
        "or 0 for any free one"
    ), log[-3000:]

    export_from_the_swarm(tmp_path, procs, info, rollout, ledger)

    learner.send_signal(signal.SIGTERM)  # the server is closed with the rest: a clean exit, nothing left listening
    learner.communicate(timeout=60)
    assert learner.returncode == 0, procs.log(learner)[-3000:]
    assert "while stopping" not in procs.log(learner)
    with pytest.raises(OSError):
        _scrape(learner_url)


def export_from_the_swarm(tmp_path, procs, info, rollout, ledger) -> None:
    """``hivegrpo export`` of a version the swarm announced, as a PEFT folder and merged: the announced bytes, and
    the merged model scores what base + adapter scores (500 held-out examples)."""
    made = lambda: [line for line in read_ledger(ledger) if "sha256" in line and not line.get("no_signal")]  # noqa: E731
    wait_until(lambda: len(made()) >= 12, "the learner's first 12 versions", 240, [rollout])
    procs.freeze(rollout)  # the learner soon runs out of groups: the versions below stay announced
    settled = []
    wait_until(lambda: settled.append(len(made())) or settled[-3:] == [settled[-1]] * 3, "the learner idle", 60)
    by_version = {line["version"]: line["sha256"] for line in made()}
    chosen = max(by_version) - 3  # an ancestor of the newest: the announcement's chain names it
    swarm = [*join_args(info), "--cache-dir", str(tmp_path / "x"), "--version", str(chosen)]

    adapter = _export(*swarm, "--out", str(tmp_path / "adapter"))
    merged = _export(*swarm, "--merge", "--out", str(tmp_path / "merged"))
    assert adapter["version"] == merged["version"] == chosen
    assert adapter["adapter_sha256"] == merged["adapter_sha256"] == by_version[chosen]
    assert merged["quantization"] == "nf4", "merged into the base as the run held it"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == read_adapter(tmp_path / "adapter")[0]

    from transformers import AutoModelForCausalLM

    from peer.model.config import ModelConfig
    from peer.model.evaluate import evaluate_model
    from peer.tasks import get_task

    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")).__name__ == "LlamaForCausalLM"
    task = get_task("addition", {})

    def em(model: str, quantization: str, adapter=None) -> float:
        config = ModelConfig(name=model, quantization=quantization, device="cpu")
        return evaluate_model(config, task, adapter, n=500, seed=0, max_new_tokens=6)["exact_match"]

    base = em("bundled", "nf4")
    with_adapter = em("bundled", "nf4", tmp_path / "adapter")  # the base as the run holds it, plus the adapter
    whole = em(str(tmp_path / "merged"), "none")
    print(f"exact match on 500: base {base}, base + v{chosen} {with_adapter}, merged {whole}")
    assert abs(whole - with_adapter) <= 0.01, (whole, with_adapter)
    assert with_adapter != base, "the adapter changed nothing: the comparison would prove nothing"
