"""The log-prob spot check's statistics on tensors and numbers alone: per-token entropy and variance, the sampling
test's z, each threshold of :class:`~peer.roles.learner.verify.LogprobCheck` and its refusal sentence. No model."""

import math

import pytest
import torch

from peer.grpo import completion_logprobs
from peer.grpo.logprobs import completion_token_stats, token_logprobs, token_stats
from peer.roles.learner.verify import GroupLogprobStats, LogprobCheck, TokenRows, judge_logprobs

torch.set_num_threads(1)


def test_token_stats_are_the_distributions_entropy_and_logprob_variance():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=generator) * 3
    logits[0, 0, 3] = float("-inf")  # a token the model rules out: 0 log 0 counts as 0
    tokens = torch.randint(0, 16, (3, 5), generator=generator)
    tokens[0, 0] = 4
    for temperature in (1.0, 0.7):
        t = token_stats(logits, tokens, temperature)
        logp = torch.log_softmax(logits.double() / temperature, -1)
        p = logp.exp()
        plogp = torch.nan_to_num(p * logp)
        entropy = -plogp.sum(-1)
        variance = torch.nan_to_num(p * logp * logp).sum(-1) - entropy**2
        assert torch.equal(t.logprobs, token_logprobs(logits, tokens, temperature)), "the loss's numbers, exactly"
        assert torch.allclose(t.entropy.double(), entropy, atol=1e-5)
        assert torch.allclose(t.variance.double(), variance, atol=1e-4)
        assert t.logprobs.dtype == t.entropy.dtype == t.variance.dtype == torch.float32
        assert torch.isfinite(t.entropy).all() and (t.variance >= 0).all()


def test_a_certain_token_has_no_entropy_and_no_variance():
    logits = torch.tensor([[0.0, -1e4, -1e4]])
    t = token_stats(logits, torch.tensor([0]), 1.0)
    assert t.logprobs.item() == 0.0 and t.entropy.item() == pytest.approx(0.0, abs=1e-6)
    assert t.variance.item() == pytest.approx(0.0, abs=1e-6)


def test_completion_token_stats_share_completion_logprobs_forward_pass():
    class Fixed(torch.nn.Module):  # logits depend on the token and its position, so a shifted slice shows
        def forward(self, input_ids, attention_mask, position_ids, **_):
            table = torch.arange(16.0).sin()[None, None, :]
            return type("Out", (), {"logits": table * (input_ids[..., None] + position_ids[..., None] + 1)})()

    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    stats = completion_token_stats(Fixed(), prompt, mask, completion, 0.8)
    assert torch.equal(stats.logprobs, completion_logprobs(Fixed(), prompt, mask, completion, 0.8))
    assert stats.entropy.shape == stats.variance.shape == (2, 4)


def sampled_groups(logits: torch.Tensor, tokens: torch.Tensor) -> list[GroupLogprobStats]:
    """One group per leading row: its tokens, recomputed and claimed alike (an honest fp32 peer)."""
    t = token_stats(logits, tokens, 1.0)
    out = []
    for lp, h, v in zip(t.logprobs.tolist(), t.entropy.tolist(), t.variance.tolist(), strict=True):
        out.append(GroupLogprobStats.of([TokenRows(lp, h, v)], [lp], LogprobCheck().drift))
    return out


def test_the_sampling_z_is_standard_normal_for_sampled_text_and_far_out_for_chosen_text():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2000, 40, 16, generator=generator) * 2
    probs = torch.softmax(logits, -1)
    sampled = torch.multinomial(probs.view(-1, 16), 1, generator=generator).view(2000, 40)
    z = torch.tensor([s.z for s in sampled_groups(logits, sampled)])
    # the floor under the square root shrinks z a little: sd = sqrt(Σ Var / (Σ Var + 1)), close to 1 here
    assert abs(z.mean().item()) < 0.1 and 0.85 < z.std().item() < 1.1
    assert z.min().item() > LogprobCheck().z_low and z.max().item() < LogprobCheck().z_high
    other = torch.multinomial(torch.softmax(-logits, -1).view(-1, 16), 1, generator=generator).view(2000, 40)
    assert max(s.z for s in sampled_groups(logits, other)) < LogprobCheck().z_low, "another policy's text"
    # the likeliest token every time: z grows as sqrt(tokens), ~4.5 over 40 of these tokens, ~8 over 120
    longer = torch.randn(200, 120, 16, generator=generator) * 2
    most_likely = [s.z for s in sampled_groups(longer, longer.argmax(-1))]
    assert min(most_likely) > LogprobCheck().z_high, "chosen, not sampled"


def group(deltas: list[float], logprob: float = -1.0) -> GroupLogprobStats:
    """A group of one completion whose recomputed log-probs are all ``logprob`` (entropy 1, variance 1: z = 0 when
    ``logprob`` is -1), claimed as ``logprob - delta``."""
    n = len(deltas)
    rows = [TokenRows([logprob] * n, [1.0] * n, [1.0] * n)]
    return GroupLogprobStats.of(rows, [[logprob - d for d in deltas]], LogprobCheck().drift)


def test_honest_rounding_passes_each_test():
    check = LogprobCheck()
    # most tokens agree, a few are off both ways, one by 3 nats (bf16 against fp32 on the bundled model)
    noisy = [0.0] * 30 + [0.03, -0.04, 0.2, -0.5, 0.9, -0.1, 0.05, -0.02, 3.0, -0.3]
    stats = group(noisy)
    assert stats.tokens == 40 and stats.max_abs == 3.0 and stats.median_abs == 0.0
    assert judge_logprobs(stats, check) is None
    assert judge_logprobs(group([]), check) is None, "nothing to check"


@pytest.mark.parametrize(
    ("deltas", "words"),
    [
        ([0.0] * 39 + [-9.0], "a behaviour log-prob differs from the recomputed one by 9 nats"),
        ([1.5, -1.5] * 20, "by 1.5 nats on average over 40 tokens (honest peers stay under 1)"),
        ([0.2, -0.2] * 20, "by a median 0.2 nats over 40 tokens (honest peers stay under 0.05)"),
        ([-0.04] * 40, "100% more of 40 behaviour log-probs are higher than recomputed"),
        ([0.04] * 30 + [0.0] * 10, "75% more of 40 behaviour log-probs are lower than recomputed"),
    ],
)
def test_each_threshold_refuses_with_its_own_sentence(deltas, words):
    refused = judge_logprobs(group(deltas), LogprobCheck())
    assert refused is not None and refused.reason == "logprobs" and words in str(refused), str(refused)
    assert "honest" in str(refused) and str(refused).count(". ") == 0, "one sentence that says what honest is"


def test_the_sampling_test_refuses_both_tails():
    unlikely = group([0.0] * 40, logprob=-4.0)  # z = 40 * (1 - 4) / sqrt(41)
    assert unlikely.z == pytest.approx(-120 / math.sqrt(41))
    refused = judge_logprobs(unlikely, LogprobCheck())
    assert "far less likely than sampled text" in refused and "not sampled from this adapter version" in refused
    likely = group([0.0] * 40, logprob=0.0)
    assert "far more likely than sampled text" in judge_logprobs(likely, LogprobCheck())


def test_the_check_refuses_impossible_thresholds_in_one_sentence():
    with pytest.raises(ValueError, match="median_abs must be a positive number of nats"):
        LogprobCheck(median_abs=0)
    with pytest.raises(ValueError, match="median_abs <= mean_abs <= max_abs"):
        LogprobCheck(mean_abs=10.0)
    with pytest.raises(ValueError, match="one_sided must be in"):
        LogprobCheck(one_sided=1.5)
    with pytest.raises(ValueError, match="z_low < 0 < z_high"):
        LogprobCheck(z_low=1.0)
    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        LogprobCheck.with_tolerance(-0.1)


def test_the_tolerance_scales_every_nat_threshold():
    assert LogprobCheck.with_tolerance(0.05) == LogprobCheck()
    doubled, default = LogprobCheck.with_tolerance(0.1), LogprobCheck()
    assert doubled.median_abs == 0.1 and doubled.mean_abs == pytest.approx(2 * default.mean_abs)
    assert doubled.max_abs == pytest.approx(2 * default.max_abs) and doubled.drift == pytest.approx(2 * default.drift)
    assert (doubled.one_sided, doubled.z_low, doubled.z_high) == (default.one_sided, default.z_low, default.z_high)
