"""``dsrl.rollout``: generation."""

from __future__ import annotations

from typing import ClassVar, Literal

from dsrl.config.names import HF_BACKEND, RolloutBackendName
from dsrl.config.section import Section, setting


class RolloutConfig(Section):
    """Generation."""

    PATH: ClassVar[str] = "dsrl.rollout"

    backend: RolloutBackendName = setting(
        HF_BACKEND, "generation backend: hf (transformers generate), cb (transformers continuous batching), auto "
        "(hf or cb per call, docs/rollout.md), vllm")
    cb_attention: Literal["auto", "model", "varlen"] = setting(
        "auto", "attention inside continuous batching (cb): model (the model's attn_implementation; sdpa/eager "
        "then attend through a dense mask), varlen (dsrl's packed attention: PyTorch's own flash kernel on a GPU "
        "in bf16/fp16), auto (varlen on the CPU for models >= 1 M parameters or >= 128 concurrent sequences, "
        "as measured; on a GPU in bf16/fp16, not measured there: docs/rollout.md)")
    max_new_tokens: int = setting(16, "completion length limit", "tokens", gt=0)
    temperature: float = setting(1.0, "sampling temperature", gt=0)
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest token set whose probability reaches top_p",
                           gt=0, le=1)
    top_k: int = setting(0, "top-k sampling (0 = off)", ge=0)
    generation_batch_size: int = setting(64, "prompts per generate() call on one rank", "prompts", gt=0)
    vllm_gpu_memory_utilization: float = setting(
        0.3, "vllm backend on a GPU: the fraction of the device the engine reserves (weights + KV cache) beside "
             "the training state; on the CPU dsrl sizes the KV cache from the workload", gt=0, lt=1)
    logprob_micro_batch_size: int = setting(
        16, "sequences per no-grad log-prob forward on one rank", "sequences", gt=0)
