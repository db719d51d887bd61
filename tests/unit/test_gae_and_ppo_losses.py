"""PPO/GSPO building blocks against hand-computed values: GAE, per-token rewards, whitening, the clipped
value loss, the sequence-level (GSPO) ratio on padded and packed rows, and per-token data in micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from dsrl.algos import gae, token_rewards, whiten
from dsrl.algos.losses import clipped_value_loss, sequence_clipped_policy_loss, sequence_index, sequence_mean
from dsrl.rl.data.batching import Sample, collate, collate_packed


def _close(t: torch.Tensor, want: list) -> bool:
    return torch.allclose(t.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_gae_matches_hand_computed_values():
    # Row 0: 3 tokens, reward 1 on the last; row 1: 2 valid tokens, reward 2 on the last, then padding (value 9
    # there must not leak). gamma 0.9, lambda 0.8, V(s_T) = 0.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.1 = 0.9;            A2 = 0.9
    #        d1 = 0.9*0.1 - 0.2 = -0.11;    A1 = -0.11 + 0.72*0.9 = 0.538
    #        d0 = 0.9*0.2 - 0.5 = -0.32;    A0 = -0.32 + 0.72*0.538 = 0.06736
    # row 1: d1 = 2 - 0.4 = 1.6;            A1 = 1.6
    #        d0 = 0.9*0.4 - 0.3 = 0.06;     A0 = 0.06 + 0.72*1.6 = 1.212
    want_adv = torch.tensor([[0.06736, 0.538, 0.9], [1.212, 1.6, 0.0]], dtype=torch.float64)
    want_ret = torch.tensor([[0.56736, 0.738, 1.0], [1.512, 2.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(adv, want_adv, atol=1e-12) and torch.allclose(ret, want_ret, atol=1e-12)


def test_gae_with_gamma_lambda_one_is_monte_carlo_return_minus_value():
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 1, 0]]), gamma=1.0, lam=1.0)
    assert ret[0, :3].tolist() == pytest.approx([1.5, 1.0, 2.0])  # reward-to-go
    assert adv[0, :3].tolist() == pytest.approx([1.4, 0.8, 1.7]) and adv[0, 3] == 0 and ret[0, 3] == 0


def test_token_rewards_put_the_score_on_the_last_token_plus_penalties():
    r = token_rewards([1.0, 2.0, 3.0], [2, 3, 0], [[-0.1, -0.2], [0.0, -0.5, 0.0], []])
    assert _close(r, [[-0.1, 0.8, 0.0], [0.0, -0.5, 2.0], [0.0, 0.0, 0.0]])


def test_whiten_uses_the_given_statistics_on_valid_tokens_only():
    out = whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]), mean=2.0, std=1.0)
    assert _close(out, [[-1.0, 1.0, 0.0]])


def test_clipped_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0, 0.5]])
    old = torch.tensor([[0.0, 0.0, 0.4]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    loss, m = clipped_value_loss(v, old, ret, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.2 -> (0.2-2)^2 = 3.24: max 3.24 (clip active)
    # token 1: V = V_old: both 1.0; token 2: (0.5)^2 = 0.25 vs V -> 0.5 within 0.2 of 0.4: equal 0.25
    assert _close(loss, [[1.62, 0.5, 0.125]])
    assert m["vf_clip_frac"].tolist() == [[1.0, 0.0, 0.0]]
    plain, _ = clipped_value_loss(v, old, ret, clip=None)
    assert _close(plain, [[0.5, 0.5, 0.125]])


def test_sequence_ratio_is_the_length_normalised_mean_and_clips_per_sequence():
    lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[9.0, -1.2, -2.2, 0.0], [0.0, 0.0, -0.4, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = sequence_clipped_policy_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    s0, s1 = math.exp(0.2), math.exp(-0.6)  # row 0: mean(0.2, 0.2); row 1: -0.6 (masked 5.0 and 9.0 ignored)
    # row 0: A > 0, s0 = 1.22 > 1.1: clipped at 1.1 -> loss -1.1; row 1: A < 0, s1 = 0.55 < 0.9: -min(-s1, -0.9) = 0.9
    assert loss[0].tolist() == pytest.approx([-1.1] * 4) and loss[1].tolist() == pytest.approx([0.9] * 4)
    assert m["clip_high_frac"][0].tolist() == [1.0] * 4 and m["clip_low_frac"][1].tolist() == [1.0] * 4
    assert m["ratio"][:, 1].tolist() == pytest.approx([s0, s1])
    # unclipped: the gradient of s_i reaches every valid token with weight s_i / n_i, masked ones get none
    loss, _ = sequence_clipped_policy_loss(lp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    (loss[0, 0] + loss[1, 0]).backward()
    assert _close(lp.grad, [[0, -s0 / 2, -s0 / 2, 0], [0, 0, s1, 0]])


def test_sequence_mean_on_packed_rows_equals_padded_rows():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    index = sequence_index(mask, torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert index.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert _close(sequence_mean(values, mask, index), [[2.5] * 3 + [5.5] * 3])


def test_collate_carries_per_token_values_returns_and_advantages():
    a = Sample(tokens=[1, 5, 6, 7], prompt_len=2, group=0, reward=1.0, values=[0.1, 0.2], returns=[1.0, 1.5],
               token_advantages=[0.3, -0.3], old_logprobs=[-1.0, -2.0])
    b = Sample(tokens=[1, 5, 6], prompt_len=2, group=0, reward=0.0, values=[0.4], returns=[0.0],
               token_advantages=[0.7], old_logprobs=[-3.0])
    padded = collate([a, b], 0)
    assert _close(padded["old_values"], [[0.0, 0.1, 0.2], [0.0, 0.4, 0.0]])
    assert _close(padded["returns"], [[0.0, 1.0, 1.5], [0.0, 0.0, 0.0]])
    assert _close(padded["advantages"], [[0.0, 0.3, -0.3], [0.0, 0.7, 0.0]])
    packed = collate_packed([a, b], 0)
    assert _close(packed["advantages"], [[0.0, 0.3, -0.3, 0.0, 0.7]])
    assert _close(packed["returns"], [[0.0, 1.0, 1.5, 0.0, 0.0]])
    plain = collate([Sample(tokens=[1, 5, 6], prompt_len=2, group=0, reward=0.0, advantage=2.0)], 0)
    assert plain["advantages"].tolist() == [2.0] and "old_values" not in plain  # group methods: one per sequence
