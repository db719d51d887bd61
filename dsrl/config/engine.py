"""``dsrl.engine``: which training engine runs the policy, and its parallel layout (docs/megatron.md).

``kind = "deepspeed"`` (the default) is DeepSpeed's engine configured by the ds_config (ZeRO, AutoTP, AutoEP).
``kind = "megatron"`` is megatron-core's ``GPTModel`` under DDP (:mod:`dsrl.backends.megatron.engine`), with the
tensor and pipeline sizes below; the data-parallel size is what is left of the world. What does not combine with
it is refused by :mod:`dsrl.config.support` (LoRA, AutoTP, ZeRO, ...), each with its reason.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator

from dsrl.config.errors import problems_error
from dsrl.config.section import Section, setting

DEEPSPEED_ENGINE, MEGATRON_ENGINE = "deepspeed", "megatron"


class EngineConfig(Section):
    """The training engine: DeepSpeed's (configured by the ds_config) or megatron-core's, with its parallel
    layout."""

    PATH: ClassVar[str] = "dsrl.engine"

    kind: Literal["deepspeed", "megatron"] = setting(
        DEEPSPEED_ENGINE, "the policy's training engine: 'deepspeed' (ZeRO 0-3, AutoTP, AutoEP from the ds_config) or "
                          "'megatron' (megatron-core's GPTModel built from the HF config, with the sizes below)")
    tensor_model_parallel_size: int = setting(
        1, "kind 'megatron': ranks that split each layer's weights (must divide the attention heads, the KV heads "
           "and the vocabulary)", ge=1)
    pipeline_model_parallel_size: int = setting(
        1, "kind 'megatron': pipeline stages, each holding a contiguous share of the layers", ge=1)
    context_parallel_size: int = setting(
        1, "kind 'megatron': ranks that split each row's positions (Megatron's load-balanced chunks; dsrl's "
           "all-gather attention in megatron-core's local spec)", ge=1)
    expert_model_parallel_size: int = setting(
        1, "kind 'megatron': ranks that split a mixture-of-experts model's experts; only 1 (dense models)", ge=1)
    sequence_parallel: bool = setting(
        False, "kind 'megatron': megatron-core's sequence parallelism: the tensor group also splits the positions "
               "outside attention and MLP (activation memory / TP); needs tensor_model_parallel_size >= 2")

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica (tensor x pipeline x context): the world divided by it is the
        data-parallel size."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @model_validator(mode="after")
    def _layout_of_its_kind(self) -> EngineConfig:
        """Megatron's sizes belong to kind 'megatron'; of them, expert parallelism is not built under launch/train.py
        (dsrl's HF weight map is dense), and sequence parallelism needs a tensor group to split the positions over."""
        p = self.PATH
        set_here = [name for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                      "context_parallel_size", "expert_model_parallel_size")
                    if getattr(self, name) != 1] + (["sequence_parallel"] if self.sequence_parallel else [])
        problems = []
        if self.kind == DEEPSPEED_ENGINE and set_here:
            problems.append(f"{p}.{', '.join(set_here)} set with {p}.kind = 'deepspeed': these sizes lay out "
                            "megatron-core's engine; DeepSpeed's layout comes from the ds_config (ZeRO, "
                            "tensor_parallel.autotp_size). Fix: set dsrl.engine.kind to 'megatron', or remove them.")
        if self.kind == MEGATRON_ENGINE:
            if self.expert_model_parallel_size != 1:
                problems.append(f"{p}.expert_model_parallel_size = {self.expert_model_parallel_size}: dsrl's HF "
                                "weight map for megatron-core is for dense models. Fix: set it to 1, or train the "
                                "mixture-of-experts model on dsrl.engine.kind 'deepspeed' (AutoEP).")
            if self.sequence_parallel and self.tensor_model_parallel_size < 2:
                problems.append(f"{p}.sequence_parallel with {p}.tensor_model_parallel_size = 1: megatron-core's "
                                "sequence parallelism splits the positions over the tensor group. Fix: set "
                                "tensor_model_parallel_size >= 2, or sequence_parallel to false.")
        if problems:
            raise problems_error(problems)
        return self
