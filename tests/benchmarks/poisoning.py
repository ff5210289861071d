"""Poisoning: groups that pass every check and still steer the policy, against the learner's defences, side by side.

An attacker holds ``K`` signing keys and makes a ``share`` of the swarm's groups. Each key first sends honest groups
until it is out of probation (every group of a new key is checked: peer/roles/learner/intake.py); from then on it
samples its assigned prompts honestly from the current adapter and, in every completion that is right, writes a
payload the reward never reads after the answer: ``<unk>``, a special token the decoded text drops (on a real
model: text after a stop string, or around an answer tag). Where no completion is right it writes one, and where
every one is right it makes one wrong, so that its group carries signal. Its behaviour log-probs are the adapter's
own, teacher-forced: the honest claim, which no spot check can refuse and which leaves the clipped ratio at 1 (a
higher claim would shrink its own gradient; a lower one is clipped). Its rewards are recomputed as right. When a key
is banned the attacker moves on to its next key (up to four at a time); once every key is banned it makes nothing.

Honest producers (four keys, two sampling in float32 and two in bfloat16) make the rest; every group reaches the
learner 1 to 4 steps after it was sampled (uniformly: in the demo groups arrive 2.3 versions old, p90 3) and goes
through the real :class:`~peer.roles.learner.intake.Intake` (prompt
and rewards recomputed, probation, the sampled log-prob check at rate 0.1 with the real spot check, the per-peer cap),
then the real update (:func:`~peer.roles.learner.update.share_gradient`, :func:`~peer.roles.learner.update.
apply_gradient`, AdamW at the learner's 2e-3) on the bundled model. Each scenario runs twice from the same seed:
with today's defences (``token_floor`` 0) and with the run's default ``token_floor`` (improbable tokens are not
learned from, and a group holding far more of them than sampling gives bans its signer). Reported per version
checkpoint: the payload's rate in held-out samples (temperature 1, 8 completions of 100 held-out prompts) and the
greedy exact match on 500 held-out prompts; per run: poisoned groups used, attacker keys banned, each honest key's
used groups, and honest groups refused (false flags)::

    python -m tests.benchmarks.poisoning --versions 150 --out poisoning.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import random
import time
from collections import Counter

from tests.helpers.poison import poisoned_rows, wrong_answer

os.environ.setdefault("OMP_NUM_THREADS", "1")

HONEST_KEYS = 4  # the first half sample in float32, the others in bfloat16
ACTIVE_KEYS = 4  # the attacker's keys in use at once
GROUPS_PER_STEP = 20
MAX_LAG = 4  # steps a group takes to reach the learner, at most (uniform from 1)
BATCH = 16
EVAL_PROMPTS = 100
EVAL_SAMPLES = 8


def sha(version: int) -> str:
    return hashlib.sha256(b"poisoning v%d" % version).hexdigest()


def lora_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


class Swarm:
    """One run: the model and learner, the honest producers and the attacker."""

    def __init__(self, keys: int, share: float, floor: float, seed: int):
        import torch

        from coordinator.manifest import RunSettings, build_manifest
        from peer.model.adapter import attach_lora, lora_parameters
        from peer.model.config import LoRAConfig, ModelConfig
        from peer.model.loading import bundled_path, load_base
        from peer.roles.learner.intake import Intake
        from peer.run.spec import run_spec
        from tests.helpers.records import PEER_ID

        manifest = build_manifest(RunSettings(run_id="poisoning"), bundled_path(), "0" * 64, PEER_ID)
        spec = run_spec(manifest, b"coordinator")
        self.spec = dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, token_floor=floor))
        base = load_base(ModelConfig(device="cpu", quantization="none"))
        torch.manual_seed(seed)
        self.model = attach_lora(base.model, LoRAConfig())
        self.tokenizer = base.tokenizer
        self.payload = self.tokenizer.unk_token_id
        self.half = copy.deepcopy(self.model).to(torch.bfloat16)  # the bfloat16 producers' copy
        self.checker = copy.deepcopy(self.model)  # holds the version a spot check needs
        self.optimizer = torch.optim.AdamW(lora_parameters(self.model), lr=2e-3)
        self.intake = Intake(
            self.spec, self.tokenizer, batch=BATCH, share_cap=0.5, check_rate=0.1, rng=random.Random(seed)
        )
        self.version, self.states = 0, {0: lora_state(self.model)}
        self.intake.known[0] = sha(0)
        self.rng = random.Random(seed + 1)
        self.generator = torch.Generator().manual_seed(seed + 2)
        self.honest = [b"ssh-rsa honest-%d" % i for i in range(HONEST_KEYS)]
        self.attackers = [b"ssh-rsa attacker-%d" % i for i in range(keys)]
        self.share = share
        self.seq: Counter = Counter()
        self.kind: dict[tuple[bytes, int], str] = {}  # (owner, seq) -> honest32, honest16, probation, poison
        self.arriving: dict[int, list] = {}  # step -> the groups that reach the learner then
        self.steps = 0
        self.counts: Counter = Counter()
        self.used_by: Counter = Counter()
        self.flagged: Counter = Counter()  # kind -> groups refused as improbable
        self.evidence: Counter = Counter()  # kind -> improbable tokens sampling would give its groups in updates
        self.producer = PEER_ID

    # --- producers ---------------------------------------------------------------------------------------------

    def live_attackers(self) -> list[bytes]:
        return [k for k in self.attackers if k not in self.intake.banned][:ACTIVE_KEYS]

    def step(self) -> None:
        """Sample this step's groups (they arrive at the next step), read those that arrived, check, update."""
        made = []
        live = self.live_attackers()
        for i in range(GROUPS_PER_STEP):
            if live and self.rng.random() < self.share:
                owner = live[self.counts["attacker_turn"] % len(live)]
                self.counts["attacker_turn"] += 1
                kind = "probation" if self.intake.on_probation(owner) else "poison"
            else:
                owner = self.honest[i % HONEST_KEYS]
                kind = "honest32" if self.honest.index(owner) < HONEST_KEYS // 2 else "honest16"
            made.append((owner, self.seq[owner], kind))
            self.seq[owner] += 1
        groups = self.sample([m for m in made if m[2] != "honest16"], self.model)
        groups += self.sample([m for m in made if m[2] == "honest16"], self.half)
        for owner, group in groups:  # 1 to MAX_LAG steps on the way, as a swarm's groups arrive 1-4 versions old
            self.arriving.setdefault(self.steps + self.rng.randint(1, MAX_LAG), []).append((owner, group))
        arrived = self.arriving.pop(self.steps, [])
        self.steps += 1
        self.read(arrived)
        self.check()
        self.update()

    def sample(self, made: list, model) -> list:
        import torch

        from peer.model.sampling import sample_run
        from peer.protocol import Completion, GroupRecord, encode_tokens
        from peer.run.spec import prompt_seed
        from tests.helpers.poison import teacher_forced

        if not made:
            return []
        s, tok = self.spec.sampling, self.tokenizer
        examples = [self.spec.example(owner, seq) for owner, seq, _ in made]
        with torch.no_grad():
            prompts = [e.prompt for e in examples]
            batch = sample_run(
                model, tok, prompts, s, self.spec.prompt, device=torch.device("cpu"), generator=self.generator
            )
        texts = batch.texts(tok)
        ids, cmask, logps = batch.completion_ids.tolist(), batch.completion_mask.tolist(), batch.logprobs.tolist()
        out = []
        for p, (owner, seq, kind) in enumerate(made):
            rows = range(p * s.group_size, (p + 1) * s.group_size)
            tokens = [[ids[r][i] for i, m in enumerate(cmask[r]) if m] for r in rows]
            claims = [[min(0.0, logps[r][i]) for i, m in enumerate(cmask[r]) if m] for r in rows]
            rewards = [float(self.spec.task.reward(texts[r], examples[p])) for r in rows]
            prompt = batch.prompt_ids[rows[0]][batch.prompt_mask[rows[0]].bool()].tolist()
            if kind == "poison":
                tokens = self.poisoned(tokens, rewards, examples[p])
                ids_t, mask_t, logps_t = teacher_forced(
                    model,
                    torch.tensor([prompt] * len(tokens)),
                    torch.ones(len(tokens), len(prompt), dtype=torch.long),
                    tokens,
                    s.temperature,
                    tok.pad_token_id,
                )
                claims = [logps_t[i, : len(t)].tolist() for i, t in enumerate(tokens)]
                rewards = [
                    float(self.spec.task.reward(tok.decode(t, skip_special_tokens=True), examples[p])) for t in tokens
                ]
            group = GroupRecord(
                version=self.version,
                adapter_sha256=sha(self.version),
                producer=self.producer,
                seq=seq,
                task_seed=prompt_seed(self.spec.seed, owner),
                task_index=seq,
                prompt_ids=encode_tokens(prompt),
                completions=[Completion.of(t, c) for t, c in zip(tokens, claims, strict=True)],
                rewards=rewards,
                created=time.time(),
            )
            self.kind[(owner, seq)] = kind
            out.append((owner, group))
        return out

    def poisoned(self, tokens: list[list[int]], rewards: list[float], example) -> list[list[int]]:
        tok = self.tokenizer
        return poisoned_rows(
            tokens,
            [r >= 1.0 for r in rewards],
            tok(example.reference, add_special_tokens=False)["input_ids"],
            tok(wrong_answer(example.reference), add_special_tokens=False)["input_ids"],
            self.payload,
            tok.eos_token_id,
            self.spec.sampling.max_new_tokens,
        )

    # --- the learner -------------------------------------------------------------------------------------------

    def read(self, arrived: list) -> None:
        from peer.network.buckets import Fetched

        for owner, group in arrived:
            verdict = self.intake.add(Fetched(owner, group.version, group.seq, group), self.version)
            self.counts[f"read_{verdict if isinstance(verdict, str) else 'ok'}"] += 1
            if verdict not in (None, "no_signal", "stale", "banned"):
                self.counts[f"refused_{self.kind[(owner, group.seq)]}"] += 1

    def check(self) -> None:
        from peer.roles.learner.verify import check_logprobs_many

        pending = self.intake.pending_checks()
        for version in sorted({a.group.version for a in pending}):
            these = [a for a in pending if a.group.version == version]
            self.checker.load_state_dict(self.states[version], strict=False)
            for a, refused in zip(
                these, check_logprobs_many(self.checker, [a.group for a in these], self.spec), strict=True
            ):
                if refused is not None:
                    self.counts[f"spot_{self.kind[(a.owner, a.group.seq)]}"] += 1
                self.intake.checked(a, refused)

    def update(self) -> None:
        import torch

        from peer.roles.learner.update import MicroBatcher, apply_gradient, batch_tensors
        from peer.roles.learner.verify import group_evidence

        chosen = self.intake.take(self.version)
        if chosen is None:
            return
        for a in chosen:
            self.used_by[self.kind[(a.owner, a.group.seq)]] += 1
            if a.owner in self.honest:
                self.used_by[a.owner] += 1
        batch = batch_tensors(chosen, self.version, self.spec, self.tokenizer.pad_token_id, torch.device("cpu"))
        share = MicroBatcher().share_gradient(self.model, batch, self.spec)
        if share is not None:
            if share.evidence is not None:  # the floor's calibration: improbable tokens against their prediction
                groups = group_evidence(share.evidence, self.spec.sampling.group_size)
                for a, (o, e) in zip(chosen, groups, strict=True):
                    kind = self.kind[(a.owner, a.group.seq)]
                    self.counts[f"observed_{kind}"] += o
                    self.evidence[kind] += e
            for a, _ in self.intake.refuse_written(chosen, share.evidence):
                self.flagged[self.kind[(a.owner, a.group.seq)]] += 1
            self.counts["improbable_tokens"] += share.stats["improbable"]
            apply_gradient(self.model, self.optimizer, share.grads, 1.0)
        self.version += 1
        self.states[self.version] = lora_state(self.model)
        self.states.pop(self.version - self.spec.staleness.tau_max - 2, None)
        self.intake.known[self.version] = sha(self.version)
        self.half.load_state_dict(self.model.state_dict())

    # --- measuring ---------------------------------------------------------------------------------------------

    def measure(self) -> dict:
        import torch

        from peer.model.evaluate import exact_match
        from peer.model.sampling import sample_groups

        examples = self.spec.task.heldout(EVAL_PROMPTS, seed=1)
        with torch.no_grad():
            batch = sample_groups(
                self.model,
                self.tokenizer,
                [e.prompt for e in examples],
                group_size=EVAL_SAMPLES,
                max_new_tokens=self.spec.sampling.max_new_tokens,
                temperature=self.spec.sampling.temperature,
                device=torch.device("cpu"),
                generator=torch.Generator().manual_seed(99),
            )
        hit = ((batch.completion_ids == self.payload) & batch.completion_mask).any(1)
        em = exact_match(self.model, self.tokenizer, self.spec.task, n=500).exact_match
        return {"version": self.version, "payload_rate": round(float(hit.float().mean()), 4), "exact_match": em}


def run(keys: int, share: float, floor: float, versions: int, seed: int, every: int) -> dict:
    swarm = Swarm(keys, share, floor, seed)
    start = time.perf_counter()
    curve = [swarm.measure()]
    steps = 0
    while swarm.version < versions and steps < 4 * versions:
        before = swarm.version
        swarm.step()
        steps += 1
        if swarm.version != before and swarm.version % every == 0:
            curve.append(swarm.measure())
    if curve[-1]["version"] != swarm.version:
        curve.append(swarm.measure())
    honest_used = {k.decode(): swarm.used_by[k] for k in swarm.honest}
    return {
        "keys": keys,
        "share": share,
        "token_floor": floor,
        "versions": swarm.version,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
        "final": curve[-1],
        "curve": curve,
        "used": {k: swarm.used_by[k] for k in ("honest32", "honest16", "probation", "poison")},
        "honest_used": honest_used,
        "attacker_keys_banned": sum(k in swarm.intake.banned for k in swarm.attackers),
        "improbable_refusals": dict(swarm.flagged),
        "improbable_tokens": swarm.counts["improbable_tokens"],
        "improbable_observed_expected": {
            k: [swarm.counts[f"observed_{k}"], round(swarm.evidence[k], 2)] for k in ("honest32", "honest16", "poison")
        },
        "spot_check_refusals": {k[5:]: v for k, v in swarm.counts.items() if k.startswith("spot_")},
        "read_refusals": {k[8:]: v for k, v in swarm.counts.items() if k.startswith("refused_")},
        "honest_banned": sum(k in swarm.intake.banned for k in swarm.honest),
    }


def main(argv: list[str] | None = None) -> None:
    import torch

    from peer.grpo import LossConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=150)
    parser.add_argument("--every", type=int, default=25, help="versions between measurements")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keys", type=int, nargs="+", default=[0, 1, 10, 100], help="0: no attacker")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    floor = LossConfig().token_floor
    results = []
    scenarios = [(k, s) for k in args.keys for s in (args.shares if k else [0.0])]
    for keys, share in scenarios:
        for f in (0.0, floor):
            r = run(keys, share, f, args.versions, args.seed, args.every)
            results.append(r)
            print(
                f"K={keys:<3} share={share:.1f} floor={f:<6g} v{r['versions']:<4} "
                f"payload {r['final']['payload_rate']:.3f} EM {r['final']['exact_match']:.3f} "
                f"poison used {r['used']['poison']:<4} keys banned "
                f"{r['attacker_keys_banned']:<3} honest used {sum(r['honest_used'].values()):<5} min/key "
                f"{min(r['honest_used'].values())} honest refused {r['improbable_refusals'].get('honest32', 0)}+"
                f"{r['improbable_refusals'].get('honest16', 0)} spot {r['spot_check_refusals']} "
                f"({r['seconds']} s)",
                flush=True,
            )
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump({"versions": args.versions, "seed": args.seed, "runs": results}, fh, indent=1)


if __name__ == "__main__":
    main()
