"""Running and checking the cells of a support matrix (docs/support.md), for tests/distributed/test_support_matrix.py
and tests/vllm_tier/test_vllm_matrix.py.

:func:`run_cell` trains a running cell (a base run file with the cell's values set) for 2 rollouts in a fresh
``deepspeed`` launch and :func:`check_cell` checks what docs/support.md says a cell shows (dsrl.config.matrix.CHECKS);
:func:`check_refused` checks that the refused cells are refused with every refusing rule's sentence, by the
validation every entry point runs first and by ``launch/train.py`` itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import REPO, launch, one_rank, write_json

from dsrl.config import ConfigError, load_config
from dsrl.config.matrix import Cell, Matrix
from dsrl.config.names import COLOCATED, CORRECTION_TIS

STEPS_PER_ROLLOUT = 2  # R = P * G = 16 sequences, B = 8
MISMATCH = ("rollout_logprob_abs_diff", "rollout_kl", "is_weight_max", "is_truncated_frac", "is_masked_frac",
            "staleness_mean", "staleness_max")
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA's all-linear


def base_run_file(source: str = "tiny_grpo_cpu.json") -> dict:
    """The shipped tiny run file cut to a cell's size: 2 rollouts of P = 4 x G = 4, B = 8, no warm-up, no schedule
    (its warm-up would outlast 4 steps), no periodic checkpoint, a collective bound of 2 minutes; the final
    checkpoint and export stay (the parameter check reads the exported model)."""
    raw = json.loads((REPO / "configs" / source).read_text())
    raw.pop("scheduler", None)
    raw.pop("csv_monitor", None)
    d = raw["dsrl"]
    d["batch"].update(prompts_per_rollout=4, samples_per_prompt=4, mini_batch_size=8)
    # a cell that hangs fails within minutes, not the default half hour
    d["run"].update(rollouts=2, save_every=0, keep_last=1, progress_bar=False, collective_timeout_s=120.0)
    d["data"].update(reward_timeout_s=60.0, environment_timeout_s=60.0)
    d["sft"] = {"steps": 0}
    d["data"]["size"] = 64
    return raw


def cell_params(matrix, runs: bool) -> list:
    return [pytest.param(c, id=c.name) for c in matrix.cells() if c.runs == runs]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_cell(cell: Cell, out: Path, run_file: dict) -> None:
    """The documented behaviour of a running cell (docs/support.md), read from its output directory."""
    s = cell.setup
    rows = _rows(out)
    steps = [r for r in rows if r["event"] == "step"]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert [r["rollout"] for r in rollouts] == [1, 2]
    assert [r["optimizer_step"] for r in steps] == list(range(1, 2 * STEPS_PER_ROLLOUT + 1)), steps
    assert all(r["step_applied"] and _finite(r["loss"]) for r in steps), steps
    # every stage reports its gradient norm, ZeRO-0 included (DeepSpeed keeps none there; dsrl measures it), except
    # ZeRO-0 under AutoTP, whose tensor-parallel shards dsrl does not reduce into one norm (docs/support.md)
    unreported = s.zero_stage == 0 and s.autotp_size > 1
    assert all(r["grad_norm"] is None if unreported else _finite(r["grad_norm"]) for r in steps), steps
    for r in rollouts:
        assert all(name in r and _finite(r[name]) for name in MISMATCH), r
        assert r["episodes"] == 16 * r["rollout"] and r["masked_samples"] == 0, r
        # every model token generated is trained once (tensor peers and generator ranks add none)
        assert r["train_tokens"] == round(r["response_len"] * 16), r
        assert sum(x["tokens"] for x in steps if x["rollout"] == r["rollout"]) == r["train_tokens"], r
        fresh = s.placement == COLOCATED or r["rollout"] == 1 or s.max_staleness == 0
        assert r["staleness_max"] == (0 if fresh else s.max_staleness), r
        if fresh:  # the generating weights are the trainer's: only kernels differ (float32)
            assert r["rollout_logprob_abs_diff"] < 1e-5, r
        else:  # one version old: a measured mismatch
            assert r["rollout_logprob_abs_diff"] > 1e-5, r
        cap = run_file["dsrl"]["algorithm"].get("rollout_correction", {}).get("cap", 2.0)
        truncating = s.correction == CORRECTION_TIS and r["is_weight_max"] > cap
        assert (r["is_truncated_frac"] > 0) == truncating and r["is_masked_frac"] == 0, r
        if s.multi_turn:
            assert r["turns_per_trajectory"] >= 1 and _finite(r["observation_tokens_per_trajectory"]), r
        else:
            assert "turns_per_trajectory" not in r, r
    _check_trained_parameters(s.lora, out, run_file)


def _check_trained_parameters(lora: bool, out: Path, run_file: dict) -> None:
    """The exported model is the base model moved by at most 4 optimizer steps' worth everywhere (consolidation of
    shards and partitions included); LoRA: bit for bit the base outside the adapted linear layers, and some adapted
    layer moved; full fine-tuning: the embedding moved."""
    import torch
    from safetensors.torch import load_file

    from dsrl.rl.policy.model import build_model
    from dsrl.rl.policy.tokenizer import load_tokenizer

    d = load_config(run_file).dsrl
    tok = load_tokenizer(d.model)
    base = build_model(d.model.model_copy(update={"lora": None}), vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, on_gpu=False,
                       seed=d.run.seed).state_dict()
    trained = load_file(str(out / "final_model" / "model.safetensors"))
    assert trained.keys() <= base.keys()
    # Adam moves a weight by about lr per step: a misplaced shard or a lost update shows as far more
    bound = 2 * 2 * STEPS_PER_ROLLOUT * run_file["optimizer"]["params"]["lr"]
    far = {k: (t - base[k]).abs().max().item() for k, t in trained.items() if (t - base[k]).abs().max() > bound}
    assert not far, far
    moved = {k for k, t in trained.items() if not torch.equal(t, base[k])}
    adapted = {k for k in trained if any(f".{m}." in k for m in ADAPTED)}
    if lora:
        assert moved and moved <= adapted, sorted(moved - adapted)
    else:
        assert "model.embed_tokens.weight" in moved, sorted(moved)


def run_cell(matrix: Matrix, cell: Cell, base: dict, tmp_path: Path, timeout: float = 300) -> None:
    """Train ``cell`` (``base`` with its values) for 2 rollouts on ``matrix.ranks`` ranks, then :func:`check_cell`."""
    run_file = cell.run_file(base)
    path = write_json(tmp_path / "run.json", run_file)
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(path), "--dsrl.run.output_dir", str(out)], nprocs=matrix.ranks,
           timeout=timeout)
    check_cell(cell, out, run_file)


def check_refused(matrix: Matrix, base: dict, tmp_path: Path) -> None:
    """Every refused cell of ``matrix`` is refused by the run-file validation with the sentence of every rule that
    refuses it; ``launch/train.py`` on the cell refused by the most rules exits 2 with all of them, writing nothing."""
    refused = [c for c in matrix.cells() if not c.runs]
    assert refused
    for cell in refused:
        with pytest.raises(ConfigError) as e:
            load_config(cell.run_file(base))
        for rule in cell.refusals:
            assert rule.message(cell.setup) in str(e.value), (cell.name, rule.name, str(e.value))
    cell = max(refused, key=lambda c: len(c.refusals))
    out = tmp_path / "out"
    path = write_json(tmp_path / "run.json", cell.run_file(base))
    proc = one_rank(["launch/train.py", "--ds_config", str(path), "--dsrl.run.output_dir", str(out)], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{len(cell.refusals)} problems:" in proc.stderr
    for rule in cell.refusals:
        assert rule.message(cell.setup) in proc.stderr, (rule.name, proc.stderr[-3000:])
    assert not out.exists()
