"""Aggregation weights (architecture §2) against hand-computed cases; NaN-safety; surrogate and KL."""

from __future__ import annotations

import math

import pytest
import torch

from dsrl.algos.losses import clipped_policy_loss, kl_estimate
from dsrl.config.names import LOSS_AGG_MODES
from dsrl.core.weights import GlobalCounts, local_counts, token_weights, weighted_sum

# Two sequences in one micro-batch: 3 and 1 valid tokens; a third sequence is fully masked.
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
MICRO = {"loss_mask": MASK}


def test_local_counts_skip_fully_masked_sequences():
    assert local_counts(MICRO) == (4, 2)


@pytest.mark.parametrize(
    "mode,expected",
    [
        # N_M = 10 tokens in the mini-batch: every valid token weighs 1/10.
        ("token-mean", [[0.1, 0.1, 0.1, 0], [0, 0, 0.1, 0], [0, 0, 0, 0]]),
        # S_M = 5 sequences: 1/(5 * n_s) -> 1/15 for the 3-token sequence, 1/5 for the 1-token one.
        ("seq-mean-token-mean", [[1 / 15] * 3 + [0], [0, 0, 1 / 5, 0], [0] * 4]),
        ("seq-mean-token-sum", [[0.2] * 3 + [0], [0, 0, 0.2, 0], [0] * 4]),
        # B = 8, L_norm = 16: 1/128 for every valid token, whatever the counts are.
        ("seq-mean-token-sum-norm", [[1 / 128] * 3 + [0], [0, 0, 1 / 128, 0], [0] * 4]),
    ],
)
def test_weights_hand_computed(mode, expected):
    w = token_weights(mode, MICRO, GlobalCounts(tokens=10, sequences=5), mini_batch_size=8, loss_agg_norm_length=16)
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)


def test_seq_mean_uses_whole_sequence_count_when_given():
    # A context-parallel shard holds 1 of the sequence's 4 valid tokens: n_s must be 4, not 1.
    micro = {"loss_mask": torch.tensor([[0, 1]]), "seq_valid_tokens": torch.tensor([4])}
    w = token_weights("seq-mean-token-mean", micro, GlobalCounts(tokens=4, sequences=1))
    assert w[0, 1].item() == 0.25


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_zero_token_mini_batch_gives_zero_not_nan(mode):
    micro = {"loss_mask": torch.zeros(2, 3, dtype=torch.long)}
    w = token_weights(mode, micro, GlobalCounts(tokens=0, sequences=0), mini_batch_size=4, loss_agg_norm_length=3)
    per_token = torch.tensor([[float("nan"), 1.0, float("inf")], [2.0, 3.0, 4.0]], requires_grad=True)
    loss = weighted_sum(per_token, w, micro["loss_mask"])
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(per_token.grad, torch.zeros(2, 3))


def test_masked_nan_never_leaks_into_the_gradient():
    # Padding positions may hold NaN/inf (e.g. log-probs of pad tokens): masked, they contribute exactly 0.
    per_token = torch.tensor([[1.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    w = token_weights("token-mean", {"loss_mask": mask}, GlobalCounts(tokens=1, sequences=1))
    weighted_sum(per_token, w, mask).backward()
    assert torch.equal(per_token.grad, torch.tensor([[1.0, 0.0]]))


def test_clipped_surrogate_and_clip_fractions():
    old = torch.zeros(1, 4)
    # ratios 0.5, 1.0, 1.5, 1.5 with advantages -1, 1, 1, -1; clip_low 0.2, clip_high 0.28
    new = torch.log(torch.tensor([[0.5, 1.0, 1.5, 1.5]]))
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]])
    loss, m = clipped_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # token 0: A<0, ratio 0.5 -> min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped at low bound, active)
    # token 2: A>0, ratio 1.5 -> min(1.5, 1.28) = 1.28 -> loss -1.28 (clipped at high bound)
    # token 3: A<0, ratio 1.5 -> min(-1.5, -1.28) = -1.5 -> loss 1.5 (unclipped branch)
    torch.testing.assert_close(loss, torch.tensor([[0.8, -1.0, -1.28, 1.5]]))
    assert m["clip_low_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert m["clip_high_frac"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
    # On-policy (ratio 1): nothing is clipped.
    _, m0 = clipped_policy_loss(old, old, adv, 0.2, 0.28)
    assert m0["clip_low_frac"].sum() == 0 and m0["clip_high_frac"].sum() == 0


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    lr = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(lr)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + lr)
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")
