"""The generation interface every rollout backend implements.

Contract of :meth:`RolloutBackend.generate` (all backends):
- it returns exactly ``len(prompt_ids) * samples_per_prompt`` completions, grouped contiguously per
  prompt: the G samples of prompt 0, then the G samples of prompt 1, ...;
- ``completion_ids`` end at the first end-of-sequence token, which is kept, and hold no padding;
  ``finished`` is True exactly when that eos was produced (False: cut at ``max_new_tokens``). The
  tokens of ``rollout.stop_strings`` (one token each, :func:`stop_token_ids`) end a completion exactly
  like eos;
- the result depends only on the weights, the prompts, the rollout settings and ``seed``, so a
  resumed run that regenerates with the same seed gets the same completions on the same hardware;
- every completion carries its behavior log-probs, one per completion token: log mu(token), the log-prob
  under the distribution it was sampled from (after temperature, top-k and top-p; with greedy decoding,
  tests only, the untempered one), as the backend's own forward computed it. The trainer's re-computed
  log-probs pi_old differ from them by the kernels (and, with top-k/top-p, by the truncation), which the
  off-policy correction (:mod:`dsrl.algos.correction`) measures and corrects;
- a backend whose :meth:`RolloutBackend.returns_routes` is True gives every completion of a mixture-of-experts
  policy its ``routes`` (:mod:`dsrl.rollout.routes`): the experts each MoE layer's router chose for every input
  position of prompt + completion (``[len(prompt) + len(completion) - 1, moe_layers, top_k]``), as the backend's
  own forwards chose them;
- every data-parallel rank calls ``generate`` the same number of times (the call may gather the
  ZeRO-3 parameters collectively); the number of prompts and the lengths may differ per rank, and a
  rank with no prompts still calls it with an empty list;
- :meth:`RolloutBackend.with_sampling` gives a backend on the *same* policy (no second copy of the weights, no
  second engine) that samples with other settings (temperature, top-p, top-k, max_new_tokens: an evaluation's);
  it keeps this contract, its calls are bounded as this backend's are (the same sequences at once, each longer by
  the change in ``max_new_tokens``), and its :meth:`RolloutBackend.close` releases only what it built itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from dsrl.config import ConfigError, RolloutConfig
from dsrl.core.forwards import PolicyForwards

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What a backend generates with: a training wrapper's policy (dsrl.core.forwards.PolicyForwards: an RLEngine) or a
# plain module (a generator rank's own copy, a test's model).
GenerationPolicy: TypeAlias = "PolicyForwards | torch.nn.Module"


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts list given to generate
    prompt_ids: list[int]  # unpadded prompt tokens
    completion_ids: list[int]  # generated tokens up to and including the first eos, no padding
    finished: bool  # True if eos (or a rollout.stop_strings token) was produced (False = cut at max_new_tokens)
    # log mu(token) per completion token: the log-prob of each token under the distribution the backend sampled it
    # from (temperature, top-k and top-p applied), computed with the backend's own kernels (ARCHITECTURE §8)
    behavior_logprobs: list[float] | None = None
    # the policy version (weight syncs) of the weights that generated it; None = the trainer's current weights
    version: int | None = None
    # mixture-of-experts policies: the experts the backend's routers chose, [positions, moe_layers, top_k] int16
    # (dsrl.rollout.routes; FREE = -1 where none was recorded); None = not recorded
    routes: Any = None


class RolloutBackend(ABC):
    """Generates completions with the current policy weights."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """``len(prompt_ids) * samples_per_prompt`` completions grouped per prompt (see module docstring)."""

    def returns_routes(self) -> bool:
        """Whether every completion carries its ``routes`` (a mixture-of-experts policy whose routers this backend
        records); False by default."""
        return False

    def begin(self, rollout_index: int) -> None:  # noqa: B027 - a no-op is the right default
        """The run (or this invocation of a resumed run) starts at ``rollout_index`` (rollouts done so far); called
        once on every rank before the first :meth:`sync_weights`. A backend whose generation runs elsewhere (the
        generator ranks of :mod:`dsrl.rl.disagg.remote`) tells them where to start; the local backends need
        nothing."""

    def sync_weights(self) -> None:  # noqa: B027 - a no-op is the right default
        """Make the generator use the policy's current weights (a no-op when they are shared)."""

    def sleep(self) -> None:  # noqa: B027 - a no-op is the right default
        """Free what the backend holds on the device beyond the policy until the next :meth:`sync_weights` /
        :meth:`generate` (called after each rollout's generation): vLLM's engine sleeps
        (``dsrl.memory.vllm_sleep_level``), continuous batching destroys its kept manager and paged cache under
        ``dsrl.memory.offload_states``. Nothing by default: ``hf`` holds nothing of its own between calls."""

    def take_timing(self) -> dict[str, float]:
        """Seconds spent on the rollout side since the last call, by name, and reset: ``wait_s`` (waiting for
        completions), ``publish_s`` (sending weights), ``generation_s`` and ``idle_s`` (a remote generator's, as it
        reported them), ``weight_sync_s``, ``weight_sync_bytes`` and ``weight_sync_buckets`` (a backend with weights
        of its own: the last sync, :mod:`dsrl.core.buckets`). Empty for a backend that generates in the caller's time
        and shares the policy's weights (its cost is the caller's)."""
        return {}

    def close(self) -> None:  # noqa: B027 - a no-op is the right default
        """Release what the backend holds beyond the policy (an engine, its memory); called once at the end."""

    def with_sampling(self, rollout_cfg: RolloutConfig) -> RolloutBackend:
        """A backend generating with the same policy, and the same weights, under ``rollout_cfg``'s sampling
        (``temperature`` 0 = greedy, ``top_p``, ``top_k``, ``max_new_tokens``; the module docstring's last rule).
        Call :meth:`sync_weights` on it before generating (a backend with its own copy of the weights reloads the
        current ones) and :meth:`close` when done. The default refuses: a backend that cannot generate with other
        settings says so."""
        raise NotImplementedError(f"{type(self).__name__} cannot generate with other sampling settings (an "
                                  "evaluation's); use rollout.backend 'hf', 'cb', 'auto' or 'vllm'")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(e) for e in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | None = None) -> list[int]:
    """The end-of-sequence token ids: the tokenizer's first, then those the model's generation config adds (a chat
    model's authors list every token that ends its turn there, e.g. Qwen2.5-Instruct's ``<|endoftext|>`` beside
    the tokenizer's ``<|im_end|>``, Llama-3.1's ``<|eom_id|>`` beside ``<|eot_id|>``). Nothing else of the
    generation config is read: sampling and lengths come from the run file alone."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    if model is not None:
        gen = getattr(model, "generation_config", None)
        ids += [e for e in _ids(getattr(gen, "eos_token_id", None)) if e not in ids]
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; generation could never stop a completion")
    return ids


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | None,
                   rollout_cfg: RolloutConfig) -> list[int]:
    """The ids that end a completion: the eos ids (:func:`eos_ids`, first) and then the one token of each of
    ``rollout.stop_strings``. A stop string that is not exactly one token is a ConfigError (a stop token keeps
    generation token-exact: no completion is ever cut inside a token or re-tokenized)."""
    ids = eos_ids(tokenizer, model)
    for text in rollout_cfg.stop_strings or []:
        encoded = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(encoded) != 1:
            raise ConfigError(
                f"dsrl.rollout.stop_strings entry {text!r} is {len(encoded)} tokens of the tokenizer "
                f"({encoded}), not one: a stop string ends a turn as one token, like eos. Fix: use a string the "
                "tokenizer encodes as a single token (e.g. one closing character, or a special token).")
        if encoded[0] not in ids:
            ids.append(int(encoded[0]))
    return ids


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """(tokens up to and including the first eos, whether an eos was found)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False

