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
- a learned reward model (``data.reward_model``) scores every rank's completions before the tensor
  peers adopt their source's samples; under ZeRO-3 every rank runs the same number of its forwards
  (:mod:`dsrl.rl.rewards.model`), whatever number of prompts it drew;
- old (and reference) log-probs -- and with a critic the old values -- are computed once per rollout,
  before any update, with the same number of forwards on every rank; with ``kl_in = "reward"`` the
  summed k1 KL is subtracted from the reward there (with a critic: ``-kl_coef * k1`` on every token
  of the GAE rewards instead); advantages come last: group advantages from the penalised rewards, or
  GAE per token from the critic's values, whitened over the whole rollout's valid tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dsrl import algos
from dsrl.algos.correction import correct
from dsrl.algos.losses import kl_estimate
from dsrl.config import AlgorithmConfig, DataConfig, DsrlConfig, RolloutConfig
from dsrl.core.collectives import all_reduce_floats
from dsrl.core.plan import BatchPlan
from dsrl.core.seeds import derived_seed
from dsrl.rl.critic import NO_CRITIC, Critic, NoCritic
from dsrl.rl.data.batching import Sample, chunks, collate, completion_positions, completion_values
from dsrl.rl.data.prompts import PromptSource
from dsrl.rl.data.replica import is_source, share_with_tensor_peers
from dsrl.rl.episodes.driver import EpisodeRunner, score_trajectories
from dsrl.rl.episodes.environment import ObservationEncoder
from dsrl.rl.episodes.trajectory import model_mask
from dsrl.rl.policy.logprobs import forward_logprobs
from dsrl.rl.rollout_stats import RolloutStats
from dsrl.rollout.base import RolloutBackend
from dsrl.runtime.phases import PhaseClock


class _NoWatch:
    @contextlib.contextmanager
    def phase(self, name: str):
        yield


_NO_WATCH = _NoWatch()


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


@dataclass
class Rewards:
    """What scores a rollout's completions: the rule reward (a task's or ``data.reward_fn``, already guarded by
    :mod:`dsrl.rl.rewards.contract`), the accuracy metric, a learned reward model, and an environment (its episodes'
    rewards, :mod:`dsrl.rl.episodes.environment`); each may be None."""

    reward_fn: Callable[..., list[float]] | None = None
    accuracy_fn: Callable[..., list[Any]] | None = None
    model: Any = None  # dsrl.rl.rewards.model.RewardModel
    environment: Any = None  # dsrl.rl.episodes.environment.EnvironmentCaller: samples are multi-turn trajectories


class ExperienceMaker:
    """Generates, scores and prepares this rank's samples of each rollout (module docstring).

    ``settings`` (:class:`ExperienceSettings`, kept as ``d``) are the run file's parts it reads. Collaborators,
    each used for what its name says: ``policy`` (the RLEngine: its parallel view, device and no-grad forwards for
    the old log-probs), ``backend`` (generation), ``prompts`` (the prompt stream and its encoding), ``rewards``,
    ``algo`` (the resolved algorithm), and optionally ``ref_model`` (KL reference), ``critic``
    (:class:`dsrl.rl.critic.Critic`, or :data:`dsrl.rl.critic.NO_CRITIC`), ``watch`` (bounded phase ends) and
    ``phases`` (the :class:`dsrl.runtime.phases.PhaseClock` that times generation, rewards and the no-grad passes).
    With an environment in ``rewards``, each sampling round is one of multi-turn trajectories, run by an
    :class:`dsrl.rl.episodes.driver.EpisodeRunner` built here from these collaborators."""

    moe: Any = None  # dsrl.rl.policy.moe.PolicyRouting of a mixture-of-experts policy, else None
    route_mismatch: Any = None  # the last score_logprobs' RouteMismatch (MoE)

    def __init__(self, settings: ExperienceSettings, plan: BatchPlan, policy: Any, backend: RolloutBackend,
                 tokenizer: Any, prompts: PromptSource, rewards: Rewards, algo: algos.ResolvedAlgorithm, *,
                 ref_model: Any = None, critic: Critic | NoCritic = NO_CRITIC, watch: Any = None,
                 phases: PhaseClock | None = None, moe: Any = None):
        self.d, self.plan, self.policy, self.backend = settings, plan, policy, backend
        self.tokenizer, self.prompts, self.rewards, self.algo = tokenizer, prompts, rewards, algo
        self.ref_model, self.critic, self.watch = ref_model, critic, watch or _NO_WATCH
        self.phases = phases or PhaseClock()
        self.moe = moe
        self.view = policy.view
        self.replica = self.view.data_parallel_rank  # which slice of each rollout's prompts this rank gets
        self.pad_id = tokenizer.pad_token_id
        self._rm_fillers = 0
        self.version = 0  # the policy version of the weights generating now (colocated: the rollout index)
        self.episodes: EpisodeRunner | None = None  # multi-turn rollouts (dsrl.rl.episodes.driver)
        if rewards is not None and rewards.environment is not None:
            self.episodes = EpisodeRunner(
                backend, tokenizer, rewards.environment, ObservationEncoder(tokenizer, settings.data.chat_template),
                settings.rollout.max_turns, settings.rollout.max_trajectory_tokens, self.view, policy.device,
                self.watch, self.phases)

    @property
    def device(self) -> Any:
        return self.policy.device

    # -- prompts and generation -------------------------------------------------------------------
    def _draw(self) -> list[int]:
        """The next P prompt indices (same on every rank) cut to this replica's slice."""
        idx = self.prompts.next_indices()
        per = self.plan.prompts_per_rank
        return idx[self.replica * per:(self.replica + 1) * per]

    def _generate_groups(self, indices: list[int], seed: int) -> list[list[Sample]]:
        records, prompt_ids = self.prompts.encode(indices)
        if self.episodes is not None:  # multi-turn trajectories, turn by turn (dsrl.rl.episodes.driver)
            trajs = self.episodes.run(records, prompt_ids, self.plan.samples_per_prompt, seed, labels=indices)
            with self.watch.phase("reward"), self.phases.phase("reward"):
                scores = self._model_scores([t.tokens for t in trajs])
                r = self.rewards
                return share_with_tensor_peers(self.view, lambda: score_trajectories(
                    indices, records, trajs, reward_fn=r.reward_fn, accuracy_fn=r.accuracy_fn, data=self.d.data,
                    version=self.version, model_scores=scores))
        with self.watch.phase("generation"), self.phases.phase("generate"):
            # Called even with no prompts: under ZeRO-3 every rank must enter generate's parameter gather.
            completions = self.backend.generate(prompt_ids, self.plan.samples_per_prompt, seed=seed)
        with self.watch.phase("reward"), self.phases.phase("reward"):
            scores = self._model_scores([list(c.prompt_ids) + list(c.completion_ids) for c in completions])
            # Tensor peers adopt their source's scored samples (dsrl.rl.data.replica rule 2).
            return share_with_tensor_peers(self.view, lambda: self._score(indices, records, completions, scores))

    def _model_scores(self, sequences: list[list[int]]) -> list[float] | None:
        """The learned reward model's scores of ``sequences`` (None without one), on every rank: a sharded reward
        model's forwards are collective; its filler forwards are counted for the rollout's statistics."""
        model = self.rewards.model
        if model is None:
            return None
        before = model.filler_forwards
        scores = model.score(sequences)
        self._rm_fillers += model.filler_forwards - before
        return scores

    def _score(self, indices: list[int], records: list[dict], completions: list,
               model_scores: list[float] | None = None) -> list[list[Sample]]:
        """Rewards (and accuracies) of one round's completions, as one group of samples per prompt:
        ``rule_reward_weight * rule reward + reward_model_weight * reward-model score`` (each when present)."""
        data, r = self.d.data, self.rewards
        if not completions:
            return []
        texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
        prompts_rep = [records[c.prompt_index]["prompt"] for c in completions]
        answers_rep = [records[c.prompt_index].get("answer") for c in completions]
        rewards = [0.0] * len(completions)
        if r.reward_fn is not None:
            rewards = [data.rule_reward_weight * float(x) for x in r.reward_fn(prompts_rep, texts, answers_rep)]
        if model_scores is not None:
            rewards = [x + data.reward_model_weight * m for x, m in zip(rewards, model_scores)]
        accs = r.accuracy_fn(prompts_rep, texts, answers_rep) if r.accuracy_fn else [None] * len(texts)
        groups: list[list[Sample]] = [[] for _ in indices]
        for c, reward, acc in zip(completions, rewards, accs):
            groups[c.prompt_index].append(Sample(
                tokens=list(c.prompt_ids) + list(c.completion_ids), prompt_len=len(c.prompt_ids),
                group=indices[c.prompt_index], reward=reward, finished=bool(c.finished), accuracy=acc,
                behavior_logprobs=c.behavior_logprobs,
                version=self.version if c.version is None else c.version, routes=c.routes))
        return groups

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
        self._rm_fillers = 0
        dynamic = self.algo.dynamic_sampling
        take = mine
        while True:
            seed = derived_seed(self.d.seed, rollout_index, rounds, self.replica)
            groups = self._generate_groups(take, seed)
            rounds += 1
            counted = float(is_source(self.view))  # statistics count each replica's data once
            stats.reward_timeouts += counted * getattr(self.rewards.reward_fn, "take_timeouts", int)()
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
        stats.reward_model_fillers = float(self._rm_fillers)
        return [s for g in kept for s in g], stats, rounds

    # -- log-probs and advantages -----------------------------------------------------------------
    def _logprob_fn(self):
        """``fn(model, micro)``: log pi(target) ``[b, t]`` on the device, computed at the micro-batch's completion
        positions only (zeros elsewhere): the output head fused into a tiled log-softmax,
        :func:`dsrl.rl.policy.logprobs.forward_logprobs`."""
        temp = self.d.rollout.temperature

        def fn(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            return forward_logprobs(model, micro, temperature=temp).logprobs  # [b, t], stays on the device

        return fn

    def score_logprobs(self, samples: list[Sample]) -> None:
        """Old (and reference) log-probs of every local sample, once per rollout, before any update;
        with ``kl_in = "reward"`` the reward is penalised by the summed k1 KL here. Each pass's results stay on
        the device until the pass ends, then leave it in one copy (:func:`completion_values`)."""
        groups = chunks(samples, self.d.rollout.logprob_micro_batch_size)
        micros = [collate(g, self.pad_id, self.device, with_logprobs=False) for g in groups]
        fn = self._logprob_fn()
        with self.phases.phase("old_logprobs"):
            outs = (self.policy.forward_no_grad(micros, fn) if self.moe is None
                    else self._moe_logprobs(groups, micros, fn))
            for s, values in zip(samples, completion_values(groups, outs)):
                s.old_logprobs = values
        self.critic.add_values(samples, groups, micros, self.phases)  # V(s_t) per completion token (with a critic)
        if self.ref_model is None:
            return
        with torch.no_grad(), self.phases.phase("ref_logprobs"):
            # The reference (a frozen copy, or the policy with its LoRA adapters disabled) pads its forwards itself.
            if self.moe is not None and self.moe.replay:  # the rollout's routes in the reference's forwards too
                fn = self.moe.forcing(fn, self.moe.ref_routing)
            try:
                refs = self.ref_model.forward_no_grad(micros, fn)
            finally:
                if self.moe is not None:
                    self.moe.release()
            for s, values in zip(samples, completion_values(groups, refs)):
                s.ref_logprobs = values
        if self.d.algorithm.kl_in == "reward" and not self.critic.present:  # with a critic: per token, in GAE
            coef = self.d.algorithm.kl_coef
            for s in samples:  # over the model's tokens only (a trajectory's observations are not the policy's)
                kl = kl_estimate(torch.tensor(s.old_logprobs), torch.tensor(s.ref_logprobs), "k1")
                s.reward -= coef * float((kl * torch.tensor(model_mask(s), dtype=kl.dtype)).sum())

    def _moe_logprobs(self, groups: list[list[Sample]], micros: list[dict], fn: Callable) -> list[torch.Tensor]:
        """The old log-probs of an MoE policy (module docstring of :mod:`dsrl.rl.policy.moe`): a forward with the
        trainer's own routes (recorded), and when the backend returns routes one with the rollout's replayed;
        the setting picks which one the samples keep. Both are compared with the behavior log-probs, and the own
        routes with the rollout's (``self.route_mismatch``). Samples keep routes only where training needs them."""
        from dsrl.core.routes import ROUTE_DTYPE
        from dsrl.rl.policy.moe import RouteMismatch

        moe, lay = self.moe, self.moe.layout
        with_routes = self.backend.returns_routes()  # the same on every rank: both passes are collective
        for g in groups:
            for s in g:
                self._check_routes(s, with_routes)
        own, calls = moe.recorded(lambda: self.policy.forward_no_grad(micros, fn))
        replayed = None
        if with_routes:
            try:
                replayed = self.policy.forward_no_grad(micros, moe.forcing(fn))
            finally:
                moe.release()
        own_cpu, replayed_cpu = _on_host(own), _on_host(replayed) if replayed is not None else None
        mm = RouteMismatch()
        counted_here = is_source(self.view)
        for i, (g, mb) in enumerate(zip(groups, micros)):
            b, t = mb["input_ids"].shape
            per_row = calls[i].reshape(b, t, lay.layers, lay.top_k)
            for row, (s, sl) in enumerate(zip(g, completion_positions(g))):
                n = len(s.tokens) - 1
                if counted_here:
                    moe.compare(s.routes, per_row[row, :n], mm)
                    _add_abs_diff(mm, s, own_cpu[i][row, sl], replayed_cpu[i][row, sl] if replayed_cpu else None)
                if not moe.keep_routes:
                    s.routes = None
                elif s.routes is None:  # the load f counts the trainer's own routes
                    s.routes = per_row[row, :n].to(ROUTE_DTYPE).clone()
        self.route_mismatch = mm
        return replayed if (moe.replay and replayed is not None) else own

    def _check_routes(self, s: Sample, with_routes: bool) -> None:
        """A sample's rollout routes fit the policy; under replay every sample has them."""
        if s.routes is not None:
            self.moe.check_sample_routes(s.routes, len(s.tokens) - 1, f"a sample of prompt {s.group}")
        elif with_routes and self.moe.replay:
            from dsrl.core.errors import RunError

            raise RunError(f"a sample of prompt {s.group} reached the trainer without routes while "
                           "dsrl.model.routing_replay = 'rollout' (its generator recorded none: a generator started "
                           "with other settings, or samples from before a resume). Fix: restart the generators "
                           "with this run file, or set routing_replay = 'off'.")

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
        if self.ref_model is not None and a.kl_in == "reward":
            penalties = [(-a.kl_coef * kl_estimate(torch.tensor(s.old_logprobs), torch.tensor(s.ref_logprobs),
                                                   "k1")).tolist() for s in samples]
        models = [model_mask(s) for s in samples]
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
        self.score_logprobs(samples)
        if self.moe is not None and self.route_mismatch is not None:
            stats.add_route_mismatch(self.route_mismatch)
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


def _on_host(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A pass's outputs on the host with one device-to-host copy (ARCHITECTURE §4)."""
    if not outs:
        return []
    flat = torch.cat([o.reshape(-1) for o in outs]).cpu()
    return [part.view(o.shape) for part, o in zip(flat.split([o.numel() for o in outs]), outs)]


def _add_abs_diff(mm: Any, s: Sample, own: torch.Tensor, replayed: torch.Tensor | None) -> None:
    """|log pi - log mu| over a sample's counted model tokens, recomputed with the trainer's own routes and (when
    present) with the rollout's replayed."""
    if s.behavior_logprobs is None or not s.active:
        return
    mu = torch.tensor(s.behavior_logprobs, dtype=torch.float64)
    keep = torch.tensor(model_mask(s), dtype=torch.bool)[: mu.shape[0]]
    mm.tokens += int(keep.sum())
    mm.own_abs_diff += float((own.double()[: mu.shape[0]] - mu).abs()[keep].sum())
    if replayed is not None:
        mm.replayed_tokens += int(keep.sum())
        mm.replayed_abs_diff += float((replayed.double()[: mu.shape[0]] - mu).abs()[keep].sum())


def masked_rewards(samples: list[Sample]) -> torch.Tensor:
    """Rewards with masked samples as NaN: dsrl.algos leaves them out of every group statistic."""
    return torch.tensor([s.reward if s.active else float("nan") for s in samples], dtype=torch.float64)
