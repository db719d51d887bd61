"""``dsrl.check`` on the Megatron engine (dsrl.cli.check_engine_megatron, through launch/check.py and the CPU shim):
the applied update of one uneven mini-batch through the engine launch/train.py builds equals the single-process
float64 reference of the unsharded Hugging Face model within 1e-6, for the policy loss and the critic's value loss,
at TP = 2 (README suite: two loss modes, a tied Qwen2; with sequence parallelism, a Qwen3) and at PP = 2, DP = 2 and
TP = 2 x PP = 2 with sequence parallelism on four ranks (extended: every loss mode, split and objective, an untied
Llama); the naive mean of micro-batch means fails on the same data (so the check can)."""

from __future__ import annotations

import json

import pytest
from conftest import EXTENDED, REPO, launch

pytest.importorskip("megatron.core")

TOL = 1e-6


def _check(tmp_path, engine: dict, *flags: str, nprocs: int = 2) -> list[dict]:
    raw = json.loads((REPO / "configs" / "check_megatron_cpu.json").read_text())
    raw["dsrl"]["engine"] = engine
    path, out = tmp_path / "run.json", tmp_path / "results.json"
    path.write_text(json.dumps(raw))
    proc = launch(["launch/check.py", "--ds_config", str(path), "--method", "dsrl,naive", "--objective",
                   "policy,value", "--json", str(out), *flags], nprocs=nprocs, timeout=900)
    assert "max relative gradient error:" in proc.stdout
    return json.loads(out.read_text())["results"]


def _judge(results: list[dict], cases: int) -> None:
    exact = [r for r in results if r["method"] == "dsrl"]
    assert len(exact) == cases and {r["engine"] for r in results} == {"megatron"}
    worst = max(exact, key=lambda r: r["error"])
    assert worst["error"] <= TOL, worst
    for r in results:
        if r["split"] == "empty":
            assert r["error"] == 0.0, r  # a zero-token mini-batch: exactly no update, no NaN
        elif r["method"] == "naive" and r["loss_agg"] == "token-mean":
            assert r["error"] > 1e-2, r


def test_dsrl_check_is_exact_on_the_megatron_engine_at_tp2(tmp_path):
    results = _check(tmp_path, {"kind": "megatron", "tensor_model_parallel_size": 2}, "--model", "qwen2",
                     "--loss_agg", "token-mean,seq-mean-token-mean", "--splits", "uneven,pad_rank,empty")
    assert {(r["tensor_parallel_size"], r["pipeline_parallel_size"], r["replicas"]) for r in results} == {(2, 1, 1)}
    _judge(results, 2 * 2 * 3)


def test_dsrl_check_is_exact_with_sequence_parallelism(tmp_path):
    """The tensor group also splits the positions: the norms' (and the value head's) partial gradients summed over
    it, the output gathered along the sequence before the head; a Qwen3 (per-head q/k norms). Planted by hand
    (docs/megatron.md): the norms' gradients left unsummed (0.90), the gather's gradient summed instead of split
    (1.0), the value head's left unsummed (0.40)."""
    results = _check(tmp_path, {"kind": "megatron", "tensor_model_parallel_size": 2, "sequence_parallel": True},
                     "--model", "qwen3", "--loss_agg", "token-mean", "--splits", "uneven,empty")
    _judge(results, 2 * 1 * 2)


@EXTENDED
@pytest.mark.parametrize("engine", [
    {"kind": "megatron", "pipeline_model_parallel_size": 2},
    {"kind": "megatron"},
    {"kind": "megatron", "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True},
], ids=["pp2", "dp2", "tp2_pp2_sp"])
def test_dsrl_check_is_exact_on_the_megatron_engine(tmp_path, engine):
    if engine.get("sequence_parallel"):  # four ranks on the CI's two cores: two loss modes, two splits
        results = _check(tmp_path, engine, "--model", "llama_untied", "--loss_agg", "token-mean,seq-mean-token-mean",
                         "--splits", "uneven,empty", nprocs=4)
        _judge(results, 2 * 2 * 2)
        return
    _judge(_check(tmp_path, engine, "--model", "llama_untied"), 2 * 4 * 4)
