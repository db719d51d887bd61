"""Exactness over interleaved masks (issue 21, item 6), in one process.

Multi-turn sequences from dsrl's trajectory path (dsrl.cli.check_trajectories: several observation spans per
sequence, empty model turns, a trajectory with no model token, trajectories ending on an observation) go through
the exact step on uneven micro-batch splits; the applied gradient equals a float64 reference whose mask is written
from the definition (a position counts iff its target is a model token), for every loss aggregation and the
policy, GSPO and off-policy-corrected objectives (<= 1e-6). A planted bug -- observation tokens counted -- is
caught by the same comparison. The 2-rank ZeRO 0-3 run is tests/distributed/test_exactness.py.
"""

from __future__ import annotations

import pytest
import torch
from test_correction import _splits
from test_step_core import PlainStep

from dsrl.cli.check import MAX_LEN, collate, make_sequences, reference_gradient
from dsrl.cli.check import relative_error as _rel
from dsrl.cli.check_models import TinyCausalModel
from dsrl.cli.check_objectives import CORRECTIONS, LOSSES, VOCAB, apply_correction
from dsrl.cli.check_trajectories import MODEL, OBSERVATION, _segments
from dsrl.config.names import LOSS_AGG_MODES, SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN

OBJECTIVES = ("policy", "gspo", *CORRECTIONS)


def _error(objective: str, loss_agg: str, mine: list[dict], seqs: list[dict]) -> float:
    torch.manual_seed(0)
    model = TinyCausalModel()
    reference = TinyCausalModel()
    reference.load_state_dict(model.state_dict())
    step = PlainStep(model, loss_agg, len(seqs))
    micros = []
    for mb in _splits(apply_correction(mine, objective)):
        micro = collate(mb)
        micro.pop("reference_mask", None)
        micros.append(micro)
    step.train(micros, LOSSES[objective])
    got = dict(zip([n for n, _ in model.named_parameters()], step.grads))
    want = reference_gradient(reference, seqs, loss_agg, MAX_LEN, objective)
    return _rel({n: got[n].double() for n in want}, want)


def test_the_data_covers_the_multi_turn_cases_and_masks_agree_with_the_definition():
    seqs = make_sequences(13, seed=5, multiturn=True)
    for s in seqs:
        assert torch.equal(s["loss_mask"], s["reference_mask"])  # dsrl's trajectory path = the definition
    g = torch.Generator().manual_seed(5 + 15485863)  # the stream trajectory_sequences draws the same shapes from
    shapes = [_segments(g, i, VOCAB)[1] for i in range(13)]
    kinds = [[k for k, _ in segs] for segs in shapes]
    assert max(k.count(OBSERVATION) for k in kinds) >= 3  # several observation spans per sequence
    assert any(k == MODEL and not tokens for segs in shapes for k, tokens in segs)  # an empty model turn
    assert any(MODEL not in k for k in kinds)  # a trajectory with no model token
    assert any(k[-1] == OBSERVATION for k in kinds)  # one that ends on an observation


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_multi_turn_step_equals_the_float64_reference(objective, loss_agg):
    seqs = make_sequences(13, seed=5, multiturn=True)
    assert _error(objective, loss_agg, seqs, seqs) <= 1e-6


@pytest.mark.parametrize("loss_agg", [TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN])
def test_observation_tokens_counted_is_caught(loss_agg):
    """Planted bug: the samples' observation tokens counted like model tokens (completion_mask dropped)."""
    seqs = make_sequences(13, seed=5, multiturn=True)
    planted = [dict(s, loss_mask=s["planted_mask"]) for s in seqs]
    assert _error("policy", loss_agg, planted, seqs) > 1e-2
    assert _error("tis_sequence", loss_agg, planted, seqs) > 1e-2
