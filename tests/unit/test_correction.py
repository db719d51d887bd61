"""The off-policy correction (ARCHITECTURE §8, dsrl.algos.correction) in one process.

- ``correct`` against hand-computed values: tis/mis per token and per sequence, uncounted tokens untouched,
  the mismatch sums, no overflow for extreme log-ratios;
- the exact step with the correction applied (weights multiply the per-token loss; mis removes tokens before
  the counts) equals a float64 reference written from the definition, for every mode, level and loss
  aggregation, on uneven micro-batch splits; a planted bug (mis tokens zero-weighted but still counted,
  weights applied after the aggregation) is caught;
- the check's data puts weights on both sides of the cap, so the distributed check can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_step_core import PlainStep

from dsrl.algos.correction import correct
from dsrl.cli.check import MAX_LEN, collate, make_sequences, reference_gradient
from dsrl.cli.check import relative_error as _rel
from dsrl.cli.check_models import TinyCausalModel
from dsrl.cli.check_objectives import CORRECTION_CAP, CORRECTIONS, LOSSES, apply_correction, reference_correction
from dsrl.config.names import LOSS_AGG_MODES, TOKEN_MEAN

LN2 = math.log(2.0)


def test_token_and_sequence_weights_by_hand():
    old = [-1.0, -1.0, -1.0, -1.0]
    mu = [-1.0 - 1.0, -1.0 + 0.25, -1.0 - 0.5, -1.0 + 3.0]  # log w = 1, -0.25, 0.5, -3
    counted = [True, True, True, False]
    none = correct(old, mu, counted, "none", "token", 2.0)
    assert none.weights is None and none.keep is None
    assert none.mismatch.tokens == 3 and none.mismatch.abs_diff_sum == pytest.approx(1.75)
    assert none.mismatch.weight_max == pytest.approx(math.e)
    k3 = sum(math.exp(x) - 1 - x for x in (1.0, -0.25, 0.5))
    assert none.mismatch.kl_sum == pytest.approx(k3)
    tis = correct(old, mu, counted, "tis", "token", 2.0)
    assert tis.weights == pytest.approx([2.0, math.exp(-0.25), math.exp(0.5), 1.0]) and tis.keep is None
    assert tis.mismatch.truncated == 1 and tis.mismatch.masked == 0
    mis = correct(old, mu, counted, "mis", "token", 2.0)
    assert mis.keep == [False, True, True, True] and mis.weights is None and mis.mismatch.masked == 1
    seq = correct(old, mu, counted, "tis", "sequence", 2.0)  # exp(1.25) > 2: every counted token capped
    assert seq.weights == [2.0, 2.0, 2.0, 1.0] and seq.mismatch.truncated == 3
    seq_mis = correct(old, mu, counted, "mis", "sequence", 4.0)  # |1.25| <= ln 4: kept whole
    assert seq_mis.keep == [True] * 4 and seq_mis.mismatch.masked == 0
    seq_mis = correct(old, mu, counted, "mis", "sequence", 3.0)  # 1.25 > ln 3: the whole sequence leaves
    assert seq_mis.keep == [False, False, False, True] and seq_mis.mismatch.masked == 3


def test_band_edges_extremes_and_bad_input():
    assert correct([0.0, 0.0], [-LN2, LN2], [True, True], "mis", "token", 2.0).keep == [True, True]
    huge = correct([0.0], [-5000.0], [True], "tis", "token", 2.0)
    assert huge.weights == [2.0] and math.isfinite(huge.mismatch.weight_max)
    tiny = correct([0.0], [5000.0], [True], "tis", "token", 2.0)
    assert tiny.weights[0] >= 0.0 and math.isfinite(tiny.mismatch.kl_sum)
    assert correct([0.0], [0.0], [False], "mis", "token", 2.0).keep is None  # nothing counted: nothing to do
    with pytest.raises(ValueError, match="differ in length"):
        correct([0.0, 1.0], [0.0], [True], "tis", "token", 2.0)


def test_the_checks_data_reaches_both_sides_of_the_cap():
    seqs = make_sequences(64, seed=0)
    tok, seq = [], []
    for s in seqs:
        m = s["loss_mask"] > 0
        log_w = (s["old_logprobs"] - s["behavior_logprobs"])[m]
        tok += log_w.tolist()
        if m.any():
            seq.append(float(log_w.sum()))
    cap = math.log(CORRECTION_CAP)
    for values in (tok, seq):
        above = sum(x > cap for x in values) / len(values)
        below = sum(x < -cap for x in values) / len(values)
        inside = 1 - above - below
        assert min(above, below, inside) > 0.05, (above, below, inside)


def _splits(seqs: list[dict]) -> list[list[dict]]:
    """Uneven micro-batches: sizes 1, 3, 2, 1, ..."""
    out, i, k = [], 0, 0
    while i < len(seqs):
        n = (1, 3, 2, 1)[k % 4]
        out.append(seqs[i:i + n])
        i, k = i + n, k + 1
    return out


def _error(objective: str, loss_agg: str, corrected: list[dict], seqs: list[dict], loss_fn=None) -> float:
    torch.manual_seed(0)
    model = TinyCausalModel()
    reference = TinyCausalModel()
    reference.load_state_dict(model.state_dict())
    step = PlainStep(model, loss_agg, len(seqs))
    step.train([collate(mb) for mb in _splits(corrected)], loss_fn or LOSSES[objective])
    got = dict(zip([n for n, _ in model.named_parameters()], step.grads))
    want = reference_gradient(reference, seqs, loss_agg, MAX_LEN, objective)
    return _rel({n: got[n].double() for n in want}, want)


@pytest.mark.parametrize("objective", list(CORRECTIONS))
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_corrected_step_equals_the_float64_reference(objective, loss_agg):
    seqs = make_sequences(13, seed=5)
    assert _error(objective, loss_agg, apply_correction(seqs, objective), seqs) <= 1e-6


def test_a_mis_token_zero_weighted_but_still_counted_is_caught():
    """Planted bug: masked-importance-sampling tokens given weight 0 instead of leaving loss_mask, so they still
    count in N_M: the token-mean update is too small, and the comparison says so."""
    seqs = make_sequences(13, seed=5)
    planted = []
    for s, c in zip(seqs, apply_correction(seqs, "mis_token")):
        planted.append(dict(s, is_weights=c["loss_mask"].float()))  # the mask as a weight, counts unchanged
    assert _error("mis_token", TOKEN_MEAN, planted, seqs, loss_fn=LOSSES["tis_token"]) > 1e-2
    _, mask = reference_correction(collate(seqs), "mis_token")
    assert 0 < mask.sum() < collate(seqs)["loss_mask"].sum()  # the data masks some tokens, not all


def test_weights_left_out_of_the_loss_are_caught():
    seqs = make_sequences(13, seed=5)
    assert _error("tis_sequence", TOKEN_MEAN, seqs, seqs, loss_fn=LOSSES["policy"]) > 1e-2
