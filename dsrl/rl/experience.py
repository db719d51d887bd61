"""One rollout's experience on this rank: prompts -> completions -> rewards -> filters -> log-probs -> advantages.

Invariants kept by :class:`ExperienceMaker`:

- the prompt sampler is identical on every rank; the P prompts of a rollout are split into
  contiguous slices of P/D prompts, one per data-parallel replica, and a replica generates all G
  completions of each of its prompts (whole groups stay on one rank, so group statistics need no
  communication);
- generation is seeded from (run seed, rollout, sampling round, replica), so a resumed run
  regenerates the same completions; the ranks of one replica (tensor-parallel peers) generate
  together and then adopt their source's scored samples, and only sources count them in the
  rollout statistics (:mod:`dsrl.rl.data.replica`);
- a non-finite reward, or an overlong-filtered completion, masks its sample (it contributes no
  token to any count); dynamic sampling (DAPO) refills zero-variance groups with one MAX all-reduce
  per round, and every rank runs the same number of rounds (under ZeRO-3 each round is a collective
  parameter gather);
- rewards come from the one reward formula (:class:`dsrl.rl.rewards.scoring.Scorer`), for single completions and
  multi-turn trajectories alike; a learned reward model (``data.reward_model``) scores every rank's completions
  before the tensor peers adopt their source's samples; under ZeRO-3 every rank runs the same number of its
  forwards (:mod:`dsrl.rl.rewards.model`), whatever number of prompts it drew;
- old (and reference) log-probs come from the policy actor (:meth:`dsrl.rl.policy.actor.PolicyActor.add_logprobs`)
  and, with a critic, the old values from the critic, once per rollout, before any update, on micro-batches
  collated once for both, with the same number of forwards on every rank; with ``kl_in = "reward"`` the summed k1
  KL is subtracted from the reward there (with a critic: ``-kl_coef * k1`` on every token of the GAE rewards
  instead); advantages come last: group advantages from the penalised rewards, or GAE per token from the critic's
  values, whitened over the whole rollout's valid tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dsrl import algos
from dsrl.algos.correction import correct
from dsrl.algos.losses import kl_estimate
from dsrl.config import AlgorithmConfig, DataConfig, DsrlConfig, RolloutConfig
from dsrl.core.collectives import all_reduce_floats
from dsrl.core.plan import BatchPlan
from dsrl.core.seeds import generation_seed
from dsrl.rl.critic import NO_CRITIC, Critic, NoCritic
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.prompts import PromptSource
from dsrl.rl.data.replica import is_source
from dsrl.rl.episodes.driver import EpisodeRunner
from dsrl.rl.policy.actor import PolicyActor
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rl.rollout_stats import RolloutStats
from dsrl.rl.scored_generation import scored_groups
from dsrl.rollout.base import RolloutBackend
from dsrl.runtime.context import RunContext


@dataclass(frozen=True)
class ExperienceSettings:
    """What of the run file one rollout's experience reads: its sections ``algorithm``, ``rollout`` and ``data``, the
    run's seed, and the most tokens a sample holds after its prompt (``DsrlConfig.max_completion_tokens``)."""

    algorithm: AlgorithmConfig
    rollout: RolloutConfig
    data: DataConfig
    seed: int
    max_completion_tokens: int

    @classmethod
    def of(cls, d: DsrlConfig) -> ExperienceSettings:
        return cls(d.algorithm, d.rollout, d.data, d.run.seed, d.max_completion_tokens)


class ExperienceMaker:
    """Generates, scores and prepares this rank's samples of each rollout (module docstring).

    ``settings`` (:class:`ExperienceSettings`, kept as ``d``) are the run file's parts it reads. Collaborators, each
    used for what its name says: ``actor`` (:class:`dsrl.rl.policy.actor.PolicyActor`: the parallel view, the device,
    the old and reference log-probs), ``backend`` (generation), ``prompts`` (the prompt stream and its encoding),
    ``scorer`` (:class:`dsrl.rl.rewards.scoring.Scorer`: the reward formula), ``algo`` (the resolved algorithm),
    ``pad_id`` (the tokenizer's), and optionally ``critic`` (:class:`dsrl.rl.critic.Critic`, or
    :data:`dsrl.rl.critic.NO_CRITIC`), ``episodes`` (an :class:`dsrl.rl.episodes.driver.EpisodeRunner`: each sampling
    round is then one of multi-turn trajectories) and ``context`` (:class:`dsrl.runtime.context.RunContext`: its
    watch bounds the generation and reward phases, its clock times them)."""

    def __init__(self, settings: ExperienceSettings, plan: BatchPlan, actor: PolicyActor, backend: RolloutBackend,
                 prompts: PromptSource, scorer: Scorer, algo: algos.ResolvedAlgorithm, pad_id: int, *,
                 critic: Critic | NoCritic = NO_CRITIC, episodes: EpisodeRunner | None = None,
                 context: RunContext | None = None):
        self.d, self.plan, self.actor, self.backend = settings, plan, actor, backend
        self.prompts, self.scorer, self.algo, self.pad_id = prompts, scorer, algo, pad_id
        self.critic, self.episodes = critic, episodes
        context = context or RunContext()
        self.watch, self.phases = context.watch, context.phases
        self.view = actor.view
        self.replica = self.view.data_parallel_rank  # which slice of each rollout's prompts this rank gets
        self.version = 0  # the policy version of the weights generating now (colocated: the rollout index)

    @property
    def device(self) -> torch.device:
        return self.actor.device

    # -- prompts and generation -------------------------------------------------------------------
    def _draw(self) -> list[int]:
        """The next P prompt indices (same on every rank) cut to this replica's slice."""
        return self.prompts.next_share(self.replica, self.plan.prompts_per_rank)

    def _generate_groups(self, indices: list[int], seed: int) -> list[list[Sample]]:
        records, prompt_ids = self.prompts.encode(indices)

        @contextlib.contextmanager
        def generating() -> Iterator[None]:
            with self.watch.phase("generation"), self.phases.phase("generate"):
                yield

        @contextlib.contextmanager
        def scoring() -> Iterator[None]:
            with self.watch.phase("reward"), self.phases.phase("reward"):
                yield

        return scored_groups(self.view, self.scorer, self.backend, self.episodes, indices, records, prompt_ids,
                             self.plan.samples_per_prompt, seed, self.version, generating, scoring)

    def _shape_rewards(self, samples: list[Sample]) -> None:
        """DAPO overlong shaping and filtering; non-finite rewards mask their sample."""
        a = self.d.algorithm
        if a.overlong_buffer > 0:
            lengths = torch.tensor([s.completion_len for s in samples], dtype=torch.float64)
            pen = algos.overlong_shaping(lengths, self.d.max_completion_tokens, a.overlong_buffer,
                                         a.overlong_penalty)
            for s, p in zip(samples, pen.tolist()):
                s.reward += p
        for s in samples:
            if (a.overlong_filter and not s.finished) or not math.isfinite(s.reward):
                s.active = False

    def collect(self, rollout_index: int) -> tuple[list[Sample], RolloutStats, int]:
        """This replica's P/D prompt groups of G samples with shaped rewards (dynamic sampling
        included), their statistics, and the number of sampling rounds (equal on every rank)."""
        mine = self._draw()
        per = len(mine)
        rounds, kept, spare = 0, [], []
        stats = RolloutStats()
        self.scorer.take_counts()  # counted from here: this rollout's reward calls and reward-model forwards
        dynamic = self.algo.dynamic_sampling
        counted = float(is_source(self.view))  # statistics count each replica's data once
        take = mine
        while True:
            groups = self._generate_groups(take, generation_seed(self.d.seed, rollout_index, rounds, self.replica))
            rounds += 1
            for g in groups:
                self._shape_rewards(g)
                flat = bool(algos.zero_variance_groups(masked_rewards(g), len(g))[0])
                stats.groups_generated += counted
                stats.groups_zero_variance += counted * float(flat)
                (spare if (dynamic and flat) else kept).append(g)
            if not dynamic:
                break
            need = per - len(kept)
            global_need = all_reduce_floats([max(need, 0)], dist.ReduceOp.MAX, self.device)[0]
            if global_need <= 0 or rounds >= self.d.algorithm.max_sampling_rounds:
                break
            take = self._draw()[:max(need, 0)]
        kept = (kept + spare)[:per]  # after the last round, zero-variance groups fill any gap
        timeouts, fillers = self.scorer.take_counts()
        stats.reward_timeouts = counted * timeouts
        stats.prompts_truncated = counted * self.prompts.take_truncated()
        stats.reward_model_fillers = float(fillers)
        return [s for g in kept for s in g], stats, rounds

    # -- off-policy correction and advantages ------------------------------------------------------
    def correct_off_policy(self, samples: list[Sample], stats: RolloutStats) -> None:
        """The off-policy correction of each sample from its proximal (old) and behavior log-probs
        (:mod:`dsrl.algos.correction`): tis weights, or mis removals from the tokens the loss counts; the
        mismatch goes to ``stats`` (sources only: each replica's data counted once)."""
        c = self.d.algorithm.rollout_correction
        counted_here = is_source(self.view)
        for s in samples:
            if s.behavior_logprobs is None:
                continue
            if len(s.behavior_logprobs) != len(s.old_logprobs):
                raise RuntimeError(f"a sample of prompt {s.group} has {len(s.behavior_logprobs)} behavior log-probs "
                                   f"for {len(s.old_logprobs)} completion tokens; the rollout backend broke its "
                                   "contract (dsrl.rollout.base)")
            mask = s.completion_mask or [1] * len(s.old_logprobs)
            counted = [bool(s.active and k) for k in mask]
            fix = correct(s.old_logprobs, s.behavior_logprobs, counted, c.mode, c.level, c.cap)
            if fix.weights is not None:
                s.is_weights = [float(np.float32(w)) for w in fix.weights]  # what the float32 loss multiplies by
            if fix.keep is not None:
                s.completion_mask = [int(k and bool(x)) for k, x in zip(fix.keep, mask)]
            if counted_here:
                stats.add_mismatch(fix.mismatch)

    def advantages(self, samples: list[Sample]) -> None:
        """Group advantages from the (penalised) rewards; masked samples get 0."""
        adv = algos.compute_advantages(self.d.algorithm.name, masked_rewards(samples), self.plan.samples_per_prompt,
                                       normalize_std=self.algo.normalize_std)
        for s, v in zip(samples, adv.tolist()):
            s.advantage = v if (s.active and math.isfinite(v)) else 0.0

    def gae_advantages(self, samples: list[Sample]) -> None:
        """Per-token advantages and returns by GAE from the critic's rollout values (:mod:`dsrl.algos.gae`),
        whitened over the valid tokens of the whole rollout when ``normalize_std`` (one all-reduce; tensor
        peers count once). Masked samples get zero advantages. In a multi-turn trajectory only model tokens are
        steps of the episode: observation tokens are skipped (their values and KL are not used, they get zero
        advantage and return) and the reward sits on the last model token."""
        a = self.d.algorithm
        lengths = [len(s.values) if s.active else 0 for s in samples]
        penalties = None
        if self.actor.has_reference and a.kl_in == "reward":
            penalties = [(-a.kl_coef * kl_estimate(torch.tensor(s.old_logprobs), torch.tensor(s.ref_logprobs),
                                                   "k1")).tolist() for s in samples]
        models = [s.model_mask for s in samples]
        ends = [max((t for t, m in enumerate(mm[:n]) if m), default=n - 1) for mm, n in zip(models, lengths)]
        rewards = algos.token_rewards([s.reward if s.active else 0.0 for s in samples], lengths, penalties, ends)
        values = torch.zeros_like(rewards)
        mask = torch.zeros_like(rewards, dtype=torch.bool)
        for i, s in enumerate(samples):
            values[i, :lengths[i]] = torch.tensor(s.values[:lengths[i]], dtype=torch.float64)
            mask[i, :lengths[i]] = torch.tensor(models[i][:lengths[i]], dtype=torch.bool)
        adv, returns = algos.gae(rewards, values, mask, a.gamma, a.lam)
        if self.algo.normalize_std:
            counted = float(is_source(self.view))
            picked = adv[mask]
            n, total, sq = all_reduce_floats([counted * picked.numel(), counted * float(picked.sum()),
                                              counted * float(picked.square().sum())], device=self.device)
            mean = total / n if n else 0.0
            std = math.sqrt(max(sq / n - mean * mean, 0.0)) if n else 1.0
            adv = algos.whiten(adv, mask, mean, std)
        for i, s in enumerate(samples):
            n = len(s.values or [])
            s.token_advantages = adv[i, :n].tolist() if lengths[i] else [0.0] * n
            s.returns = returns[i, :n].tolist() if lengths[i] else [0.0] * n
            s.advantage = 0.0

    def make(self, rollout_index: int) -> tuple[list[Sample], RolloutStats, int]:
        """The whole pipeline for one rollout: samples ready to train on, stats, sampling rounds."""
        t0 = time.perf_counter()
        # A backend with its own copy of the weights (vllm) takes the policy's current ones (every rank:
        # a parameter gather under ZeRO-3); shared-weight backends do nothing. Either way the generating
        # weights are now those of version = rollout index, the version the trainer holds: staleness 0.
        self.backend.sync_weights()
        self.version = rollout_index
        samples, stats, rounds = self.collect(rollout_index)
        self.backend.sleep()  # a backend with memory of its own (vLLM) frees it until the next sync
        stats.add_timing(self.backend.take_timing())
        batches = self.actor.pass_batches(samples, self.pad_id)  # collated once for every no-grad pass
        mismatch = self.actor.add_logprobs(batches, with_routes=self.backend.returns_routes(),
                                           kl_in_reward=not self.critic.present)  # with a critic: KL per token
        if mismatch is not None:
            stats.add_route_mismatch(mismatch)
        self.critic.add_values(batches)  # V(s_t) per completion token (with a critic)
        self.correct_off_policy(samples, stats)
        if self.critic.present:  # per token by GAE from its values, else per group from the rewards
            self.gae_advantages(samples)
        else:
            self.advantages(samples)
        if is_source(self.view):
            stats.add_samples(samples)
            stats.add_staleness(samples, trainer_version=rollout_index)
        stats.rollout_s = time.perf_counter() - t0
        return samples, stats, rounds


def masked_rewards(samples: list[Sample]) -> torch.Tensor:
    """Rewards with masked samples as NaN: dsrl.algos leaves them out of every group statistic."""
    return torch.tensor([s.reward if s.active else float("nan") for s in samples], dtype=torch.float64)
