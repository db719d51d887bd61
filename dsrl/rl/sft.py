"""A short supervised warm-up before the first rollout (``dsrl.sft.steps``): optional, off by default.

A randomly initialised policy first has to discover what an answer looks like before a reward can
teach it anything; a few supervised steps on the prompts' reference answers give RL a starting
point. :class:`SupervisedWarmup` runs ``sft.steps`` optimizer steps of the policy's own
:class:`dsrl.core.engine.TrainEngine` before rollout 1, each on ``batch.mini_batch_size`` (prompt, reference
answer + eos) sequences, with the per-token loss ``-log pi(answer token)``:

- the step is the exact step of every RL step (same aggregation mode, partition and micro-batches,
  one optimizer step per mini-batch), and counts towards the plan's total optimizer steps (the LR
  schedule's horizon and the progress bar: :class:`dsrl.core.plan.BatchPlan`);
- the sequences of step k are drawn from ``random.Random(f"dsrl-sft:{seed}:{k}")``, the same on every
  rank, independently of the RL prompt sampler and of the torch RNG (so RL rollouts start where a
  run without warm-up would);
- only prompts whose answer is a string qualify (built-in tasks, or a prompts file's ``answer_key``
  column); the answer is tokenized without special tokens, followed by eos, and cut at
  ``rollout.max_new_tokens`` like a completion;
- with an environment (``data.environment``) a sequence is the prompt's reference *trajectory* instead
  (:func:`dsrl.rl.episodes.driver.demonstration`: the factory's ``demonstration(prompt, answer)`` turns, stepped through
  a fresh episode): the model learns its own turns, the observations between them are shown but masked (loss
  mask 0), and it is cut at ``rollout.max_trajectory_tokens``; built when first drawn, then kept;
- it runs once: a resumed run (which always resumes after a rollout) skips it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import ConfigError, DataConfig, RolloutConfig, SftConfig
from dsrl.core.partition import partition_mini_batch
from dsrl.core.plan import BatchPlan
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.prompts import PromptSource
from dsrl.rl.data.replica import my_micro_batches
from dsrl.rl.policy.logprobs import TokenLogprobs, forward_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dsrl.core.engine import TrainEngine


class SupervisedWarmup:
    """The ``dsrl.sft`` phase (module docstring): ``policy`` (the RLEngine) takes ``sft.steps`` exact steps on
    (prompt, reference answer) pairs of ``prompts`` (a :class:`dsrl.rl.data.prompts.PromptSource`), partitioned by
    ``plan``. It reads its own section ``sft``, and of the others what shapes its sequences: ``data`` (the answer
    column, the environment and its chat template), ``rollout`` (the length limits, the stop tokens) and the run's
    ``seed``."""

    def __init__(self, sft: SftConfig, plan: BatchPlan, policy: TrainEngine, tokenizer: PreTrainedTokenizerBase,
                 prompts: PromptSource, *,
                 data: DataConfig, rollout: RolloutConfig, seed: int):
        self.sft, self.data, self.rollout, self.seed = sft, data, rollout, seed
        self.plan, self.policy, self.pad_id = plan, policy, tokenizer.pad_token_id
        pool = [i for i, r in enumerate(prompts.records) if isinstance(r.get("answer"), str)]
        if not pool:
            raise ConfigError(
                f"dsrl.sft.steps = {sft.steps} needs reference answers, but no prompt has a string answer "
                f"(dsrl.data.answer_key = {data.answer_key!r}). Fix: point answer_key at a text column, use a "
                "built-in task, or set dsrl.sft.steps to 0."
            )
        records, prompt_ids = prompts.encode(pool)
        self._trajectories: dict[int, Sample] = {}
        self._demo: Callable[[int], Sample] | None = None
        if data.environment:
            self._demo = self._demonstrations(tokenizer, pool, records, prompt_ids)
            self.pairs = pool  # drawn by index; each trajectory is built when first drawn
            return
        answers = tokenizer([r["answer"] for r in records], add_special_tokens=False)["input_ids"]
        limit = rollout.max_new_tokens
        eos = tokenizer.eos_token_id
        self.pairs = [(list(p), (list(a) + [eos])[:limit]) for p, a in zip(prompt_ids, answers)]

    def _demonstrations(self, tokenizer: PreTrainedTokenizerBase, pool: list[int], records: list[dict],
                        prompt_ids: list[list[int]]) -> Callable[[int], Sample]:
        """``i -> the reference trajectory of pool entry i`` as a sample (module docstring)."""
        from dsrl.rl.episodes.driver import demonstration
        from dsrl.rl.episodes.environment import ObservationEncoder, load_environment
        from dsrl.rollout.base import stop_token_ids

        env = load_environment(self.data)
        encoder = ObservationEncoder(tokenizer, self.data.chat_template)
        stops = stop_token_ids(tokenizer, None, self.rollout)

        def make(i: int) -> Sample:
            t = demonstration(env, tokenizer, encoder, stops, records[i], prompt_ids[i],
                              self.rollout.max_trajectory_tokens, label=pool[i])
            return t.sample(group=-1, reward=0.0)

        return make

    def samples(self, step: int) -> list[Sample]:
        """The mini-batch of step ``step`` (0-based): B (prompt, answer) sequences, the same on every rank."""
        rng = random.Random(f"dsrl-sft:{self.seed}:{step}")
        picks = [rng.randrange(len(self.pairs)) for _ in range(self.plan.mini_batch_size)]
        if self._demo is not None:
            for i in picks:
                if i not in self._trajectories:
                    self._trajectories[i] = self._demo(i)
            return [self._trajectories[i] for i in picks]
        return [Sample(tokens=self.pairs[i][0] + self.pairs[i][1], prompt_len=len(self.pairs[i][0]), group=-1,
                       reward=0.0) for i in picks]

    @staticmethod
    def forward(engine: Any, micro: dict[str, torch.Tensor]) -> TokenLogprobs:
        """The answer's log-probs and whether its token has the largest logit (both from the fused output head's
        tiles, :mod:`dsrl.rl.policy.logprobs`)."""
        return forward_logprobs(engine, micro)

    @staticmethod
    def token_loss(tok: TokenLogprobs, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token negative log-likelihood of the answer, and the top-1 token accuracy as a metric."""
        return -tok.logprobs, {"token_accuracy": tok.target_is_top}

    def run(self, on_step: Callable[[int, Any], None]) -> None:
        """Run every warm-up step; ``on_step(step, result)`` after each."""
        for step in range(self.sft.steps):
            samples = self.samples(step)
            per_rank = partition_mini_batch(range(len(samples)), [s.length for s in samples], self.plan)
            micros = my_micro_batches(samples, per_rank, self.policy.view, self.pad_id, self.policy.device,
                                      self.plan.packing)
            t0 = time.perf_counter()
            res = self.policy.train_mini_batch(micros, self.forward, self.token_loss)
            res["step_s"] = time.perf_counter() - t0
            on_step(step + 1, res)
