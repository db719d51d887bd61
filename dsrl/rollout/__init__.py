"""Generation backends: ``hf`` (transformers ``generate`` on the policy), ``cb`` (transformers continuous
batching on the policy), ``auto`` (one of those two per call, see :mod:`dsrl.rollout.auto`) and ``vllm``.

The interface lives in :mod:`dsrl.rollout.base`, each backend in its own module (imported only when
chosen: vLLM is optional); :func:`make_backend` picks one from ``rollout.backend``. Imports point one
way: backends import ``base`` (``vllm`` also reuses helpers of ``hf``), ``base`` imports no backend.
"""

from __future__ import annotations

from typing import Any

from dsrl.rollout.base import Completion, RolloutBackend

__all__ = ["Completion", "RolloutBackend", "make_backend"]


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
