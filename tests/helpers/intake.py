"""Honest rollout groups for tests of a learner's intake: a run on the bundled model, sampled for three signers.

The intake needs no network and no model, only the run's spec and its tokenizer, but its checks (the prompt
re-derived from the signer's seed and seq, every reward recomputed) must first pass on real data: the groups here
are sampled from the bundled model exactly as a rollout peer samples them (``build_groups``).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from peer.network.buckets import Fetched
from peer.protocol import GroupRecord
from peer.roles.learner.intake import Intake
from tests.helpers.records import PEER_ID, adapter_sha, changed, make_group

# Signing keys as the intake sees them (it only derives prompt seeds and fingerprints from them): two honest
# signers and the one whose groups each test tampers with.
A = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/intake-a=="
B = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/intake-b=="
M = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/intake-m=="
SHA0, SHA1 = adapter_sha(0), adapter_sha(1)
GROUPS_PER_SIGNER = {A: 12, B: 8, M: 12}
FORGIVEN_BY_DESIGN = frozenset({"schema", "unavailable", "duplicate", "unknown_version", "lineage"})
"""Refusals that must not ban the signer (peer/roles/learner/intake.py): a cut blob, a blob not delivered, an entry
read twice, a version from before a restart or of a learner that lost the lead. Every other refusal of
``check_group`` or a replay bans."""


def sample_scored(model, tokenizer, spec, owner: bytes, seqs, seed: int, device=None):
    """Sample the prompts of ``owner``'s ``seqs`` as a rollout peer does (``sample_groups`` with the run's sampling
    settings, a generator seeded with ``seed``) and score every completion: ``(batch, rewards)``."""
    import torch

    from peer.model.sampling import sample_run

    device = device or torch.device("cpu")
    s = spec.sampling
    examples = [spec.example(owner, seq) for seq in seqs]
    generator = torch.Generator(device=device).manual_seed(seed)
    batch = sample_run(
        model, tokenizer, [e.prompt for e in examples], s, spec.prompt, device=device, generator=generator
    )
    texts = batch.texts(tokenizer)
    return batch, [spec.task.reward(text, examples[i // s.group_size]) for i, text in enumerate(texts)]


def sample_run(groups_per_signer: dict[bytes, int] = GROUPS_PER_SIGNER) -> SimpleNamespace:
    """``spec``, ``model`` (the fp32 base with LoRA that sampled them), ``tokenizer``, ``vocab`` and
    ``groups[owner]``: honest v0 groups with seqs ``0 .. n - 1``, each with signal (rewards not all equal: the
    intake keeps no other; a seq whose first sample scored flat is sampled again)."""
    import torch

    from coordinator.manifest import RunSettings, build_manifest
    from peer.model.adapter import attach_lora
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import bundled_path, load_base
    from peer.roles.rollout.groups import build_groups
    from peer.run.spec import run_spec

    manifest = build_manifest(RunSettings(run_id="intake"), bundled_path(), "0" * 64, PEER_ID)
    spec = run_spec(manifest, A)
    base = load_base(ModelConfig(device="cpu", quantization="none"))
    torch.manual_seed(0)
    model = attach_lora(base.model, LoRAConfig())
    groups = {}
    flat: dict[tuple[bytes, int], GroupRecord] = {}
    for owner, n in groups_per_signer.items():
        made: dict[int, GroupRecord] = {}
        for attempt in range(1, 9):  # a group whose rewards are all equal is dropped by the intake (no signal):
            seqs = [seq for seq in range(n) if seq not in made]  # sample its prompt again until it has signal
            if not seqs:
                break
            batch, rewards = sample_scored(model, base.tokenizer, spec, owner, seqs, seed=attempt)
            built = build_groups(batch, rewards, seqs, spec, version=0, sha=SHA0, owner=owner, producer=PEER_ID)
            made.update({g.seq: g for g in built if max(g.rewards) > min(g.rewards)})
            flat.update({(owner, g.seq): g for g in built if max(g.rewards) == min(g.rewards)})
        for seq in [seq for seq in range(n) if seq not in made]:  # never scored apart: one completion answers
            made[seq] = _with_the_answer(model, base.tokenizer, spec, flat[(owner, seq)], owner)
        groups[owner] = [made[seq] for seq in range(n)]
    return SimpleNamespace(spec=spec, model=model, tokenizer=base.tokenizer, vocab=len(base.tokenizer), groups=groups)


def _with_the_answer(model, tokenizer, spec, group: GroupRecord, owner: bytes) -> GroupRecord:
    """``group`` with its first completion replaced by the right answer, its behaviour log-probs the model's own
    (teacher-forced at the run's temperature) and its rewards recomputed: honest, with signal."""
    import torch

    from peer.grpo import completion_logprobs
    from peer.protocol import Completion

    example = spec.example(owner, group.seq)
    answer = tokenizer(example.reference, add_special_tokens=False)["input_ids"][: spec.sampling.max_new_tokens - 1]
    tokens = [*answer, tokenizer.eos_token_id]
    prompt = torch.tensor([group.prompt_tokens()])
    with torch.no_grad():
        logprobs = completion_logprobs(
            model, prompt, torch.ones_like(prompt), torch.tensor([tokens]), spec.sampling.temperature
        )[0].tolist()
    completions = [Completion.of(tokens, logprobs), *group.completions[1:]]
    texts = [tokenizer.decode(c.tokens(), skip_special_tokens=True) for c in completions]
    rewards = [float(spec.task.reward(t, example)) for t in texts]
    return changed(group, completions=completions, rewards=rewards)


def new_intake(run: SimpleNamespace, batch: int = 16, share_cap: float = 0.5, check_rate: float = 0.0) -> Intake:
    """An intake that knows adapter versions 0 and 1 (by default it admits every verified group: no spot checks)."""
    intake = Intake(
        run.spec, run.tokenizer, batch=batch, share_cap=share_cap, check_rate=check_rate, rng=random.Random(3)
    )
    intake.known.update({0: SHA0, 1: SHA1})
    return intake


def fetched(owner: bytes, group: GroupRecord) -> Fetched:
    """``group`` as a bucket read hands it over, signed by ``owner``."""
    return Fetched(owner, group.version, group.seq, group)


def pool_ids(intake: Intake, owner: bytes) -> list[tuple[int, int]]:
    """``(version, seq)`` of the groups of ``owner`` waiting in the pool, in order."""
    return [(a.group.version, a.group.seq) for a in intake.pool.get(owner, [])]


def signer_state(intake: Intake, owner: bytes) -> dict:
    """Everything the intake holds about one signer (to show a refusal of another signer changed none of it)."""
    return {
        "pool": pool_ids(intake, owner),
        "seqs": dict(intake.seqs.get(owner, {})),
        "floor": intake.floor.get(owner),
        "banned": owner in intake.banned,
        "rejected": intake.rejected_by.get(owner, 0),
        "last_verified": intake.last_verified.get(owner),
    }


def answered_group(run, owner: bytes, seq: int, right: int) -> GroupRecord:
    """A v0 group of ``owner``'s example ``seq`` whose first ``right`` completions are the answer, made rather than
    sampled: its prompt and rewards pass the intake's checks (prompt re-derived, rewards recomputed), its behaviour
    log-probs (-0.5 a token) are no model's."""
    from peer.model.prompts import completion_text, prompt_ids
    from peer.run.spec import prompt_seed

    spec, tokenizer, G = run.spec, run.tokenizer, run.spec.sampling.group_size
    example = spec.example(owner, seq)
    wrong = f"{(int(example.reference) + 1) % 10 ** len(example.reference):0{len(example.reference)}d}"
    answers = [example.reference] * right + [wrong] * (G - right)
    tokens = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
    return make_group(
        version=0,
        adapter_sha256=SHA0,
        seq=seq,
        task_seed=prompt_seed(spec.seed, owner),
        task_index=seq,
        prompt=prompt_ids(tokenizer, spec.prompt, example.prompt),
        completions=tokens,
        rewards=[spec.task.reward(completion_text(tokenizer, t, spec.prompt.stop), example) for t in tokens],
        created=1.0,
    )
