"""The rollout peer's decode loop against ``generate()`` on the same model, batch and device: tokens/s and peak memory.

One process loads ``--model`` (``bundled``, a folder such as ``hivegrpo fetch-model``'s, or a hub id) with the
peer's own loader (``--quantization``, ``--dtype``, ``--device``) and a LoRA adapter, renders ``--prompts``
prompts of ``--task`` with the prompt settings a run would carry (``--chat-template``, ``--system-prompt``), and
alternates rounds, each sampling the same batch of prompts x ``--group-size`` rows with up to ``--max-new-tokens``:

* **generate**: ``model.generate(do_sample=True, temperature=T, top_k=0, top_p=1)`` with the per-token log-probs
  (``output_scores`` + ``compute_transition_scores``, what a rollout peer must record), stopping at the model's
  end tokens (its generation config's ``eos_token_id``);
* **decode**: :func:`peer.model.sampling.sample_groups`, the rollout peer's loop (finished rows leave the batch,
  the prefill keeps the last logits only);
* **decode, no compaction**: the same loop keeping finished rows in the batch (``compact=False``), to show what
  dropping them is worth;
* **decode, every row's prefill**: the same loop given each prompt ``--group-size`` times (``decode`` with
  ``repeats=1``: every row runs its own prompt's forward, as the loop did before a group's prompt was computed
  once);
* **decode, LoRA merged**: the loop as a rollout peer runs it where it can, with the LoRA update held in the base
  weights (:class:`peer.model.merge.MergedLoRA`; float32 bases only, else this kind is left out).

Completion tokens are counted the same way for all (up to and including each row's first end token). Reported per
kind: the median tokens/s over its rounds, and the peak memory of a round (``torch.cuda.max_memory_allocated`` on
a GPU; on CPU the peak RSS growth over the loaded model, from ``/proc/self/status`` VmHWM after a reset)::

    python -m tests.benchmarks.decode --model ~/.cache/hivegrpo/models/smollm2-135m-instruct --chat-template auto \\
        --task basic_arithmetic --prompts 8 --group-size 4 --max-new-tokens 32 --rounds 3

Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("generate", "decode", "decode, no compaction", "decode, every row's prefill", "decode, LoRA merged")


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):  # writing 5 to clear_refs resets VmHWM to the current RSS (Linux)
            Path("/proc/self/clear_refs").write_text("5")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _peak_bytes(device, before: int) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _rss_kib("VmHWM") * 1024 - before


def _baseline(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _rss_kib("VmRSS") * 1024


def generate_round(model, tokenizer, ids, mask, args, end_ids) -> int:
    """Completion tokens sampled (with their log-probs) by one ``generate()`` call."""
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(end_ids),
        )
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    new = out.sequences[:, ids.shape[1] :]
    ended = torch.isin(new, torch.tensor(list(end_ids), device=new.device))
    # a row's tokens: up to and including its first end token (generate pads the rest with pad_token_id)
    first = torch.where(
        ended.any(1), ended.float().argmax(1) + 1, torch.full_like(ended[:, 0], new.shape[1], dtype=torch.long)
    )
    return int(first.sum())


def add_model_options(parser) -> None:
    """The options that say which model, how it is held, and which task's prompts it sees (shared with
    :mod:`tests.benchmarks.update`)."""
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--quantization", default="nf4", choices=["nf4", "int8", "none"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--task-config", default="{}", help="JSON object of task options")
    parser.add_argument("--chat-template", default="none", choices=["none", "auto"])
    parser.add_argument("--system-prompt", default="")


def load_model(args):
    """``(base, model with a fresh LoRA adapter, prompt settings, task)`` as :func:`add_model_options` chose them,
    loaded with the peer's own loader."""
    from peer.grpo.config import PromptConfig
    from peer.model.adapter import attach_lora
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import load_base
    from peer.tasks import get_task

    base = load_base(
        ModelConfig(name=args.model, quantization=args.quantization, dtype=args.dtype, device=args.device)
    )
    prompt = PromptConfig(chat_template=args.chat_template, system_prompt=args.system_prompt)
    return base, attach_lora(base.model, LoRAConfig()), prompt, get_task(args.task, json.loads(args.task_config))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(parser)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from peer.model.merge import MergedLoRA
    from peer.model.prompts import end_token_ids
    from peer.model.sampling import decode, encode_prompts, sample_groups

    base, model, prompt, task = load_model(args)
    tokenizer, device = base.tokenizer, base.device
    texts = [task.example(0, i).prompt for i in range(args.prompts)]
    repeated = [t for t in texts for _ in range(args.group_size)]
    ids, mask = encode_prompts(tokenizer, repeated, device, prompt)
    end_ids = end_token_ids(model, tokenizer)
    generator = torch.Generator(device=device)
    merged = MergedLoRA.of(model)
    kinds = KINDS if merged is not None else KINDS[:-1]
    if merged is not None:
        merged.unmerge()

    def run(kind: str, seed: int) -> int:
        if kind == "generate":
            torch.manual_seed(seed)
            return generate_round(model, tokenizer, ids, mask, args, end_ids)
        generator.manual_seed(seed)
        if kind == "decode, every row's prefill":
            batch = decode(
                model,
                ids,
                mask,
                max_new_tokens=args.max_new_tokens,
                eos_id=end_ids,
                pad_id=tokenizer.pad_token_id,
                temperature=args.temperature,
                generator=generator,
                stop=prompt.stop,
                tokenizer=tokenizer,
            )
            return int(batch.completion_mask.sum())
        if kind == "decode, LoRA merged":
            merged.refresh()
        batch = sample_groups(
            model,
            tokenizer,
            texts,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            device=device,
            generator=generator,
            prompt=prompt,
            compact=kind != "decode, no compaction",
        )
        if kind == "decode, LoRA merged":
            merged.unmerge()
        return int(batch.completion_mask.sum())

    for kind in kinds:  # warm-up: one small round each, not counted
        run(kind, 10_000)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    peaks: dict[str, list[int]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds:
            before = _baseline(device)
            _reset_peak(device)
            start = time.perf_counter()
            tokens = run(kind, r)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rates[kind].append(tokens / (time.perf_counter() - start))
            peaks[kind].append(_peak_bytes(device, before))
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "dtype": str(base.dtype).removeprefix("torch."),
        "device": str(device),
        "rows": len(repeated),
        "prompt_tokens": int(mask.sum(1).max()),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "kinds": {
            k: {
                "tokens_per_s": round(statistics.median(rates[k]), 1),
                "rounds": [round(x, 1) for x in rates[k]],
                "peak_mib": round(max(peaks[k]) / 2**20, 1),
            }
            for k in kinds
        },
    }
    g = result["kinds"]["generate"]["tokens_per_s"]
    for k in kinds:
        result["kinds"][k]["vs_generate"] = round(result["kinds"][k]["tokens_per_s"] / g, 3) if g else None
    print(
        f"{args.model} ({args.quantization}, {result['dtype']}, {device}): {len(repeated)} rows, "
        f"prompts up to {result['prompt_tokens']} tokens, up to {args.max_new_tokens} new"
    )
    print(f"{'kind':<30}{'tokens/s':>10}{'vs generate':>13}{'peak MiB':>10}")
    for k in kinds:
        v = result["kinds"][k]
        print(f"{k:<30}{v['tokens_per_s']:>10.1f}{v['vs_generate']:>13.3f}{v['peak_mib']:>10.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
