"""GRPO configs: validation messages, dict round-trips, unknown keys."""

import json

import pytest

from peer.grpo import WEIGHTING_NAMES, LossConfig, SamplingConfig, StalenessConfig

ALL = [SamplingConfig, LossConfig, StalenessConfig]


@pytest.mark.parametrize("cls", ALL)
def test_defaults_round_trip_through_json(cls):
    config = cls()
    data = json.loads(json.dumps(config.to_dict()))
    assert cls.from_dict(data) == config
    assert set(data) == set(cls.field_help())


def test_round_trip_keeps_non_default_values():
    config = StalenessConfig(tau_max=8, weighting="hinge", knee=3)
    assert StalenessConfig.from_dict(config.to_dict()) == config
    assert StalenessConfig.from_dict(config.to_dict()).knee == 3


def test_from_dict_missing_keys_take_defaults():
    assert LossConfig.from_dict({"kl_beta": 0.1}) == LossConfig(kl_beta=0.1)


@pytest.mark.parametrize("cls", ALL)
def test_from_dict_rejects_unknown_keys(cls):
    data = cls().to_dict() | {"clip_range": 0.3}
    with pytest.raises(ValueError, match=r"no field\(s\) \['clip_range'\]"):
        cls.from_dict(data)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ValueError, match="expects a mapping"):
        SamplingConfig.from_dict([("group_size", 4)])


@pytest.mark.parametrize("cls", ALL)
def test_every_field_has_help(cls):
    assert all(text.strip() for text in cls.field_help().values())


def test_frozen():
    config = SamplingConfig()
    with pytest.raises(AttributeError):
        config.group_size = 3


def test_ints_given_for_floats_are_stored_as_floats():
    config = LossConfig(kl_beta=1)
    assert isinstance(config.kl_beta, float) and config.kl_beta == 1.0


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (SamplingConfig, {"group_size": 1}, r"SamplingConfig.group_size must be in \[2, 256\], got 1"),
        (SamplingConfig, {"group_size": 257}, r"group_size must be in \[2, 256\]"),
        (SamplingConfig, {"group_size": 8.0}, r"group_size must be an int"),
        (SamplingConfig, {"group_size": True}, r"group_size must be an int"),
        (SamplingConfig, {"temperature": 0.0}, r"temperature must be > 0"),
        (SamplingConfig, {"temperature": "hot"}, r"temperature must be a finite number"),
        (SamplingConfig, {"temperature": float("nan")}, r"temperature must be a finite number"),
        (SamplingConfig, {"max_new_tokens": 0}, r"max_new_tokens must be in \[1, 4096\]"),
        (SamplingConfig, {"max_new_tokens": 4097}, r"max_new_tokens must be in \[1, 4096\]"),
        (LossConfig, {"clip_eps_low": 1.0}, r"clip_eps_low must be in \[0, 1\)"),
        (LossConfig, {"clip_eps_low": -0.1}, r"clip_eps_low must be in \[0, 1\)"),
        (LossConfig, {"clip_eps_high": -0.1}, r"clip_eps_high must be >= 0"),
        (LossConfig, {"kl_beta": -1e-3}, r"kl_beta must be >= 0"),
        (LossConfig, {"adv_eps": 0.0}, r"adv_eps must be > 0"),
        (StalenessConfig, {"tau_max": -1}, r"tau_max must be in \[0, 1024\]"),
        (StalenessConfig, {"weighting": "linear"}, r"weighting must be one of \['constant', 'exponential', 'hinge'"),
        (StalenessConfig, {"weighting": ["hinge"]}, r"weighting must be one of"),
        (StalenessConfig, {"power": -0.5}, r"power must be >= 0"),
        (StalenessConfig, {"decay": 0.0}, r"decay must be in \(0, 1\]"),
        (StalenessConfig, {"decay": 1.5}, r"decay must be in \(0, 1\]"),
        (StalenessConfig, {"knee": -1}, r"knee must be in >= 0"),
        (StalenessConfig, {"weighting": "hinge", "tau_max": 2, "knee": 3}, r"knee=3 must be <= tau_max=2.*raise"),
    ],
)
def test_validation_names_the_field_and_range(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_knee_above_tau_max_is_fine_when_not_hinge():
    assert StalenessConfig(tau_max=0, weighting="polynomial").knee == 1


def test_boundaries_accepted():
    SamplingConfig(group_size=2, max_new_tokens=1)
    SamplingConfig(group_size=256, max_new_tokens=4096)
    LossConfig(clip_eps_low=0.0, clip_eps_high=0.0)
    StalenessConfig(tau_max=0, weighting="hinge", knee=0)
    StalenessConfig(decay=1.0, power=0.0)
    assert set(WEIGHTING_NAMES) == {"constant", "polynomial", "exponential", "hinge"}


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_every_weighting_name_is_a_valid_config(name):
    assert StalenessConfig(weighting=name).weighting == name
    assert name in StalenessConfig.field_help()["weighting"]
