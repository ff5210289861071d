"""Learning against wall time: the swarm, the synchronous reference loop and TRL's GRPOTrainer on one task.

The three systems run one after another on this machine, each in a fresh child process (``--one SYSTEM``), so
no threads, memory or caches carry over from one to the next. All three train the same LoRA (r = 8, alpha = 16,
the seven projections, no dropout; the same initial adapter, ``LoRAConfig.init_seed``) on the bundled model's
nf4 base for the ``addition`` task, with G = 8 completions per prompt, 16 prompts (128 completions) per update,
AdamW at lr 2e-3 (weight decay 0.01, grad-norm clip 1.0, constant rate), plain temperature-1.0 sampling of at most
6 new tokens, and the clipped loss (eps 0.2, token mean, no KL). Held-out greedy exact match (``exact_match``:
``--eval-n`` examples, seed 0) is measured every ``--eval-every`` seconds; the table shows it at every whole
minute and the first time an evaluation reached ``--target``:

* **swarm**: ``hivegrpo demo`` without a target (host, one learner, two rollout peers, one torch thread per
  process, all sharing the machine's cores). Clock: wall time from before the first process starts, start-up
  included. Its observer evaluates in the demo's own process *while* the swarm trains: the evaluations take CPU
  from the swarm but their time is not taken off the clock. Steps are adapter versions, the step time is the
  learner's update alone (sampling runs elsewhere, concurrently); staleness is the mean of the ledger's lines;
  ``first_version_seconds`` says how much of its clock went to starting up before version 1.
* **reference**: ``hivegrpo train-local`` (``run_reference``), ``--threads`` torch threads. Clock: training
  seconds, the sum of its steps (sample, score, learn); model loading and evaluations are not counted.
* **trl**: ``trl.GRPOTrainer`` on CPU (``use_cpu``), ``--threads`` torch threads, on the same nf4 base and
  PeftModel, the same prompts in the same order (``task.example(0, i)``, no shuffling), the task's own reward.
  Clock: seconds since training began, less the time a callback spends evaluating (the clock is paused);
  model loading and the trainer's construction are not counted. Differences that are TRL's own rule, kept as
  they are: advantages divide by the sample std + 1e-4 (the others: population std + 1e-6), groups whose
  rewards are all equal still count in the token mean (the others leave them out), no dual clip, and sampling
  through ``generate()``. TRL casts LoRA weights to bf16 on a quantized base; here they are cast back
  to float32 before the optimizer exists, as the other two train them.

EM at t is the newest evaluation made by t + ``--eval-every``/2 seconds on that system's clock. ``--rounds N`` runs the
systems N times, in alternating order (round 2 runs them in reverse), each round in ``KEEP/round-K``, and reports
each ratio by round, its median (a system that never reached the target counts as the slowest), how many rounds
met the goal, and each system's mean EM at every checkpoint: the first time an evaluation crosses 0.80 moves a lot
with evaluation noise (the reference's alone has ranged 60-135 s), exact match at fixed times less. TRL is an optional
dependency (``pip install -e ".[bench]"``); without it the other systems still run::

    python -m tests.benchmarks.learning --duration 300 --eval-every 15 --eval-n 500 --out learning.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer.plots import require
from tests.benchmarks import json_lines, mean

os.environ.setdefault("OMP_NUM_THREADS", "1")

SYSTEMS = ("swarm", "reference", "trl")
PROMPTS_PER_STEP = 16
RATIO_GOAL = 1.3  # swarm / reference time to the target that the swarm aims to stay within
INSTALL_TRL = 'TRL is not installed: pip install -e ".[bench]" (or pip install "trl>=1.16") to run it.'


def checkpoints(duration: float) -> list[float]:
    """The times the table shows: every whole minute up to ``duration``, and ``duration`` itself."""
    marks = [60.0 * k for k in range(1, int(duration // 60) + 1)]
    return marks if marks and marks[-1] == duration else [*marks, float(duration)]


def em_at(evaluations: list, seconds: float, slack: float) -> float | None:
    """Exact match of the newest evaluation made by ``seconds + slack`` (``evaluations``: (s, step, em) rows)."""
    made = [row for row in evaluations if row[0] <= seconds + slack]
    return made[-1][2] if made else None


def first_at(evaluations: list, target: float) -> float | None:
    """Seconds of the first evaluation with exact match >= ``target``; None if none reached it."""
    return next((row[0] for row in evaluations if row[2] >= target), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(result: dict, args) -> dict:
    """Add the table's numbers (EM at each checkpoint, final EM, time to the target) to a system's result."""
    evaluations = result.get("evaluations") or []
    if evaluations:
        result["em_at"] = {f"{t:g}": em_at(evaluations, t, args.eval_every / 2) for t in checkpoints(args.duration)}
        result["final_exact_match"] = evaluations[-1][2]
        result["seconds_to_target"] = first_at(evaluations, args.target)
    return result


# --- the systems, each run in a child process ------------------------------------------------------------------


def run_swarm(args, root: Path) -> dict:
    import torch

    from peer.demo import DemoConfig, run_demo

    torch.set_num_threads(1)  # the demo's own process (the observer) too, as ``hivegrpo demo`` runs it
    report_dir = root / "swarm"
    config = DemoConfig(
        duration=args.duration, target=None, eval_every=args.eval_every, eval_n=args.eval_n, report_dir=report_dir
    )
    report = run_demo(config, live=False)
    made = [line for line in json_lines(report_dir / "ledger.jsonl") if not line.get("no_signal")]
    span = made[-1]["time"] - made[0]["time"] if len(made) > 1 else 0.0
    return {
        "system": "swarm",
        "clock": "wall time since start, start-up included; evaluations run concurrently and are not paused",
        "threads": "1 per process",
        "quantization": "nf4",
        "steps": len(made),
        "steps_per_s": round((len(made) - 1) / span, 3) if span else None,
        "groups_per_s": round(sum(line["groups"] for line in made[1:]) / span, 2) if span else None,
        "step_seconds_mean": mean([line["step_seconds"] for line in made]),
        "staleness_mean": mean([line["staleness_mean"] for line in made]),
        "first_version_seconds": report["updates"][0]["seconds"] if report["updates"] else None,
        "evaluations": [(e["seconds"], e["version"], e["exact_match"]) for e in report["evaluations"]],
        "exit_codes": report["exit_codes"],
        "report_dir": str(report_dir),
    }


def run_reference_loop(args) -> dict:
    import torch

    from peer.model.config import ModelConfig
    from peer.roles.learner.reference import ReferenceConfig, run_reference

    torch.set_num_threads(args.threads)
    config = ReferenceConfig(
        model=ModelConfig(name="bundled", quantization="nf4", device="cpu"),
        prompts_per_step=PROMPTS_PER_STEP,
        duration=args.duration,
        eval_every=args.eval_every,
        eval_n=args.eval_n,
    )
    result = run_reference(config)
    steps, seconds = result["steps"], result["train_seconds"]
    return {
        "system": "reference",
        "clock": "training seconds (steps only; model loading and evaluations excluded)",
        "threads": torch.get_num_threads(),
        "quantization": "nf4",
        "steps": steps,
        "steps_per_s": result["steps_per_second"],
        "groups_per_s": round(steps * PROMPTS_PER_STEP / seconds, 2) if seconds else None,
        "step_seconds_mean": round(seconds / steps, 4) if steps else None,
        "staleness_mean": 0.0,
        "evaluations": [(p["seconds"], p["step"], p["exact_match"]) for p in result["curve"]],
        "adapter_sha256": result["adapter_sha256"],
    }


class _TrainingClock:
    """Training seconds with the evaluations left out: ``paused()`` wraps everything that is not training."""

    def __init__(self):
        self.start = None
        self.paused_seconds = 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start - self.paused_seconds if self.start is not None else 0.0

    def pause(self, fn):
        began = time.perf_counter()
        try:
            return fn()
        finally:
            self.paused_seconds += time.perf_counter() - began


def run_trl(args, root: Path) -> dict:
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return {"system": "trl", "skipped": f"{INSTALL_TRL} ({e})"}
    import torch

    from peer.grpo import LossConfig, SamplingConfig
    from peer.log import get_logger
    from peer.model.adapter import attach_lora, lora_parameters
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.evaluate import exact_match
    from peer.model.loading import load_base
    from peer.tasks import get_task

    logger = get_logger(__name__)
    torch.set_num_threads(args.threads)
    seed = 0
    sampling, loss, lora = SamplingConfig(), LossConfig(), LoRAConfig()
    task = get_task("addition")
    base = load_base(ModelConfig(name="bundled", quantization="nf4", device="cpu"))
    model = attach_lora(base.model, lora)
    # enough prompts for 25 steps/s: the reference loop makes ~7 with 2 threads, so none repeats within the run
    rows = PROMPTS_PER_STEP * int(args.duration * 25 + 16)
    examples = [task.example(seed, i) for i in range(rows)]
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in examples], "index": list(range(rows))})

    def addition_reward(prompts, completions, index, **kwargs):
        return [task.reward(text, task.example(seed, i)) for text, i in zip(completions, index, strict=True)]

    clock = _TrainingClock()
    evaluations: list = []

    def evaluate(step: int) -> None:
        seconds = round(clock.seconds(), 2)
        result = exact_match(
            model, base.tokenizer, task, n=args.eval_n, seed=seed, max_new_tokens=sampling.max_new_tokens
        )
        evaluations.append((seconds, step, result.exact_match))
        logger.info("trl: %.1fs step %d exact match %.3f", evaluations[-1][0], step, result.exact_match)

    class EvaluateEvery(TrainerCallback):
        def __init__(self):
            self.next_eval = args.eval_every

        def on_train_begin(self, _args, state, control, **kwargs):
            evaluate(0)
            clock.begin()

        def on_step_end(self, _args, state, control, **kwargs):
            trained = clock.seconds()
            if trained >= self.next_eval:
                clock.pause(lambda: evaluate(state.global_step))
                self.next_eval += args.eval_every
            if trained >= args.duration:
                control.should_training_stop = True
            return control

    config = GRPOConfig(
        output_dir=str(root / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=seed,
        learning_rate=2e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # torch.optim.AdamW's default, which the reference loop and the learner use
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=rows // PROMPTS_PER_STEP,
        num_generations=sampling.group_size,
        per_device_train_batch_size=PROMPTS_PER_STEP * sampling.group_size,  # one optimizer step = 16 groups
        gradient_accumulation_steps=1,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=1.0,
        top_k=0,
        beta=loss.kl_beta,
        epsilon=loss.clip_eps_low,
        epsilon_high=loss.clip_eps_high,
        loss_type="dapo",  # token mean over the batch, as clipped_policy_loss
        scale_rewards="group",
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=dataset,
        processing_class=base.tokenizer,
        callbacks=[EvaluateEvery()],
    )
    for param in lora_parameters(trainer.model):  # TRL's QLoRA recipe made them bf16; train them as the others do
        param.data = param.data.float()
    trainer.train()
    steps, seconds = trainer.state.global_step, clock.seconds()
    if not evaluations or evaluations[-1][1] != steps:
        evaluate(steps)
    return {
        "system": "trl",
        "clock": "training seconds (evaluations paused; model loading and trainer set-up excluded)",
        "threads": torch.get_num_threads(),
        "quantization": "nf4",
        "lora_dtype": str(lora_parameters(trainer.model)[0].dtype).removeprefix("torch."),
        "trl_version": trl.__version__,
        "steps": steps,
        "steps_per_s": round(steps / seconds, 3) if seconds else None,
        "groups_per_s": round(steps * PROMPTS_PER_STEP / seconds, 2) if seconds else None,
        "step_seconds_mean": round(seconds / steps, 4) if steps else None,
        "staleness_mean": 0.0,
        "evaluations": evaluations,
    }


def run_one(args) -> dict:
    """The child's side: run ``args.one`` and write its result to ``args.child_out``."""

    def stop(signum, frame):  # a parent's SIGTERM stops the swarm's processes as ^C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    root = Path(args.keep)
    if args.one == "swarm":
        result = run_swarm(args, root)
    elif args.one == "reference":
        result = run_reference_loop(args)
    else:
        result = run_trl(args, root)
    Path(args.child_out).write_text(json.dumps(result, indent=2))
    return result


def run_child(system: str, args, root: Path) -> dict:
    """Run one system in a fresh Python process; its output goes to ``root/SYSTEM.log``."""
    out, log_path = root / f"{system}.json", root / f"{system}.log"
    out.unlink(missing_ok=True)
    threads = 1 if system == "swarm" else args.threads
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "tests.benchmarks.learning", "--one", system, "--child-out", str(out)]
    command += ["--keep", str(root), "--duration", str(args.duration), "--eval-every", str(args.eval_every)]
    command += ["--eval-n", str(args.eval_n), "--target", str(args.target), "--threads", str(args.threads)]
    print(f"{system}: {args.duration:g} s, log {log_path}", file=sys.stderr, flush=True)
    began = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = child.wait(timeout=args.duration * 2 + 600)
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                code = child.wait(timeout=90)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
        except BaseException:
            child.terminate()
            child.wait(timeout=90)
            raise
    if code != 0 or not out.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        return {"system": system, "error": f"exit code {code}; the log's end:\n{tail}"}
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.monotonic() - began, 1)
    return summarize(result, args)


def _cell(value, width: int, spec: str = ".3f") -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def print_table(result: dict, args) -> None:
    marks = checkpoints(args.duration)
    target = f"t(EM≥{args.target:g})"
    header = f"{'system':>9} {'steps/s':>7} {'groups/s':>8} " + " ".join(f"{'EM@' + format(t, 'g'):>6}" for t in marks)
    print(header + f" {'EM end':>6} {target:>10} {'stale':>5} {'step s':>6}")
    for name, r in result["systems"].items():
        if "evaluations" not in r:
            print(f"{name:>9} {r.get('skipped') or r.get('error', '').splitlines()[0]}")
            continue
        cells = [
            f"{name:>9}",
            _cell(r["steps_per_s"], 7, ".2f"),
            _cell(r["groups_per_s"], 8, ".1f"),
            *(_cell(r["em_at"][f"{t:g}"], 6) for t in marks),
            _cell(r["final_exact_match"], 6),
            _cell(r["seconds_to_target"], 10, ".1f"),
            _cell(r["staleness_mean"], 5, ".2f"),
            _cell(r["step_seconds_mean"], 6, ".3f"),
        ]
        print(" ".join(cells))
    for name, r in result["systems"].items():
        if "evaluations" in r:
            curve = ", ".join(f"{s:.0f}s {em:.2f}" for s, _, em in r["evaluations"])
            print(f"EM, {name} ({r['clock']}): {curve}")
    for name, value in result["ratios"].items():
        goal = f" (goal ≤ {RATIO_GOAL:g})" if "reference" in name else ""
        print(f"{name}: {'-' if value is None else value}{goal}")
    for name, r in result["systems"].items():
        if "error" in r:
            print(f"{name} failed: {r['error']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of each system's clock")
    parser.add_argument("--eval-every", type=float, default=15.0)
    parser.add_argument("--eval-n", type=int, default=500)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--target", type=float, default=0.8, help="exact match whose first time is reported")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the reference loop and TRL")
    parser.add_argument(
        "--keep", default=None, help="keep the runs' reports and logs here (default: a temporary folder)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the systems this many times, in alternating order; report medians"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="write exact match against each system's clock here (PNG)")
    parser.add_argument("--one", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot:
        require("--plot")  # now, not after the whole run
    if args.one:
        return run_one(args)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="hivegrpo-bench-learning-") as tmp:
        root = Path(args.keep or tmp).resolve()
        for k in range(args.rounds):
            # alternate the order so that neither system always runs on the machine the other just warmed or loaded
            order = args.systems if k % 2 == 0 else list(reversed(args.systems))
            folder = root if args.rounds == 1 else root / f"round-{k + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            systems = {}
            for system in order:
                systems[system] = run_child(system, args, folder)
                shown = {key: v for key, v in systems[system].items() if key not in ("evaluations", "error")}
                print(json.dumps(shown), flush=True)
            systems = {name: systems[name] for name in args.systems}
            rounds.append({"systems": systems, "ratios": ratios_of(systems, args.target)})
            if args.rounds > 1:
                print(f"round {k + 1} of {args.rounds}:")
            print_table(rounds[-1], args)
    config = {k: v for k, v in vars(args).items() if k not in ("one", "child_out")}
    if args.rounds == 1:
        result = {**rounds[0], "config": config}
    else:
        result = {"rounds": rounds, "summary": summarize_rounds(rounds, args), "config": config}
        print_summary(result["summary"], args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot([r["systems"] for r in rounds], args.target, Path(args.plot))
    return result


def ratios_of(systems: dict, target: float) -> dict:
    """Swarm against each other system: the ratio of their times to the target (None if one never reached it)."""
    times = {name: r.get("seconds_to_target") for name, r in systems.items()}
    return {
        f"swarm / {other} time to EM ≥ {target:g}": ratio(times["swarm"], times[other])
        for other in ("reference", "trl")
        if "swarm" in systems and other in systems
    }


def median(values: list) -> float | None:
    """The median, None counted as larger than every number (a system that never reached the target is slowest)."""
    if not values:
        return None
    ranked = sorted(values, key=lambda v: (v is None, v or 0.0))
    n = len(ranked)
    middle = ranked[(n - 1) // 2 : n // 2 + 1]
    if any(v is None for v in middle):
        return None
    return round(sum(middle) / len(middle), 3)


def summarize_rounds(rounds: list, args) -> dict:
    """Across rounds: each ratio's values and median, and per system the times to the target and the mean EM at
    each checkpoint (EM at fixed times moves less with one lucky or unlucky evaluation than the first crossing)."""
    names = list(rounds[0]["ratios"])
    ratios = {name: {"rounds": [r["ratios"][name] for r in rounds]} for name in names}
    for row in ratios.values():
        row["median"] = median(row["rounds"])
        row["met"] = sum(1 for v in row["rounds"] if v is not None and v <= RATIO_GOAL)
    systems = {}
    for name in rounds[0]["systems"]:
        ran = [r["systems"][name] for r in rounds if "evaluations" in r["systems"][name]]
        if not ran:
            continue
        times = [r["seconds_to_target"] for r in ran]
        em = {}
        for t in checkpoints(args.duration):
            values = [r["em_at"][f"{t:g}"] for r in ran if r["em_at"].get(f"{t:g}") is not None]
            em[f"{t:g}"] = round(sum(values) / len(values), 3) if values else None
        systems[name] = {"rounds": len(ran), "seconds_to_target": times, "median_seconds": median(times), "em_at": em}
    return {"ratios": ratios, "systems": systems, "goal": RATIO_GOAL}


def print_summary(summary: dict, args) -> None:
    marks = checkpoints(args.duration)
    print(f"over {args.rounds} rounds:")
    print(f"{'system':>9} {'runs':>4} {'median t':>8} " + " ".join(f"{'EM@' + format(t, 'g'):>6}" for t in marks))
    for name, s in summary["systems"].items():
        cells = [f"{name:>9}", f"{s['rounds']:>4}", _cell(s["median_seconds"], 8, ".1f")]
        print(" ".join(cells + [_cell(s["em_at"][f"{t:g}"], 6) for t in marks]))
        times = ", ".join(_cell(v, 1, ".1f") for v in s["seconds_to_target"])
        print(f"{'':>9} t(EM≥{args.target:g}) by round: {times}")
    for name, row in summary["ratios"].items():
        values = ", ".join(_cell(v, 1) for v in row["rounds"])
        goal = f"; ≤ {summary['goal']:g} in {row['met']} of {len(row['rounds'])}" if "reference" in name else ""
        print(f"{name}: median {_cell(row['median'], 1)} (by round: {values}{goal})")


def plot(rounds: list, target: float, path: Path) -> None:
    """Exact match against each system's own clock, one line per system and round (one colour per system)."""
    plt = require("--plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {}
    for systems in rounds:
        for name, r in systems.items():
            rows = r.get("evaluations") or []
            if not rows:
                continue
            first = name not in colours
            colour = colours.setdefault(name, f"C{len(colours)}")
            xs, ys = [row[0] for row in rows], [row[2] for row in rows]
            alpha = 1.0 if len(rounds) == 1 else 0.6
            ax.plot(xs, ys, "o-", markersize=3, color=colour, alpha=alpha, label=name if first else None)
    ax.axhline(target, linestyle="--", color="grey", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("seconds (swarm: wall time from start; reference, TRL: training time)")
    ax.set_ylabel("held-out exact match (greedy)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
