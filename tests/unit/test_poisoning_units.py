"""The defence against poisoned-but-valid groups (docs/reliability.md, "Poisoning"), on the bundled model: a token
the policy gives less than the run's ``token_floor`` is not learned from, and a group holding far more such tokens
than sampling gives is refused as ``improbable`` and bans its signer. The groups are an attacker's
(tests/helpers/poison.py: the right answer plus ``<unk>``, log-probs teacher-forced) and honest ones sampled in
float32 and bfloat16."""

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from peer.model.adapter import lora_parameters
from peer.protocol import Completion
from peer.roles.learner.intake import Accepted
from peer.roles.learner.update import apply_gradient, batch_tensors, share_gradient
from peer.roles.learner.verify import IMPROBABLE_ALPHA, judge_improbable, poisson_tail
from tests.helpers.intake import A, M, fetched, new_intake, sample_run
from tests.helpers.poison import poisoned_rows, teacher_forced, wrong_answer
from tests.helpers.records import changed


def test_the_poisson_tail_is_the_sum_of_its_terms():
    def term(i, mean):
        return math.exp(i * math.log(mean) - mean - math.lgamma(i + 1))

    for mean in (1e-4, 0.03, 0.7, 3.0, 12.0):
        for k in (0, 1, 2, 3, 5, 9, 20):
            direct = 1.0 - sum(term(i, mean) for i in range(k))
            tail = sum(term(i, mean) for i in range(k, k + 200))
            assert poisson_tail(k, mean) == pytest.approx(tail if k > mean else direct, rel=1e-9, abs=1e-15)
    assert poisson_tail(3, 0.0) == 0.0 and poisson_tail(0, 0.0) == 1.0


def test_a_group_is_refused_only_for_more_improbable_tokens_than_sampling_gives():
    assert judge_improbable(1, 1e-9, 1e-3) is None, "one token alone is never enough"
    assert judge_improbable(2, 1.0, 1e-3) is None, "as many as sampling gives"
    refused = judge_improbable(4, 0.04, 1e-3)
    assert refused is not None and refused.reason == "improbable" and "written, not sampled" in refused
    assert poisson_tail(4, 0.04) < IMPROBABLE_ALPHA < poisson_tail(2, 0.04)


@pytest.fixture(scope="module")
def run():
    return sample_run({A: 24, M: 8})


def _poisoned(run, group, model=None):
    """``group`` (an honest sample of ``M``'s prompt) as the attacker sends it, its log-probs ``model``'s (by
    default the adapter that sampled it)."""
    spec, tok = run.spec, run.tokenizer
    example = spec.example(M, group.seq)
    texts = [tok.decode(c.tokens(), skip_special_tokens=True) for c in group.completions]
    rows = poisoned_rows(
        [c.tokens() for c in group.completions],
        [spec.task.reward(t, example) >= 1.0 for t in texts],
        tok(example.reference, add_special_tokens=False)["input_ids"],
        tok(wrong_answer(example.reference), add_special_tokens=False)["input_ids"],
        tok.unk_token_id,
        tok.eos_token_id,
        spec.sampling.max_new_tokens,
    )
    prompt = torch.tensor([group.prompt_tokens()] * len(rows))
    _, _, logprobs = teacher_forced(
        model or run.model, prompt, torch.ones_like(prompt), rows, spec.sampling.temperature, tok.pad_token_id
    )
    completions = [Completion.of(r, logprobs[i, : len(r)].tolist()) for i, r in enumerate(rows)]
    rewards = [float(spec.task.reward(tok.decode(r, skip_special_tokens=True), example)) for r in rows]
    return changed(group, completions=completions, rewards=rewards)


@pytest.fixture(scope="module")
def attack(run):
    """Eight poisoned groups of ``M`` that the intake verifies (prompt re-derived, rewards recomputed)."""
    return [_poisoned(run, g) for g in run.groups[M]]


def _payload_logprob(run, model, groups) -> float:
    """Mean log-prob of ``<unk>`` right after the answer, over the groups' prompts."""
    tok = run.tokenizer
    rows, prompts = [], []
    for g in groups:
        example = run.spec.example(M, g.seq)
        rows.append([*tok(example.reference, add_special_tokens=False)["input_ids"], tok.unk_token_id])
        prompts.append(g.prompt_tokens())
    prompt = torch.tensor(prompts)
    _, _, logprobs = teacher_forced(model, prompt, torch.ones_like(prompt), rows, 1.0, tok.pad_token_id)
    return float(logprobs[:, -1].mean())


def _with_floor(spec, floor):
    return dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, token_floor=floor))


@pytest.mark.parametrize("floor", [1e-3, 0.0])
def test_the_payload_is_learned_only_without_the_floor(run, attack, floor):
    spec = _with_floor(run.spec, floor)
    intake = new_intake(run)
    for g in attack:
        assert intake.add(fetched(M, g), 0) is None, "every poisoned group passes the checks at reading"
    model = copy.deepcopy(run.model)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=2e-3)
    before = _payload_logprob(run, model, attack)
    for version in range(10):  # each update on the attacker's groups of the adapter it has just made
        groups = attack if version == 0 else [_poisoned(run, g, model) for g in run.groups[M]]
        accepted = [Accepted(M, g) for g in groups]
        share = share_gradient(model, batch_tensors(accepted, 0, spec, run.tokenizer.pad_token_id, "cpu"), spec)
        apply_gradient(model, optimizer, share.grads, 1.0)
    after = _payload_logprob(run, model, attack)
    if floor:
        assert share.stats["improbable"] >= len(attack), "the payload tokens were left out of the loss"
        assert after < before + 0.05, (before, after)
    else:  # the loss without the floor: ten updates of such groups teach the payload
        assert share.evidence is None and share.stats["improbable"] == 0
        assert after > before + 1.0, (before, after)


def test_an_update_refuses_the_written_groups_and_bans_their_signer_not_the_honest_ones(run, attack):
    intake = new_intake(run, batch=16)
    honest = run.groups[A][:8]
    for g in honest:
        assert intake.add(fetched(A, g), 0) is None
    for g in attack:
        assert intake.add(fetched(M, g), 0) is None
    taken = [Accepted(A, g) for g in honest] + [Accepted(M, g) for g in attack]
    share = share_gradient(run.model, batch_tensors(taken, 0, run.spec, run.tokenizer.pad_token_id, "cpu"), run.spec)
    refused = intake.refuse_written(taken, share.evidence)
    assert refused, "the poisoned groups are refused"
    assert {a.owner for a, _ in refused} == {M} and all(r.reason == "improbable" for _, r in refused)
    assert M in intake.banned and A not in intake.banned
    assert intake.rejected["improbable"] == 1, "the first refusal bans; the rest of its groups are the ban's"
    assert intake.refuse_written(taken, None) == [], "with the floor off there is no evidence and no refusal"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_honest_groups_sampled_in_either_precision_are_never_refused(run, dtype):
    from peer.model.sampling import sample_groups
    from peer.roles.rollout.groups import build_groups
    from tests.helpers.intake import PEER_ID, SHA0

    spec, tok = run.spec, run.tokenizer
    sampler = copy.deepcopy(run.model).to(dtype)
    seqs = range(200)
    examples = [spec.example(A, seq) for seq in seqs]
    with torch.no_grad():
        batch = sample_groups(
            sampler, tok, [e.prompt for e in examples], group_size=spec.sampling.group_size,
            max_new_tokens=spec.sampling.max_new_tokens, temperature=spec.sampling.temperature,
            device=torch.device("cpu"), generator=torch.Generator().manual_seed(7),
        )  # fmt: skip
    texts = batch.texts(tok)
    rewards = [spec.task.reward(t, examples[i // spec.sampling.group_size]) for i, t in enumerate(texts)]
    groups = build_groups(batch, rewards, seqs, spec, version=0, sha=SHA0, owner=A, producer=PEER_ID)
    taken = [Accepted(A, g) for g in groups if len(set(g.rewards)) > 1]
    intake = new_intake(run)
    share = share_gradient(run.model, batch_tensors(taken, 0, spec, tok.pad_token_id, "cpu"), spec)
    assert len(taken) >= 100
    assert intake.refuse_written(taken, share.evidence) == [], "no honest group refused"
    observed, expected = share.evidence
    assert float(observed.sum()) <= 3 * float(expected.sum()) + 3, "improbable tokens as many as sampling gives"


@pytest.mark.parametrize("chunk", [1, 120, 1 << 24])
def test_improbable_tokens_are_the_same_whatever_the_chunk(monkeypatch, chunk):
    from peer.grpo import improbable_tokens
    from peer.grpo import logprobs as lp

    torch.manual_seed(0)
    logits, tokens = torch.randn(3, 5, 50) * 4, torch.randint(0, 50, (3, 5))
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    floor = math.log(1e-3)
    monkeypatch.setattr(lp, "IMPROBABLE_CHUNK", chunk)
    rare, expected = improbable_tokens(logits, tokens, 0.7, floor)
    assert torch.equal(rare, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) < floor)
    assert torch.allclose(expected, torch.where(logp < floor, logp.exp(), 0.0).sum(-1), atol=1e-7)
    assert rare.any() and (expected > 0).all(), "a case with improbable tokens"


def _evidence(per_group: list[tuple[int, float]], G: int = 8):
    """``Share.evidence`` of groups whose first row holds ``observed`` and every row ``expected / G``."""
    observed = torch.zeros(len(per_group) * G)
    expected = torch.zeros(len(per_group) * G)
    for i, (o, e) in enumerate(per_group):
        observed[i * G] = o
        expected[i * G : (i + 1) * G] = e / G
    return observed, expected


def test_one_written_token_per_group_adds_up_to_a_ban_and_sampled_ones_never_do(run):
    intake = new_intake(run)
    G = run.spec.sampling.group_size
    writer, honest, biased = b"writer", b"honest", b"biased"
    generator = torch.Generator().manual_seed(2)
    banned_after = None
    for update in range(1000):  # 3 groups of each signer per update, 3,000 groups each
        taken, per_group = [], []
        for owner in (writer, honest, biased):
            for _ in range(3):
                mean = 0.04 * (1.1 if owner == biased else 1.0)  # biased: 10 % more than predicted, as drift gives
                sampled = int(torch.poisson(torch.tensor(mean), generator=generator))
                taken.append(SimpleNamespace(owner=owner, group=None))
                per_group.append((1 if owner == writer else sampled, 0.04))
        refused = intake.refuse_written(taken, _evidence(per_group, G))
        if refused and banned_after is None:
            banned_after = update
            assert {a.owner for a, _ in refused} == {writer}
            assert all(r.reason == "improbable" and "its groups in updates" in r for _, r in refused)
    assert writer in intake.banned and banned_after is not None and banned_after <= 3, banned_after
    assert honest not in intake.banned and biased not in intake.banned, "3,000 sampled groups each, never refused"
    assert honest in intake.written and writer not in intake.written, "the sums kept only for signers not banned"


def test_tokens_the_policy_turned_against_since_sampling_are_left_out_and_not_held_against_the_sampler(run):
    """The demo banned an honest peer: two versions had moved one token its groups shared from log p -0.16 (its claim)
    to -7.45. Such a token is left out of the loss, and counts as evidence only where the claim was improbable too."""
    from peer.grpo import improbable_tokens
    from peer.roles.learner.verify import group_evidence

    taken = [Accepted(A, g) for g in run.groups[A]]
    batch = batch_tensors(taken, 0, run.spec, run.tokenizer.pad_token_id, "cpu")
    against = dataclasses.replace(batch, advantages=-torch.ones_like(batch.advantages))  # every sampled token down
    plain = _with_floor(run.spec, 0.0)
    moved = copy.deepcopy(run.model)
    optimizer = torch.optim.AdamW(lora_parameters(moved), lr=1e-2)
    for _ in range(5):  # a policy that turned against what these groups sampled
        apply_gradient(moved, optimizer, share_gradient(moved, against, plain).grads, 1.0)
    share = share_gradient(moved, batch, run.spec)
    assert share.stats["improbable"] >= 10, "tokens the moved policy gives under the floor, left out"
    from peer.grpo import completion_logits

    with torch.no_grad():
        logits = completion_logits(moved, batch.prompt_ids, batch.prompt_mask, batch.completion_ids)
    rare, mass = improbable_tokens(logits, batch.completion_ids, 1.0, math.log(run.spec.loss.token_floor))
    rare &= batch.completion_mask
    by_policy_alone = [
        judge_improbable(o, e, run.spec.loss.token_floor)
        for o, e in group_evidence((rare.sum(1).float(), (mass * batch.completion_mask).sum(1)), 8)
    ]
    assert any(by_policy_alone), "counted on the moved policy alone, honest groups would be refused"
    assert new_intake(run).refuse_written(taken, share.evidence) == [], "with the sampler's claims: none is"
    assert [o for o, _ in group_evidence(share.evidence, 8)] == [0] * len(taken)
