"""The learner's update with every row's own forward against each group's prompt run once, on the same batch.

One process loads ``--model`` with the peer's own loader (``--quantization``, ``--dtype``, ``--device``) and a LoRA
adapter, samples ``--prompts`` prompts of ``--task`` x ``--group-size`` completions with the rollout peer's sampler
(the prompt settings a run would carry: ``--chat-template``, ``--system-prompt``), gives every group a reward
spread (so every row carries signal, as in a learner's update), and alternates rounds of
:func:`peer.roles.learner.update.share_gradient` (the clipped loss's forward and backward) on that batch:

* **every row's forward**: each completion row runs its prompt and completion (``share_prompts=False``: the update
  as it was);
* **a group's prompt once**: each group's prompt runs once and its KV cache is copied to the group's rows
  (``share_prompts=True``, what a learner runs);
* **prompt once, floor off**: the same with the run's ``token_floor`` at 0 (no improbable tokens measured or left
  out: the update before the poisoning defence, docs/reliability.md), so the defence's cost is the difference
  between the last two.

Reported per kind: the median seconds of an update over its rounds and the positions it computes (rows x tokens
through the model), and the largest difference between the two gradients (relative to the largest gradient
entry). No memory column: on CPU the allocator keeps the pages one kind freed for the next, so a peak measured by
RSS growth says which kind ran first::

    python -m tests.benchmarks.update --model ~/.cache/hivegrpo/models/smollm2-135m-instruct --chat-template auto \\
        --task basic_arithmetic --prompts 4 --group-size 8 --max-new-tokens 32 --rounds 3

Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from tests.benchmarks.decode import add_model_options, load_model

os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("every row's forward", "a group's prompt once", "prompt once, floor off")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(parser)
    parser.add_argument("--prompts", type=int, default=16, help="groups per update")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from peer.grpo import group_advantages
    from peer.grpo.config import LossConfig, SamplingConfig
    from peer.model.sampling import sample_groups
    from peer.roles.learner.update import Batch, share_gradient

    base, model, prompt, task = load_model(args)
    tokenizer, device = base.tokenizer, base.device
    sampled = sample_groups(
        model,
        tokenizer,
        [task.example(0, i).prompt for i in range(args.prompts)],
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        device=device,
        generator=torch.Generator(device=device).manual_seed(0),
        prompt=prompt,
    )
    rewards = torch.zeros(args.prompts, args.group_size)
    rewards[:, : args.group_size // 2] = 1.0  # a spread in every group: every row carries signal
    advantages = group_advantages(rewards, 1e-6).flatten().to(device)
    batch = Batch(
        sampled.prompt_ids,
        sampled.prompt_mask,
        sampled.completion_ids,
        sampled.completion_mask,
        sampled.logprobs,
        advantages,
        torch.ones_like(advantages),
        rewards,
    )
    spec = argparse.Namespace(sampling=SamplingConfig(group_size=args.group_size), loss=LossConfig())
    unfloored = argparse.Namespace(sampling=spec.sampling, loss=LossConfig(token_floor=0.0))
    P, C = sampled.prompt_ids.shape[1], sampled.completion_ids.shape[1]
    rows = sampled.prompt_ids.shape[0]
    once = args.prompts * P + rows * max(0, C - 1)
    positions = {KINDS[0]: rows * (P + C), KINDS[1]: once, KINDS[2]: once}

    def run(kind: str):
        return share_gradient(model, batch, unfloored if kind == KINDS[2] else spec, share_prompts=kind != KINDS[0])

    shares = {kind: run(kind) for kind in KINDS}  # warm-up, and the first two gradients compared
    grads = [shares[k].grads for k in KINDS[:2]]
    largest = max(float(g.abs().max()) for g in grads[0])
    difference = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True)) / max(largest, 1e-30)
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            start = time.perf_counter()
            run(kind)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[kind].append(time.perf_counter() - start)
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "dtype": str(base.dtype).removeprefix("torch."),
        "device": str(device),
        "groups": args.prompts,
        "rows": rows,
        "prompt_tokens": int(sampled.prompt_mask.sum(1).max()),
        "completion_tokens": C,
        "rounds": args.rounds,
        "gradient_difference": difference,
        "improbable_tokens": shares[KINDS[1]].stats["improbable"],
        "kinds": {
            k: {
                "seconds": round(statistics.median(seconds[k]), 4),
                "rounds": [round(x, 4) for x in seconds[k]],
                "positions": positions[k],
            }
            for k in KINDS
        },
    }
    first = result["kinds"][KINDS[0]]["seconds"]
    print(
        f"{args.model} ({args.quantization}, {result['dtype']}, {device}): {args.prompts} groups x {args.group_size}, "
        f"prompts up to {result['prompt_tokens']} tokens, completions up to {C}"
    )
    print(f"{'kind':<24}{'seconds':>10}{'speed-up':>10}{'positions':>11}")
    for k in KINDS:
        v = result["kinds"][k]
        print(f"{k:<24}{v['seconds']:>10.4f}{first / v['seconds']:>10.2f}{v['positions']:>11}")
    print(f"largest gradient difference of the first two: {difference:.2e} of the largest entry")
    print(f"tokens under the floor, left out of the loss: {result['improbable_tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
