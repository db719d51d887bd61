"""LoRA (``dsrl.model.lora``): the policy wrapped by Hugging Face PEFT, the adapters its only trainable parameters.

Invariants:
- PEFT is imported only when ``dsrl.model.lora`` is set; without it the error is one sentence naming
  ``pip install -e '.[lora]' (in the dsrl checkout)``: a ConfigError when the run file is checked, before any work
  (:func:`dsrl.backends.deepspeed.validation.check_lora_run`), an ImportError from :func:`import_peft`;
- :func:`apply_lora` wraps the model *before* ``dsrl.initialize``: the adapters (and ``modules_to_save``) are then
  the only parameters with ``requires_grad``, so they are the only ones DeepSpeed's optimizer holds (its state
  shrinks accordingly) while the frozen base weights are still partitioned by ZeRO-3 like any other parameter.
  The adapters are initialised by PEFT (A random, B = 0) under a forked RNG seeded from the run seed, so every
  rank holds the same adapters and the adapted model starts equal to the base model;
- nothing about the step changes: the engine's averaging, the counts and the weights of ARCHITECTURE §2 act on
  whatever parameters have gradients (``dsrl.check`` compares the adapters' applied update with a float64
  reference of the same PEFT model);
- the KL reference is the policy engine itself with its adapters disabled (:class:`AdaptersDisabled`), never a
  second copy; it forwards through the engine with the same number of forwards on every rank (ZeRO-3);
- refused before any work: AutoTP and AutoEP (they replace the layers the adapters wrap; refused with the
  run file, rules ``autotp-lora`` and ``autoep-lora`` of :mod:`dsrl.config.support`), adapters or
  ``modules_to_save`` on the embedding or output head of a model with tied word embeddings (the tie would
  break), target modules that match nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import ConfigError, LoraConfig

if TYPE_CHECKING:
    from dsrl.core.engine import TrainEngine

INSTALL_HINT = ("dsrl.model.lora needs Hugging Face PEFT, which is not installed. Fix: in the dsrl checkout, "
                "pip install -e '.[lora]' (peft>=0.21,<0.22), or remove dsrl.model.lora to fine-tune every parameter.")
TIED_NAMES = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")


def import_peft() -> Any:
    """The ``peft`` module, or an ImportError whose message names the fix."""
    try:
        import peft
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return peft


def peft_config(lora: LoraConfig, *, dropout: float | None = None, task_type: str | None = "CAUSAL_LM") -> Any:
    """PEFT's ``LoraConfig`` for a :class:`dsrl.config.LoraConfig` (``dropout`` overrides its dropout: the
    exactness check runs with 0, where a random mask could not be reproduced by its reference)."""
    peft = import_peft()
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout if dropout is None else dropout,
                           target_modules=lora.target_modules, modules_to_save=lora.modules_to_save, bias="none",
                           task_type=task_type)


def _check_tied(model: torch.nn.Module, lora: LoraConfig) -> None:
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    named = [*(lora.target_modules if isinstance(lora.target_modules, list) else []), *(lora.modules_to_save or [])]
    clash = [n for n in named if n.split(".")[-1] in TIED_NAMES]
    if clash:
        raise ConfigError(f"dsrl.model.lora names {clash[0]!r}, the embedding or output head of a model with tied "
                          "word embeddings: adapting one of the two would silently untie them. Fix: adapt the "
                          "attention/MLP layers only (e.g. target_modules \"all-linear\"), or use a model without "
                          "tied embeddings.")


def apply_lora(model: torch.nn.Module, lora: LoraConfig, *, seed: int = 0, dropout: float | None = None,
               task_type: str | None = "CAUSAL_LM", base_path: str | None = None) -> torch.nn.Module:
    """``model`` wrapped by PEFT with ``lora``'s adapters (module docstring); the base weights are frozen.

    The adapters are drawn under a forked RNG seeded with ``seed`` (the caller's RNG stream is untouched), so
    every rank that calls this with the same arguments gets bit-identical adapters. ``base_path`` is recorded
    in the adapter config (``base_model_name_or_path``) for PEFT's loader."""
    peft = import_peft()
    _check_tied(model, lora)
    cfg = peft_config(lora, dropout=dropout, task_type=task_type)
    if base_path:
        cfg.base_model_name_or_path = base_path
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT 0.21 calls a transformers 5 deprecated property
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, cfg)
        except ValueError as e:  # PEFT: "Target modules ... not found in the base model"
            raise ConfigError(f"dsrl.model.lora: PEFT could not apply the adapters ({str(e).splitlines()[0]}). Fix: "
                              "set dsrl.model.lora.target_modules to module names of this model (e.g. [\"q_proj\", "
                              "\"v_proj\"]) or \"all-linear\".") from None
    wrapped.train(model.training)
    return wrapped


def is_lora_model(model: Any) -> bool:
    """Whether ``model`` (a module or an engine) is a PEFT model."""
    module = getattr(model, "module", model)
    return hasattr(module, "peft_config") and callable(getattr(module, "disable_adapter", None))


class AdaptersDisabled:
    """The KL reference of a LoRA policy: the policy's own engine with its adapters disabled (the base model), so
    no second copy of the weights exists. ``forward_no_grad(micros, fn)`` runs ``fn(engine, micro)`` through
    :meth:`dsrl.core.engine.TrainEngine.forward_no_grad` (eval mode, no gradients, the same number of
    forwards on every rank) inside PEFT's ``disable_adapter()``; the adapters are enabled again after."""

    def __init__(self, policy: TrainEngine):
        if not is_lora_model(policy):
            raise TypeError("AdaptersDisabled needs an engine whose module is a PEFT model (dsrl.model.lora)")
        self.policy = policy

    @contextlib.contextmanager
    def base_model(self):
        """The block runs the policy's module as its base model: every adapter layer off, then on again (PEFT's
        ``disable_adapter()`` without its model-status scan, which reads every parameter on every call)."""
        tuner = self.policy.module.base_model  # peft's LoraModel
        tuner.disable_adapter_layers()
        try:
            yield
        finally:
            tuner.enable_adapter_layers()

    @torch.no_grad()
    def forward_no_grad(self, micro_batches: Sequence[Any], fn: Callable[[Any, Any], Any]) -> list[Any]:
        with self.base_model():
            return self.policy.forward_no_grad(micro_batches, fn)
