"""``dsrl.rollout``: generation."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import field_validator

from dsrl.config.errors import ConfigError
from dsrl.config.names import AUTO_BACKEND, COLOCATED, Placement, RolloutBackendName
from dsrl.config.section import Section, setting


class RolloutConfig(Section):
    """Generation."""

    PATH: ClassVar[str] = "dsrl.rollout"

    placement: Placement = setting(
        COLOCATED, "colocated: every rank generates, then trains; disaggregated: the last generator_ranks ranks "
                   "only generate (each with its own copy of the weights, no optimizer state), the others only "
                   "train, up to algorithm.max_staleness versions apart (docs/async.md)")
    generator_ranks: int = setting(
        0, "disaggregated: how many ranks (the job's last ones) generate; 0 when colocated", "ranks", ge=0)
    backend: RolloutBackendName = setting(
        AUTO_BACKEND, "generation backend: auto (cb or hf for the run's workload, whichever was measured faster "
        "in the training loop: the device, attention, model size, parallel layout, concurrent sequences and new "
        "tokens per call decide; dsrl plan prints the choice and why; docs/rollout.md), hf (transformers generate), "
        "cb (transformers continuous batching, one manager and its CUDA graphs kept for the run), vllm")
    cb_attention: Literal["auto", "model", "varlen"] = setting(
        "auto", "attention inside continuous batching (cb): model (the model's attn_implementation; sdpa/eager "
        "then attend through a dense mask), varlen (dsrl's packed attention: PyTorch's own flash kernel on a GPU "
        "in bf16/fp16), auto (varlen on the CPU for models >= 1 M parameters or >= 128 concurrent sequences, "
        "as measured; on a GPU in bf16/fp16, not measured there: docs/rollout.md)")
    max_new_tokens: int = setting(
        16, "completion length limit (with data.environment: per model turn)", "tokens", gt=0)
    stop_strings: list[str] = setting(
        list, "strings that end a completion (with data.environment: a model turn) like eos, kept as its last token; "
              "each must be exactly one token of the tokenizer, e.g. the closing bracket of a tool call")
    max_turns: int = setting(
        8, "with data.environment: model turns per trajectory at most; a trajectory the environment has not ended "
           "after them is truncated (like a completion cut at max_new_tokens)", "turns", gt=0)
    max_trajectory_tokens: int = setting(
        1024, "with data.environment: tokens after the prompt (model and observation tokens) per trajectory at "
              "most; a trajectory that reaches it, or whose next observation would not fit, is truncated",
        "tokens", gt=0)
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

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings_not_empty(cls, strings: list[str]) -> list[str]:
        """Every entry of `stop_strings` is a non-empty string, none repeated (that each is one token of the
        tokenizer is checked when the rollout backend is built)."""
        for s in strings:
            if not s:
                raise ConfigError(f"{cls.PATH}.stop_strings holds an empty string, which can never end a turn. Fix: "
                                  "remove it.")
        if len(set(strings)) != len(strings):
            raise ConfigError(f"{cls.PATH}.stop_strings = {strings!r} repeats an entry. Fix: list each string once.")
        return strings
