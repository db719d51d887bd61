"""Generation backends: ``hf`` (transformers ``generate`` on the policy, the default) and ``vllm``."""

from dsrl.rollout.base import Completion, RolloutBackend, make_backend

__all__ = ["Completion", "RolloutBackend", "make_backend"]
