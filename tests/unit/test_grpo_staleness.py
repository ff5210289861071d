"""Staleness: accept/drop window, weightings, vectorized weights."""

import pytest
import torch

from peer.grpo import (
    WEIGHTING_NAMES,
    WEIGHTINGS,
    StalenessConfig,
    accept,
    staleness,
    staleness_weight,
    staleness_weights,
)


def test_staleness_is_version_difference():
    assert staleness(7, 4) == 3
    assert staleness(4, 4) == 0
    assert staleness(3, 5) == -2
    with pytest.raises(ValueError, match="group_version must be a non-negative int"):
        staleness(3, -1)
    with pytest.raises(ValueError, match="learner_version must be a non-negative int"):
        staleness(2.0, 1)


def test_accept_boundaries():
    config = StalenessConfig(tau_max=4)
    assert [accept(tau, config) for tau in range(-2, 7)] == [False, False, True, True, True, True, True, False, False]
    assert accept(0, StalenessConfig(tau_max=0)) and not accept(1, StalenessConfig(tau_max=0))


def test_every_weighting_name_has_a_function_and_every_function_a_name():
    """The names a manifest may carry (peer.grpo.config) and the functions that compute them (peer.grpo.staleness)
    are kept in two modules so that configs load without torch; they must agree one to one."""
    assert sorted(WEIGHTINGS) == sorted(WEIGHTING_NAMES)
    assert len(WEIGHTING_NAMES) == len(set(WEIGHTING_NAMES))
    assert all(callable(fn) for fn in WEIGHTINGS.values())


@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
@pytest.mark.parametrize("tau_max", [0, 1, 4, 9])
def test_weight_is_one_at_zero_non_increasing_and_positive(name, tau_max):
    config = StalenessConfig(tau_max=tau_max, weighting=name, knee=min(1, tau_max))
    weights = [staleness_weight(tau, config) for tau in range(tau_max + 1)]
    assert weights[0] == 1.0
    assert all(later <= earlier for earlier, later in zip(weights, weights[1:], strict=False))
    assert all(0 < w <= 1 for w in weights)


def test_weighting_values():
    poly = StalenessConfig(weighting="polynomial", power=0.5)
    assert staleness_weight(3, poly) == pytest.approx(0.5)
    expo = StalenessConfig(weighting="exponential", decay=0.5)
    assert staleness_weight(3, expo) == pytest.approx(0.125)
    hinge = StalenessConfig(weighting="hinge", tau_max=4, knee=1)
    assert [staleness_weight(tau, hinge) for tau in range(5)] == pytest.approx([1, 1, 0.75, 0.5, 0.25])
    constant = StalenessConfig(weighting="constant")
    assert [staleness_weight(tau, constant) for tau in range(5)] == [1.0] * 5


def test_strictly_decreasing_where_the_knob_says_so():
    poly = StalenessConfig(weighting="polynomial", power=1.0, tau_max=3)
    assert staleness_weight(1, poly) < staleness_weight(0, poly)
    flat = StalenessConfig(weighting="polynomial", power=0.0, tau_max=3)
    assert staleness_weight(3, flat) == 1.0


def test_weight_refuses_dropped_tau():
    config = StalenessConfig(tau_max=2)
    with pytest.raises(ValueError, match=r"tau=3 is outside the accepted window \[0, tau_max=2\]"):
        staleness_weight(3, config)
    with pytest.raises(ValueError, match="tau=-1 is outside"):
        staleness_weight(-1, config)


def test_vectorized_weights_match_scalar():
    config = StalenessConfig(weighting="hinge", tau_max=4, knee=1)
    taus = torch.tensor([[0, 2], [4, 3]])
    weights = staleness_weights(taus, config)
    assert weights.shape == (2, 2) and weights.dtype == torch.float32
    expected = [[staleness_weight(t, config) for t in row] for row in taus.tolist()]
    torch.testing.assert_close(weights, torch.tensor(expected))
    torch.testing.assert_close(staleness_weights([0, 3], config), torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="tau=5 is outside"):
        staleness_weights([0, 5], config)
    with pytest.raises(ValueError, match="integer tensor"):
        staleness_weights(torch.tensor([0.0]), config)
