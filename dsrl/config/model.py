"""``dsrl.model``: the policy (and reference) model."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from dsrl.config.names import TinyArch
from dsrl.config.section import Section, setting


class ModelConfig(Section):
    """The policy (and reference) model."""

    PATH: ClassVar[str] = "dsrl.model"

    path: str | None = setting(None, "local directory of a HF causal LM; unset = the built-in tiny model")
    tokenizer: str | None = setting(None, "tokenizer directory; unset = model.path, or the shipped tiny tokenizer")
    arch: TinyArch = setting("qwen2", "architecture of the tiny model")
    tiny: dict[str, Any] = setting(dict, "overrides of the tiny model's transformers config")
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", "load dtype; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: str | None = setting(
        None, "transformers attn_implementation (sdpa, flash_attention_2, eager)")
    gradient_checkpointing: bool = setting(False, "activation checkpointing")
    apex: Literal["auto", "off"] = setting(
        "auto", "NVIDIA apex where it imports: on GPU its prebuilt FusedAdam replaces the FusedAdam DeepSpeed would "
                "compile for a ds_config Adam/AdamW (same update rule; docs/benchmarks.md); 'off' = never")
    packing: bool = setting(
        False, "padding-free micro-batches: sequences packed into one row, position_ids restarting per sequence "
               "and no attention mask (transformers builds the block-diagonal mask on sdpa/eager, varlen kernels "
               "on flash attention); the token budget then counts real tokens only")
