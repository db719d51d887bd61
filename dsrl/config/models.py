"""The ``"dsrl"`` section of a run file as pydantic models: types, ranges, enums and cross-field rules.

Invariants kept here (and nowhere else):
- types are strict: no bool for a number, no string for a number, no float for an integer; numbers
  are finite; unknown keys are errors with a close-match suggestion;
- every rule that needs neither the world size, the dataset nor the ds_config is a ``Field``
  constraint or a ``model_validator`` of the section it concerns (or of :class:`DsrlConfig` when it
  spans sections); each validator's docstring is the rule as docs/configuration.md states it;
- constructing any section directly (``RolloutConfig(max_new_tokens=10)``) validates it the same
  way and raises :class:`dsrl.config.errors.ConfigError`, never a pydantic error.

The rules that need the world size live in :mod:`dsrl.core.plan`, those that need the scheduler horizon
in :mod:`dsrl.backends.deepspeed.schedule`, those that need the data files in :mod:`dsrl.data`, and the DeepSpeed half is
validated by DeepSpeed's own classes (:mod:`dsrl.backends.deepspeed.validation`).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUndefined

from dsrl.config.errors import ConfigError, config_error
from dsrl.config.names import (
    ALGORITHM_LOSS_AGG,
    CRITIC_ALGORITHMS,
    DEFAULT_TASK,
    GROUP_RELATIVE_ALGORITHMS,
    PROMPT_FILE_FORMATS,
    TASK_NAMES,
    AlgorithmName,
    LossAgg,
    RatioLevel,
    TaskName,
    TinyArch,
)


def setting(default: Any = PydanticUndefined, doc: str = "", unit: str = "", **constraints: Any) -> Any:
    """A documented field: ``doc`` and ``unit`` feed docs/configuration.md and the error messages."""
    extra = {"unit": unit} if unit else None
    if isinstance(default, type):  # a mutable default: dict, list
        return Field(default_factory=default, description=doc, json_schema_extra=extra, **constraints)
    return Field(default, description=doc, json_schema_extra=extra, **constraints)


class Section(BaseModel):
    """Base of the "dsrl" sections: strict, closed, and every validation error is a ConfigError."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)
    PATH: ClassVar[str] = "dsrl"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, type(self), self.PATH) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise config_error(e, type(self), self.PATH) from None


def _exactly_one(path: str, a: str, a_value: Any, a_means: str, b: str, b_value: Any, b_means: str) -> None:
    if (a_value is None) == (b_value is None):
        raise ConfigError(
            f"{path}: set exactly one of {a} ({a_means}, got {a_value!r}) and {b} ({b_means}, got {b_value!r}). "
            "Fix: keep one and set the other to null."
        )


class BatchConfig(Section):
    """The batch hierarchy: rollout -> mini-batch (optimizer step) -> micro-batch."""

    PATH: ClassVar[str] = "dsrl.batch"

    prompts_per_rollout: int = setting(8, "P: prompts drawn per rollout", "prompts", gt=0)
    samples_per_prompt: int = setting(4, "G: completions per prompt (GRPO group size, RLOO k)", "sequences", gt=0)
    mini_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = setting(
        "auto", 'B: sequences per optimizer step; "auto" = the rollout size R = P*G', "sequences")
    epochs_per_rollout: int = setting(
        1, "E: passes over each rollout (PPO epochs); reshuffled every pass", "passes", gt=0)
    micro_batch_size_per_rank: int | None = setting(
        None, "m: sequences per forward/backward on one rank (fixed mode)", "sequences", gt=0)
    max_tokens_per_micro_batch: int | None = setting(
        None, "T: token budget per forward/backward on one rank (token-budget mode; the micro-batch count "
              "varies per step but is equal on every rank)", "tokens", gt=0)
    loss_agg: LossAgg | None = setting(None, "loss aggregation (docs/concepts.md); unset = the algorithm's default")
    loss_agg_norm_length: int | None = setting(
        None, "L_norm of seq-mean-token-sum-norm (Dr. GRPO); unset = rollout.max_new_tokens", "tokens", gt=0)
    allow_oversize: bool = setting(False, "token-budget mode: place a sequence longer than T alone instead of failing")
    balance_attention_coef: float = setting(
        0.0, "token-budget mode: rank-balancing cost = tokens + coef * tokens^2 / T (attention's quadratic share; "
             "0 = tokens only)", ge=0)
    shuffle: bool = setting(True, "reshuffle the rollout before every epoch")

    @model_validator(mode="after")
    def _one_micro_batch_mode(self) -> BatchConfig:
        """Exactly one of `micro_batch_size_per_rank` (fixed micro-batches) and `max_tokens_per_micro_batch`
        (token budget) is set."""
        _exactly_one(self.PATH, "micro_batch_size_per_rank", self.micro_batch_size_per_rank, "fixed micro-batches",
                     "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, "token budget")
        return self

    @model_validator(mode="after")
    def _whole_steps_per_rollout(self) -> BatchConfig:
        """`mini_batch_size` divides the rollout size R = P*G: a rollout splits into whole optimizer steps."""
        P, G, B = self.prompts_per_rollout, self.samples_per_prompt, self.mini_batch_size
        R = P * G
        if B != "auto" and R % B != 0:
            good = [x for x in range(1, R + 1) if R % x == 0]
            raise ConfigError(
                f"{self.PATH}.mini_batch_size = {B} does not divide the rollout size R = P*G = {P}*{G} = {R}; "
                f"a rollout must split into whole optimizer steps. Fix: choose B among {good[-8:]} "
                "(divisors of R; the plan also needs B to be a multiple of the data-parallel size) "
                "or change prompts_per_rollout/samples_per_prompt."
            )
        return self


class RunConfig(Section):
    """How long to run, where to write, how to checkpoint."""

    PATH: ClassVar[str] = "dsrl.run"

    epochs: float | None = setting(None, "passes over the prompt dataset (exclusive with rollouts)", "epochs", gt=0)
    rollouts: int | None = setting(None, "number of rollouts (exclusive with epochs)", "rollouts", gt=0)
    last_rollout: Literal["drop", "wrap"] = setting(
        "drop", "with epochs: 'drop' = floor(epochs*N/P) rollouts (leftover prompts unused), 'wrap' = ceil "
                "(the last rollout wraps into the next shuffled epoch)")
    output_dir: str = setting("runs/dsrl", "metrics, logs and checkpoints go here")
    seed: int = setting(0, "global seed; per-rank seeds derive from it and the rank")
    save_every: int = setting(0, "checkpoint every N rollouts (0 = only at the end)", "rollouts", ge=0)
    keep_last: int = setting(2, "complete checkpoints kept on disk", "checkpoints", gt=0)
    save_final: bool = setting(True, "checkpoint after the last rollout")
    resume: str = setting("auto", "'auto' = continue from output_dir's latest complete checkpoint; 'never'; or a path")
    log_every: int = setting(1, "print a log line every N rollouts", "rollouts", gt=0)
    stop_after_rollouts: int | None = setting(
        None, "end this invocation after N rollouts with a checkpoint (job time limits); the plan, schedule and "
              "progress total are unchanged and --resume continues", "rollouts", gt=0)
    progress_bar: bool = setting(True, "show a tqdm bar over optimizer steps (rank 0)")
    overwrite: bool = setting(
        False, "start over in an output_dir that already holds a run: delete its checkpoints, metrics.jsonl and "
               "final model first (without it such a start is refused; docs/reliability.md)")
    export_final: bool = setting(
        True, "after the last rollout, write the final checkpoint as a Hugging Face model directory to "
              "<output_dir>/final_model (needs save_final)")
    checkpoint_checksums: bool = setting(
        True, "record a CRC-32 of every checkpoint file in its MANIFEST.json and verify it on resume and export "
              "(false: sizes only)")
    join_timeout_s: float | None = setting(
        None, "how long rank 0 waits for every rank to join the process group; unset = $DSRL_INIT_TIMEOUT_S, "
              "else 300", "seconds", gt=0)
    collective_timeout_s: float = setting(
        1800.0, "a rank that has not reached a collective (or the end of a phase: generation, reward, step, save) "
                "this long after the first rank ends the job with a message naming the phase and the rank",
        "seconds", gt=0)
    stop_grace_s: float = setting(
        25.0, "after SIGTERM/SIGINT or the death of the launcher: finish the rollout and checkpoint if that fits "
              "in this time, else stop at the next mini-batch boundary; a rank still running after it exits",
        "seconds", gt=0)

    @model_validator(mode="after")
    def _one_length(self) -> RunConfig:
        """Exactly one of `epochs` and `rollouts` is set."""
        _exactly_one(self.PATH, "epochs", self.epochs, "passes over the prompts", "rollouts", self.rollouts,
                     "a rollout count")
        return self


class ModelConfig(Section):
    """The policy (and reference) model."""

    PATH: ClassVar[str] = "dsrl.model"

    path: str | None = setting(None, "local directory of a HF causal LM; unset = the built-in tiny model")
    tokenizer: str | None = setting(None, "tokenizer directory; unset = model.path, or the shipped tiny tokenizer")
    arch: TinyArch = setting("qwen2", "architecture of the tiny model")
    tiny: dict[str, Any] = setting(dict, "overrides of the tiny model's transformers config")
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", "load dtype; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: str | None = setting(
        None, "transformers attn_implementation (sdpa, flash_attention_2, eager)")
    gradient_checkpointing: bool = setting(False, "activation checkpointing")
    apex: Literal["auto", "off"] = setting(
        "auto", "NVIDIA apex where it imports: on GPU its prebuilt FusedAdam replaces the FusedAdam DeepSpeed would "
                "compile for a ds_config Adam/AdamW (same update rule; docs/benchmarks.md); 'off' = never")
    packing: bool = setting(
        False, "padding-free micro-batches: sequences packed into one row, position_ids restarting per sequence "
               "and no attention mask (transformers builds the block-diagonal mask on sdpa/eager, varlen kernels "
               "on flash attention); the token budget then counts real tokens only")


class DataConfig(Section):
    """Where prompts and rewards come from."""

    PATH: ClassVar[str] = "dsrl.data"

    task: TaskName | None = setting(
        None, f"built-in task (dsrl/tasks): {' | '.join(TASK_NAMES)}; unset = {DEFAULT_TASK} when path is unset")
    path: str | None = setting(
        None, f"local prompts file ({', '.join(PROMPT_FILE_FORMATS)}), read when the run starts")
    prompt_key: str = setting("prompt", "column holding the prompt text")
    answer_key: str = setting("answer", "column passed to the reward function")
    reward_fn: str | None = setting(
        None, "dotted path 'pkg.module:function' (or pkg.module.function) of the rule reward; with path, it or "
              "reward_model is required")
    reward_model: str | None = setting(
        None, "local directory of a Hugging Face AutoModelForSequenceClassification (num_labels 1) sharing the "
              "policy's tokenizer: each sample's score is read at its last valid token; ZeRO-3 shards it like the "
              "policy (docs/ppo.md)")
    reward_model_weight: float = setting(1.0, "reward = reward_model_weight * score + rule_reward_weight * rule reward")
    rule_reward_weight: float = setting(
        1.0, "weight of the rule reward (reward_fn or the task's); 0 with a task = the reward model alone")
    size: int = setting(512, "number of prompts a built-in task generates", "prompts", gt=0)
    max_prompt_tokens: int = setting(64, "prompts are truncated to this many tokens", "tokens", gt=0)
    chat_template: bool = setting(False, "apply the tokenizer's chat template to prompts")
    reward_timeout_s: float | None = setting(
        600.0, "limit on one call of reward_fn (per sample for a per-sample function, per batch for a batched "
               "one); a call past it masks its samples and counts them in reward_timeouts (null = no limit)",
        "seconds", gt=0)

    @model_validator(mode="before")
    @classmethod
    def _default_task(cls, data: Any) -> Any:
        """With neither `task` nor `path` set, prompts come from the built-in task `reverse` (no downloads)."""
        if isinstance(data, dict) and data.get("task") is None and data.get("path") is None:
            data = {**data, "task": DEFAULT_TASK}
        return data

    @field_validator("path")
    @classmethod
    def _known_file_type(cls, path: str | None) -> str | None:
        """`path` ends in one of the readable suffixes."""
        if path is not None:
            ext = os.path.splitext(path)[1].lower()
            if ext not in PROMPT_FILE_FORMATS:
                raise ConfigError(
                    f"{cls.PATH}.path = {path!r}: unsupported file type {ext or '(none)'!r}. "
                    f"Fix: use one of {', '.join(PROMPT_FILE_FORMATS)}."
                )
        return path

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        """Prompts come from exactly one source, and a file needs `reward_fn` or `reward_model` (it has no
        built-in reward)."""
        if self.task and self.path:
            raise ConfigError(
                f"{self.PATH}.task = {self.task!r} and {self.PATH}.path = {self.path!r} are both set; prompts come "
                f"from exactly one source. Fix: set {self.PATH}.task to null to read the file, or remove "
                f"{self.PATH}.path."
            )
        if self.path and not self.reward_fn and not self.reward_model:
            raise ConfigError(
                f"{self.PATH}.reward_fn and {self.PATH}.reward_model are unset but prompts come from {self.PATH}.path "
                f"= {self.path!r}, which has no built-in reward. Fix: set {self.PATH}.reward_fn to "
                "'package.module:function' taking (prompts, completions, answers) and returning one float per "
                f"completion, or {self.PATH}.reward_model to a local sequence-classification model directory."
            )
        return self

    @property
    def has_rule_reward(self) -> bool:
        """Whether a rule reward (``reward_fn`` or the task's) enters the reward with a non-zero weight."""
        return self.rule_reward_weight != 0 and (self.task is not None or self.reward_fn is not None)

    @model_validator(mode="after")
    def _some_reward(self) -> DataConfig:
        """The reward has a non-zero part: `rule_reward_weight` and `reward_model_weight` are not both 0 (or the
        rule weight 0 without a `reward_model`)."""
        model = self.reward_model is not None and self.reward_model_weight != 0
        if not (self.has_rule_reward or model):
            raise ConfigError(
                f"{self.PATH}: every reward would be 0 (rule_reward_weight = {self.rule_reward_weight}, reward_model = "
                f"{self.reward_model!r}, reward_model_weight = {self.reward_model_weight}). Fix: give the rule reward "
                "or a reward model a non-zero weight."
            )
        return self


class RolloutConfig(Section):
    """Generation."""

    PATH: ClassVar[str] = "dsrl.rollout"

    backend: Literal["hf", "cb", "auto", "vllm"] = setting(
        "hf", "generation backend: hf (transformers generate), cb (transformers continuous batching), auto "
        "(hf or cb per call, docs/rollout.md), vllm")
    cb_attention: Literal["auto", "model", "varlen"] = setting(
        "auto", "attention inside continuous batching (cb): model (the model's attn_implementation; sdpa/eager "
        "then attend through a dense mask), varlen (dsrl's packed attention: PyTorch's own flash kernel on a GPU "
        "in bf16/fp16), auto (varlen on the CPU for models >= 1 M parameters or >= 128 concurrent sequences, "
        "as measured; on a GPU in bf16/fp16, not measured there: docs/rollout.md)")
    max_new_tokens: int = setting(16, "completion length limit", "tokens", gt=0)
    temperature: float = setting(1.0, "sampling temperature", gt=0)
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest token set whose probability reaches top_p",
                           gt=0, le=1)
    top_k: int = setting(0, "top-k sampling (0 = off)", ge=0)
    generation_batch_size: int = setting(64, "prompts per generate() call on one rank", "prompts", gt=0)
    logprob_micro_batch_size: int = setting(
        16, "sequences per no-grad log-prob forward on one rank", "sequences", gt=0)


class AlgorithmConfig(Section):
    """Advantages, sample filters and the policy loss (unset keys take the algorithm's default)."""

    PATH: ClassVar[str] = "dsrl.algorithm"

    name: AlgorithmName = setting("grpo", "algorithm (defaults per algorithm: see the table below)")
    clip_low: float | None = setting(
        None, "PPO clip: ratio >= 1 - clip_low; unset = the algorithm's (0.2; GSPO 3e-4)", ge=0, lt=10)
    clip_high: float | None = setting(
        None, "PPO clip: ratio <= 1 + clip_high; unset = the algorithm's, else clip_low (DAPO 0.28, GSPO 4e-4)",
        ge=0, lt=10)
    ratio_level: RatioLevel | None = setting(
        None, "importance ratio: token (pi/pi_old per token) or sequence (GSPO: exp of the mean token log-ratio of "
              "the sequence, clipped per sequence); unset = the algorithm's")
    gamma: float = setting(1.0, "ppo: GAE discount per token", ge=0, le=1)
    lam: float = setting(0.95, "ppo: GAE lambda", ge=0, le=1)
    normalize_std: bool | None = setting(
        None, "divide group advantages by the group std (ppo: whiten GAE advantages over the rollout's valid "
              "tokens); unset = algorithm default")
    kl_coef: float = setting(0.0, "KL penalty against the frozen reference model", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = setting("k3", "KL estimator")
    kl_in: Literal["loss", "reward"] = setting("loss", "KL as a loss term or a reward penalty")
    entropy_coef: float = setting(0.0, "entropy bonus coefficient")
    dynamic_sampling: bool | None = setting(
        None, "drop zero-variance groups and refill the rollout; unset = on for dapo")
    max_sampling_rounds: int = setting(
        8, "dynamic sampling: generation rounds before giving up on a full rollout", gt=0)
    overlong_filter: bool = setting(False, "mask out completions truncated at max_new_tokens")
    overlong_buffer: int = setting(
        0, "soft overlong punishment: length window before max_new_tokens", "tokens", ge=0)
    overlong_penalty: float = setting(1.0, "soft overlong punishment at the limit")


class CriticConfig(Section):
    """The value model of algorithms with a critic (ppo): a second engine with its own optimizer, LR schedule
    and ZeRO settings; unset keys take the policy's."""

    PATH: ClassVar[str] = "dsrl.critic"

    path: str | None = setting(
        None, "local Hugging Face directory: a causal LM (its backbone gets a new scalar head) or an "
              "AutoModelForTokenClassification with num_labels 1; unset = the policy's model (model.path, or the "
              "tiny model built the same way)")
    zero_optimization: dict[str, Any] | None = setting(
        None, "ds_config zero_optimization section of the critic's engine; unset = the policy's")
    optimizer: dict[str, Any] | None = setting(
        None, "ds_config optimizer section of the critic; unset = the policy's (with lr below)")
    lr: float | None = setting(None, "the critic optimizer's lr; unset = its optimizer section's", gt=0)
    scheduler: dict[str, Any] | None = setting(
        None, "ds_config scheduler section of the critic (horizon: the critic's optimizer steps); unset = the "
              "policy's")
    gradient_clipping: float | None = setting(None, "gradient clipping of the critic; unset = the policy's", ge=0)
    value_clip: float | None = setting(
        0.2, "clipped value loss: the new value may move at most this far from the rollout's value; null = "
             "unclipped squared error", gt=0)
    warmup_rollouts: int = setting(
        0, "critic-only rollouts at the start of the run (part of the run's rollouts): the policy does not update",
        "rollouts", ge=0)


class SftConfig(Section):
    """An optional supervised warm-up on the prompts' reference answers before the first rollout (dsrl/rl/sft.py)."""

    PATH: ClassVar[str] = "dsrl.sft"

    steps: int = setting(
        0, "optimizer steps of next-token loss on (prompt, answer + eos) before rollout 1, batch.mini_batch_size "
           "sequences each; they count towards the plan's total optimizer steps (0 = off)", "optimizer steps", ge=0)


class SchedulerConfig(Section):
    """A transformers named schedule, owned by dsrl (alternative to the ds_config "scheduler")."""

    PATH: ClassVar[str] = "dsrl.scheduler"

    name: str | None = setting(
        None, "transformers schedule name (linear, cosine, cosine_with_min_lr, ...)")
    warmup_steps: int | None = setting(None, "warmup length", "optimizer steps", ge=0)
    warmup_ratio: float | None = setting(None, "warmup as a fraction of the horizon", ge=0, lt=1)
    kwargs: dict[str, Any] = setting(dict, "scheduler_specific_kwargs")

    @model_validator(mode="after")
    def _one_warmup(self) -> SchedulerConfig:
        """At most one of `warmup_steps` and `warmup_ratio` is set."""
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ConfigError(
                f"{self.PATH}: set at most one of warmup_steps ({self.warmup_steps}) and warmup_ratio "
                f"({self.warmup_ratio}). Fix: remove one."
            )
        return self


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

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        """A section given as null takes its defaults."""
        if isinstance(data, dict):
            data = {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
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
    def _overlong_buffer_fits(self) -> DsrlConfig:
        """`algorithm.overlong_buffer` is shorter than `rollout.max_new_tokens`."""
        buf, limit = self.algorithm.overlong_buffer, self.rollout.max_new_tokens
        if buf >= limit:
            raise ConfigError(
                f"dsrl.algorithm.overlong_buffer = {buf} must be in [0, rollout.max_new_tokens = {limit}). "
                "Fix: lower overlong_buffer or raise dsrl.rollout.max_new_tokens."
            )
        return self

    @model_validator(mode="after")
    def _token_budget_fits_a_sequence(self) -> DsrlConfig:
        """In token-budget mode `batch.max_tokens_per_micro_batch` holds the longest possible sequence
        (`data.max_prompt_tokens` + `rollout.max_new_tokens`), unless `batch.allow_oversize`."""
        T, b = self.batch.max_tokens_per_micro_batch, self.batch
        max_len = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if T is not None and T < max_len and not b.allow_oversize:
            raise ConfigError(
                f"dsrl.batch.max_tokens_per_micro_batch T = {T} is smaller than the longest possible sequence "
                f"(data.max_prompt_tokens + rollout.max_new_tokens = {max_len}). Fix: raise T to >= {max_len} "
                "or set dsrl.batch.allow_oversize = true to place such sequences alone."
            )
        return self

    @model_validator(mode="after")
    def _reward_timeout_below_collective_bound(self) -> DsrlConfig:
        """`data.reward_timeout_s`, when set, is smaller than `run.collective_timeout_s`: a reward call must give
        up before the other ranks stop waiting for it."""
        limit, bound = self.data.reward_timeout_s, self.run.collective_timeout_s
        if limit is not None and limit >= bound:
            raise ConfigError(
                f"dsrl.data.reward_timeout_s = {limit} is not below dsrl.run.collective_timeout_s = {bound}: the "
                "other ranks would end the job before a stuck reward call is given up. Fix: lower "
                "reward_timeout_s or raise collective_timeout_s."
            )
        return self

    @property
    def loss_agg(self) -> str:
        """The resolved aggregation mode: the configured one, else the algorithm's default."""
        return self.batch.loss_agg or ALGORITHM_LOSS_AGG[self.algorithm.name]

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm trains a value model beside the policy (dsrl.critic)."""
        return self.algorithm.name in CRITIC_ALGORITHMS

    @property
    def loss_norm_length(self) -> int:
        """L_norm for seq-mean-token-sum-norm (a constant, never the batch's padded length)."""
        return self.batch.loss_agg_norm_length or self.rollout.max_new_tokens


__all__ = ["AlgorithmConfig", "BatchConfig", "CriticConfig", "DataConfig", "DsrlConfig", "ModelConfig", "RolloutConfig",
           "RunConfig", "SchedulerConfig", "Section", "SftConfig", "setting"]
