"""Generation backends: ``hf`` (transformers ``generate`` on the policy), ``cb`` (transformers continuous
batching on the policy), ``auto`` (one of those two per call, see :mod:`dsrl.rollout.auto`) and ``vllm``.

Owns: the generation contract (:mod:`.base`), each backend in its own module (imported only when
chosen: vLLM is optional), access to the policy's weights for generation (:mod:`.policy`: ZeRO-3
gather, tensor peers, neutral generation settings) and packed attention (:mod:`.varlen_attention`);
:func:`make_backend` picks one from ``rollout.backend``. Inside the package imports point one way:
backends import ``base`` and ``policy`` (``cb`` and ``auto`` build on ``hf``), never the other way.

May import: :mod:`dsrl.config`, :mod:`dsrl.core`, :mod:`dsrl.algos`; never :mod:`dsrl.rl`,
:mod:`dsrl.checkpoint` or :mod:`dsrl.cli`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsrl.config import RolloutConfig
from dsrl.config.names import AUTO_BACKEND, CB_BACKEND, HF_BACKEND
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dsrl.rollout.cb import CallBounds

__all__ = ["Completion", "RolloutBackend", "make_backend"]


def make_backend(rollout_cfg: RolloutConfig, engine: GenerationPolicy, tokenizer: PreTrainedTokenizerBase, *,
                 bounds: CallBounds | None = None, release_between_calls: bool = False,
                 **kwargs: Any) -> RolloutBackend:
    """The backend named by ``rollout.backend`` (:data:`dsrl.config.names.ROLLOUT_BACKENDS`, validated by the
    config): ``hf`` (transformers generate on the policy), ``cb`` (transformers continuous batching on the
    policy), ``auto`` (per call one of these two, see :mod:`dsrl.rollout.auto`) or ``vllm`` (a vLLM engine;
    ``kwargs`` go to :class:`dsrl.rollout.vllm.VLLMRolloutBackend`). ``bounds``
    (:class:`dsrl.rollout.cb.CallBounds`, the run's largest call) lets ``cb`` and ``auto`` keep one
    continuous-batching manager for the whole run; ``release_between_calls`` (``dsrl.memory.offload_states``)
    destroys it after each rollout's generation instead."""
    name = rollout_cfg.backend
    if name == HF_BACKEND:
        from dsrl.rollout.hf import HFRolloutBackend

        return HFRolloutBackend(engine, tokenizer, rollout_cfg)
    if name == CB_BACKEND:
        from dsrl.rollout.cb import ContinuousBatchingBackend

        return ContinuousBatchingBackend(engine, tokenizer, rollout_cfg, bounds=bounds,
                                         release_between_calls=release_between_calls)
    if name == AUTO_BACKEND:
        from dsrl.rollout.auto import AutoRolloutBackend

        return AutoRolloutBackend(engine, tokenizer, rollout_cfg, bounds=bounds,
                                  release_between_calls=release_between_calls)
    from dsrl.rollout.vllm import VLLMRolloutBackend

    return VLLMRolloutBackend(engine, tokenizer, rollout_cfg, **kwargs)
