"""``rollout.backend = "auto"``: per call, ``hf`` (static batches through ``generate``) or ``cb``
(continuous batching), whichever measured faster for the attention, the device and the concurrency.

The choice depends only on the model's attention implementation, the device and the call's
concurrency C = min(prompts, ``generation_batch_size``) * G, never on timing, so a call's result stays
a function of weights, prompts, settings and seed (resume regenerates the same completions). Both
backends gather ZeRO-3 parameters exactly once per call, so ranks that choose differently (different
prompt counts) still issue the same collectives.

- Flash attention (GPU): ``cb``. Not measured here (no GPU was available). transformers then runs
  continuous batching on varlen kernels (no padding, no dense mask) with CUDA graphs and asynchronous
  batching; published serving figures put continuous batching several times above static batching
  when output lengths vary (Anyscale, 2023, OPT-13B on an A100: 8x for iteration-level batching in
  TGI / Ray Serve, 23x with vLLM's paged memory).
- sdpa / eager on the CPU: ``cb`` up to ``CPU_CB_MAX_CONCURRENCY`` concurrent sequences, ``hf`` above.
  Measured side by side with ``bench/rollout.py`` (docs/benchmarks.md, 2026-11-23, 2 shared cores, one
  thread, long-tailed completions): ``cb`` 1.1-2.4x faster than ``hf`` at C = 8-256 on dsrl's tiny
  model and on a 26.5 M parameter Qwen2 shape, but slower at C = 512 (0.7x on the tiny model): with a
  dense mask each step attends every query to every cached token of the step, a cost that grows with
  C squared, while ``hf``'s padded batch attends within each sequence only.
- sdpa / eager on an accelerator: ``hf``. Not measured; continuous batching then runs without CUDA
  graphs under the same C-squared dense mask.
"""

from __future__ import annotations

from typing import Any

import torch

from dsrl.rollout.base import Completion, RolloutBackend
from dsrl.rollout.cb import ContinuousBatchingBackend, is_flash
from dsrl.rollout.hf import HFRolloutBackend

CPU_CB_MAX_CONCURRENCY = 256


def auto_backend_name(device_type: str, attn_implementation: str | None, concurrency: int) -> str:
    """``"hf"`` or ``"cb"`` for a device type (``"cpu"``, ``"cuda"``, ...), attention and concurrency C."""
    if is_flash(attn_implementation):
        return "cb"
    if device_type == "cpu":
        return "cb" if concurrency <= CPU_CB_MAX_CONCURRENCY else "hf"
    return "hf"


class AutoRolloutBackend(RolloutBackend):
    """Dispatches each call to an :class:`HFRolloutBackend` or a :class:`ContinuousBatchingBackend` on the
    same policy (both share the weights; nothing is copied) by :func:`auto_backend_name`."""

    def __init__(self, engine_or_module: Any, tokenizer: Any, rollout_cfg: Any):
        self.hf = HFRolloutBackend(engine_or_module, tokenizer, rollout_cfg)
        self.cb = ContinuousBatchingBackend(engine_or_module, tokenizer, rollout_cfg)
        self.cfg = rollout_cfg

    def choose(self, num_prompts: int, samples_per_prompt: int) -> RolloutBackend:
        """The backend a call with this many prompts and samples per prompt uses."""
        concurrency = max(1, min(num_prompts, self.cfg.generation_batch_size)) * samples_per_prompt
        device: torch.device = self.hf.device
        attn = getattr(getattr(self.hf.module, "config", None), "_attn_implementation", None)
        return self.cb if auto_backend_name(device.type, attn, concurrency) == "cb" else self.hf

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int, **kwargs: Any
                 ) -> list[Completion]:
        """See :mod:`dsrl.rollout.base`; the chosen backend's ``generate``."""
        return self.choose(len(prompt_ids), samples_per_prompt).generate(prompt_ids, samples_per_prompt, seed,
                                                                          **kwargs)
