"""The whole ``"dsrl"`` section: every section together and the rules that span sections."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

from dsrl.config.algorithm import AlgorithmConfig, CriticConfig, SftConfig
from dsrl.config.batch import BatchConfig
from dsrl.config.data import DataConfig
from dsrl.config.engine import EngineConfig
from dsrl.config.errors import ConfigError
from dsrl.config.evaluation import EvalConfig
from dsrl.config.memory import MemoryConfig
from dsrl.config.model import ModelConfig
from dsrl.config.names import ALGORITHM_LOSS_AGG, CRITIC_ALGORITHMS, DISAGGREGATED, GROUP_RELATIVE_ALGORITHMS
from dsrl.config.rollout import RolloutConfig
from dsrl.config.run import RunConfig, SchedulerConfig
from dsrl.config.section import Section, collected, report_collected, setting, start_collecting


class DsrlConfig(Section):
    """The whole "dsrl" section."""

    PATH: ClassVar[str] = "dsrl"

    batch: BatchConfig = setting(BatchConfig, BatchConfig.__doc__)
    run: RunConfig = setting(RunConfig, RunConfig.__doc__)
    model: ModelConfig = setting(ModelConfig, ModelConfig.__doc__)
    data: DataConfig = setting(DataConfig, DataConfig.__doc__)
    rollout: RolloutConfig = setting(RolloutConfig, RolloutConfig.__doc__)
    algorithm: AlgorithmConfig = setting(AlgorithmConfig, AlgorithmConfig.__doc__)
    scheduler: SchedulerConfig = setting(SchedulerConfig, SchedulerConfig.__doc__)
    critic: CriticConfig = setting(CriticConfig, CriticConfig.__doc__)
    sft: SftConfig = setting(SftConfig, SftConfig.__doc__)
    memory: MemoryConfig = setting(MemoryConfig, MemoryConfig.__doc__)
    eval: EvalConfig = setting(EvalConfig, EvalConfig.__doc__)
    engine: EngineConfig = setting(EngineConfig, EngineConfig.__doc__)

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        """A section given as null takes its defaults."""
        start_collecting()
        if isinstance(data, dict):
            data = {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    @collected
    def _groups_can_differ(self) -> DsrlConfig:
        """A group-relative algorithm (grpo, dr_grpo, rloo, dapo) needs `batch.samples_per_prompt` >= 2: a group
        of one sample always has advantage 0, so the policy would never get a gradient."""
        name, G = self.algorithm.name, self.batch.samples_per_prompt
        if name in GROUP_RELATIVE_ALGORITHMS and G < 2:
            raise ConfigError(
                f"dsrl.batch.samples_per_prompt = {G} with dsrl.algorithm.name = {name!r}: {name} computes each "
                "sample's advantage relative to the other samples of its prompt, so a group of one sample always "
                "has advantage 0 and training never gets a gradient. Fix: set dsrl.batch.samples_per_prompt >= 2 "
                "(GRPO-style runs use 4-16)."
            )
        return self

    @model_validator(mode="after")
    @collected
    def _critic_only_with_a_critic_algorithm(self) -> DsrlConfig:
        """A `critic` key is set only with an algorithm that trains a critic (ppo)."""
        if self.critic.model_fields_set and self.algorithm.name not in CRITIC_ALGORITHMS:
            keys = ", ".join(sorted(self.critic.model_fields_set))
            raise ConfigError(
                f"dsrl.critic ({keys}) is set but dsrl.algorithm.name = {self.algorithm.name!r} trains no critic. "
                f"Fix: set dsrl.algorithm.name to one of {', '.join(CRITIC_ALGORITHMS)}, or remove dsrl.critic."
            )
        return self

    @model_validator(mode="after")
    @collected
    def _overlong_buffer_fits(self) -> DsrlConfig:
        """`algorithm.overlong_buffer` is shorter than the completion bound: `rollout.max_new_tokens`, with
        `data.environment` `rollout.max_trajectory_tokens`."""
        buf, limit = self.algorithm.overlong_buffer, self.max_completion_tokens
        name = "rollout.max_trajectory_tokens" if self.multi_turn else "rollout.max_new_tokens"
        if buf >= limit:
            raise ConfigError(
                f"dsrl.algorithm.overlong_buffer = {buf} must be in [0, {name} = {limit}). "
                f"Fix: lower overlong_buffer or raise dsrl.{name}."
            )
        return self

    @model_validator(mode="after")
    @collected
    def _turn_bounds_need_an_environment(self) -> DsrlConfig:
        """`rollout.max_turns` and `rollout.max_trajectory_tokens` keep their defaults unless `data.environment` is
        set (without one every sample is a single completion and they would do nothing)."""
        fields = type(self.rollout).model_fields
        keys = [k for k in ("max_trajectory_tokens", "max_turns") if getattr(self.rollout, k) != fields[k].default]
        if keys and not self.multi_turn:
            raise ConfigError(
                f"dsrl.rollout.{' and dsrl.rollout.'.join(keys)} bound multi-turn trajectories, but dsrl.data."
                "environment is unset, so every sample is one completion (bounded by rollout.max_new_tokens). Fix: "
                "set dsrl.data.environment, or remove them.")
        return self

    @model_validator(mode="after")
    @collected
    def _environment_timeout_below_collective_bound(self) -> DsrlConfig:
        """`data.environment_timeout_s`, when set with an environment, is smaller than `run.collective_timeout_s`:
        a stuck environment call must give up before the other ranks stop waiting for it."""
        limit, bound = self.data.environment_timeout_s, self.run.collective_timeout_s
        if self.multi_turn and limit is not None and limit >= bound:
            raise ConfigError(
                f"dsrl.data.environment_timeout_s = {limit} is not below dsrl.run.collective_timeout_s = {bound}: the "
                "other ranks would end the job before a stuck environment call is given up. Fix: lower "
                "environment_timeout_s or raise collective_timeout_s.")
        return self

    @model_validator(mode="after")
    @collected
    def _token_budget_fits_a_sequence(self) -> DsrlConfig:
        """In token-budget mode `batch.max_tokens_per_micro_batch` holds the longest possible sequence
        (`data.max_prompt_tokens` + `rollout.max_new_tokens`, with `data.environment` + `rollout.max_trajectory_tokens`
        instead: a trajectory is one sequence), unless `batch.allow_oversize`."""
        T, b = self.batch.max_tokens_per_micro_batch, self.batch
        max_len = self.data.max_prompt_tokens + self.max_completion_tokens
        bound = "rollout.max_trajectory_tokens" if self.multi_turn else "rollout.max_new_tokens"
        if T is not None and T < max_len and not b.allow_oversize:
            raise ConfigError(
                f"dsrl.batch.max_tokens_per_micro_batch T = {T} is smaller than the longest possible sequence "
                f"(data.max_prompt_tokens + {bound} = {max_len}). Fix: raise T to >= {max_len} "
                "or set dsrl.batch.allow_oversize = true to place such sequences alone."
            )
        return self

    @model_validator(mode="after")
    @collected
    def _reward_timeout_below_collective_bound(self) -> DsrlConfig:
        """`data.reward_timeout_s`, when set and a reward function is called (`data.reward_fn`, or a task's reward
        without `data.environment`), is smaller than `run.collective_timeout_s`: a reward call must give up before
        the other ranks stop waiting for it."""
        limit, bound = self.data.reward_timeout_s, self.run.collective_timeout_s
        called = self.data.reward_fn is not None or not self.multi_turn
        if called and limit is not None and limit >= bound:
            raise ConfigError(
                f"dsrl.data.reward_timeout_s = {limit} is not below dsrl.run.collective_timeout_s = {bound}: the "
                "other ranks would end the job before a stuck reward call is given up. Fix: lower "
                "reward_timeout_s or raise collective_timeout_s."
            )
        return self

    @model_validator(mode="after")
    @collected
    def _eval_split_of_the_training_dataset(self) -> DsrlConfig:
        """`eval.split` without `eval.path` is a split of the training dataset: it needs `data.path` (a built-in task
        has no splits) and differs from `data.split` (else the evaluation prompts would be the training prompts)."""
        e, d = self.eval, self.data
        if e.split is None or e.path is not None:
            return self
        if d.path is None:
            raise ConfigError(
                f"dsrl.eval.split = {e.split!r} names a split of the training dataset, but prompts come from the "
                f"built-in task {d.task!r}, which has no splits (with no eval source set it evaluates the task's "
                "held-out prompts). Fix: remove dsrl.eval.split, or set dsrl.eval.path to the dataset to evaluate.")
        if e.split == d.split:
            raise ConfigError(
                f"dsrl.eval.split = {e.split!r} is dsrl.data.split, the split the run trains on: the evaluation would "
                "measure the training prompts. Fix: set dsrl.eval.split to a held-out split (e.g. test), or "
                "dsrl.eval.path to held-out prompts.")
        return self

    @model_validator(mode="after")
    def _report(self) -> DsrlConfig:
        # not a rule: raises the problems every rule above found, together (dsrl.config.section.collected)
        return report_collected(self)

    @property
    def max_staleness(self) -> int:
        """k, resolved: the configured one, else 1 when disaggregated and 0 when colocated."""
        if self.algorithm.max_staleness is not None:
            return self.algorithm.max_staleness
        return 1 if self.rollout.placement == DISAGGREGATED else 0

    @property
    def loss_agg(self) -> str:
        """The resolved aggregation mode: the configured one, else the algorithm's default."""
        return self.batch.loss_agg or ALGORITHM_LOSS_AGG[self.algorithm.name]

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm trains a value model beside the policy (dsrl.critic)."""
        return self.algorithm.name in CRITIC_ALGORITHMS

    @property
    def loss_agg_norm_length(self) -> int:
        """L_norm for seq-mean-token-sum-norm (a constant, never the batch's padded length)."""
        return self.batch.loss_agg_norm_length or self.max_completion_tokens

    @property
    def multi_turn(self) -> bool:
        """Whether samples are multi-turn trajectories (``data.environment`` is set; dsrl.rl.episodes.driver)."""
        return self.data.environment is not None

    @property
    def max_completion_tokens(self) -> int:
        """The most tokens after the prompt one sample holds: ``rollout.max_new_tokens``, or with an environment
        ``rollout.max_trajectory_tokens`` (model and observation tokens together)."""
        return self.rollout.max_trajectory_tokens if self.multi_turn else self.rollout.max_new_tokens

    @property
    def max_generation_tokens(self) -> int:
        """The longest sequence one generate call may hold (a vLLM engine's max_model_len): the prompt bound plus
        ``max_completion_tokens``; with an environment plus one more turn, since a trajectory's last turn is
        generated whole and then cut at ``rollout.max_trajectory_tokens``."""
        extra = self.rollout.max_new_tokens if self.multi_turn else 0
        return self.data.max_prompt_tokens + self.max_completion_tokens + extra

    @property
    def eval_sampling(self) -> RolloutConfig:
        """The rollout settings evaluation generates with: ``dsrl.rollout``'s, with ``eval``'s temperature (0 =
        greedy), top_p, top_k and max_new_tokens (unset = the rollout's)."""
        e = self.eval
        return self.rollout.model_copy(update={
            "temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k,
            "max_new_tokens": e.max_new_tokens or self.rollout.max_new_tokens})

    @property
    def max_eval_generation_tokens(self) -> int:
        """The longest sequence one evaluation generate call may hold: :attr:`max_generation_tokens` with
        ``eval.max_new_tokens`` in place of ``rollout.max_new_tokens``."""
        return self.max_generation_tokens - self.rollout.max_new_tokens + self.eval_sampling.max_new_tokens
