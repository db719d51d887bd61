"""Held-out evaluation (``dsrl.eval``), during training and of a model (``dsrl eval``): :class:`Evaluator`.

When (:class:`EvalSchedule`, pure): with ``eval.every`` = e > 0, rollout N (rollouts trained so far) is due when
N = 0 (before the first rollout), N is a multiple of e, or N is the plan's last. An evaluation that ran is recorded
(:class:`EvalProgress`, the checkpoint's client-state key ``evaluated``) before the rollout's checkpoint is committed
and never runs again; a due one that did not run (a stop skipped it) runs when the run resumes, before its first
rollout. So a resumed run evaluates exactly the rollouts an uninterrupted one would.

One evaluation (:meth:`Evaluator.run`):

- the prompts (:mod:`dsrl.rl.data.evalset`) are split over the D data-parallel replicas in contiguous shares of
  ceil(n / D) (:func:`dsrl.rl.data.prompts.replica_share`), each prompt evaluated once by its replica, and each share
  in calls of at most ``prompts_per_call`` prompts (as many sequences as a training call: continuous batching's
  bounds); every rank makes the same number of calls, a rank whose share is used up calling with no prompts (a
  ZeRO-3 parameter gather), and multi-turn prompts go through the run's :class:`dsrl.rl.episodes.driver.EpisodeRunner`;
- generation is the run's own backend under the evaluation's sampling (:meth:`dsrl.rollout.base.RolloutBackend.
  with_sampling`: no second copy of the weights; temperature 0 = greedy), synced to the current weights and closed
  after; call c of replica d at rollout N is seeded :func:`dsrl.core.seeds.eval_seed` (run seed, N, d, c);
- scores come from the run's :class:`dsrl.rl.rewards.scoring.Scorer` (the one reward formula; accuracy is the
  built-in reward's or task's exact match, the function training reports); tensor peers adopt their source's
  samples and only sources count (:mod:`dsrl.rl.data.replica`); the sums are all-reduced once;
- it changes nothing of training: it runs under forked torch random streams and restored Python and NumPy ones,
  never draws from the training prompt stream, never touches the weights (training rows are bitwise those of the
  same run without evaluation);
- a stop request is decided collectively before each call (:meth:`dsrl.runtime.stop.StopControl.decide`): the
  evaluation ends there, writes nothing, and stays due.

The row (metrics.jsonl ``{"event": "eval"}``, DeepSpeed's monitor, one console line): ``rollout``,
``optimizer_step``, ``prompts`` (n), ``samples_per_prompt`` (s), ``pass_k`` (k), ``accuracy`` (the mean exact match
over all n * s samples), ``pass_at_k`` (the mean over prompts of :func:`pass_at_k`), ``reward_mean`` (over samples
with a finite reward), ``response_len`` (mean completion tokens; the model's tokens of a trajectory),
``truncated_frac`` (samples cut at ``max_new_tokens`` or a trajectory bound), ``reward_timeouts`` and ``eval_s``.
``accuracy`` and ``pass_at_k`` are null where the run has no accuracy (a reward function of the user's own). With
``eval.log_samples`` = N the completions of the first N prompts go to ``eval_samples.jsonl`` beside it (one row per
sample: rollout, prompt index, prompt, completion, reward, accuracy), so a user reads what the model writes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from dsrl.config import DataConfig, DsrlConfig, EvalConfig, RolloutConfig
from dsrl.core.collectives import all_reduce_floats
from dsrl.core.parallel import ParallelView
from dsrl.core.seeds import eval_seed, forked_torch_rng
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.evalset import EvalPrompts, replica_calls
from dsrl.rl.data.prompts import encode
from dsrl.rl.data.replica import is_source
from dsrl.rl.disagg.remote import GenerationStopped
from dsrl.rl.episodes.driver import EpisodeRunner
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rl.scored_generation import scored_groups
from dsrl.rollout.base import RolloutBackend
from dsrl.runtime.context import RunContext
from dsrl.runtime.metrics import MetricsWriter

log = logging.getLogger("dsrl.rl.evaluation")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): the probability that k samples drawn without replacement from the n hold at
    least one correct one, 1 - C(n - c, k) / C(n, k). With k = n it is 1 if c > 0 else 0; with k = 1 it is c / n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one correctly rounded division


@dataclass(frozen=True)
class EvalSchedule:
    """When evaluations run (module docstring): ``every`` = ``eval.every`` (0 = never), ``rollouts`` = the plan's."""

    every: int
    rollouts: int

    def due(self, rollout: int) -> bool:
        """Whether the weights after ``rollout`` rollouts are evaluated."""
        if self.every <= 0 or not 0 <= rollout <= self.rollouts:
            return False
        return rollout == 0 or rollout % self.every == 0 or rollout == self.rollouts


@dataclass
class EvalProgress:
    """The last rollout evaluated (-1: none), kept in the run's state (checkpoint client-state key ``evaluated``)."""

    last: int = -1


@dataclass
class EvalTotals:
    """One evaluation's sums on one rank (sources only count), all-reduced once."""

    prompts: float = 0.0
    samples: float = 0.0
    correct: float = 0.0  # samples whose accuracy is 1 (a timed-out accuracy counts as wrong)
    scored: float = 0.0  # samples with an accuracy function
    pass_sum: float = 0.0  # sum over scored prompts of pass@k
    scored_prompts: float = 0.0
    reward_sum: float = 0.0
    rewards: float = 0.0  # samples with a finite reward
    tokens: float = 0.0
    truncated: float = 0.0
    reward_timeouts: float = 0.0

    def add(self, groups: list[list[Sample]], k: int) -> None:
        """Count one call's prompt groups (each the prompt's samples)."""
        for group in groups:
            self.prompts += 1
            self.samples += len(group)
            self.tokens += sum(s.model_tokens for s in group)
            self.truncated += sum(not s.finished for s in group)
            finite = [s.reward for s in group if math.isfinite(s.reward)]
            self.reward_sum += sum(finite)
            self.rewards += len(finite)
            if group and all(s.accuracy is not None for s in group):
                c = sum(1 for s in group if s.accuracy is not None and math.isfinite(s.accuracy) and s.accuracy >= 1)
                self.correct += c
                self.scored += len(group)
                self.pass_sum += pass_at_k(len(group), c, k)
                self.scored_prompts += 1

    def summed(self, device: Any) -> EvalTotals:
        names = [f.name for f in fields(self)]
        return EvalTotals(*all_reduce_floats([getattr(self, n) for n in names], device=device))


@dataclass(frozen=True)
class EvalSettings:
    """What of the run file an evaluation reads: its section ``eval``, the sampling it generates with
    (``DsrlConfig.eval_sampling``), ``data`` (prompt encoding), the run's seed and the plan's rollouts."""

    eval: EvalConfig
    sampling: RolloutConfig
    data: DataConfig
    seed: int
    rollouts: int

    @classmethod
    def of(cls, d: DsrlConfig, rollouts: int) -> EvalSettings:
        return cls(d.eval, d.eval_sampling, d.data, d.run.seed, rollouts)


@contextlib.contextmanager
def isolated_random_streams(device: torch.device) -> Iterator[None]:
    """torch's (CPU and ``device``'s), Python's and NumPy's random streams as they were before the block."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with forked_torch_rng(device):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


class Evaluator:
    """Evaluates the policy on held-out prompts (module docstring).

    ``settings``: :class:`EvalSettings`; ``prompts``: the evaluation prompts (None when ``eval.every`` is 0 in
    training: nothing is ever due); ``backend``: the run's rollout backend (evaluations use its
    :meth:`~dsrl.rollout.base.RolloutBackend.with_sampling`); ``scorer``: the run's; ``tokenizer``: the run's;
    ``view``/``device``: the policy's parallel view and collective device; ``prompts_per_call``: prompts per generate
    call; optional ``context`` (:class:`dsrl.runtime.context.RunContext`: the rank that writes, stop requests decided
    before each call, the watch that bounds the phase), ``episodes`` (multi-turn: the run's runner, whose calls then
    use the evaluation backend), ``metrics`` (where rows go), ``progress`` (shared with the run's state)."""

    def __init__(self, settings: EvalSettings, prompts: EvalPrompts | None, backend: RolloutBackend, scorer: Scorer,
                 tokenizer: Any, view: ParallelView, device: torch.device, prompts_per_call: int, *,
                 context: RunContext | None = None, episodes: EpisodeRunner | None = None,
                 metrics: MetricsWriter | None = None, progress: EvalProgress | None = None,
                 samples_path: str | None = None):
        self.settings, self.prompts, self.backend, self.scorer = settings, prompts, backend, scorer
        self.samples_path = samples_path if settings.eval.log_samples else None
        self.tokenizer, self.view, self.device = tokenizer, view, torch.device(device)
        self.prompts_per_call = max(1, int(prompts_per_call))
        context = context or RunContext()
        self.episodes, self.metrics = episodes, metrics
        self.stop, self.watch, self.rank = context.stop, context.watch, context.rank
        self.progress = progress if progress is not None else EvalProgress()
        e = settings.eval
        self.schedule = EvalSchedule(e.every if prompts is not None else 0, settings.rollouts)

    def describe(self) -> str:
        """What an evaluation does, for the start-up log."""
        e, s = self.settings.eval, self.settings.sampling
        how = "greedy" if s.temperature <= 0 else f"temperature {s.temperature:g}"
        n = len(self.prompts) if self.prompts is not None else 0
        return (f"{self.prompts.where if self.prompts is not None else 'no prompts'}: {n} x {e.samples_per_prompt} "
                f"{how}, max_new_tokens {s.max_new_tokens}, pass@{e.k}")

    def due(self, rollout: int) -> bool:
        """Whether the weights after ``rollout`` rollouts are to be evaluated now: the schedule says so and no
        evaluation of them has run yet."""
        return self.schedule.due(rollout) and rollout > self.progress.last

    def evaluate_if_due(self, rollout: int, optimizer_step: int = 0) -> dict[str, Any] | None:
        """Evaluate the weights after ``rollout`` rollouts when :meth:`due` (module docstring); the row, or None (not
        due, or a stop request ended it). Collective: every rank calls it."""
        if not self.due(rollout):
            return None
        record = self.run(rollout, optimizer_step)
        if record is not None:
            self.progress.last = rollout
        return record

    def run(self, rollout: int | None, optimizer_step: int | None = None) -> dict[str, Any] | None:
        """One evaluation of the current weights (module docstring): its row, written to the metrics and the console,
        or None when a stop request ended it. Collective: every rank calls it."""
        assert self.prompts is not None, "Evaluator.run without evaluation prompts"
        t0 = time.perf_counter()
        st, e = self.settings, self.settings.eval
        replica = self.view.data_parallel_rank
        calls = replica_calls(len(self.prompts), self.view.data_parallel_size, replica, self.prompts_per_call)
        local, shown = EvalTotals(), []
        self.scorer.take_counts()  # from here: this evaluation's reward calls
        if self._stopped(rollout, 0, len(calls)):
            return None
        with isolated_random_streams(self.device):
            backend = self.backend.with_sampling(st.sampling)
            episodes = self.episodes.with_backend(backend) if self.episodes is not None else None  # own phase clock
            try:
                # the current weights: a backend with its own copy (vllm) reloads them, generator ranks receive them
                backend.sync_weights()
                for c, part in enumerate(calls):
                    if c and self._stopped(rollout, c, len(calls)):
                        return None
                    seed = eval_seed(st.seed, rollout or 0, replica, c)
                    groups = self._call(part, seed, backend, episodes)
                    if is_source(self.view):
                        local.add(groups, e.k)
                        shown += self._shown(part, groups, rollout)
            except GenerationStopped as stopped:
                if not stopped.requested:
                    raise  # a generator is gone: the trainer commits what it trained and ends
                self._stopped(rollout, -1, len(calls))
                return None
            finally:
                backend.close()  # continuous batching: its manager and paged cache
        local.reward_timeouts = self.scorer.take_counts()[0] * float(is_source(self.view))
        record = self._record(local.summed(self.device), rollout, optimizer_step, time.perf_counter() - t0)
        if self.metrics is not None:
            self.metrics.write("eval", record, optimizer_step or 0)
        if self.samples_path is not None:
            self._write_samples(shown)
        if self.rank == 0:
            log.info(eval_line(record, st.rollouts))
        return record

    def _shown(self, indices: list[int], groups: list[list[Sample]], rollout: int | None) -> list[dict[str, Any]]:
        """The rows ``eval_samples.jsonl`` gets of one call: the samples of its prompts among the first
        ``eval.log_samples``."""
        if self.samples_path is None:
            return []
        rows = []
        for i, group in zip(indices, groups):
            if i < self.settings.eval.log_samples:
                for s in group:
                    completion = self.tokenizer.decode(s.tokens[s.prompt_len:], skip_special_tokens=True)
                    rows.append({"rollout": rollout, "prompt_index": i, "prompt": self.prompts.records[i]["prompt"],
                                 "completion": completion, "reward": s.reward, "accuracy": s.accuracy})
        return rows

    def _write_samples(self, shown: list[dict[str, Any]]) -> None:
        """Every replica's shown samples, gathered (one collective), written by rank 0 in prompt order."""
        import json
        import os

        import torch.distributed as dist

        everyone = [shown]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, shown)
        if self.rank != 0:
            return
        rows = sorted((r for part in everyone for r in part or []), key=lambda r: r["prompt_index"])
        os.makedirs(os.path.dirname(os.path.abspath(self.samples_path)), exist_ok=True)
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")

    def _stopped(self, rollout: int | None, done: int, calls: int) -> bool:
        """Whether a stop request ends the evaluation before call ``done`` (-1: while waiting for generator ranks);
        decided by every rank alike (one small all-reduce, until a request is agreed)."""
        if done >= 0 and (self.stop is None or self.stop.decide(0) is None):
            return False
        if self.rank == 0:
            log.warning("the evaluation of rollout %s ended on the stop request (%s of %d calls done); it runs when "
                        "the run resumes", rollout, "some" if done < 0 else done, calls)
        return True

    def _call(self, indices: list[int], seed: int, backend: RolloutBackend,
              episodes: EpisodeRunner | None) -> list[list[Sample]]:
        """Generate and score one call's prompts (every rank calls it, possibly with none)."""
        d = self.settings.data
        records = [self.prompts.records[i] for i in indices]
        prompt_ids = encode(self.tokenizer, [r["prompt"] for r in records], d.max_prompt_tokens, d.chat_template,
                            d.system_prompt).ids if records else []
        def phase() -> contextlib.AbstractContextManager[Any]:
            return self.watch.phase("evaluation")

        return scored_groups(self.view, self.scorer, backend, episodes, indices, records, prompt_ids,
                             self.settings.eval.samples_per_prompt, seed, 0, generating=phase, scoring=phase)

    def _record(self, t: EvalTotals, rollout: int | None, optimizer_step: int | None,
                seconds: float) -> dict[str, Any]:
        e = self.settings.eval
        return {
            "rollout": rollout,
            "optimizer_step": optimizer_step,
            "prompts": int(t.prompts),
            "samples_per_prompt": e.samples_per_prompt,
            "pass_k": e.k,
            "accuracy": t.correct / t.scored if t.scored else None,
            "pass_at_k": t.pass_sum / t.scored_prompts if t.scored_prompts else None,
            "reward_mean": t.reward_sum / t.rewards if t.rewards else None,
            "response_len": t.tokens / t.samples if t.samples else 0.0,
            "truncated_frac": t.truncated / t.samples if t.samples else 0.0,
            "reward_timeouts": t.reward_timeouts,
            "eval_s": seconds,
        }


def eval_line(record: dict[str, Any], total_rollouts: int | None = None) -> str:
    """The console line of an evaluation row."""
    where = "" if record.get("rollout") is None else f" at rollout {record['rollout']}" + (
        f"/{total_rollouts}" if total_rollouts else "")
    parts = [f"eval{where}: {record['prompts']} prompts x {record['samples_per_prompt']}"]
    shown = (("accuracy", "acc"), ("pass_at_k", f"pass@{record.get('pass_k')}"), ("reward_mean", "reward"))
    for key, name in shown:
        v = record.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            parts.append(f"{name} {v:.3f}")
    parts.append(f"len {record['response_len']:.1f}")
    parts.append(f"{record['eval_s']:.1f}s")
    return " | ".join(parts)
