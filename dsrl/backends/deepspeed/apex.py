"""NVIDIA apex's fused optimizer where apex is importable; never required.

DeepSpeed builds its own ``FusedAdam`` for a ds_config ``"optimizer": {"type": "Adam" | "AdamW"}`` on
GPU by compiling a CUDA extension the first time a machine runs it (nvcc and ninja at run time,
about a minute, cached under ``~/.cache/torch_extensions``). NVIDIA's GPU images ship apex with the
same multi-tensor Adam kernel already built. Where ``apex.optimizers.FusedAdam`` imports and its
CUDA extension is present, dsrl builds that optimizer from the ds_config's own hyper-parameters and
hands it to DeepSpeed as the client optimizer (DeepSpeed lists it among ZeRO's supported optimizers),
so nothing is compiled at start-up; the update rule is the same (DeepSpeed's kernel is a port of
apex's). Everything else (the ds_config, ZeRO, clipping, dsrl's step and scheduler) is unchanged.

The swap happens only when all of these hold, else DeepSpeed's own path runs exactly as before:
``dsrl.model.apex = "auto"``; a GPU; no client optimizer passed to ``dsrl.initialize``; a ds_config
optimizer of type Adam or AdamW without ``torch_adam``, ``amsgrad`` or an optimizer offload; and
apex's FusedAdam with its CUDA extension importable.

Megatron: megatron-core itself picks apex's ``FusedLayerNorm`` (local layer spec) and ``FusedAdam``
(``get_megatron_optimizer``) when apex imports, so the Megatron example gets them with no dsrl code.
"""

from __future__ import annotations

from typing import Any

import torch

ADAM_TYPES = ("adam", "adamw")


def apex_fused_adam() -> type | None:
    """``apex.optimizers.FusedAdam`` when apex and its CUDA extension (``amp_C``) are importable, else None."""
    try:
        from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore[import-not-found]
        from apex.optimizers import FusedAdam  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - a broken apex install is "no apex", never an error
        return None
    return FusedAdam if getattr(multi_tensor_applier, "available", False) else None


def apex_adam_reason(ds_config: dict[str, Any], setting: str, on_gpu: bool, client_optimizer: Any) -> str | None:
    """Why apex's FusedAdam would *not* be used (a short phrase), or None when it would be."""
    opt = ds_config.get("optimizer")
    params = (opt or {}).get("params") or {}
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if setting != "auto":
        return "dsrl.model.apex = 'off'"
    if not on_gpu:
        return "not on a GPU"
    if client_optimizer is not None:
        return "a client optimizer was given"
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ADAM_TYPES:
        return "the ds_config optimizer is not Adam/AdamW"
    if params.get("torch_adam") or params.get("amsgrad"):
        return "torch_adam/amsgrad is set"
    if str(offload).lower() not in ("none", ""):
        return "the optimizer is offloaded (DeepSpeed's CPU Adam)"
    if apex_fused_adam() is None:
        return "apex (with its CUDA extension) is not importable"
    return None


def apex_adam_for(ds_config: dict[str, Any], model_parameters: Any, setting: str, on_gpu: bool,
                  client_optimizer: Any = None) -> tuple[torch.optim.Optimizer | None, dict[str, Any]]:
    """``(apex FusedAdam, ds_config without its "optimizer")`` when the swap applies (module docstring),
    else ``(None, ds_config)`` unchanged. The optimizer takes the ds_config's lr, betas, eps,
    weight_decay and DeepSpeed's AdamW-mode rule (type AdamW: decoupled decay; type Adam: decoupled
    unless ``adam_w_mode`` is false)."""
    if apex_adam_reason(ds_config, setting, on_gpu, client_optimizer) is not None:
        return None, ds_config
    fused_adam = apex_fused_adam()
    opt = ds_config["optimizer"]
    params = dict(opt.get("params") or {})
    adam_w_mode = True if str(opt["type"]).lower() == "adamw" else bool(params.get("adam_w_mode", True))
    kwargs = {k: params[k] for k in ("lr", "eps", "weight_decay", "bias_correction") if k in params}
    if "betas" in params:
        kwargs["betas"] = tuple(params["betas"])
    optimizer = fused_adam(model_parameters, adam_w_mode=adam_w_mode, **kwargs)
    return optimizer, {k: v for k, v in ds_config.items() if k != "optimizer"}
