"""Group-normalized advantages."""

import pytest
import torch

from peer.grpo import group_advantages, has_signal

torch.set_num_threads(1)


def test_values_match_population_std_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, eps=1e-6)
    mean, std = 0.6, (0.24) ** 0.5  # population variance of {1,0,0,1,1} is 0.6 * 0.4
    expected = (rewards - mean) / (std + 1e-6)
    torch.testing.assert_close(adv, expected)
    # Population std: unit mean square whatever G is.
    assert adv.mean().abs() < 1e-6
    assert abs(adv.pow(2).mean().item() - 1.0) < 1e-4


def test_binary_pair_gives_plus_minus_one():
    adv = group_advantages(torch.tensor([1.0, 0.0]), eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)


def test_all_equal_groups_are_exact_zeros():
    # 0.1 is not exact in binary; the mean of three 0.1s need not be 0.1 bit for bit.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [3.0, 3.0, 3.0], [0.0, 1.0, 0.0]])
    adv = group_advantages(rewards, eps=1e-6)
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert (adv[2] != 0).all()
    assert has_signal(rewards).tolist() == [False, False, True]


def test_batch_dims_are_independent_groups():
    rewards = torch.rand(2, 3, 8)
    adv = group_advantages(rewards, eps=1e-6)
    assert adv.shape == (2, 3, 8)
    torch.testing.assert_close(adv[1, 2], group_advantages(rewards[1, 2], eps=1e-6))
    torch.testing.assert_close(adv.mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
    assert has_signal(rewards).shape == (2, 3)


def test_integer_rewards_become_float32_and_float64_is_kept():
    assert group_advantages(torch.tensor([0, 1, 1, 0]), eps=1e-6).dtype == torch.float32
    assert group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), eps=1e-6).dtype == torch.float64


def test_eps_bounds_a_tiny_spread():
    adv = group_advantages(torch.tensor([0.0, 1e-8]), eps=1e-2)
    assert adv.abs().max() < 1e-5


def test_errors():
    with pytest.raises(ValueError, match="NaN or infinity"):
        group_advantages(torch.tensor([0.0, float("nan")]), eps=1e-6)
    with pytest.raises(ValueError, match=r"shape \[\.\.\., G\]"):
        group_advantages(torch.tensor(1.0), eps=1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.tensor([0.0, 1.0]), eps=0.0)
