"""A learned reward model: a local ``AutoModelForSequenceClassification`` directory (``dsrl.data.reward_model``).

Invariants kept by :class:`RewardModel`:

- a sample's score is the classification head's output at its *last valid token* (the last token of
  prompt + completion: eos when the completion emitted it), read from the head's per-position output
  with a forward hook, so it never depends on the model's pad-token convention or on padding;
- the model is frozen and placed like the policy by the policy's engine (:meth:`dsrl.core.engine.TrainEngine.frozen`;
  DeepSpeed under ZeRO-3: an optimizer-less engine sharded over the ranks); scoring is then collective, and every
  rank runs the same number of forwards whatever number of sequences it scores (filler forwards of a one-token
  sequence, counted by :meth:`RewardModel.take_filler_forwards`) -- with dynamic sampling, ranks score different
  prompt counts;
- no download: the directory is read with ``local_files_only``; it must share the policy's tokenizer
  (its vocabulary covers every token id the policy can emit).

The reward of a sample is ``data.reward_model_weight * score + data.rule_reward_weight * rule reward``
(``dsrl.rl.experience``). :func:`save_tiny_reward_model` writes a tiny one from a config, for tests and demos.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dsrl.core.engine import FrozenPasses, TrainEngine


class RewardModel:
    """Scores token sequences with a sequence-classification model (module docstring)."""

    def __init__(self, frozen: FrozenPasses, head: torch.nn.Module, pad_id: int, micro_batch_size: int,
                 device: torch.device):
        """``frozen``: the model as the policy's engine placed it (:meth:`dsrl.core.engine.TrainEngine.frozen`, with
        its weights' offload between scoring passes under ``dsrl.memory.offload_states``); ``head`` its score
        head, whose per-position output a forward hook reads."""
        self.frozen, self.pad_id, self.micro_batch_size, self.device = frozen, pad_id, micro_batch_size, device
        self._per_position: torch.Tensor | None = None
        head.register_forward_hook(self._capture)

    def _capture(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        self._per_position = output

    @classmethod
    def load(cls, path: str, tokenizer: PreTrainedTokenizerBase, rl: TrainEngine, *, on_gpu: bool,
             micro_batch_size: int, offload: Callable[[Any], Any] | None = None) -> RewardModel:
        """Load ``path`` (``dsrl.data.reward_model``) and place it like the policy engine ``rl`` (``offload``: with
        ``dsrl.memory.offload_states``, makes the placed model's weights' offload; :meth:`TrainEngine.frozen`)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from dsrl.rl.policy.model import resolve_dtype

        field = "dsrl.data.reward_model"
        if not os.path.isdir(path):
            raise ConfigError(f"{field} = {path!r} is not a directory. Fix: point it at a local Hugging Face "
                              "AutoModelForSequenceClassification directory (config.json + weights).")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if getattr(config, "num_labels", 1) != 1:
            raise ConfigError(f"{field} = {path!r} has num_labels = {config.num_labels}; a reward model gives one "
                              "score per sequence. Fix: use a model saved with num_labels = 1.")
        if getattr(config, "vocab_size", len(tokenizer)) < len(tokenizer):
            raise ConfigError(f"{field} = {path!r}: its vocabulary ({config.vocab_size}) is smaller than the policy's "
                              f"tokenizer ({len(tokenizer)}); the reward model must share the policy's tokenizer.")
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id  # lets transformers run batches; dsrl reads the head itself
        dtype = resolve_dtype("auto", on_gpu)
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, local_files_only=True,
                                                                   dtype=dtype)
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ConfigError(f"{field} = {path!r} is a {type(model).__name__} without a 'score' head; dsrl reads the "
                              "score of causal-LM sequence classifiers (Llama, Qwen2, Mistral, ... "
                              "ForSequenceClassification).")
        return cls(rl.frozen(model, offload), head, tokenizer.pad_token_id, micro_batch_size, rl.device)

    def _forward(self, model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], use_cache=False)
        scores = self._per_position[..., 0].float()
        return scores.gather(1, micro["last"].unsqueeze(1)).squeeze(1).cpu()

    def _collate(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        last = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long)
        return {k: v.to(self.device) for k, v in {"input_ids": ids, "attention_mask": mask, "last": last}.items()}

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        """One score per token sequence (prompt + completion ids, unpadded, non-empty), at its last token.

        Collective under ZeRO-3: every rank calls it the same number of times (possibly with no sequence).
        """
        if any(not s for s in sequences):
            raise ValueError("RewardModel.score: every sequence needs at least one token")
        micros = [self._collate(sequences[i:i + self.micro_batch_size])
                  for i in range(0, len(sequences), self.micro_batch_size)]
        filler = self._collate([[self.pad_id]])
        outs = self.frozen.forward_no_grad(micros, self._forward, filler)
        return [float(x) for out in outs for x in out.tolist()]

    def take_filler_forwards(self) -> int:
        """The forwards this rank ran only to match other ranks' counts (ZeRO-3) since the last call, and reset."""
        fillers, self.frozen.filler_forwards = self.frozen.filler_forwards, 0
        return fillers


def save_tiny_reward_model(path: str, tokenizer: PreTrainedTokenizerBase, arch: str = "qwen2", seed: int = 0,
                           overrides: dict[str, Any] | None = None) -> str:
    """Write a tiny random-init ``AutoModelForSequenceClassification`` (num_labels 1) and ``tokenizer`` to
    ``path`` with ``save_pretrained`` (built from a config: no download). Returns ``path``."""
    from transformers import AutoModelForSequenceClassification

    from dsrl.rl.policy.model import tiny_config

    config = tiny_config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                         {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, **(overrides or {})})
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # a visible spread of scores: the default init gives |score| ~ 1e-2
            model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
