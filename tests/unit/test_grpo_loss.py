"""The clipped policy loss: values, masking, weights, clipping gradients, KL, shape checks."""

import math

import pytest
import torch

from peer.grpo import LossConfig, clipped_policy_loss

torch.set_num_threads(1)

CONFIG = LossConfig(clip_eps_low=0.2, clip_eps_high=0.3)


def _leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_on_policy_loss_is_minus_token_weighted_mean_advantage():
    logprobs = _leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    advantages = torch.tensor([1.5, -0.5])
    loss, stats = clipped_policy_loss(logprobs, logprobs.detach().clone(), advantages, mask, None, CONFIG)
    expected = -(3 * 1.5 + 1 * -0.5) / 4
    assert loss.item() == pytest.approx(expected)
    assert stats.loss == pytest.approx(expected) and stats.policy_loss == pytest.approx(expected)
    assert stats.tokens == 4 and stats.clip_fraction == 0.0
    assert stats.ratio_mean == pytest.approx(1.0) and stats.ratio_max == pytest.approx(1.0)
    assert stats.kl == 0.0
    loss.backward()
    # d/dlogp of -ratio*A/4 at ratio 1 is -A/4 on counted tokens and 0 elsewhere.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.375, -0.375, -0.375], [0.125, 0.0, 0.0]]))


def test_masked_positions_do_not_count_even_when_garbage():
    logprobs = _leaf([[-1.0, float("nan")], [-2.0, -1.0]])
    behaviour = torch.tensor([[-1.0, float("inf")], [-2.0, float("nan")]])
    mask = torch.tensor([[True, False], [True, False]])
    loss, stats = clipped_policy_loss(logprobs, behaviour, torch.tensor([1.0, 3.0]), mask, None, CONFIG)
    assert loss.item() == pytest.approx(-2.0)
    assert math.isfinite(stats.ratio_max) and stats.tokens == 2
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[:, 1].abs().sum() == 0


def test_weights_scale_each_sequence():
    logprobs = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    advantages = torch.tensor([1.0, 1.0])
    loss, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask, torch.tensor([1.0, 0.25]), CONFIG)
    assert loss.item() == pytest.approx(-(2 * 1.0 + 2 * 0.25) / 4)
    unweighted, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask, None, CONFIG)
    assert unweighted.item() == pytest.approx(-1.0)


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped"),
    [
        (1.5, 1.0, True),  # A > 0, ratio above 1 + high: no further push up
        (0.5, 1.0, False),  # A > 0, ratio below 1 - low: still pushed up
        (1.1, 1.0, False),  # inside the band
        (0.5, -1.0, True),  # A < 0, ratio below 1 - low: no further push down
        (1.5, -1.0, False),  # A < 0, ratio above 1 + high: still pushed down
        (0.9, -1.0, False),  # inside the band
    ],
)
def test_clipping_zeroes_exactly_the_right_gradients(ratio, advantage, clipped):
    behaviour = torch.tensor([[-1.0]])
    logprobs = (behaviour + math.log(ratio)).clone().requires_grad_()
    loss, stats = clipped_policy_loss(
        logprobs, behaviour, torch.tensor([advantage]), torch.tensor([[True]]), None, CONFIG
    )
    loss.backward()
    grad = logprobs.grad.item()
    if clipped:
        assert grad == 0.0
        assert stats.clip_fraction == 1.0
        bound = 1 + CONFIG.clip_eps_high if advantage > 0 else 1 - CONFIG.clip_eps_low
        assert loss.item() == pytest.approx(-bound * advantage)
    else:
        assert grad == pytest.approx(-ratio * advantage, rel=1e-5)
        assert stats.clip_fraction == 0.0
        assert loss.item() == pytest.approx(-ratio * advantage, rel=1e-5)


def test_clip_fraction_counts_only_masked_clipped_tokens():
    behaviour = torch.zeros(2, 4)
    ratios = torch.tensor([[1.5, 0.5, 1.0, 2.0], [0.5, 1.5, 0.1, 1.0]])
    logprobs = ratios.log().requires_grad_()
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = clipped_policy_loss(logprobs, behaviour, advantages, mask, None, CONFIG)
    # Clipped and counted: [0, 0] (A>0, 1.5), [1, 0] and [1, 2] (A<0, below 0.8). [0, 3] is clipped but masked.
    assert stats.clip_fraction == pytest.approx(3 / 7)
    assert stats.ratio_max == pytest.approx(1.5) and stats.ratio_min == pytest.approx(0.1)
    assert stats.ratio_mean == pytest.approx(ratios[mask].mean().item())
    loss.backward()
    zero = logprobs.grad == 0
    assert zero.tolist() == [[True, False, False, True], [True, False, True, False]]


def test_zero_advantage_tokens_count_in_the_denominator_but_push_nothing():
    logprobs = torch.zeros(2, 2, requires_grad=True)
    loss, stats = clipped_policy_loss(
        logprobs, torch.zeros(2, 2), torch.tensor([2.0, 0.0]), torch.ones(2, 2, dtype=torch.bool), None, CONFIG
    )
    assert loss.item() == pytest.approx(-1.0) and stats.tokens == 4
    loss.backward()
    assert logprobs.grad[1].abs().sum() == 0


def test_no_gradient_flows_into_behaviour_or_reference():
    logprobs = torch.full((1, 3), -1.0, requires_grad=True)
    behaviour = torch.full((1, 3), -1.2, requires_grad=True)
    ref = torch.full((1, 3), -0.8, requires_grad=True)
    loss, _ = clipped_policy_loss(
        logprobs,
        behaviour,
        torch.tensor([1.0]),
        torch.ones(1, 3, dtype=torch.bool),
        None,
        LossConfig(kl_beta=0.1),
        ref_logprobs=ref,
    )
    loss.backward()
    assert behaviour.grad is None and ref.grad is None
    assert logprobs.grad.abs().sum() > 0


def test_kl_is_zero_at_the_reference_and_positive_away_from_it():
    config = LossConfig(kl_beta=0.5)
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    loss, stats = clipped_policy_loss(logprobs, logprobs.detach(), adv, mask, None, config, logprobs.detach())
    assert stats.kl == 0.0 and loss.item() == pytest.approx(stats.policy_loss)
    ref = torch.tensor([[-1.5, -1.0]])
    loss, stats = clipped_policy_loss(logprobs, logprobs.detach(), adv, mask, None, config, ref)
    diff = ref - logprobs.detach()
    expected_kl = (diff.exp() - diff - 1).mean().item()
    assert stats.kl == pytest.approx(expected_kl) and stats.kl > 0
    assert loss.item() == pytest.approx(stats.policy_loss + 0.5 * expected_kl)


def test_kl_is_measured_but_not_added_when_beta_is_zero():
    logprobs = torch.tensor([[-1.0]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = clipped_policy_loss(
        logprobs, logprobs, torch.tensor([1.0]), mask, None, LossConfig(), torch.tensor([[-3.0]])
    )
    assert stats.kl > 0 and loss.item() == pytest.approx(stats.policy_loss)


def test_kl_beta_requires_reference():
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        clipped_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool), None,
            LossConfig(kl_beta=0.1),
        )  # fmt: skip


def test_empty_mask_gives_zero_loss_and_neutral_stats():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = clipped_policy_loss(
        logprobs, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool), None, CONFIG
    )
    assert loss.item() == 0.0 and stats.tokens == 0 and stats.clip_fraction == 0.0 and stats.ratio_mean == 1.0
    loss.backward()
    assert logprobs.grad.abs().sum() == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logprobs": torch.zeros(2, 3, 1)}, r"logprobs must have shape \[B, C\]"),
        ({"behaviour_logprobs": torch.zeros(2, 4)}, r"behaviour_logprobs must have shape \[2, 3\], got \[2, 4\]"),
        ({"advantages": torch.zeros(2, 1)}, r"advantages must have shape \[2\]"),
        ({"mask": torch.ones(3, 3, dtype=torch.bool)}, r"mask must have shape \[2, 3\]"),
        ({"mask": torch.ones(2, 3)}, "mask must be a bool tensor"),
        ({"weights": torch.ones(3)}, r"weights must have shape \[2\]"),
        ({"ref_logprobs": torch.zeros(2)}, r"ref_logprobs must have shape \[2, 3\]"),
    ],
)
def test_shape_errors(change, message):
    args = {
        "logprobs": torch.zeros(2, 3),
        "behaviour_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "weights": None,
        "config": CONFIG,
        "ref_logprobs": None,
    } | change
    with pytest.raises(ValueError, match=message):
        clipped_policy_loss(**args)


@pytest.mark.parametrize(
    ("ratio", "advantage", "dual_clip", "surrogate", "moves"),
    [
        (10.0, -1.0, 3.0, -3.0, False),  # A < 0, ratio far above 1: the surrogate is held at 3 A, no gradient
        (2.0, -1.0, 3.0, -2.0, True),  # below the dual clip: the ordinary r A, pushed down
        (10.0, 1.0, 3.0, 1.3, False),  # A > 0 is the ordinary upper clip, untouched by the dual one
        (10.0, -1.0, 0.0, -10.0, True),  # dual clip off: unbounded in r
    ],
)
def test_dual_clip_bounds_negative_advantages_of_runaway_ratios(ratio, advantage, dual_clip, surrogate, moves):
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.3, dual_clip=dual_clip)
    behaviour = torch.tensor([[-2.0]])
    logprobs = _leaf([[-2.0 + math.log(ratio)]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logprobs, behaviour, torch.tensor([advantage]), mask, None, config)
    assert loss.item() == pytest.approx(-surrogate, rel=1e-5)
    assert stats.clip_fraction == (0.0 if moves else 1.0)
    loss.backward()
    assert (logprobs.grad.abs().item() > 0) == moves


def test_dual_clip_must_sit_above_the_upper_clip():
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(clip_eps_high=0.3, dual_clip=1.2)
