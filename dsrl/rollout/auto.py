"""``rollout.backend = "auto"`` (the default): per call, ``hf`` (static batches through ``generate``) or ``cb``
(continuous batching), whichever measured faster for the attention, the device and the concurrency.

The choice depends only on the model's attention implementation and size, the device, the tensor-parallel layout
and the call's concurrency C = min(prompts, ``generation_batch_size``) * G (with :class:`dsrl.rollout.cb.CallBounds`:
the run's largest call, so every call of a run chooses alike), never on timing, so a call's result stays a function
of weights, prompts, settings and seed (resume regenerates the same completions). Both backends gather ZeRO-3
parameters exactly once per call, so ranks that choose differently still issue the same collectives.

- Under tensor parallelism (AutoTP): ``hf``, whose stopping criterion keeps tensor peers stepping together
  (:class:`dsrl.rollout.policy.TensorPeersStop`).
- Flash attention (GPU): ``cb``. transformers then runs continuous batching on varlen kernels (no padding, no
  dense mask) with CUDA graphs and asynchronous batching.
- sdpa / eager on an accelerator: ``cb`` when it runs under dsrl's packed attention (``rollout.cb_attention``
  ``"auto"`` gives it in bf16/fp16 on a GPU whose PyTorch has the flash kernel) at C >= ``GPU_CB_MIN_CONCURRENCY``,
  else ``hf``. Measured on one H200 (2026-11-26, Qwen2.5-0.5B shape, bf16, C = 128, 256 new tokens,
  ``bench/rollout.py`` in ``bench/gpu.py``): ``generate`` 725 tokens/s, ``cb`` under the dense mask 975 (1.35x),
  ``cb`` under the packed attention 9,927 (13.7x); earlier, one H100 at C = 64 under the dense mask: cb/hf 0.83.
  Below C = 128 the packed attention has not been measured on a GPU, so ``hf`` stays there.
- sdpa / eager on the CPU: ``cb``, except ``hf`` for a model under ``CPU_SMALL_MODEL_PARAMETERS`` at more
  than ``CPU_SMALL_MODEL_MAX_CB_CONCURRENCY`` concurrent sequences *when cb would attend through the dense
  mask* (``rollout.cb_attention = "model"``; its ``"auto"`` uses dsrl's packed attention there, measured
  2.74x ``hf`` on the tiny model at C = 512, 2026-11-24). Measured side by side with
  ``bench/rollout.py`` (docs/benchmarks.md, 2026-11-23, 2 shared cores, one thread, long-tailed
  completions): ``cb`` was faster in every cell (1.8-3.5x, C = 8-512) on a 26.5 M parameter Qwen2 shape
  and at C = 8-256 on dsrl's 0.1 M parameter tiny model (1.07-3.4x), but 0.72x on the tiny model at
  C = 512 (table in docs/rollout.md): with a dense mask each step attends every query to every cached
  token of the step, a cost that grows with C squared and, on a model that small, outweighs the
  padding ``hf`` decodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import RolloutConfig
from dsrl.config.names import CB_BACKEND, HF_BACKEND
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend
from dsrl.rollout.cb import CallBounds, ContinuousBatchingBackend, concurrency, is_flash, num_parameters
from dsrl.rollout.hf import HFRolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CPU_SMALL_MODEL_PARAMETERS = 1_000_000
CPU_SMALL_MODEL_MAX_CB_CONCURRENCY = 256
GPU_CB_MIN_CONCURRENCY = 128  # packed-attention cb measured 13.7x generate at C = 128 on an H200 (module docstring)


def auto_backend_name(device_type: str, attn_implementation: str | None, parameters: int, concurrency: int,
                      cb_attention: str | None = None, tensor_parallel: int = 1) -> str:
    """``"hf"`` or ``"cb"`` for a device type (``"cpu"``, ``"cuda"``, ...), the model's attention
    implementation and parameter count, the call's concurrency C, the attention continuous batching
    would run under (:func:`dsrl.rollout.cb.cb_attention_implementation`; default: the model's) and the
    tensor-parallel size (module docstring)."""
    if tensor_parallel > 1:
        return HF_BACKEND
    if is_flash(attn_implementation):
        return CB_BACKEND
    packed = is_flash(cb_attention if cb_attention is not None else attn_implementation)
    if device_type == "cpu":
        small = parameters < CPU_SMALL_MODEL_PARAMETERS
        return HF_BACKEND if not packed and small and concurrency > CPU_SMALL_MODEL_MAX_CB_CONCURRENCY else CB_BACKEND
    return CB_BACKEND if packed and concurrency >= GPU_CB_MIN_CONCURRENCY else HF_BACKEND


class AutoRolloutBackend(RolloutBackend):
    """Dispatches each call to an :class:`HFRolloutBackend` or a :class:`ContinuousBatchingBackend` on the
    same policy (both share the weights; nothing is copied) by :func:`auto_backend_name`; always ``hf``
    when continuous batching is unavailable (an older transformers, a policy that is not a transformers
    model)."""

    def __init__(self, engine_or_module: GenerationPolicy, tokenizer: PreTrainedTokenizerBase,
                 rollout_cfg: RolloutConfig, bounds: CallBounds | None = None):
        self.hf = HFRolloutBackend(engine_or_module, tokenizer, rollout_cfg)
        try:
            self.cb: ContinuousBatchingBackend | None = ContinuousBatchingBackend(engine_or_module, tokenizer,
                                                                                  rollout_cfg, bounds=bounds)
        except (ImportError, TypeError):
            self.cb = None
        self.cfg, self.bounds = rollout_cfg, bounds
        self.num_params = num_parameters(self.hf.module)
        policy = self.hf.policy
        self.tensor_parallel = policy.view.tensor_parallel_size if policy is not None else 1

    def choose(self, num_prompts: int, samples_per_prompt: int) -> RolloutBackend:
        """The backend a call with this many prompts and samples per prompt uses (with bounds: the run's
        largest call's, for every call)."""
        c = concurrency(num_prompts, samples_per_prompt, self.cfg.generation_batch_size)
        if self.bounds is not None:
            c = self.bounds.sequences
        device: torch.device = self.hf.device
        attn = getattr(getattr(self.hf.module, "config", None), "_attn_implementation", None)
        cb_attn = self.cb.attention(num_prompts, samples_per_prompt) if self.cb is not None else None
        name = auto_backend_name(device.type, attn, self.num_params, c, cb_attn, self.tensor_parallel)
        if self.hf.synced:  # DeepSpeed AutoEP: only hf runs its forwards in lockstep over the expert-parallel group
            return self.hf
        return self.cb if name == CB_BACKEND and self.cb is not None else self.hf

    def returns_routes(self) -> bool:
        return self.hf.returns_routes()  # cb records them too, on the same policy

    def close(self) -> None:
        if self.cb is not None:
            self.cb.close()

    def with_sampling(self, rollout_cfg: RolloutConfig) -> AutoRolloutBackend:
        """A new dispatcher on the same policy, choosing per call on its own workload and bounds
        (:meth:`dsrl.rollout.base.RolloutBackend.with_sampling`)."""
        return AutoRolloutBackend(self.hf.source, self.hf.tokenizer, rollout_cfg,
                                  bounds=self.bounds and self.bounds.for_sampling(self.cfg, rollout_cfg))

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int, **kwargs: Any
                 ) -> list[Completion]:
        """See :mod:`dsrl.rollout.base`; the chosen backend's ``generate``."""
        return self.choose(len(prompt_ids), samples_per_prompt).generate(prompt_ids, samples_per_prompt, seed,
                                                                          **kwargs)
