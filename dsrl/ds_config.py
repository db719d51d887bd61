"""The ds_config DeepSpeed is allowed to see, derived from the run file and the batch plan.

Invariants (architecture §7): the result never contains the ``"dsrl"`` or ``"scheduler"`` sections
or any ``"auto"``; it always sets ``gradient_clipping`` explicitly, runs with
``managed_gradient_accumulation: false`` and ``gradient_accumulation_steps: 1``, accumulates and
communicates gradients in fp32 under bf16/fp16 unless the user chose otherwise, and rejects the
combinations step-owned accumulation cannot run (overlap_comm on ZeRO-0/1, the pipeline engine).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from dsrl.config import DEFAULT_GRADIENT_CLIPPING, DS_BATCH_KEYS, Config, ConfigError

_AUTO_DROPPING_SECTIONS = ("zero_optimization", "bf16", "fp16", "data_types", "activation_checkpointing")


def _find_auto(node: Any, path: str) -> list[str]:
    if node == "auto":
        return [path]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _find_auto(v, f"{path}[{i}]")]
    return []


def _resolve_enabled(section: dict[str, Any] | None, default: bool) -> bool:
    if not isinstance(section, dict):
        return False
    value = section.get("enabled", False)
    return default if value == "auto" else bool(value)


def resolve_deepspeed_config(
    cfg: Config, plan: Any, *, on_gpu: bool, bf16_supported: bool | None = None
) -> dict[str, Any]:
    """The ds_config handed to ``deepspeed.initialize`` (see the module docstring's invariants).

    ``plan`` is the run's :class:`dsrl.plan.BatchPlan`; an explicit DeepSpeed batch field that
    contradicts it is an error. dsrl owns the LR schedule, so ``"scheduler"`` is removed here.
    """
    ds = copy.deepcopy(cfg.ds_config)
    ds.pop("scheduler", None)
    plan.check_user_batch_fields(ds)
    for key in DS_BATCH_KEYS:
        ds.pop(key, None)
    # DeepSpeed asserts train_batch = micro * gas * world; gas=1 and the real micro size keep its
    # sample counters honest in fixed mode. dsrl never lets it scale by an accumulation count.
    ds["train_micro_batch_size_per_gpu"] = plan.micro_batch_size_per_rank or 1
    ds["gradient_accumulation_steps"] = 1

    managed = ds.get("managed_gradient_accumulation", "auto")
    if managed not in ("auto", False):
        raise ConfigError(
            f"ds_config managed_gradient_accumulation = {managed!r}: dsrl owns the optimizer-step boundary "
            "(N backwards, one step per mini-batch). Fix: remove the key or set it to false."
        )
    ds["managed_gradient_accumulation"] = False

    clip = ds.get("gradient_clipping", "auto")
    if clip in ("auto", None):
        clip = DEFAULT_GRADIENT_CLIPPING
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"ds_config gradient_clipping = {clip!r} must be a number >= 0 (0 = no clipping).")
    ds["gradient_clipping"] = float(clip)

    if bf16_supported is None:
        bf16_supported = on_gpu
    for name, default in (("bf16", bf16_supported), ("fp16", False)):
        if isinstance(ds.get(name), dict):
            ds[name]["enabled"] = _resolve_enabled(ds[name], default)
    bf16 = _resolve_enabled(ds.get("bf16"), False)
    fp16 = _resolve_enabled(ds.get("fp16"), False)
    if bf16 and fp16:
        raise ConfigError("ds_config: bf16.enabled and fp16.enabled are both true. Fix: enable at most one.")
    if fp16 and not on_gpu:
        raise ConfigError("ds_config fp16.enabled = true: the CPU accelerator has no fp16 training. Fix: use bf16.")
    if bf16 or fp16:
        # Exactness: accumulate and communicate gradients in fp32 unless the user chose otherwise.
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
        ds.setdefault("communication_data_type", "fp32")

    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage == "auto":
        stage = zero["stage"] = 0
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config zero_optimization.stage = {stage!r} must be 0, 1, 2 or 3.")
    if zero.get("overlap_comm") is True and stage in (0, 1):
        raise ConfigError(
            f"ds_config zero_optimization.overlap_comm = true with stage {stage}: with dsrl's step-owned "
            "accumulation DeepSpeed only overlaps on ZeRO-2 (stage 1 would apply unaveraged gradients). "
            "Fix: set overlap_comm to false, or use stage 2."
        )
    if "pipeline" in ds:
        raise ConfigError(
            "ds_config pipeline: DeepSpeed's pipeline engine cannot run step-owned accumulation. "
            "Fix: remove the pipeline section; for pipeline parallelism embed dsrl in Megatron (docs/megatron.md)."
        )
    if ds.get("gradient_allreduce_op", "mean") not in ("mean", "sum"):
        raise ConfigError(
            f"ds_config gradient_allreduce_op = {ds['gradient_allreduce_op']!r} must be 'mean' or 'sum'."
        )

    if not on_gpu:
        opt = ds.get("optimizer")
        if isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
            # DeepSpeed would JIT-build CPUAdam; the torch implementation is exact and builds nothing.
            opt.setdefault("params", {}).setdefault("torch_adam", True)

    for section in ("tensorboard", "csv_monitor"):
        # An enabled monitor without a path writes under the run's output directory, not the cwd.
        sec = ds.get(section)
        if isinstance(sec, dict) and sec.get("enabled") and sec.get("output_path") in (None, "", "auto"):
            sec["output_path"] = os.path.join(cfg.dsrl.run.output_dir, "monitor", "")
            sec.setdefault("job_name", section)

    for section in _AUTO_DROPPING_SECTIONS:
        if isinstance(ds.get(section), dict):
            ds[section] = {k: v for k, v in ds[section].items() if v != "auto"}
    left = _find_auto(ds, "")
    if left:
        raise ConfigError(
            f"ds_config {left[0]} = \"auto\": dsrl cannot derive this value. Fix: set it explicitly."
        )
    return ds
