"""Building the policy model: a local Hugging Face checkpoint or a tiny random-init model.

Invariants:
- every rank that calls :func:`build_model` with the same arguments gets bit-identical weights (the
  tiny model is initialised on the CPU under a forked, explicitly seeded RNG, so the global RNG
  state of the caller is left untouched and the device does not change the draw);
- nothing is downloaded: checkpoints load with ``local_files_only=True``;
- the dtype follows ``model.dtype``: ``"auto"`` is bfloat16 on an accelerator that supports it and
  float32 otherwise (the CPU always gets float32).

The reference model for a KL penalty is a :func:`frozen_copy` of the policy taken *before*
``deepspeed.initialize`` (a ZeRO-3 engine partitions the module in place, so a later deepcopy would
copy empty shards); a LoRA policy needs none (the policy with its adapters disabled, :mod:`dsrl.rl.policy.lora`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from dsrl.config import ModelConfig
from dsrl.config.names import MOE_TINY_ARCHS

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
# The tiny mixture-of-experts model (arch qwen3_moe): every layer's MLP is 4 experts of which each token uses 2,
# the top-2 probabilities renormalised (norm_topk_prob, as in Qwen3-30B-A3B; DeepSpeed AutoEP's Qwen-MoE preset
# follows the config's norm_topk_prob). Same attention as the dense tiny models.
TINY_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "output_router_logits": False,
}


def resolve_dtype(dtype: str, on_gpu: bool) -> torch.dtype:
    """The torch dtype for ``model.dtype`` (validated by ModelConfig): auto = bfloat16 on a bf16-capable
    accelerator, else float32."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if on_gpu:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().is_bf16_supported():
            return torch.bfloat16
    return torch.float32


def tiny_config(arch: str, vocab_size: int, pad_token_id: int | None, bos_token_id: int | None,
                eos_token_id: int | list[int] | None, overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config of the built-in tiny model (``TINY_DEFAULTS`` updated by ``overrides``).

    ``arch`` is one of :data:`dsrl.config.names.TINY_ARCHS` (``ModelConfig.arch`` admits nothing else).
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}
    moe = TINY_MOE_DEFAULTS if arch in MOE_TINY_ARCHS else {}
    kwargs = {**TINY_DEFAULTS, **moe, "vocab_size": vocab_size, "pad_token_id": pad_token_id,
              "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, **(overrides or {})}
    return classes[arch](**kwargs)


def build_model(
    model_cfg: ModelConfig,
    vocab_size: int,
    pad_token_id: int | None,
    bos_token_id: int | None,
    eos_token_id: int | list[int] | None,
    on_gpu: bool,
    *,
    seed: int = 0,
) -> torch.nn.Module:
    """The policy as a ``transformers.PreTrainedModel`` in train mode, on the CPU.

    ``model_cfg`` is a :class:`dsrl.config.ModelConfig`. With ``model_cfg.path`` the checkpoint is
    loaded from that local directory; otherwise a tiny ``model_cfg.arch`` model is initialised from
    ``seed`` (identical on every rank). ``vocab_size`` and the special token ids only apply to the
    tiny model; a checkpoint keeps its own. With ``model_cfg.lora`` the result is a PEFT model whose
    adapters (drawn from ``seed``) are its only trainable parameters (:mod:`dsrl.rl.policy.lora`). The caller
    (DeepSpeed) moves the model to the device.
    """
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(model_cfg.dtype, on_gpu)
    attn = {"attn_implementation": model_cfg.attn_implementation} if model_cfg.attn_implementation else {}
    if model_cfg.path:
        if not os.path.isdir(model_cfg.path):
            raise FileNotFoundError(
                f"model.path = {model_cfg.path!r} is not a directory; set model.path to a local Hugging Face "
                "checkpoint directory (config.json + weights), or leave it unset for the built-in tiny model"
            )
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, local_files_only=True, dtype=dtype, **attn)
    else:
        config = tiny_config(model_cfg.arch, vocab_size, pad_token_id, bos_token_id, eos_token_id, model_cfg.tiny)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_cfg.lora is not None:  # adapters as the only trainable parameters (dsrl.rl.policy.lora)
        from dsrl.rl.policy.lora import apply_lora

        model = apply_lora(model, model_cfg.lora, seed=seed, base_path=model_cfg.path)
    model.train()
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy in eval mode with ``requires_grad=False`` everywhere (the KL reference policy).

    Take it before ``deepspeed.initialize``: under ZeRO-3 the original's parameters are partitioned
    in place afterwards. The copy is an ordinary module; keep it on the device with ``.to(device)``
    (memory: one more full model per rank) or wrap it in its own inference engine.
    """
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref
