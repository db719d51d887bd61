"""The Megatron engine's context-parallel cut of a row (dsrl.backends.megatron.context_parallel), pure torch: each
rank's two chunks are Megatron's load-balanced ones (the same as dsrl.backends.megatron.cp's cut of a micro-batch,
which megatron-core's rotary embedding assumes), their positions are the chunks' sequence positions, and the order
that the attention and the output gather use puts every rank's rows back in sequence order."""

from __future__ import annotations

import pytest
import torch

from dsrl.backends.megatron.context_parallel import global_positions, in_sequence_order, rows_multiple
from dsrl.backends.megatron.cp import cut_along, shard_for_context_parallel


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_cut_is_megatrons_and_the_gather_order_restores_every_row(cp):
    length = 3 * rows_multiple(cp)
    rows = torch.arange(2 * length).reshape(2, length)
    parts = [cut_along(rows, 1, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        megatron = shard_for_context_parallel({"loss_mask": torch.ones(2, length), "ids": rows}, cp, r)["ids"]
        assert torch.equal(part, megatron)
        assert torch.equal(global_positions(part.shape[1], cp, r), part[0])  # row 0 holds its own positions
    gathered = torch.cat([p.t() for p in parts])  # the rank-ordered all-gather, sequence first
    assert torch.equal(in_sequence_order(gathered, cp).t(), rows)


def test_a_row_is_padded_to_whole_chunks_that_sequence_parallelism_splits_again():
    assert rows_multiple(2) == 4 and rows_multiple(2, tp_split=2) == 8 and rows_multiple(3, tp_split=2) == 12
