"""Forced staleness: what the clipped ratio and the staleness weight w(tau) buy when rollouts lag behind.

One process plays both sides so the lag is exact. Update ``t`` (the learner holds adapter version ``t``) trains on
16 prompts x G completions sampled with adapter version ``t - lag`` (version 0 while ``t < lag``); the adapter
of every version is kept in memory for that. Lag per prompt:

* ``fixed``: every prompt is ``k`` versions behind (rollouts ``k`` versions behind);
* ``mixed``: each prompt's lag is drawn uniformly from ``0..k``, as when rollout peers of several speeds
  contribute to one update.

The update itself uses the learner's functions (:func:`~peer.grpo.group_advantages`,
:func:`~peer.grpo.completion_logprobs`, :func:`~peer.grpo.clipped_policy_loss`,
:func:`~peer.grpo.staleness_weights`, AdamW with the learner's lr and grad-norm clip). Variants:

* ``clip-w``: the learner's loss — ratio against the behaviour log-probs recorded at sampling, PPO clip, each
  sequence weighted by ``w(tau)`` (the default polynomial weighting, ``tau_max = max(k, 4)``);
* ``clip``: the same without ``w(tau)`` (weights all 1);
* ``none``: uncorrected — the behaviour log-probs are replaced by the current policy's (detached), so the ratio
  is exactly 1, nothing is clipped, and stale samples are treated as if they were fresh.

With a ``fixed`` lag all sequences of an update share one weight ``w(k)``; AdamW normalizes the gradient's scale
away, so ``clip-w`` can differ from ``clip`` there only through the grad-norm clip and Adam's epsilon. ``mixed``
is where w(tau) can matter. Variant ``clip-w`` at ``k = 0`` equals ``clip`` (w(0) = 1) and ``mixed`` at
``k = 0`` equals ``fixed``; those runs are skipped. All runs share prompts and sampling seeds. Reported: greedy
exact match on the bundled task's held-out split (n = 500) after ``--updates`` updates, and per-run reward, clip
fraction and ratio means::

    OMP_NUM_THREADS=2 python -m tests.benchmarks.staleness --k 0 2 4 8 --updates 250 --threads 2 --out staleness.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

VARIANTS = ("clip-w", "clip", "none")
LAGS = ("fixed", "mixed")
PROMPTS_PER_UPDATE = 16


def lags_for(t: int, k: int, mode: str, rng: random.Random, n: int) -> list[int]:
    """Each prompt's lag at update ``t``: never older than version 0."""
    if mode == "fixed":
        return [min(k, t)] * n
    return [min(rng.randint(0, k), t) for _ in range(n)]


def run_one(k: int, variant: str, lag: str, updates: int, seed: int, eval_n: int) -> dict:
    import torch

    from peer.grpo import (
        LossConfig,
        SamplingConfig,
        StalenessConfig,
        clipped_policy_loss,
        completion_logprobs,
        group_advantages,
        staleness_weights,
    )
    from peer.model.adapter import attach_lora, lora_parameters
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.evaluate import exact_match
    from peer.model.loading import load_base
    from peer.model.sampling import sample_groups
    from peer.roles.learner.peer import LearnerConfig
    from peer.tasks import derive_seed, get_task

    defaults = LearnerConfig(run_id="bench")
    sampling, loss_config = SamplingConfig(), LossConfig()
    staleness = StalenessConfig(tau_max=max(k, 4))
    torch.manual_seed(seed)
    task = get_task("addition", {})
    base = load_base(ModelConfig())
    model = attach_lora(base.model, LoRAConfig())
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=defaults.lr)
    generator = torch.Generator(device=base.device)
    rng = random.Random(derive_seed(seed, "staleness-lags", k))
    versions = {0: [p.detach().clone() for p in params]}  # adapter of each version still within reach

    def load(values) -> None:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)

    G = sampling.group_size
    rewards_seen, clip_fractions, ratio_means = [], [], []
    started = time.perf_counter()
    for t in range(updates):
        examples = [task.example(seed, t * PROMPTS_PER_UPDATE + i) for i in range(PROMPTS_PER_UPDATE)]
        lags = lags_for(t, k, lag, rng, PROMPTS_PER_UPDATE)
        current = versions[t]
        parts = []  # (lag, Completions, rewards [n, G]) per distinct lag
        model.eval()
        for L in sorted(set(lags)):
            chosen = [e for e, x in zip(examples, lags, strict=True) if x == L]
            load(versions[t - L])
            generator.manual_seed(derive_seed(seed, "staleness-sampling", t, L))
            batch = sample_groups(
                model,
                base.tokenizer,
                [e.prompt for e in chosen],
                group_size=G,
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                device=base.device,
                generator=generator,
            )
            texts = batch.texts(base.tokenizer)
            rewards = torch.tensor(
                [task.reward(text, chosen[i // G]) for i, text in enumerate(texts)], dtype=torch.float32
            ).view(len(chosen), G)
            parts.append((L, batch, rewards))
        load(current)
        model.train()
        total_tokens, terms, stats_seen = 0, [], []
        for L, batch, rewards in parts:
            rewards_seen.append(rewards.mean().item())
            advantages = group_advantages(rewards, loss_config.adv_eps).flatten().to(base.device)
            rows = advantages.ne(0).nonzero().flatten()
            if rows.numel() == 0:
                continue
            logprobs = completion_logprobs(
                model,
                batch.prompt_ids[rows],
                batch.prompt_mask[rows],
                batch.completion_ids[rows],
                sampling.temperature,
            )
            behaviour = logprobs.detach() if variant == "none" else batch.logprobs[rows]
            weights = None
            if variant == "clip-w":
                weights = staleness_weights([L] * int(rows.numel()), staleness).to(base.device)
            loss, stats = clipped_policy_loss(
                logprobs, behaviour, advantages[rows], batch.completion_mask[rows], weights, loss_config
            )
            terms.append(loss * stats.tokens)  # token-mean over the whole update, as the learner's one batch
            total_tokens += stats.tokens
            stats_seen.append(stats)
        if terms:
            optimizer.zero_grad(set_to_none=True)
            (sum(terms) / max(total_tokens, 1)).backward()
            torch.nn.utils.clip_grad_norm_(params, defaults.max_grad_norm)
            optimizer.step()
            clip_fractions.extend(s.clip_fraction for s in stats_seen)
            ratio_means.extend(s.ratio_mean for s in stats_seen)
        versions[t + 1] = [p.detach().clone() for p in params]
        versions.pop(t + 1 - k - 1, None)  # older than any lag still to come
        model.eval()
    train_seconds = time.perf_counter() - started
    result = exact_match(model, base.tokenizer, task, n=eval_n, max_new_tokens=sampling.max_new_tokens)
    tail = rewards_seen[-max(1, len(rewards_seen) // 10) :]
    return {
        "k": k,
        "variant": variant,
        "lag": lag,
        "updates": updates,
        "exact_match": result.exact_match,
        "reward_mean_last_10pct": round(sum(tail) / len(tail), 4),
        "clip_fraction_mean": round(sum(clip_fractions) / len(clip_fractions), 4) if clip_fractions else 0.0,
        "ratio_mean": round(sum(ratio_means) / len(ratio_means), 4) if ratio_means else 1.0,
        "w_tau_at_k": (staleness_weights([k], staleness).item() if variant == "clip-w" else 1.0),
        "train_seconds": round(train_seconds, 1),
    }


def plan(ks: list[int], variants: list[str], lags: list[str]) -> list[tuple[int, str, str]]:
    """The runs to make, without the ones identical to another by construction (see the module docstring)."""
    runs = []
    for lag in lags:
        for k in ks:
            if lag == "mixed" and k == 0:
                continue
            for variant in variants:
                if variant == "clip-w" and k == 0:
                    continue
                runs.append((k, variant, lag))
    return runs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8], help="versions of lag")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--lags", nargs="+", default=list(LAGS), choices=LAGS)
    parser.add_argument("--updates", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-n", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the report here as JSON")
    args = parser.parse_args(argv)
    if any(k < 0 for k in args.k):
        parser.error("--k values must be >= 0")
    import torch

    torch.set_num_threads(args.threads)
    runs = []
    for k, variant, lag in plan(args.k, args.variants, args.lags):
        runs.append(run_one(k, variant, lag, args.updates, args.seed, args.eval_n))
        r = runs[-1]
        print(
            f"k={k} {lag:5s} {variant:6s}: exact match {r['exact_match']:.3f}"
            f"  reward {r['reward_mean_last_10pct']:.3f}"
            f"  clip {r['clip_fraction_mean']:.3f}  ratio {r['ratio_mean']:.3f}  ({r['train_seconds']} s)",
            flush=True,
        )
        if args.out:  # written after every run, so a long benchmark that is stopped keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"threads": args.threads, "seed": args.seed, "runs": runs}, f, indent=2)
    return {"runs": runs}


if __name__ == "__main__":
    main()
