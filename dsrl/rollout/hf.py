"""Generation with transformers ``generate`` on the policy itself (the default backend).

Invariants:
- sampling depends only on the weights, the prompts, ``dsrl.rollout`` (temperature, top_p, top_k,
  max_new_tokens, generation_batch_size) and the seed: the model's own ``generation_config`` (e.g. a
  checkpoint's repetition penalty) is replaced by a neutral one for the call, and the torch RNG is
  forked and seeded, so the caller's RNG stream is untouched and a resumed run regenerates the same
  completions;
- prompts are left-padded with an attention mask (generate derives position ids from it), so a
  padded prompt is conditioned exactly like the same prompt alone;
- the model is in eval mode during generation and its previous train/eval mode is restored after;
- no collective over the data-parallel group runs inside generation (AutoTP: see below). Under
  ZeRO-3 the parameters are gathered once per ``generate`` call on every rank
  (``deepspeed.zero.GatheredParameters`` over all parameters) and DeepSpeed's ZeRO-3 module hooks
  are suspended for the call: with the hooks active, every sub-module forward would re-partition its
  parameters and gather them again (one all-gather per layer per token), and the top-level
  pre-forward hook runs cross-rank trace checks, so ranks generating different numbers of tokens
  would hang. Hence every data-parallel rank must call ``generate`` the same number of times (one
  gather each); prompt counts and lengths may differ.
- under AutoTP (``tensor_parallel.autotp_size > 1``) every forward all-reduces over the tensor
  group, so tensor peers must run exactly the same steps: they get the same prompts and seed (one
  replica), and a stopping criterion (:class:`TensorPeersStop`) ORs the per-row end-of-sequence
  flags over the tensor group at every step, so a row ends on every peer at the same step and the
  peers leave the loop together, even if their sampled tokens were to differ (the trainer then keeps
  the tensor source's completions: :mod:`dsrl.rl.replica_data`). Cost: one all-reduce of a bool per row
  per token step, inside the tensor group only.

Memory: under ZeRO-3 every rank holds the full (unpartitioned; under AutoTP: its tensor shard of
the) model in the engine's dtype for the duration of ``generate``, in addition to its optimizer
shards and the KV cache of one chunk (``generation_batch_size * samples_per_prompt`` sequences). If
that does not fit, lower ``generation_batch_size`` or use the vLLM backend.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dsrl.rollout.base import Completion, RolloutBackend, cut_at_eos, eos_ids
from dsrl.rollout.policy import (
    TensorPeersStop,
    gathered_for_generation,
    neutral_generation_config,
    tensor_parallel_group,
    unwrap,
)


class HFRolloutBackend(RolloutBackend):
    """``transformers`` generate on the policy (an RLEngine, a DeepSpeedEngine or a plain module).

    ``tokenizer`` only needs ``eos_token_id`` (an int or a list) and ``pad_token_id`` (None = the
    first eos id). ``rollout_cfg`` is a :class:`dsrl.config.RolloutConfig`; ``temperature <= 0``
    means greedy decoding. See the module docstring for the ZeRO-3 contract and memory cost.
    """

    def __init__(self, engine_or_module: Any, tokenizer: Any, rollout_cfg: Any):
        self.module, self.ds_engine = unwrap(engine_or_module)
        self.cfg = rollout_cfg
        self.eos = eos_ids(tokenizer, self.module)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos[0]
        self.tp_group = tensor_parallel_group(self.ds_engine)

    @property
    def device(self) -> torch.device:
        if self.ds_engine is not None:
            return torch.device(self.ds_engine.device)
        return next(self.module.parameters()).device

    def generation_config(self, return_logprobs: bool = False) -> Any:
        """The complete sampling settings of one generate call (nothing inherited from the model).

        Each prompt is repeated G times in the batch (what ``num_return_sequences`` does internally),
        so greedy decoding works with G > 1 too.
        """
        from transformers import GenerationConfig

        cfg = self.cfg
        sampling = cfg.temperature > 0
        extra = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k} if sampling else {}
        return GenerationConfig(
            do_sample=sampling, max_new_tokens=cfg.max_new_tokens, num_return_sequences=1,
            eos_token_id=self.eos, pad_token_id=self.pad_id, use_cache=True, num_beams=1,
            return_dict_in_generate=True, output_logits=return_logprobs, **extra,
        )

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int, *,
                 return_logprobs: bool = False) -> list[Completion]:
        """Sample ``samples_per_prompt`` completions per prompt; see :mod:`dsrl.rollout.base`.

        Prompts are processed in chunks of ``rollout.generation_batch_size`` in order, after one
        ``torch.manual_seed(seed)``. With ``return_logprobs`` each completion carries the log-prob of
        its tokens under the model's raw logits (before temperature/top-k/top-p) as the sampler saw them.
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. bos)")
        gen_cfg = self.generation_config(return_logprobs)
        device = self.device
        rng_devices = [] if device.type == "cpu" else [device.index if device.index is not None else 0]
        was_training = self.module.training
        out: list[Completion] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(gathered_for_generation(self.module, self.ds_engine))
            stack.enter_context(neutral_generation_config(self.module))
            stack.enter_context(torch.random.fork_rng(devices=rng_devices, device_type=device.type))
            self.module.eval()
            try:
                torch.manual_seed(seed)
                bs = self.cfg.generation_batch_size
                for start in range(0, len(prompt_ids), bs):
                    out += self._generate_chunk(prompt_ids[start:start + bs], start, samples_per_prompt, gen_cfg,
                                                device)
            finally:
                self.module.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], offset: int, g: int, gen_cfg: Any,
                        device: torch.device) -> list[Completion]:
        """One generate call on ``len(prompts) * g`` left-padded rows (prompt k fills rows k*g .. k*g+g-1)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
        input_ids = input_ids.repeat_interleave(g, dim=0)
        attention_mask = attention_mask.repeat_interleave(g, dim=0)
        extra = {}
        if self.tp_group is not None:
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList([TensorPeersStop(self.eos, self.tp_group)])
        result = self.module.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen_cfg,
            synced_gpus=False, **extra,
        )
        new_tokens = result.sequences[:, width:].cpu()
        logps = None
        if gen_cfg.output_logits:
            logits = torch.stack(result.logits, dim=1).float()  # [n, steps, V]
            logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.to(logits.device).unsqueeze(-1))
            logps = logps.squeeze(-1).cpu()
        eos = set(self.eos)
        completions = []
        for row in range(new_tokens.shape[0]):
            tokens, finished = cut_at_eos(new_tokens[row].tolist(), eos)
            k = row // g
            completions.append(Completion(
                prompt_index=offset + k, prompt_ids=list(prompts[k]), completion_ids=tokens, finished=finished,
                logprobs=logps[row, : len(tokens)].tolist() if logps is not None else None,
            ))
        return completions
