"""Generation with a vLLM engine colocated with the trainer on every rank (optional; ``pip install dsrl[vllm]``).

Invariants and contract (see :mod:`dsrl.rollout.base` for the common ones):
- vLLM is imported only when this backend is built; without it the error names ``pip install dsrl[vllm]``;
- each rank runs its own in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and the
  ``external_launcher`` executor when torch.distributed runs several ranks); it generates only this
  rank's prompts, so generation itself needs no collective;
- vLLM keeps its own copy of the weights: call :meth:`VLLMRolloutBackend.sync_weights` on *every*
  rank after each optimizer step and before the next ``generate`` (under ZeRO-3 it gathers the
  parameters once, a collective). Generation is seeded per prompt (``seed`` and the prompt's index),
  so results do not depend on how prompts are batched, but vLLM's kernels may differ from the
  trainer's forward: re-compute log-probs with the trainer, never reuse vLLM's.
- memory: the vLLM engine reserves ``gpu_memory_utilization`` of the accelerator next to the
  training state; during ``sync_weights`` under ZeRO-3 the full model is gathered on every rank too.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from dsrl.rollout.base import Completion, RolloutBackend, cut_at_eos, eos_ids
from dsrl.rollout.policy import gathered_for_generation, unwrap

INSTALL_HINT = "rollout.backend = 'vllm' needs vLLM, which is not installed: pip install dsrl[vllm]"


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm


class VLLMRolloutBackend(RolloutBackend):
    """A colocated vLLM engine fed with the policy's weights.

    ``model_path``: the checkpoint vLLM starts from (architecture, config); unset = the policy is
    saved to a temporary directory first (fine for small models). ``llm_kwargs`` go to ``vllm.LLM``.
    """

    def __init__(self, engine_or_module: Any, tokenizer: Any, rollout_cfg: Any, *, model_path: str | None = None,
                 gpu_memory_utilization: float = 0.3, dtype: str = "auto", **llm_kwargs: Any):
        vllm = import_vllm()
        import torch.distributed as dist

        self._vllm = vllm
        self.module, self.ds_engine = unwrap(engine_or_module)
        self.cfg = rollout_cfg
        self.eos = eos_ids(tokenizer, self.module)
        if model_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dsrl-vllm-")
            with gathered_for_generation(self.module, self.ds_engine):
                self.module.save_pretrained(self._tmp.name)
            model_path = self._tmp.name
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights load directly
        if dist.is_initialized() and dist.get_world_size() > 1:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        self.llm = vllm.LLM(model=model_path, skip_tokenizer_init=True, dtype=dtype,
                            gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)

    def _sampling_params(self, samples_per_prompt: int, seed: int) -> Any:
        cfg = self.cfg
        return self._vllm.SamplingParams(
            n=samples_per_prompt, temperature=max(cfg.temperature, 0.0), top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_new_tokens, seed=seed,
            stop_token_ids=list(self.eos), detokenize=False,
        )

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """``len(prompt_ids) * samples_per_prompt`` completions grouped per prompt; prompt i uses its own
        seed derived from ``seed`` and i."""
        if not prompt_ids:
            return []
        params = [self._sampling_params(samples_per_prompt, (seed * 1_000_003 + i) % (2**63))
                  for i in range(len(prompt_ids))]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        eos = set(self.eos)
        out: list[Completion] = []
        for i, request in enumerate(outputs):
            if len(request.outputs) != samples_per_prompt:
                raise RuntimeError(f"vLLM returned {len(request.outputs)} samples for prompt {i}, "
                                   f"expected {samples_per_prompt}")
            for sample in request.outputs:
                tokens, found = cut_at_eos(list(sample.token_ids), eos)
                finished = found or sample.finish_reason == "stop"
                if finished and not found:  # vLLM dropped the stop token: put it back
                    stop = sample.stop_reason if isinstance(sample.stop_reason, int) else self.eos[0]
                    tokens.append(stop)
                out.append(Completion(prompt_index=i, prompt_ids=list(prompt_ids[i]), completion_ids=tokens,
                                      finished=finished))
        return out

    def sync_weights(self) -> None:
        """Copy the policy's current parameters into vLLM (collective under ZeRO-3: call on every rank)."""
        with gathered_for_generation(self.module, self.ds_engine):
            weights = [(name, p.detach()) for name, p in self.module.named_parameters()]
            if hasattr(self.llm, "apply_model"):
                self.llm.apply_model(lambda model: model.load_weights(weights))
            else:
                self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
