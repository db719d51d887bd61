"""``rollout.backend = "auto"``: per call, ``hf`` (static batches through ``generate``) or ``cb``
(continuous batching), whichever measured faster for the attention, the device and the concurrency.

The choice depends only on the model's attention implementation and size, the device and the call's
concurrency C = min(prompts, ``generation_batch_size``) * G, never on timing, so a call's result stays
a function of weights, prompts, settings and seed (resume regenerates the same completions). Both
backends gather ZeRO-3 parameters exactly once per call, so ranks that choose differently (different
prompt counts) still issue the same collectives.

- Flash attention (GPU): ``cb``. Not measured here (no GPU was available). transformers then runs
  continuous batching on varlen kernels (no padding, no dense mask) with CUDA graphs and asynchronous
  batching; published serving figures put continuous batching several times above static batching
  when output lengths vary (Anyscale, 2023, OPT-13B on an A100: 8x for iteration-level batching in
  TGI / Ray Serve, 23x with vLLM's paged memory).
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
- sdpa / eager on an accelerator: ``hf``. Continuous batching under the dense mask was measured on one
  H100 (Qwen2.5-0.5B shape, bf16, C = 64, ``bench/rollout.py --device cuda --shapes 0.5b``): cb/hf 0.83.
  Under dsrl's packed attention (PyTorch's flash kernel, CUDA graphs) it has not been measured on a GPU,
  so ``auto`` does not pick it there; ``rollout.backend = "cb"`` does (docs/rollout.md).
"""

from __future__ import annotations

from typing import Any

import torch

from dsrl.config.names import CB_BACKEND, HF_BACKEND
from dsrl.rollout.base import Completion, RolloutBackend
from dsrl.rollout.cb import ContinuousBatchingBackend, concurrency, is_flash, num_parameters
from dsrl.rollout.hf import HFRolloutBackend

CPU_SMALL_MODEL_PARAMETERS = 1_000_000
CPU_SMALL_MODEL_MAX_CB_CONCURRENCY = 256


def auto_backend_name(device_type: str, attn_implementation: str | None, parameters: int, concurrency: int,
                      cb_attention: str | None = None) -> str:
    """``"hf"`` or ``"cb"`` for a device type (``"cpu"``, ``"cuda"``, ...), the model's attention
    implementation and parameter count, the call's concurrency C and the attention continuous batching
    would run under (:func:`dsrl.rollout.cb.cb_attention_implementation`; default: the model's)."""
    if is_flash(attn_implementation):
        return CB_BACKEND
    if device_type == "cpu":
        dense = not is_flash(cb_attention if cb_attention is not None else attn_implementation)
        small = parameters < CPU_SMALL_MODEL_PARAMETERS
        return HF_BACKEND if dense and small and concurrency > CPU_SMALL_MODEL_MAX_CB_CONCURRENCY else CB_BACKEND
    return HF_BACKEND


class AutoRolloutBackend(RolloutBackend):
    """Dispatches each call to an :class:`HFRolloutBackend` or a :class:`ContinuousBatchingBackend` on the
    same policy (both share the weights; nothing is copied) by :func:`auto_backend_name`; always ``hf``
    when continuous batching is unavailable (an older transformers, a policy that is not a transformers
    model)."""

    def __init__(self, engine_or_module: Any, tokenizer: Any, rollout_cfg: Any):
        self.hf = HFRolloutBackend(engine_or_module, tokenizer, rollout_cfg)
        try:
            self.cb: ContinuousBatchingBackend | None = ContinuousBatchingBackend(engine_or_module, tokenizer,
                                                                                  rollout_cfg)
        except (ImportError, TypeError):
            self.cb = None
        self.cfg = rollout_cfg
        self.num_params = num_parameters(self.hf.module)

    def choose(self, num_prompts: int, samples_per_prompt: int) -> RolloutBackend:
        """The backend a call with this many prompts and samples per prompt uses."""
        c = concurrency(num_prompts, samples_per_prompt, self.cfg.generation_batch_size)
        device: torch.device = self.hf.device
        attn = getattr(getattr(self.hf.module, "config", None), "_attn_implementation", None)
        cb_attn = self.cb.attention(num_prompts, samples_per_prompt) if self.cb is not None else None
        name = auto_backend_name(device.type, attn, self.num_params, c, cb_attn)
        return self.cb if name == CB_BACKEND and self.cb is not None else self.hf

    def returns_routes(self) -> bool:
        return self.hf.returns_routes()  # cb records them too, on the same policy

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int, **kwargs: Any
                 ) -> list[Completion]:
        """See :mod:`dsrl.rollout.base`; the chosen backend's ``generate``."""
        return self.choose(len(prompt_ids), samples_per_prompt).generate(prompt_ids, samples_per_prompt, seed,
                                                                          **kwargs)
