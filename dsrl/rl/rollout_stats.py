"""One rollout's statistics: each rank's sums (:class:`RolloutStats`), added up over all ranks once per rollout.

Every field is a sum over this rank's samples, except the ``*_max`` fields, maxima; :meth:`RolloutStats.summed`
combines the ranks with one SUM and one MAX all-reduce, so every rank holds the same totals, from which
:func:`dsrl.runtime.metrics.rollout_record` writes the ``rollout`` row of metrics.jsonl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch.distributed as dist

from dsrl.algos.correction import Mismatch
from dsrl.core.collectives import all_reduce_floats
from dsrl.rl.data.batching import Sample
from dsrl.rl.episodes.trajectory import MAX_TOKENS, MAX_TURNS, OBSERVATION_OVERFLOW, TIMEOUT

if TYPE_CHECKING:
    import torch

    from dsrl.rl.policy.moe import RouteMismatch


@dataclass
class RolloutStats:
    """This rank's sums over one rollout; :meth:`summed` adds them up over all ranks."""

    samples: float = 0.0
    finite_rewards: float = 0.0  # samples whose reward is finite
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    scored_accuracy: float = 0.0  # samples with an accuracy value
    accuracy_sum: float = 0.0
    completion_tokens: float = 0.0
    masked_samples: float = 0.0
    truncated_samples: float = 0.0
    groups_generated: float = 0.0
    groups_zero_variance: float = 0.0
    reward_timeouts: float = 0.0  # samples masked because their reward call ran past data.reward_timeout_s
    prompts_truncated: float = 0.0  # prompts cut to data.max_prompt_tokens (data.prompt_truncation = "left")
    reward_model_fillers: float = 0.0  # reward-model forwards run only to match other ranks' counts (ZeRO-3)
    rollout_s: float = 0.0
    train_s: float = 0.0
    # The behavior policy's mismatch (dsrl.algos.correction.Mismatch) and the samples' staleness; the *_max
    # fields are maxima over ranks, every other field a sum.
    mismatch_tokens: float = 0.0
    logprob_abs_diff_sum: float = 0.0
    rollout_kl_sum: float = 0.0
    is_weight_max: float = 0.0
    is_truncated: float = 0.0
    is_masked: float = 0.0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    # disaggregated generation (dsrl.rl.disagg.remote): trainers' wait for samples and weight publishing, and the
    # generators' generation and idle (waiting for weights) seconds as their messages reported them
    wait_s: float = 0.0
    publish_s: float = 0.0
    generator_s: float = 0.0
    generator_idle_s: float = 0.0
    # weight sync to a generating engine with its own weights (vLLM, generator ranks; 0 when the weights are shared):
    # seconds, bytes and buckets (dsrl.memory.weight_sync_bucket_mib), as the backend's take_timing() reported them
    weight_sync_s: float = 0.0
    weight_sync_bytes: float = 0.0
    weight_sync_buckets: float = 0.0
    vllm_sleep_s: float = 0.0  # dsrl.memory.vllm_sleep_level: putting the engine to sleep and waking it
    vllm_wake_s: float = 0.0
    # Multi-turn trajectories (dsrl.rl.episodes.driver): their count, model turns, tool calls, observation tokens,
    # seconds
    # in the environment, and why they were cut (completion_tokens counts model tokens only).
    trajectories: float = 0.0
    turns: float = 0.0
    tool_calls: float = 0.0
    observation_tokens: float = 0.0
    environment_s: float = 0.0
    environment_timeouts: float = 0.0
    observation_overflows: float = 0.0
    turn_limit_cuts: float = 0.0
    token_limit_cuts: float = 0.0
    # A mixture-of-experts policy (dsrl.rl.policy.moe): (position, layer) pairs compared between the rollout's routes
    # and the trainer's own, how many chose other experts, and |log pi - log mu| over the counted tokens recomputed
    # with the trainer's own routes and with the rollout's replayed
    route_pairs: float = 0.0
    route_differing: float = 0.0
    route_tokens: float = 0.0
    own_routes_abs_diff_sum: float = 0.0
    replayed_tokens: float = 0.0
    replayed_routes_abs_diff_sum: float = 0.0
    moe_policy: float = 0.0  # ranks with an MoE policy (the route columns are written when > 0)

    def add_timing(self, timing: dict[str, float]) -> None:
        """The rollout side's seconds and weight-sync figures (:meth:`dsrl.rollout.base.RolloutBackend.take_timing`)."""
        self.wait_s, self.publish_s = timing.get("wait_s", 0.0), timing.get("publish_s", 0.0)
        self.generator_s, self.generator_idle_s = timing.get("generation_s", 0.0), timing.get("idle_s", 0.0)
        self.weight_sync_s = timing.get("weight_sync_s", 0.0)
        self.weight_sync_bytes = timing.get("weight_sync_bytes", 0.0)
        self.weight_sync_buckets = timing.get("weight_sync_buckets", 0.0)
        self.vllm_sleep_s, self.vllm_wake_s = timing.get("vllm_sleep_s", 0.0), timing.get("vllm_wake_s", 0.0)

    def add_samples(self, samples: list[Sample]) -> None:
        """Count the final (kept) samples of this rank."""
        finite = [s.reward for s in samples if math.isfinite(s.reward)]
        accs = [s.accuracy for s in samples if s.accuracy is not None]
        self.samples += len(samples)
        self.finite_rewards += len(finite)
        self.reward_sum += sum(finite)
        self.reward_sq_sum += sum(r * r for r in finite)
        self.scored_accuracy += len(accs)
        self.accuracy_sum += sum(accs)
        self.completion_tokens += sum(s.model_tokens for s in samples)
        self.masked_samples += sum(not s.active for s in samples)
        self.truncated_samples += sum(not s.finished for s in samples)
        trajs = [s for s in samples if s.turn_mask is not None]
        self.trajectories += len(trajs)
        self.turns += sum(s.turns for s in trajs)
        self.tool_calls += sum(s.tool_calls for s in trajs)
        self.observation_tokens += sum(s.observation_tokens for s in trajs)
        self.environment_s += sum(s.environment_s for s in trajs)
        self.environment_timeouts += sum(s.ended_by == TIMEOUT for s in trajs)
        self.observation_overflows += sum(s.ended_by == OBSERVATION_OVERFLOW for s in trajs)
        self.turn_limit_cuts += sum(s.ended_by == MAX_TURNS for s in trajs)
        self.token_limit_cuts += sum(s.ended_by == MAX_TOKENS for s in trajs)

    def add_staleness(self, samples: list[Sample], trainer_version: int) -> None:
        """How many versions behind the trainer's weights each sample's generating weights were."""
        ages = [trainer_version - s.version for s in samples]
        self.staleness_sum += sum(ages)
        self.staleness_max = max([self.staleness_max, *ages])

    def add_route_mismatch(self, m: RouteMismatch) -> None:
        """A :class:`dsrl.rl.policy.moe.RouteMismatch` of this rank's samples."""
        self.moe_policy = 1.0
        self.route_pairs += m.pairs
        self.route_differing += m.differing
        self.route_tokens += m.tokens
        self.own_routes_abs_diff_sum += m.own_abs_diff
        self.replayed_tokens += m.replayed_tokens
        self.replayed_routes_abs_diff_sum += m.replayed_abs_diff

    def add_mismatch(self, m: Mismatch) -> None:
        self.mismatch_tokens += m.tokens
        self.logprob_abs_diff_sum += m.abs_diff_sum
        self.rollout_kl_sum += m.kl_sum
        self.is_weight_max = max(self.is_weight_max, m.weight_max)
        self.is_truncated += m.truncated
        self.is_masked += m.masked

    def summed(self, device: torch.device | str = "cpu") -> RolloutStats:
        """The fields summed over every rank (one all-reduce), the ``*_max`` fields maximised (a second one)."""
        names = [f.name for f in fields(self) if not f.name.endswith("_max")]
        maxima = [f.name for f in fields(self) if f.name.endswith("_max")]
        totals = all_reduce_floats([getattr(self, n) for n in names], device=device)
        tops = all_reduce_floats([getattr(self, n) for n in maxima], dist.ReduceOp.MAX, device=device)
        return RolloutStats(**dict(zip(names, totals)), **dict(zip(maxima, tops)))
