"""``rollout.backend = "auto"``: the rule on the corners of the grid it was read from (bench/auto_grid.py, table in
docs/rollout.md), its bounds, the layouts that force ``hf``, and the one build of the workload: what ``dsrl plan``
prints is what the backend runs, for every call of a run."""

from __future__ import annotations

import json
import types

import pytest
import torch

from dsrl.config import ModelConfig, RolloutConfig, load_config
from dsrl.rl.policy.model import build_model
from dsrl.rollout.auto import (
    CPU_CB_MIN_STEP_WORK,
    CPU_FEW_SEQUENCES,
    CPU_FEW_SEQUENCES_MIN_NEW_TOKENS,
    CPU_SHORT_CB_MIN_STEP_WORK,
    CPU_SHORT_NEW_TOKENS,
    CPU_SMALL_MODEL_MAX_CB_CONCURRENCY,
    GPU_CB_MIN_CONCURRENCY,
    AutoRolloutBackend,
    GenerationWorkload,
    choose_backend,
)
from dsrl.rollout.cb import CallBounds
from dsrl.rollout.varlen_attention import VARLEN_ATTENTION

TINY, MID, SCALED = 140_000, 4_200_000, 26_500_000  # the grid's shapes (bench/_common.py SHAPES)
PAD, BOS, EOS = 0, 1, 2
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)


def cpu(parameters: int, c: int, new_tokens: int, cb_attention: str | None = None, **kw) -> str:
    if cb_attention is None:  # what cb_attention "auto" gives on the CPU: packed from 1 M parameters or C >= 128
        cb_attention = VARLEN_ATTENTION if parameters >= 1_000_000 or c >= 128 else "sdpa"
    w = GenerationWorkload("cpu", "sdpa", cb_attention, parameters, c, new_tokens, **kw)
    return choose_backend(w).backend


def gpu(c: int, new_tokens: int, attn: str = "sdpa", packed: bool = True, **kw) -> str:
    w = GenerationWorkload("cuda", attn, VARLEN_ATTENTION if packed else attn, 500_000_000, c, new_tokens, **kw)
    return choose_backend(w).backend


@pytest.mark.parametrize(("parameters", "c", "new_tokens", "expected"), [
    # short calls (8-16 new tokens): hf on the tiny model at every C, on the 4.2 M shape up to C = 32 and on the
    # 26.5 M shape at C = 8; cb from the 4.2 M shape at C = 128 and the 26.5 M shape at C = 32
    (TINY, 8, 8, "hf"), (TINY, 512, 8, "hf"), (TINY, 512, 16, "hf"), (MID, 8, 8, "hf"), (MID, 32, 8, "hf"),
    (MID, 128, 8, "cb"), (SCALED, 8, 8, "hf"), (SCALED, 32, 8, "cb"), (SCALED, 512, 8, "cb"),
    # longer calls: hf on the tiny model at C = 8, cb from C = 32; with few sequences (C = 8) cb only from 128 new
    # tokens on (the 26.5 M shape: slower at 64, faster at 256)
    (TINY, 8, 32, "hf"), (TINY, 8, 256, "hf"), (TINY, 32, 32, "cb"), (TINY, 32, 64, "cb"), (TINY, 512, 256, "cb"),
    (SCALED, 8, 64, "hf"), (SCALED, 8, 256, "cb"), (SCALED, 32, 64, "cb"), (SCALED, 128, 64, "cb"),
])
def test_cpu_grid_corners(parameters, c, new_tokens, expected):
    assert cpu(parameters, c, new_tokens) == expected


def test_cpu_bounds_are_where_the_constants_say():
    """A decode step's work C x parameters against the bound of short calls, then of longer ones."""
    short = CPU_SHORT_NEW_TOKENS - 1
    p = CPU_SHORT_CB_MIN_STEP_WORK // 100
    assert cpu(p - 1, 100, short) == "hf" and cpu(p, 100, short) == "cb"
    p = CPU_CB_MIN_STEP_WORK // 100
    assert cpu(p - 1, 100, CPU_SHORT_NEW_TOKENS) == "hf" and cpu(p, 100, CPU_SHORT_NEW_TOKENS) == "cb"
    assert cpu(p, 100, short) == "hf"  # the same step in a short call saves too little
    few, n = CPU_FEW_SEQUENCES - 1, CPU_FEW_SEQUENCES_MIN_NEW_TOKENS
    assert cpu(SCALED, few, n - 1) == "hf" and cpu(SCALED, few, n) == "cb" and cpu(SCALED, few + 1, n - 1) == "cb"


def test_dense_mask_on_a_small_model_at_high_concurrency_is_hf():
    limit = CPU_SMALL_MODEL_MAX_CB_CONCURRENCY
    assert cpu(TINY, limit, 256, cb_attention="sdpa") == "cb"
    assert cpu(TINY, limit + 1, 256, cb_attention="sdpa") == "hf"
    assert cpu(TINY, limit + 1, 256, cb_attention=VARLEN_ATTENTION) == "cb"  # cb_attention "auto" packs there


def test_layouts_that_need_lockstep_get_hf():
    assert cpu(SCALED, 512, 256, tensor_parallel=2) == "hf"  # tensor peers step together under hf only
    assert cpu(SCALED, 512, 256, expert_parallel=2) == "hf"  # AutoEP forwards in lockstep
    assert gpu(512, 256, attn="flash_attention_2", tensor_parallel=2) == "hf"


def test_accelerator_rule():
    c = GPU_CB_MIN_CONCURRENCY
    assert gpu(c, 256) == "cb"  # packed attention: 13.7x generate at C = 128, 256 new tokens (H200)
    assert gpu(c - 1, 256) == "hf"  # not measured below
    assert gpu(c, 8) == "cb"  # short calls: assumed to keep the margin (the GPU grid's 8-token cells check it)
    assert gpu(512, 256, packed=False) == "hf"  # the dense mask: measured slower than generate
    assert gpu(8, 256, attn="flash_attention_2") == "cb"  # not measured: transformers' own varlen path


def test_calls_per_rollout_leave_the_per_call_choice_alone():
    """Turns and sampling rounds repeat a call; the choice is per call (each call pays cb's costs and gets its
    savings), and the workload's description says how many there are."""
    for c, n in ((8, 8), (512, 256), (32, 32)):
        w = GenerationWorkload("cpu", "sdpa", "sdpa", TINY, c, n)
        multi = GenerationWorkload("cpu", "sdpa", "sdpa", TINY, c, n, calls_per_rollout=8)
        assert choose_backend(w) == choose_backend(multi)
    assert "8 calls per rollout" in multi.describe()


def tiny(vocab: int = 32) -> torch.nn.Module:
    return build_model(ModelConfig(arch="qwen2"), vocab, PAD, BOS, EOS, on_gpu=False, seed=0)


def test_backend_dispatches_by_the_run_bounds_for_every_call():
    """With the run's bounds, every call chooses alike whatever its size (a resumed run's too); without them a call
    decides on its own concurrency; the reason names the workload's figures."""
    model = tiny()
    cfg = RolloutConfig(max_new_tokens=8, generation_batch_size=64)
    short = AutoRolloutBackend(model, TOK, cfg, bounds=CallBounds(64, 24))
    assert all(short.choose(n, 4) is short.hf for n in (0, 1, 16, 500))
    assert short.decision(3, 4).reason == short.decision(16, 4).reason and "64 x " in short.decision(3, 4).reason
    long = AutoRolloutBackend(model, TOK, cfg.model_copy(update={"max_new_tokens": 256}), bounds=CallBounds(64, 272))
    assert all(long.choose(n, 4) is long.cb for n in (0, 1, 16, 500))
    # the bounds' per-call token bound (an environment's turn within its trajectory bound) wins over max_new_tokens
    turn = AutoRolloutBackend(model, TOK, cfg.model_copy(update={"max_new_tokens": 256}),
                              bounds=CallBounds(64, 272, new_tokens=8, calls_per_rollout=4))
    assert turn.choose(16, 4) is turn.hf and turn.workload(16, 4).calls_per_rollout == 4
    unbounded = AutoRolloutBackend(model, TOK, cfg.model_copy(update={"max_new_tokens": 32}))
    assert unbounded.workload(2, 4).concurrency == 8 and unbounded.workload(100, 4).concurrency == 256
    not_hf = AutoRolloutBackend(torch.nn.Linear(2, 2), TOK, cfg)  # no continuous batching: always hf
    assert not_hf.cb is None and not_hf.choose(1, 1) is not_hf.hf and "unavailable" in not_hf.decision(1, 1).reason


def run_file(tmp_path, **rollout) -> dict:
    raw = json.loads(open("configs/tiny_grpo_cpu.json").read())
    raw["dsrl"]["rollout"].pop("backend", None)  # a run file that names no backend: auto
    raw["dsrl"]["rollout"].update(rollout)
    raw["dsrl"]["run"]["output_dir"] = str(tmp_path / "run")
    return raw


@pytest.mark.parametrize(("world_size", "rollout", "expected"), [
    (1, {"max_new_tokens": 8}, "hf"), (2, {"max_new_tokens": 64}, "cb"), (2, {"max_new_tokens": 32}, "cb"),
    (2, {"max_new_tokens": 32, "generation_batch_size": 1}, "hf"),
])
def test_plan_prints_what_the_run_builds(tmp_path, world_size, rollout, expected):
    """`dsrl plan` counts the model on the meta device and builds the workload as the backend does at run time,
    from the calls of P / D prompts the generating ranks make: both choose alike."""
    from dsrl.cli.main import build_plan_report
    from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings

    cfg = load_config(run_file(tmp_path, **rollout))
    plan, extra = build_plan_report(cfg, world_size, None, on_gpu=False)
    assert extra["rollout_backend"] == expected, extra["rollout_backend_reason"]
    side = RolloutSide(RolloutSideSettings.of(cfg.dsrl), on_gpu=False)
    backend = side.backend(side.build_model(), plan.prompts_per_rank)
    assert isinstance(backend, AutoRolloutBackend)
    assert backend.decision(plan.prompts_per_rank, plan.samples_per_prompt).backend == expected
    assert backend.workload(1, 1) == side.planned_workload(plan.prompts_per_rank)  # one build, two moments


def test_plan_names_a_chosen_backend_and_leaves_an_unreadable_model_to_the_run(tmp_path, capsys):
    from dsrl.cli.main import build_plan_report, main

    _, extra = build_plan_report(load_config(run_file(tmp_path, backend="cb")), 2, None, on_gpu=False)
    assert extra["rollout_backend"] == "cb" and "names it" in extra["rollout_backend_reason"]
    missing = run_file(tmp_path)
    missing["dsrl"]["model"] = {"path": str(tmp_path / "no_such_checkpoint")}
    _, extra = build_plan_report(load_config(missing), 2, None, on_gpu=False)
    assert extra["rollout_backend"] == "auto" and "when the run starts" in extra["rollout_backend_reason"]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(run_file(tmp_path, max_new_tokens=8)))
    assert main(["plan", "--ds_config", str(path), "--world_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "hf (auto: short calls" in out and "C = 64 concurrent sequences" in out
    assert main(["plan", "--ds_config", str(path), "--world_size", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rollout_backend"] == "hf" and "up to 8 new tokens" in got["rollout_workload"]
