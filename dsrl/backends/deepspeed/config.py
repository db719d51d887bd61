"""The ds_config DeepSpeed is allowed to see, derived from the run file and the batch plan.

Invariants (architecture §7): the result never contains the ``"dsrl"`` or ``"scheduler"`` sections
or any ``"auto"``; it always sets ``gradient_clipping`` explicitly (a finite number >= 0), turns DeepSpeed's
throughput timer off unless the user turned it on (it synchronizes the device on every forward of the
engine's module once two steps have run; a warning says so when it is on), runs with
``managed_gradient_accumulation: false`` and ``gradient_accumulation_steps: 1``, accumulates and
communicates gradients in fp32 under bf16/fp16 unless the user chose otherwise, and rejects what
DeepSpeed accepts but dsrl cannot run (the pipeline engine) or would run wrong (a user-managed
accumulation boundary). Everything DeepSpeed itself rejects is found by DeepSpeed's own classes on
the result (:mod:`dsrl.backends.deepspeed.validation`), not by rules copied here.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any

from dsrl.config import DS_BATCH_KEYS, Config, ConfigError

# DeepSpeed >= 0.19 clips at 1.0 when gradient_clipping is omitted; dsrl always states it explicitly.
DEFAULT_GRADIENT_CLIPPING = 1.0

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


THROUGHPUT_TIMER_WARNING = (
    "ds_config timers.throughput.enabled = true: DeepSpeed's throughput timer synchronizes the device on every "
    "forward of the engine's module once two optimizer steps have run, which stalls the GPU's run-ahead in training "
    "forwards (dsrl runs generation and no-grad passes outside the engine's hooks). Remove the key (dsrl turns the "
    "timer off) unless you need DeepSpeed's samples/s lines.")


def _throughput_timer(ds: dict[str, Any]) -> None:
    """DeepSpeed's throughput timer off unless the user asked for it (then a warning, from rank 0)."""
    timers = ds.setdefault("timers", {})
    if not isinstance(timers, dict):
        raise ConfigError(f"ds_config timers = {timers!r} must be a section (an object), e.g. "
                          '{"throughput": {"enabled": false}}. Fix: write it as an object or remove it.')
    throughput = timers.setdefault("throughput", {})
    if not isinstance(throughput, dict):
        raise ConfigError(f"ds_config timers.throughput = {throughput!r} must be a section (an object), e.g. "
                          '{"enabled": false}. Fix: write it as an object or remove it.')
    if throughput.get("enabled", "auto") in ("auto", None, False):
        throughput["enabled"] = False
    elif os.environ.get("RANK", "0") == "0":
        logging.getLogger("dsrl").warning(THROUGHPUT_TIMER_WARNING)


def sequence_parallel_size(ds_config: dict[str, Any]) -> int:
    """``sequence_parallel_size`` (Ulysses; read by dsrl and deepspeed.initialize, not DeepSpeedConfig)."""
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp is None:
        return 1
    if isinstance(sp, bool) or not isinstance(sp, int) or sp <= 0:
        raise ConfigError(f"ds_config sequence_parallel_size = {sp!r} must be a positive integer (1 = off). "
                          "Fix: set it to the number of ranks that share one sequence.")
    return sp


def data_parallel_size(ds_config: dict[str, Any], world_size: int) -> int:
    """D of the plan: the replicas holding different sequences, world / (autotp_size * sequence_parallel_size),
    with every divisibility rule checked (:func:`dsrl.backends.deepspeed.autotp.data_parallel_replicas`)."""
    from dsrl.backends.deepspeed.autoep import check_expert_layout
    from dsrl.backends.deepspeed.autotp import data_parallel_replicas

    check_expert_layout(ds_config, world_size)  # AutoEP folds inside the replicas: D does not change
    return data_parallel_replicas(ds_config, world_size, sequence_parallel_size(ds_config))


def resolve_deepspeed_config(
    cfg: Config, plan: Any, *, on_gpu: bool, bf16_supported: bool | None = None
) -> dict[str, Any]:
    """The ds_config handed to ``deepspeed.initialize`` (see the module docstring's invariants).

    ``plan`` is the run's :class:`dsrl.core.plan.BatchPlan`; an explicit DeepSpeed batch field that
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
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        # DeepSpeed reads it unchecked: a string fails mid-step, NaN would put NaN into the weights.
        raise ConfigError(
            f"ds_config gradient_clipping = {clip!r} must be a finite number >= 0 (0 = no clipping). "
            f"Fix: set gradient_clipping to e.g. {DEFAULT_GRADIENT_CLIPPING}."
        )
    ds["gradient_clipping"] = float(clip)

    if bf16_supported is None:
        bf16_supported = on_gpu
    for name, default in (("bf16", bf16_supported), ("fp16", False)):
        if isinstance(ds.get(name), dict):
            ds[name]["enabled"] = _resolve_enabled(ds[name], default)
    bf16 = _resolve_enabled(ds.get("bf16"), False)
    fp16 = _resolve_enabled(ds.get("fp16"), False)
    if bf16 or fp16:
        # Exactness: accumulate and communicate gradients in fp32 unless the user chose otherwise.
        if isinstance(ds.setdefault("data_types", {}), dict):
            ds["data_types"].setdefault("grad_accum_dtype", "fp32")
        ds.setdefault("communication_data_type", "fp32")

    _throughput_timer(ds)

    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == "auto":
        zero["stage"] = 0
    from dsrl.backends.deepspeed.autotp import resolve_section

    resolve_section(ds)  # AutoTP: full-vocabulary logits (vocab_parallel_lm_head false)
    if "pipeline" in ds:
        raise ConfigError(
            "ds_config pipeline: DeepSpeed's pipeline engine cannot run step-owned accumulation. "
            "Fix: remove the pipeline section; for pipeline parallelism embed dsrl in Megatron (docs/megatron.md)."
        )

    if not on_gpu:
        opt = ds.get("optimizer")
        if (isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw")
                and isinstance(opt.setdefault("params", {}), dict)):
            # DeepSpeed would JIT-build CPUAdam; the torch implementation is exact and builds nothing. The same
            # with memory.offload_states on or off (under ZeRO-3 dsrl moves any optimizer's states: offload.py).
            opt["params"].setdefault("torch_adam", True)

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
