"""Advantage estimators, DAPO filters and algorithm defaults against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from dsrl.algos import (
    ALGORITHM_DEFAULTS,
    compute_advantages,
    group_statistics,
    overlong_filter_mask,
    overlong_shaping,
    resolve_algorithm,
    truncated,
    valid_rewards,
    zero_variance_groups,
)
from dsrl.config import AlgorithmConfig, load_config
from dsrl.config.names import ALGORITHM_LOSS_AGG

NAN = float("nan")
# Two groups of G = 4: [1, 0, 0, 1] and [0, 0, 0, 1].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])


def close(a: torch.Tensor, b: list[float], tol: float = 1e-5) -> None:
    assert a.shape == (len(b),), (a, b)
    assert torch.allclose(a.double(), torch.tensor(b, dtype=torch.float64), atol=tol), (a, b)


def test_grpo_hand_computed():
    # Group 1: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.577350 -> +-0.5 / 0.577350 = +-0.866025.
    # Group 2: mean 0.25, sample std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5 -> -0.25/0.5 = -0.5, 0.75/0.5 = 1.5.
    adv = compute_advantages("grpo", REWARDS, 4, eps=0.0)
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025, -0.5, -0.5, -0.5, 1.5])
    # With the default eps = 1e-6 the values move by < 2e-6.
    close(compute_advantages("grpo", REWARDS, 4), [0.866025, -0.866025, -0.866025, 0.866025, -0.5, -0.5, -0.5, 1.5])


def test_grpo_uses_sample_std_like_torch_std():
    r = torch.tensor([0.2, 0.9, 0.4, 0.7, 0.1, 0.3])
    g = r.view(-1, 3)
    want = ((g - g.mean(1, keepdim=True)) / g.std(1, keepdim=True)).view(-1)
    close(compute_advantages("grpo", r, 3, eps=0.0), want.tolist())


def test_grpo_without_std_and_dr_grpo():
    want = [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]
    close(compute_advantages("grpo", REWARDS, 4, normalize_std=False), want)
    close(compute_advantages("dr_grpo", REWARDS, 4), want)
    # An explicit normalize_std overrides the Dr. GRPO default.
    close(compute_advantages("dr_grpo", REWARDS, 4, normalize_std=True, eps=0.0),
          compute_advantages("grpo", REWARDS, 4, eps=0.0).tolist())


def test_dapo_equals_grpo():
    assert torch.equal(compute_advantages("dapo", REWARDS, 4), compute_advantages("grpo", REWARDS, 4))


def test_rloo_hand_computed():
    # Group 1: r_i - mean(others): 1 - 1/3 = 0.666667, 0 - 2/3 = -0.666667.
    # Group 2: 0 - 1/3 = -0.333333, 1 - 0 = 1.0.
    adv = compute_advantages("rloo", REWARDS, 4)
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0])
    # G = 2: r_i - r_j.
    close(compute_advantages("rloo", torch.tensor([0.3, 0.8]), 2), [-0.5, 0.5])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        compute_advantages("rloo", torch.tensor([1.0, 0.0]), 1)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_equal_rewards_give_exact_zero(name):
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive (r - mean) / (std + eps) would give ~1e-11, not 0.
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5])
    adv = compute_advantages(name, r, 3)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert not torch.isnan(adv).any()
    assert (adv[6:] != 0).sum() >= 2


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_group_of_one_gives_zero(name):
    assert torch.equal(compute_advantages(name, torch.tensor([0.3, 0.9]), 1), torch.zeros(2))


def test_nan_rewards_are_zero_and_excluded_from_statistics():
    r = torch.tensor([NAN, 1.0, 0.0, 0.5, NAN, NAN, NAN, NAN, NAN, 0.4, math.inf, 0.2])
    assert valid_rewards(r).tolist() == [False, True, True, True] + [False] * 4 + [False, True, False, True]
    # Group 1 finite [1, 0, 0.5]: mean 0.5, sample std 0.5 -> 1, -1, 0.
    close(compute_advantages("grpo", r, 4, eps=0.0), [0, 1, -1, 0, 0, 0, 0, 0, 0, 1 / math.sqrt(0.02) * 0.1, 0,
                                                       -1 / math.sqrt(0.02) * 0.1])
    # rloo, n = 3 finite: 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0.
    close(compute_advantages("rloo", r, 4)[:4], [0, 0.75, -0.75, 0])
    for name in ("grpo", "dr_grpo", "rloo", "dapo"):
        adv = compute_advantages(name, r, 4)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[~valid_rewards(r)], torch.zeros(int((~valid_rewards(r)).sum())))


def test_group_statistics_and_dtype():
    stats = group_statistics(torch.tensor([1, 0, 0, 1], dtype=torch.int64), 2)
    assert stats["mean"].tolist() == [0.5, 0.5]
    assert stats["count"].tolist() == [2.0, 2.0]
    close(stats["std"], [math.sqrt(0.5), math.sqrt(0.5)])
    assert compute_advantages("grpo", torch.tensor([True, False]), 2).dtype == torch.float32
    assert compute_advantages("grpo", torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float64


def test_bad_inputs():
    with pytest.raises(ValueError, match="samples_per_prompt"):
        compute_advantages("grpo", torch.zeros(5), 2)
    with pytest.raises(ValueError, match="flat"):
        compute_advantages("grpo", torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="dsrl.algorithm.name"):
        compute_advantages("ppo", torch.zeros(4), 2)


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.3, 0.3, NAN, NAN, 0.5, NAN, 0.2, NAN, 0.9, NAN])
    groups = zero_variance_groups(r.view(-1)[:16], 2)
    # [1,1] [1,0] [1,0] [.3,.3] [nan,nan] [.5,nan] [.2,nan] [.9,nan]
    assert groups.tolist() == [True, False, False, True, True, True, True, True]
    assert zero_variance_groups(torch.tensor([0.0, 0.0, 1.0, 0.0]), 4).tolist() == [False]


def test_overlong_shaping_values():
    lengths = torch.tensor([0, 10, 12, 13, 14, 15, 16, 20])
    # max 16, buffer 4: free up to 12, then -(L - 12)/4 * penalty, full penalty at 16 and beyond.
    close(overlong_shaping(lengths, 16, 4, 1.0), [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0])
    close(overlong_shaping(lengths, 16, 4, 0.5), [0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5])
    assert torch.equal(overlong_shaping(lengths, 16, 0, 1.0), torch.zeros(8))
    assert not torch.signbit(overlong_shaping(lengths, 16, 4, 1.0)[:3]).any()
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_shaping(lengths, 16, 17, 1.0)


def test_overlong_filter_rule():
    lengths = torch.tensor([3, 16, 16, 8])
    eos = torch.tensor([True, True, False, False])
    # With eos information: truncated = no eos emitted.
    assert truncated(lengths, 16, eos).tolist() == [False, False, True, True]
    assert overlong_filter_mask(lengths, 16, eos).tolist() == [True, True, False, False]
    # Without: length reached the limit.
    assert truncated(lengths, 16).tolist() == [False, True, True, False]


def test_defaults_agree_with_config():
    for name, d in ALGORITHM_DEFAULTS.items():
        assert d["loss_agg"] == ALGORITHM_LOSS_AGG[name]
        cfg = load_config({"dsrl": {"algorithm": {"name": name}, "batch": {"micro_batch_size_per_rank": 1},
                                    "run": {"rollouts": 1}}})
        assert cfg.dsrl.loss_agg == d["loss_agg"]
    assert ALGORITHM_DEFAULTS["dapo"]["dynamic_sampling"] is True
    assert ALGORITHM_DEFAULTS["dr_grpo"]["normalize_std"] is False


def test_resolve_algorithm():
    grpo = resolve_algorithm(AlgorithmConfig(name="grpo"))
    assert (grpo.normalize_std, grpo.clip_high, grpo.dynamic_sampling) == (True, 0.2, False)
    dapo = resolve_algorithm(AlgorithmConfig(name="dapo"))
    assert (dapo.normalize_std, dapo.clip_low, dapo.clip_high, dapo.dynamic_sampling) == (True, 0.2, 0.28, True)
    rloo = resolve_algorithm(AlgorithmConfig(name="rloo", normalize_std=True, clip_high=0.3, dynamic_sampling=True))
    assert (rloo.normalize_std, rloo.clip_high, rloo.dynamic_sampling) == (True, 0.3, True)
    assert resolve_algorithm(AlgorithmConfig(name="dr_grpo")).normalize_std is False
