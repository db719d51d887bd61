"""The CPU support matrix (docs/support.md): every running cell of ``dsrl.config.matrix.CPU_MATRIX`` trains 2 rollouts
in a fresh ``deepspeed`` launch and shows its documented behaviour; every refused cell is refused before any work
with the sentence of every rule that refuses it.

The cells are the pairwise covering array of the axes (placement and k, ZeRO 0-3, hf/cb, LoRA, multi-turn, tis,
AutoTP): the list the docs table shows and the configuration's validation decides, so the three cannot disagree.
The checks are in tests/matrix_cells.py (shared with the vLLM tier's matrix).
"""

from __future__ import annotations

import pytest
from matrix_cells import base_run_file, cell_params, check_refused, run_cell

from dsrl.config.matrix import CPU_MATRIX


@pytest.mark.parametrize("cell", cell_params(CPU_MATRIX, runs=True))
def test_running_cell(tmp_path, cell):
    run_cell(CPU_MATRIX, cell, base_run_file(), tmp_path)


def test_refused_cells_are_refused_before_work_with_every_sentence(tmp_path):
    check_refused(CPU_MATRIX, base_run_file(), tmp_path)
