"""``dsrl.check`` on a LoRA run file (``dsrl.model.lora``): the check's model gets the run's adapters.

The model is a tiny Hugging Face causal LM (``--model qwen2`` or ``llama``; ``auto`` picks qwen2) wrapped by PEFT
with the run's ``r``, ``alpha``, ``target_modules`` and ``modules_to_save`` and no dropout (a random mask could not
be reproduced by the reference). PEFT starts every ``B`` at zero, which would leave every ``A`` without a gradient,
so the check draws ``B`` at random (seeded): both factors then get gradients. The reference is the same PEFT model
in float64; the comparison covers every parameter, so the adapters' applied update must equal the reference
gradient and the frozen base weights must not move at all (their reference gradient is zero).
"""

from __future__ import annotations

from typing import Any

import torch

LORA_MODELS = ("qwen2", "llama")
B_STD = 0.1  # the check's random B: the adapted model differs from the base and A gets a gradient (larger B
# makes the float32 forward itself worse conditioned: B_STD 0.5 puts a plain float32 gradient 1.5e-6 from float64)


def lora_settings(raw: dict[str, Any]) -> Any:
    """The run file's :class:`dsrl.config.LoraConfig`, or None (``raw``: the run file as a dict)."""
    from dsrl.config import LoraConfig

    lora = ((raw.get("dsrl") or {}).get("model") or {}).get("lora")
    return LoraConfig(**lora) if isinstance(lora, dict) else None


def lora_model_for(requested: str, objective: str) -> str:
    """The check's architecture under LoRA: qwen2 or llama (``auto`` = qwen2); the tiny custom model and the
    critic's value objective are refused with the fix."""
    from dsrl.config import ConfigError

    if "value" in objective.split(","):
        raise ConfigError("dsrl.check --objective value with dsrl.model.lora: the critic trains all its parameters "
                          "(LoRA adapts the policy only). Fix: check the value objective with a run file without "
                          "dsrl.model.lora.")
    from dsrl.cli.check_models import is_model_dir

    if requested == "auto":
        return "qwen2"
    if requested not in LORA_MODELS and not is_model_dir(requested):
        raise ConfigError(f"dsrl.check --model {requested} with dsrl.model.lora: the adapters need a Hugging Face "
                          f"model. Fix: --model {' or '.join(LORA_MODELS)} (or auto), or a model directory.")
    return requested


def with_adapters(model: torch.nn.Module, lora: Any, seed: int) -> torch.nn.Module:
    """``model`` wrapped with the run's adapters (no dropout), every ``B`` drawn from N(0, B_STD^2) with ``seed``."""
    from dsrl.rl.policy.lora import apply_lora

    wrapped = apply_lora(model, lora, seed=seed, dropout=0.0)
    g = torch.Generator().manual_seed(seed + 31)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * B_STD)
    return wrapped


def adapter_parameters(names: Any) -> list[str]:
    """The trainable names among a PEFT model's parameter names: adapters and modules_to_save copies."""
    return [n for n in names if ".lora_" in n or ".modules_to_save." in n]
