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
  gather each); prompt counts and lengths may differ. Under every stage DeepSpeed's engine hooks are out of the
  module for the call (:func:`dsrl.rollout.policy.gathered_for_generation`): no decode step synchronizes the device.
- under AutoTP (``tensor_parallel.autotp_size > 1``) every forward all-reduces over the tensor
  group, so tensor peers must run exactly the same steps: they get the same prompts and seed (one
  replica), and a stopping criterion (:class:`TensorPeersStop`) ORs the per-row end-of-sequence
  flags over the tensor group at every step, so a row ends on every peer at the same step and the
  peers leave the loop together, even if their sampled tokens were to differ (the trainer then keeps
  the tensor source's completions: :mod:`dsrl.rl.data.replica`). Cost: one all-reduce of a bool per row
  per token step, inside the tensor group only.
- a mixture-of-experts policy's completions carry their routes (:mod:`dsrl.rollout.routes`): the experts every
  router chose in ``generate``'s own forwards, the prefill's and then one position per decode step. Under
  DeepSpeed AutoEP (experts split over ranks, every forward an all-to-all of the expert-parallel group) every
  rank runs the same number of ``generate`` calls (a rank with fewer prompt chunks runs discarded one-token
  ones) and each call runs with ``synced_gpus``, so a rank whose rows all ended keeps running forwards until
  every rank's rows have (one all-reduce of a flag per token step over all ranks).

Memory: under ZeRO-3 every rank holds the full (unpartitioned; under AutoTP: its tensor shard of
the) model in the engine's dtype for the duration of ``generate``, in addition to its optimizer
shards and the KV cache of one chunk (``generation_batch_size * samples_per_prompt`` sequences). If
that does not fit, lower ``generation_batch_size`` or use the vLLM backend.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dsrl.config import RolloutConfig
from dsrl.core.seeds import forked_torch_rng
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend, cut_at_eos, stop_token_ids
from dsrl.rollout.policy import (
    TensorPeersStop,
    gathered_for_generation,
    neutral_generation_config,
    tensor_parallel_group,
    unwrap,
)
from dsrl.rollout.routes import MoERouting, generation_routes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HFRolloutBackend(RolloutBackend):
    """``transformers`` generate on the policy (a :class:`dsrl.RLEngine` or a plain module).

    ``tokenizer`` only needs ``eos_token_id`` (an int or a list) and ``pad_token_id`` (None = the
    first eos id). ``rollout_cfg`` is a :class:`dsrl.config.RolloutConfig`; ``temperature <= 0``
    means greedy decoding. See the module docstring for the ZeRO-3 contract and memory cost.
    """

    def __init__(self, engine_or_module: GenerationPolicy, tokenizer: PreTrainedTokenizerBase,
                 rollout_cfg: RolloutConfig):
        self.module, self.policy = unwrap(engine_or_module)
        self.source, self.tokenizer = engine_or_module, tokenizer  # what with_sampling builds on
        self.cfg = rollout_cfg
        self.eos = stop_token_ids(tokenizer, self.module, rollout_cfg)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos[0]
        self.tp_group = tensor_parallel_group(self.policy)
        self.routing = MoERouting.of(self.module)  # None for a dense policy
        # AutoEP: every forward is a collective of the expert-parallel group (module docstring)
        self.synced = self.routing is not None and self.routing.expert_parallel_size > 1

    def returns_routes(self) -> bool:
        return self.routing is not None

    def with_sampling(self, rollout_cfg: RolloutConfig) -> HFRolloutBackend:
        """A new ``generate`` backend on the same policy (:meth:`dsrl.rollout.base.RolloutBackend.with_sampling`)."""
        return HFRolloutBackend(self.source, self.tokenizer, rollout_cfg)

    @property
    def device(self) -> torch.device:
        if self.policy is not None:
            return torch.device(self.policy.device)
        return next(self.module.parameters()).device

    def generation_config(self, sampling_in_config: bool = False) -> Any:
        """The complete generate settings of one call (nothing inherited from the model). Sampling itself
        (temperature, top-k, top-p) is applied by :meth:`logits_processors`, not through these settings, so
        the behavior log-probs are recorded after exactly the processing the sampler sees, in any
        transformers version; ``sampling_in_config`` puts them in the settings instead (continuous batching
        builds its own warpers from them).

        Each prompt is repeated G times in the batch (what ``num_return_sequences`` does internally),
        so greedy decoding works with G > 1 too.
        """
        from transformers import GenerationConfig

        cfg = self.cfg
        sampling = cfg.temperature > 0
        neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        if sampling_in_config:
            neutral = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        neutral = neutral if sampling else {}
        return GenerationConfig(
            do_sample=sampling, max_new_tokens=self.cfg.max_new_tokens, num_return_sequences=1,
            eos_token_id=self.eos, pad_token_id=self.pad_id, use_cache=True, num_beams=1,
            return_dict_in_generate=True, **neutral,
        )

    def logits_processors(self) -> tuple[Any, BehaviorLogprobs]:
        """transformers' own temperature, top-k and top-p warpers (in generate's order, only those that change
        anything), then the recorder of the behavior log-probs."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        cfg, procs = self.cfg, LogitsProcessorList()
        if cfg.temperature > 0:
            if cfg.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(cfg.temperature))
            if cfg.top_k > 0:
                procs.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
            if cfg.top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
        recorder = BehaviorLogprobs()
        procs.append(recorder)
        return procs, recorder

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """Sample ``samples_per_prompt`` completions per prompt; see :mod:`dsrl.rollout.base`.

        Prompts are processed in chunks of ``rollout.generation_batch_size`` in order, after one
        ``torch.manual_seed(seed)``. Every completion carries its behavior log-probs (the log-prob of each
        token under the distribution it was sampled from, computed by generate's own forward).
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. bos)")
        gen_cfg = self.generation_config()
        device = self.device
        was_training = self.module.training
        out: list[Completion] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(gathered_for_generation(self.module, self.policy))
            stack.enter_context(neutral_generation_config(self.module))
            stack.enter_context(forked_torch_rng(device))
            self.module.eval()
            try:
                torch.manual_seed(seed)
                bs = self.cfg.generation_batch_size
                starts = list(range(0, len(prompt_ids), bs))
                missing = self._missing_calls(len(starts), device)  # AutoEP: counted before any forward
                for start in starts:
                    out += self._generate_chunk(prompt_ids[start:start + bs], start, samples_per_prompt, gen_cfg,
                                                device)
                for _ in range(missing):  # as many calls as the rank with the most
                    self._generate_chunk([[self.pad_id]], 0, 1, gen_cfg, device)
            finally:
                self.module.train(was_training)
        return out

    def _missing_calls(self, calls: int, device: torch.device) -> int:
        """Under AutoEP, how many discarded calls this rank runs so that every rank runs as many ``generate`` calls
        as the one with the most (one MAX all-reduce, before any forward: a forward is itself collective); 0
        otherwise."""
        if not self.synced:
            return 0
        n = torch.tensor([calls], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item()) - calls

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
        processors, recorder = self.logits_processors()
        extra = {}
        if self.tp_group is not None:
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList([TensorPeersStop(self.eos, self.tp_group)])
        with self.routing.recording() if self.routing is not None else contextlib.nullcontext() as log:
            result = self.module.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen_cfg,
                logits_processor=processors, synced_gpus=self.synced, **extra,
            )
        new_tokens = result.sequences[:, width:]
        rows = new_tokens.shape[0]
        routes = generation_routes(log, rows, width, new_tokens.shape[1]) if log is not None else None
        logps = recorder.finish(new_tokens).cpu()
        new_tokens = new_tokens.cpu()
        eos = set(self.eos)
        completions = []
        for row in range(new_tokens.shape[0]):
            tokens, finished = cut_at_eos(new_tokens[row].tolist(), eos)
            k = row // g
            pad = width - len(prompts[k])
            completions.append(Completion(
                prompt_index=offset + k, prompt_ids=list(prompts[k]), completion_ids=tokens, finished=finished,
                behavior_logprobs=logps[row, : len(tokens)].tolist(),
                routes=(routes[row, pad:width + len(tokens) - 1].clone() if routes is not None else None),
            ))
        return completions


class BehaviorLogprobs:
    """A logits processor that records, at every generation step, the log-softmax of the scores the sampler
    draws from (so it must come last), and pairs each step's row with the token drawn from it: read at the
    next step from ``input_ids``, and for the last step from the finished sequences (:meth:`finish`).
    Memory: one float32 ``[rows, vocab]`` row set, plus one float per generated token."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._last is not None:
            self._steps.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``[rows, generated]`` behavior log-probs for the generated tokens ``new_tokens`` (float32)."""
        steps = list(self._steps)
        if self._last is not None and len(steps) < new_tokens.shape[1]:
            steps.append(self._last.gather(-1, new_tokens[:, len(steps):len(steps) + 1].to(self._last.device))
                         .squeeze(-1))
        self._steps, self._last = [], None
        if not steps:
            return torch.zeros((new_tokens.shape[0], 0), dtype=torch.float32)
        return torch.stack(steps, dim=1)
