"""The log-prob spot check against honest hardware and against liars, on the bundled model.

A learner recomputes a sample of groups' behaviour log-probs and bans the signer of a group that fails
:class:`~peer.roles.learner.verify.LogprobCheck`. Honest peers sample in float32, bfloat16 or float16 and the learner
recomputes in its own dtype, so the check must pass every honest group of every (sampler, verifier) pair while
refusing lies. This benchmark measures both sides:

1. **An adapter with a history.** The nf4 bundled model's LoRA is trained ``--steps`` GRPO steps on ``addition``
   (:func:`peer.roles.learner.reference.grpo_step`, fp32, 8 prompts a step); every step's LoRA tensors are kept, so
   version ``v`` below is the adapter after ``v`` steps, and the checked version is the last one.
2. **Honest groups.** For each sampler dtype a base is loaded in that dtype (``torch_dtype`` and the nf4 compute
   dtype), the checked version is loaded into its LoRA, and ``--groups`` groups are sampled exactly as a rollout
   peer samples them (:func:`~peer.model.sampling.sample_groups` + :func:`~peer.roles.rollout.peer.build_groups`),
   with the prompts of a signer's seqs. Each verifier dtype checks every one of them: any refusal is a false
   refusal of an honest peer.
3. **Lies**, checked by the fp32 verifier, each built from the fp32 sampler's honest groups (or sampled afresh):

   * forged log-probs: every token's raised by a constant (+0.1, +0.3 nats, capped at 0), log-prob 0 claimed on
     one token of each completion, or every log-prob halved;
   * stale: groups sampled by the adapter ``gap`` versions older, with that sampler's honest log-probs, claimed
     as the checked version (gap 1 is two adapters one optimizer step apart: expected to pass);
   * cherry-picked: the reference answer's tokens + eos put in place of ``k`` of the G completions (all, or half),
     with the log-probs the verifier itself computes for them (so only the sampling test can tell).

Everything runs in this process on one torch thread::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.verification --groups 2000 --json verification.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

DTYPES = ("float32", "bfloat16", "float16")
GAPS = (1, 5, 20, 100)
OWNER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/verification-bench=="
PEER_ID = "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT"
SHA = "0" * 64  # the groups' claimed adapter sha256: the check under test never looks at it
PROMPTS_PER_STEP = 8
CHUNK = 64  # groups per sampling batch and per verifying forward pass


@dataclass(frozen=True)
class Row:
    """One line of the table: a kind of group, how many were checked and how many the check refused."""

    side: str  # "honest" (refusals are false) or "lie" (refusals are detections)
    case: str
    sampler: str
    verifier: str
    groups: int
    refused: int
    worst: dict  # the extreme statistics over the groups (max of max |Δ|, of mean |Δ|; min and max z)
    reasons: dict  # refusal messages' first words -> count

    @property
    def rate(self) -> float:
        return self.refused / self.groups if self.groups else 0.0


def run_spec():
    """The run a default host publishes on the bundled model (addition, default sampling, loss and LoRA, seed 0),
    built here without a manifest: the peer package never imports the coordinator's."""
    from types import SimpleNamespace

    from peer.grpo.config import LossConfig, SamplingConfig, StalenessConfig
    from peer.model.config import LoRAConfig
    from peer.run.spec import RunSpec
    from peer.tasks import get_task

    return RunSpec(
        manifest=SimpleNamespace(run_id="verification", seed=0),
        coordinator_key=b"",
        task=get_task("addition"),
        sampling=SamplingConfig(),
        loss=LossConfig(),
        staleness=StalenessConfig(),
        lora=LoRAConfig(),
        groups_per_version=16,
    )


def load_model(dtype: str, lora):
    """The nf4 bundled base in ``dtype`` (its non-quantized modules and the 4-bit compute dtype) with a LoRA."""
    from peer.model.adapter import attach_lora
    from peer.model.config import ModelConfig
    from peer.model.loading import load_base

    base = load_base(ModelConfig(name="bundled", quantization="nf4", device="cpu", dtype=dtype))
    return attach_lora(base.model, lora), base.tokenizer


def set_lora(model, tensors) -> None:
    import torch

    from peer.model.adapter import lora_parameters

    with torch.no_grad():
        for p, t in zip(lora_parameters(model), tensors, strict=True):
            p.copy_(t)


def train_versions(spec, steps: int) -> list[list]:
    """The LoRA tensors after 0, 1, …, ``steps`` GRPO steps on the run's task (fp32 nf4, one process)."""
    import torch

    from peer.model.adapter import lora_parameters
    from peer.roles.learner.reference import ReferenceConfig, grpo_step
    from peer.tasks import derive_seed

    model, tokenizer = load_model("float32", spec.lora)
    config = ReferenceConfig(sampling=spec.sampling, loss=spec.loss, prompts_per_step=PROMPTS_PER_STEP)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=config.lr)
    generator = torch.Generator()
    versions = [[p.detach().clone() for p in lora_parameters(model)]]
    for step in range(steps):
        generator.manual_seed(derive_seed(0, "verification-bench", step))
        examples = [spec.task.example(1, step * PROMPTS_PER_STEP + i) for i in range(PROMPTS_PER_STEP)]
        grpo_step(model, tokenizer, spec.task, examples, config, optimizer, generator, torch.device("cpu"))
        versions.append([p.detach().clone() for p in lora_parameters(model)])
    return versions


def sample(model, tokenizer, spec, seqs: range, seed: int) -> list:
    """Groups ``seqs`` of :data:`OWNER`, sampled as a rollout peer samples them."""
    import torch

    from peer.model.sampling import sample_groups
    from peer.roles.rollout.groups import build_groups

    s = spec.sampling
    groups = []
    for first in range(seqs.start, seqs.stop, CHUNK):
        chunk = range(first, min(first + CHUNK, seqs.stop))
        examples = [spec.example(OWNER, seq) for seq in chunk]
        batch = sample_groups(
            model,
            tokenizer,
            [e.prompt for e in examples],
            group_size=s.group_size,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            device=torch.device("cpu"),
            generator=torch.Generator().manual_seed(seed * 1_000_003 + first),
        )
        texts = batch.texts(tokenizer)
        rewards = [spec.task.reward(t, examples[i // s.group_size]) for i, t in enumerate(texts)]
        groups += build_groups(batch, rewards, chunk, spec, version=0, sha=SHA, owner=OWNER, producer=PEER_ID)
    return groups


def stats_of(model, groups: list, spec, check) -> list:
    from peer.roles.learner.verify import logprob_stats

    out = []
    for i in range(0, len(groups), CHUNK):
        out += logprob_stats(model, groups[i : i + CHUNK], spec, check.drift)
    return out


def judge(side, case, sampler, verifier, stats: list, check) -> Row:
    from peer.roles.learner.verify import judge_logprobs

    verdicts = [judge_logprobs(s, check) for s in stats]
    reasons: dict[str, int] = {}
    for v in verdicts:
        if v is not None:
            key = " ".join(str(v).split(":", 1)[1].split()[:4])
            reasons[key] = reasons.get(key, 0) + 1
    worst = {
        "max_abs": round(max(s.max_abs for s in stats), 3),
        "mean_abs": round(max(s.mean_abs for s in stats), 3),
        "median_abs": round(max(s.median_abs for s in stats), 3),
        "one_sided": round(max(abs(s.one_sided) for s in stats), 3),
        "z_min": round(min(s.z for s in stats), 2),
        "z_max": round(max(s.z for s in stats), 2),
    }
    return Row(side, case, sampler, verifier, len(stats), sum(v is not None for v in verdicts), worst, reasons)


def forged(groups: list, how: str) -> list:
    from peer.protocol import Completion, GroupRecord

    def lie(values: list[float]) -> list[float]:
        if how.startswith("+"):
            return [min(0.0, v + float(how)) for v in values]
        if how == "zero on one token":
            return [0.0, *values[1:]]
        if how == "x0.5":
            return [0.5 * v for v in values]
        raise ValueError(f"unknown forgery {how!r}")

    return [
        GroupRecord(
            **{
                **g.dict(),
                "completions": [Completion.of(c.tokens(), lie(c.behaviour_logprobs())) for c in g.completions],
            }
        )
        for g in groups
    ]


def cherry_picked(model, tokenizer, groups: list, spec, k: int) -> list:
    """``groups`` with their first ``k`` completions replaced by the reference answer + eos, its log-probs
    computed honestly by ``model`` (rewards recomputed)."""
    import torch

    from peer.grpo.logprobs import completion_logprobs
    from peer.protocol import Completion, GroupRecord
    from peer.roles.learner.verify import pack_rows

    examples = [spec.example(OWNER, g.seq) for g in groups]
    answers = [
        (tokenizer(e.reference, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[
            : spec.sampling.max_new_tokens
        ]
        for e in examples
    ]
    # a record needs two completions: the answer twice, one row of the two read back
    twice = [
        GroupRecord(**{**g.dict(), "completions": [Completion.of(a, [0.0] * len(a))] * 2, "rewards": [0.0, 0.0]})
        for g, a in zip(groups, answers, strict=True)
    ]
    prompt_ids, prompt_mask, ids, _ = pack_rows(twice, 0, torch.device("cpu"))
    with torch.no_grad():
        lp = completion_logprobs(model, prompt_ids, prompt_mask, ids, spec.sampling.temperature)[::2].tolist()
    out = []
    for g, e, a, row in zip(groups, examples, answers, lp, strict=True):
        picked = Completion.of(a, [min(0.0, v) for v in row[: len(a)]])
        reward = spec.task.reward(tokenizer.decode(a, skip_special_tokens=True), e)
        completions = [picked] * k + list(g.completions[k:])
        rewards = [reward] * k + list(g.rewards[k:])
        out.append(GroupRecord(**{**g.dict(), "completions": completions, "rewards": rewards}))
    return out


def lies(args, spec, versions, verifier, liar: str, base_groups: list, check) -> list[Row]:
    """Forged, stale and cherry-picked groups made by a ``liar``-dtype sampler, judged by the fp32 ``verifier``."""
    rows = []
    for how in ("+0.1", "+0.3", "zero on one token", "x0.5"):
        stats = stats_of(verifier, forged(base_groups, how), spec, check)
        rows.append(judge("lie", f"forged {how}", liar, "float32", stats, check))
    sampler, tokenizer = load_model(liar, spec.lora)
    current = len(versions) - 1
    for gap in GAPS:
        if gap > current:
            continue
        set_lora(sampler, versions[current - gap])
        stale = sample(sampler, tokenizer, spec, range(len(base_groups)), seed=100 + gap)
        rows.append(judge("lie", f"stale by {gap}", liar, "float32", stats_of(verifier, stale, spec, check), check))
    G = spec.sampling.group_size
    for k in (G, G // 2, 1):
        picked = cherry_picked(verifier, tokenizer, base_groups, spec, k)
        rows.append(
            judge("lie", f"cherry-picked {k}/{G}", liar, "float32", stats_of(verifier, picked, spec, check), check)
        )
    return rows


def run(args) -> dict:
    import torch

    from peer.roles.learner.verify import LogprobCheck

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    check = LogprobCheck()
    spec = run_spec()
    versions = train_versions(spec, args.steps)
    current = len(versions) - 1
    trained = time.perf_counter() - t0
    seqs = range(args.groups)
    honest: dict[str, list] = {}
    models = {}
    for dtype in args.samplers:
        print(f"sampling {args.groups} groups in {dtype} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        model, tokenizer = load_model(dtype, spec.lora)
        set_lora(model, versions[current])
        models[dtype] = model
        honest[dtype] = sample(model, tokenizer, spec, seqs, seed=DTYPES.index(dtype))
    sampled = time.perf_counter() - t0 - trained
    rows = []
    for verifier in args.verifiers:
        vmodel = models.get(verifier)
        if vmodel is None:
            vmodel, _ = load_model(verifier, spec.lora)
            set_lora(vmodel, versions[current])
            models[verifier] = vmodel
        for sampler in args.samplers:
            print(f"verifying {sampler} in {verifier} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            rows.append(
                judge("honest", "sampled", sampler, verifier, stats_of(vmodel, honest[sampler], spec, check), check)
            )
    verifier = models["float32"] if "float32" in models else load_model("float32", spec.lora)[0]
    set_lora(verifier, versions[current])
    for liar in args.lie_samplers:
        print(f"lies on {liar} groups ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        rows += lies(args, spec, versions, verifier, liar, honest[liar][: args.lie_groups], check)
    return {
        "check": asdict(check),
        "groups": args.groups,
        "lie_groups": args.lie_groups,
        "steps": args.steps,
        "seconds": {
            "train": round(trained, 1),
            "sample": round(sampled, 1),
            "total": round(time.perf_counter() - t0, 1),
        },
        "rows": [{**asdict(r), "rate": round(r.rate, 4)} for r in rows],
    }


def table(result: dict) -> str:
    lines = [
        f"{'side':6} {'case':22} {'sampler':9} {'verifier':9} {'groups':>6} {'refused':>7} {'rate':>7}  worst",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['side']:6} {r['case']:22} {r['sampler']:9} {r['verifier']:9} {r['groups']:>6} {r['refused']:>7} "
            f"{r['rate']:>7.2%}  {json.dumps(r['worst'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.verification", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2000, help="honest groups per sampler dtype")
    p.add_argument("--lie-groups", type=int, default=200, help="groups per kind of lie")
    p.add_argument("--steps", type=int, default=120, help="GRPO steps of the adapter's history (>= 100 for gap 100)")
    p.add_argument("--samplers", default="float32,bfloat16,float16", help="sampler dtypes, comma-separated")
    p.add_argument("--verifiers", default="float32,bfloat16", help="verifier dtypes, comma-separated")
    p.add_argument("--lie-samplers", default="float32,bfloat16", help="dtypes the liars sample in (of --samplers)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the result here")
    args = p.parse_args(argv)
    args.samplers = tuple(args.samplers.split(","))
    args.verifiers = tuple(args.verifiers.split(","))
    args.lie_samplers = tuple(args.lie_samplers.split(","))
    for name in (*args.samplers, *args.verifiers):
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}: use {', '.join(DTYPES)}")
    if not set(args.lie_samplers) <= set(args.samplers):
        p.error("--lie-samplers must be among --samplers (the lies start from those honest groups)")
    if args.groups < 1 or args.lie_groups < 1 or args.steps < 1:
        p.error("--groups, --lie-groups and --steps must be at least 1")
    result = run(args)
    print(table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
