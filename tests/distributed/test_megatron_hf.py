"""A megatron-core GPTModel from a Hugging Face model (dsrl.backends.megatron.hf_weights): the HF model's logits and
its weights back bit for bit, for Llama (untied, grouped-query attention), Qwen2 (q/k/v biases, tied head) and Qwen3
(per-head q/k norms), at TP = 1, TP = 2 and PP = 2 on two CPU ranks (tests/workers/megatron_hf_worker.py); a planted
swap of k and v in the map fails both checks (the extended tier). The same for value models (the critic's: a token
classifier with one label, its head replicated over the tensor group) of Qwen2 and Llama; a planted bias fails it."""

from __future__ import annotations

import json

import pytest
from conftest import EXTENDED
from test_megatron import torchrun

pytest.importorskip("megatron.core")

LOGIT_TOL = 1e-5  # float32, different kernels (megatron-core's local layers against transformers')


def _run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "rows.json"
    torchrun("tests/workers/megatron_hf_worker.py", 2, ["--out", str(out), *extra])
    return json.loads(out.read_text())


def test_gpt_model_from_hf_weights_matches_the_hf_forward_and_gathers_back(tmp_path):
    rows = _run(tmp_path)
    assert {(r["arch"], r["tp"], r["pp"]) for r in rows} == {(a, tp, pp) for a in ("llama", "qwen2", "qwen3")
                                                             for tp, pp in ((1, 1), (2, 1), (1, 2))}
    for r in rows:
        assert r["logit_error"] <= LOGIT_TOL, r
        assert r["mismatched"] == [] and r["missing_names"] == [] and r["extra_names"] == [], r


@EXTENDED
def test_a_planted_mapping_error_fails_both_checks(tmp_path):
    (r,) = _run(tmp_path, "--plant")
    assert r["logit_error"] > 1e-2 and r["mismatched"], r


def test_a_value_model_from_hf_weights_matches_the_hf_forward_and_gathers_back(tmp_path):
    """The critic's value model (``<Arch>ForTokenClassification``, one label): the GPTModel with dsrl's ValueHead gives
    the HF values and gives its weights back, ``score`` included, at TP = 1, TP = 2 and PP = 2."""
    rows = _run(tmp_path, "--value")
    assert {(r["arch"], r["tp"], r["pp"]) for r in rows} == {(a, tp, pp) for a in ("qwen2-value", "llama-value")
                                                             for tp, pp in ((1, 1), (2, 1), (1, 2))}
    for r in rows:
        assert r["logit_error"] <= LOGIT_TOL, r
        assert r["mismatched"] == [] and r["missing_names"] == [] and r["extra_names"] == [], r


@EXTENDED
def test_a_planted_value_head_error_fails_both_checks(tmp_path):
    (r,) = _run(tmp_path, "--value", "--plant", "--export")
    assert r["logit_error"] > 1e-2 and "score.bias" in r["mismatched"] and r["export_mismatched"], r


@EXTENDED
def test_dsrl_export_reads_the_hf_weights_from_a_dist_checkpoint_of_any_layout(tmp_path):
    """Each model of the checks above (the three architectures and the value models, at TP = 2 and PP = 2)
    saved with megatron-core's dist-checkpointing and read back as ``dsrl export`` reads it
    (:func:`dsrl.backends.megatron.checkpoint.model_tensors`, :func:`hf_weights.hf_state_of_checkpoint`): the HF
    weights, bit for bit, every name once; the planted bias above fails it."""
    for extra in ((), ("--value",)):
        for r in _run(tmp_path, "--export", *extra):
            assert r["export_mismatched"] == [] and r["export_names"], r
