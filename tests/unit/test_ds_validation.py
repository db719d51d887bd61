"""The DeepSpeed half is checked by DeepSpeed's own code, builds no kernel, needs no process group, and
catches what DeepSpeed alone would accept silently."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import REPO

from dsrl.backends.deepspeed.config import resolve_deepspeed_config
from dsrl.backends.deepspeed.probe import EngineView
from dsrl.backends.deepspeed.schedule import PlannedScheduler, ScheduleSpec
from dsrl.backends.deepspeed.validation import check_with_deepspeed, validated_deepspeed_config
from dsrl.config import ConfigError, load_config
from dsrl.core.plan import BatchPlan

BASE = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text(encoding="utf-8"))


def _validate(changes: dict, on_gpu: bool = False):
    raw = copy.deepcopy(BASE)
    raw.update(copy.deepcopy(changes))
    cfg = load_config(raw)
    plan = BatchPlan.from_config(cfg, 2, 512)
    return cfg, plan, validated_deepspeed_config(cfg, plan, on_gpu=on_gpu)


@pytest.fixture
def no_kernel_builds(monkeypatch):
    """Any attempt to compile or load a DeepSpeed op fails the test."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(*args, **kwargs):
        raise AssertionError("validation tried to build a DeepSpeed kernel")

    monkeypatch.setattr(OpBuilder, "load", refuse)
    monkeypatch.setattr(OpBuilder, "jit_load", refuse)


def test_kernel_optimizers_are_checked_without_building_or_a_process_group(no_kernel_builds):
    import deepspeed.comm

    # torch_adam false: DeepSpeed would build its FusedAdam kernel; its arguments are bound, not run.
    adam = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": False, "bias_correction": True}}
    _validate({"optimizer": adam})
    assert not torch.distributed.is_initialized() and not deepspeed.comm.is_initialized()
    bad = copy.deepcopy(adam)
    bad["params"]["betas"] = [0.9, 1.5]  # FusedAdam itself would not object; torch's AdamW (same rule) does
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas = \[0\.9, 1\.5\]"):
        _validate({"optimizer": bad})
    bad = copy.deepcopy(adam)
    bad["params"]["foreach"] = True  # a torch.optim argument FusedAdam does not take
    with pytest.raises(ConfigError, match=r"optimizer\.params\.foreach"):
        _validate({"optimizer": bad})


def test_the_engine_checks_are_deepspeeds_own_code():
    from deepspeed.runtime.engine import DeepSpeedEngine

    cfg, plan, (ds, _) = _validate({})
    view = EngineView(check_with_deepspeed(ds))
    assert view._do_sanity_check.__func__ is DeepSpeedEngine._do_sanity_check
    assert view._configure_basic_optimizer.__func__ is DeepSpeedEngine._configure_basic_optimizer
    assert ds == resolve_deepspeed_config(cfg, plan, on_gpu=False)  # validation does not change the config


# What DeepSpeed's parser alone accepts without a word, and dsrl rejects (the reason these checks exist).
SILENTLY_ACCEPTED = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}}}, "optimizer.parms"),
    ({"gradient_clippping": 0.5}, "gradient_clippping"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping"),
    ({"activation_checkpointing": {"partition_activation": True}}, "activation_checkpointing.partition_activation"),
]


@pytest.mark.parametrize("changes,field", SILENTLY_ACCEPTED)
def test_what_deepspeed_accepts_silently_is_rejected(changes, field):
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = copy.deepcopy(BASE)
    raw.update(copy.deepcopy(changes))
    raw.pop("dsrl")
    raw.pop("scheduler")
    DeepSpeedConfig({**raw, "train_micro_batch_size_per_gpu": 1})  # DeepSpeed's parser takes it
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _validate(changes)


def test_a_rich_valid_config_is_accepted():
    """Every section DeepSpeed reads in its own way (pydantic, key by key, whole) passes: no false 'unknown key'."""
    _validate({
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "none"}},
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32",
        "checkpoint": {"load_universal": False, "tag_validation": "Warn"},
        "flops_profiler": {"enabled": False, "profile_step": 1, "detailed": True},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
        "comms_logger": {"enabled": False}, "wandb": {"enabled": False}, "tensorboard": {"enabled": False},
        "timers": {"throughput": {"enabled": True}}, "compile": {"deepcompile": False},
        "wall_clock_breakdown": False, "prescale_gradients": False, "sequence_parallel_size": 1,
    })


@pytest.mark.parametrize("name,params", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3}),
])
def test_planned_schedule_starts_at_index_zero_like_deepspeed_stepped_once(name, params):
    """PlannedScheduler builds DeepSpeed's schedules at index 0 (no warning); the LRs equal DeepSpeed's own
    construction (index -1) stepped once, at every step."""
    from deepspeed.runtime import lr_schedules

    def adam():
        return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)

    ours = PlannedScheduler(ScheduleSpec("deepspeed", name, dict(params)), adam())
    opt = adam()
    theirs = getattr(lr_schedules, name)(opt, **params)
    theirs.step()
    for _ in range(25):
        assert ours.current_lr() == opt.param_groups[0]["lr"]
        assert ours.optimizer.param_groups[0].get("betas") == opt.param_groups[0].get("betas")
        ours.step()
        theirs.step()
