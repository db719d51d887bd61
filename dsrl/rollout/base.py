"""The generation interface every rollout backend implements.

Contract of :meth:`RolloutBackend.generate` (all backends):
- it returns exactly ``len(prompt_ids) * samples_per_prompt`` completions, grouped contiguously per
  prompt: the G samples of prompt 0, then the G samples of prompt 1, ...;
- ``completion_ids`` end at the first end-of-sequence token, which is kept, and hold no padding;
  ``finished`` is True exactly when that eos was produced (False: cut at ``max_new_tokens``);
- the result depends only on the weights, the prompts, the rollout settings and ``seed``, so a
  resumed run that regenerates with the same seed gets the same completions on the same hardware;
- every data-parallel rank calls ``generate`` the same number of times (the call may gather the
  ZeRO-3 parameters collectively); the number of prompts and the lengths may differ per rank, and a
  rank with no prompts still calls it with an empty list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts list given to generate
    prompt_ids: list[int]  # unpadded prompt tokens
    completion_ids: list[int]  # generated tokens up to and including the first eos, no padding
    finished: bool  # True if eos was produced (False = truncated at max_new_tokens)
    logprobs: list[float] | None = None  # only on request: log pi(token) per completion token (raw logits)


class RolloutBackend(ABC):
    """Generates completions with the current policy weights."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """``len(prompt_ids) * samples_per_prompt`` completions grouped per prompt (see module docstring)."""

    def sync_weights(self) -> None:  # noqa: B027 - a no-op is the right default
        """Make the generator use the policy's current weights (a no-op when they are shared)."""


def eos_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The end-of-sequence token ids: the tokenizer's, else the model's generation config's."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None and model is not None:
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; generation could never stop a completion")
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """(tokens up to and including the first eos, whether an eos was found)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


def make_backend(rollout_cfg: Any, engine: Any, tokenizer: Any, **kwargs: Any) -> RolloutBackend:
    """The backend named by ``rollout.backend``: ``"hf"`` (transformers generate on the policy), ``"cb"``
    (transformers continuous batching on the policy), ``"auto"`` (per call one of these two, see
    :mod:`dsrl.rollout.auto`) or ``"vllm"`` (a colocated vLLM engine; ``kwargs`` go to
    :class:`dsrl.rollout.vllm.VLLMRolloutBackend`, e.g. ``model_path``)."""
    if rollout_cfg.backend == "hf":
        from dsrl.rollout.hf import HFRolloutBackend

        return HFRolloutBackend(engine, tokenizer, rollout_cfg)
    if rollout_cfg.backend in ("cb", "auto"):
        from dsrl.rollout.auto import AutoRolloutBackend
        from dsrl.rollout.cb import ContinuousBatchingBackend

        cls = ContinuousBatchingBackend if rollout_cfg.backend == "cb" else AutoRolloutBackend
        return cls(engine, tokenizer, rollout_cfg)
    if rollout_cfg.backend == "vllm":
        from dsrl.rollout.vllm import VLLMRolloutBackend

        return VLLMRolloutBackend(engine, tokenizer, rollout_cfg, **kwargs)
    raise ValueError(f"rollout.backend = {rollout_cfg.backend!r} is not one of 'hf', 'cb', 'auto', 'vllm'")
