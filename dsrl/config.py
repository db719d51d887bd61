"""One JSON file is the whole run: a DeepSpeed ds_config plus a top-level ``"dsrl"`` section.

This module reads that file, applies dotted command-line overrides, validates the ``"dsrl"``
section into typed dataclasses (the ds_config DeepSpeed sees is derived in :mod:`dsrl.ds_config`).

Invariants kept here:
- every error is a :class:`ConfigError` raised *before* any work starts; its message names the
  field (as a dotted path), the offending value(s) and the fix;
- unknown keys are errors with a close-match suggestion; types are checked per field.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ALGORITHMS = ("grpo", "dr_grpo", "rloo", "dapo")
# The loss aggregation each algorithm uses when "dsrl.batch.loss_agg" is left unset.
ALGORITHM_LOSS_AGG = {
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "rloo": "token-mean",
    "dapo": "token-mean",
}
DEFAULT_GRADIENT_CLIPPING = 1.0
DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts. The message names field and fix."""


def doc(text: str, unit: str = "") -> dict[str, str]:
    """Field metadata used to generate docs/configuration.md and error messages."""
    return {"doc": text, "unit": unit}


# --------------------------------------------------------------------------------------------
# The "dsrl" section, one dataclass per sub-section
# --------------------------------------------------------------------------------------------


@dataclass
class BatchConfig:
    """The batch hierarchy: rollout -> mini-batch (optimizer step) -> micro-batch."""

    prompts_per_rollout: int = field(default=8, metadata=doc("P: prompts drawn per rollout", "prompts"))
    samples_per_prompt: int = field(
        default=4, metadata=doc("G: completions per prompt (GRPO group size, RLOO k)", "sequences")
    )
    mini_batch_size: int | str = field(
        default="auto",
        metadata=doc('B: sequences per optimizer step; "auto" = the rollout size R = P*G', "sequences"),
    )
    epochs_per_rollout: int = field(
        default=1, metadata=doc("E: passes over each rollout (PPO epochs); reshuffled every pass", "passes")
    )
    micro_batch_size_per_rank: int | None = field(
        default=None,
        metadata=doc("m: sequences per forward/backward on one rank (fixed mode)", "sequences"),
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata=doc(
            "T: token budget per forward/backward on one rank (token-budget mode; "
            "the micro-batch count varies per step but is equal on every rank)",
            "tokens",
        ),
    )
    loss_agg: str | None = field(
        default=None,
        metadata=doc(
            "loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum | "
            "seq-mean-token-sum-norm; unset = the algorithm's default",
        ),
    )
    loss_agg_norm_length: int | None = field(
        default=None,
        metadata=doc(
            "L_norm of seq-mean-token-sum-norm (Dr. GRPO); unset = rollout.max_new_tokens", "tokens"
        ),
    )
    allow_oversize: bool = field(
        default=False,
        metadata=doc("token-budget mode: place a sequence longer than T alone instead of failing"),
    )
    balance_attention_coef: float = field(
        default=0.0,
        metadata=doc(
            "token-budget mode: rank-balancing cost = tokens + coef * tokens^2 / T "
            "(attention's quadratic share; 0 = tokens only)"
        ),
    )
    shuffle: bool = field(default=True, metadata=doc("reshuffle the rollout before every epoch"))


@dataclass
class RunConfig:
    """How long to run, where to write, how to checkpoint."""

    epochs: float | None = field(
        default=None, metadata=doc("passes over the prompt dataset (exclusive with rollouts)", "epochs")
    )
    rollouts: int | None = field(
        default=None, metadata=doc("number of rollouts (exclusive with epochs)", "rollouts")
    )
    last_rollout: Literal["drop", "wrap"] = field(
        default="drop",
        metadata=doc(
            "with epochs: 'drop' = floor(epochs*N/P) rollouts (leftover prompts unused), "
            "'wrap' = ceil (the last rollout wraps into the next shuffled epoch)"
        ),
    )
    output_dir: str = field(default="runs/dsrl", metadata=doc("metrics, logs and checkpoints go here"))
    seed: int = field(default=0, metadata=doc("global seed; per-rank seeds derive from it and the rank"))
    save_every: int = field(default=0, metadata=doc("checkpoint every N rollouts (0 = only at the end)", "rollouts"))
    keep_last: int = field(default=2, metadata=doc("complete checkpoints kept on disk", "checkpoints"))
    save_final: bool = field(default=True, metadata=doc("checkpoint after the last rollout"))
    resume: str = field(
        default="auto",
        metadata=doc("'auto' = continue from output_dir's latest complete checkpoint; 'never'; or a path"),
    )
    log_every: int = field(default=1, metadata=doc("print a log line every N rollouts", "rollouts"))
    stop_after_rollouts: int | None = field(
        default=None,
        metadata=doc("end this invocation after N rollouts with a checkpoint (job time limits); the plan, "
                     "schedule and progress total are unchanged and --resume continues", "rollouts"),
    )
    progress_bar: bool = field(default=True, metadata=doc("show a tqdm bar over optimizer steps (rank 0)"))


@dataclass
class ModelConfig:
    """The policy (and reference) model."""

    path: str | None = field(
        default=None, metadata=doc("local directory of a HF causal LM; unset = the built-in tiny model")
    )
    tokenizer: str | None = field(
        default=None, metadata=doc("tokenizer directory; unset = model.path, or the shipped tiny tokenizer")
    )
    arch: Literal["llama", "qwen2"] = field(default="qwen2", metadata=doc("architecture of the tiny model"))
    tiny: dict[str, Any] = field(
        default_factory=dict, metadata=doc("overrides of the tiny model's transformers config")
    )
    dtype: Literal["auto", "float32", "bfloat16"] = field(
        default="auto", metadata=doc("load dtype; auto = bfloat16 on GPU, float32 on CPU")
    )
    attn_implementation: str | None = field(
        default=None, metadata=doc("transformers attn_implementation (sdpa, flash_attention_2, eager)")
    )
    gradient_checkpointing: bool = field(default=False, metadata=doc("activation checkpointing"))
    packing: bool = field(
        default=False,
        metadata=doc("padding-free micro-batches: sequences packed into one row, position_ids restarting per "
                     "sequence and no attention mask (transformers builds the block-diagonal mask on sdpa/eager, "
                     "varlen kernels on flash attention); the token budget then counts real tokens only"),
    )


@dataclass
class DataConfig:
    """Where prompts and rewards come from."""

    task: str | None = field(
        default=None,
        metadata=doc("built-in task (dsrl/tasks): reverse | copy | add; unset = reverse when path is unset"),
    )
    path: str | None = field(default=None, metadata=doc("local prompts file (.jsonl, .json or .parquet)"))
    prompt_key: str = field(default="prompt", metadata=doc("column holding the prompt text"))
    answer_key: str = field(default="answer", metadata=doc("column passed to the reward function"))
    reward_fn: str | None = field(
        default=None, metadata=doc("dotted path 'pkg.module:function' (or pkg.module.function) of the reward")
    )
    size: int = field(default=512, metadata=doc("number of prompts a built-in task generates", "prompts"))
    max_prompt_tokens: int = field(default=64, metadata=doc("prompts are truncated to this many tokens", "tokens"))
    chat_template: bool = field(default=False, metadata=doc("apply the tokenizer's chat template to prompts"))


@dataclass
class RolloutConfig:
    """Generation."""

    backend: Literal["hf", "cb", "auto", "vllm"] = field(default="hf", metadata=doc("generation backend"))
    max_new_tokens: int = field(default=16, metadata=doc("completion length limit", "tokens"))
    temperature: float = field(default=1.0, metadata=doc("sampling temperature"))
    top_p: float = field(default=1.0, metadata=doc("nucleus sampling"))
    top_k: int = field(default=0, metadata=doc("top-k sampling (0 = off)"))
    generation_batch_size: int = field(
        default=64, metadata=doc("prompts per generate() call on one rank", "prompts")
    )
    logprob_micro_batch_size: int = field(
        default=16, metadata=doc("sequences per no-grad log-prob forward on one rank", "sequences")
    )


@dataclass
class AlgorithmConfig:
    """Advantages, sample filters and the policy loss."""

    name: Literal["grpo", "dr_grpo", "rloo", "dapo"] = field(default="grpo", metadata=doc("algorithm"))
    clip_low: float = field(default=0.2, metadata=doc("PPO clip: ratio >= 1 - clip_low"))
    clip_high: float | None = field(
        default=None, metadata=doc("PPO clip: ratio <= 1 + clip_high; unset = clip_low (DAPO default 0.28)")
    )
    normalize_std: bool | None = field(
        default=None, metadata=doc("divide group advantages by the group std; unset = algorithm default")
    )
    kl_coef: float = field(default=0.0, metadata=doc("KL penalty against the frozen reference model"))
    kl_estimator: Literal["k1", "k2", "k3"] = field(default="k3", metadata=doc("KL estimator"))
    kl_in: Literal["loss", "reward"] = field(default="loss", metadata=doc("KL as a loss term or a reward penalty"))
    entropy_coef: float = field(default=0.0, metadata=doc("entropy bonus coefficient"))
    dynamic_sampling: bool | None = field(
        default=None, metadata=doc("drop zero-variance groups and refill the rollout; unset = on for dapo")
    )
    max_sampling_rounds: int = field(
        default=8, metadata=doc("dynamic sampling: generation rounds before giving up on a full rollout")
    )
    overlong_filter: bool = field(
        default=False, metadata=doc("mask out completions truncated at max_new_tokens")
    )
    overlong_buffer: int = field(
        default=0, metadata=doc("soft overlong punishment: length window before max_new_tokens", "tokens")
    )
    overlong_penalty: float = field(default=1.0, metadata=doc("soft overlong punishment at the limit"))


@dataclass
class SchedulerConfig:
    """A transformers named schedule, owned by dsrl (alternative to the ds_config "scheduler")."""

    name: str | None = field(
        default=None, metadata=doc("transformers schedule name (linear, cosine, cosine_with_min_lr, ...)")
    )
    warmup_steps: int | None = field(default=None, metadata=doc("warmup length", "optimizer steps"))
    warmup_ratio: float | None = field(default=None, metadata=doc("warmup as a fraction of the horizon"))
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=doc("scheduler_specific_kwargs"))


@dataclass
class DsrlConfig:
    """The whole "dsrl" section."""

    batch: BatchConfig = field(default_factory=BatchConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def loss_agg(self) -> str:
        """The resolved aggregation mode: the configured one, else the algorithm's default."""
        return self.batch.loss_agg or ALGORITHM_LOSS_AGG[self.algorithm.name]

    @property
    def loss_norm_length(self) -> int:
        """L_norm for seq-mean-token-sum-norm (a constant, never the batch's padded length)."""
        return self.batch.loss_agg_norm_length or self.rollout.max_new_tokens


@dataclass
class Config:
    """A parsed run file: the user's ds_config (without "dsrl") and the validated "dsrl" section."""

    ds_config: dict[str, Any]
    dsrl: DsrlConfig
    source: str = "<dict>"

    def to_dict(self) -> dict[str, Any]:
        """The full run file, as it would be written back (with overrides applied)."""
        out = copy.deepcopy(self.ds_config)
        out["dsrl"] = dataclasses.asdict(self.dsrl)
        return out


# --------------------------------------------------------------------------------------------
# Building dataclasses from raw dicts, with errors that name the field
# --------------------------------------------------------------------------------------------


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (dict, list):
        return isinstance(value, origin)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def build_section(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from ``raw``; unknown keys and wrong types raise ConfigError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a JSON object, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {path}.{close[0]}?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{path}.{key} is not a known setting{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_section(hint, value, f"{path}.{key}")
            continue
        if not _type_ok(value, hint):
            raise ConfigError(
                f"{path}.{key} = {value!r} has the wrong type: expected {_describe(hint)}. "
                f"Fix: set {path}.{key} to a {_describe(hint)} value."
            )
        kwargs[key] = value
    return cls(**kwargs)


def _positive_int(value: Any, path: str, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{path} = {value!r} is invalid: {what} must be a positive integer.")


def validate_dsrl(cfg: DsrlConfig) -> None:
    """Checks that need no world size; the plan (dsrl.plan) checks divisibility by rank counts."""
    b = cfg.batch
    _positive_int(b.prompts_per_rollout, "dsrl.batch.prompts_per_rollout", "P (prompts per rollout)")
    _positive_int(b.samples_per_prompt, "dsrl.batch.samples_per_prompt", "G (samples per prompt)")
    if b.mini_batch_size != "auto":
        _positive_int(b.mini_batch_size, "dsrl.batch.mini_batch_size", "B (sequences per optimizer step)")
    _positive_int(b.epochs_per_rollout, "dsrl.batch.epochs_per_rollout", "E (passes per rollout)")
    if (b.micro_batch_size_per_rank is None) == (b.max_tokens_per_micro_batch is None):
        raise ConfigError(
            "dsrl.batch: set exactly one of micro_batch_size_per_rank (fixed micro-batches, got "
            f"{b.micro_batch_size_per_rank!r}) and max_tokens_per_micro_batch (token budget, got "
            f"{b.max_tokens_per_micro_batch!r}). Fix: keep one and set the other to null."
        )
    if b.micro_batch_size_per_rank is not None:
        _positive_int(b.micro_batch_size_per_rank, "dsrl.batch.micro_batch_size_per_rank", "m")
    if b.max_tokens_per_micro_batch is not None:
        _positive_int(b.max_tokens_per_micro_batch, "dsrl.batch.max_tokens_per_micro_batch", "T")
    if b.loss_agg is not None and b.loss_agg not in LOSS_AGG_MODES:
        close = difflib.get_close_matches(b.loss_agg, LOSS_AGG_MODES, n=1)
        raise ConfigError(
            f"dsrl.batch.loss_agg = {b.loss_agg!r} is not a mode. Fix: use one of "
            f"{', '.join(LOSS_AGG_MODES)}" + (f" (did you mean {close[0]!r}?)" if close else "")
        )
    if b.loss_agg_norm_length is not None:
        _positive_int(b.loss_agg_norm_length, "dsrl.batch.loss_agg_norm_length", "L_norm")
    if b.balance_attention_coef < 0:
        raise ConfigError(
            f"dsrl.batch.balance_attention_coef = {b.balance_attention_coef} must be >= 0."
        )

    r = cfg.run
    if (r.epochs is None) == (r.rollouts is None):
        raise ConfigError(
            f"dsrl.run: set exactly one of epochs (got {r.epochs!r}) and rollouts (got {r.rollouts!r}). "
            "Fix: keep one and set the other to null."
        )
    if r.epochs is not None and not r.epochs > 0:
        raise ConfigError(f"dsrl.run.epochs = {r.epochs!r} must be > 0.")
    if r.rollouts is not None:
        _positive_int(r.rollouts, "dsrl.run.rollouts", "the number of rollouts")
    if r.save_every < 0:
        raise ConfigError(f"dsrl.run.save_every = {r.save_every} must be >= 0 (0 = only at the end).")
    _positive_int(r.keep_last, "dsrl.run.keep_last", "the number of checkpoints kept")
    _positive_int(r.log_every, "dsrl.run.log_every", "the log interval")
    if r.stop_after_rollouts is not None:
        _positive_int(r.stop_after_rollouts, "dsrl.run.stop_after_rollouts", "the rollouts of this invocation")

    _positive_int(cfg.rollout.max_new_tokens, "dsrl.rollout.max_new_tokens", "the completion length")
    _positive_int(cfg.rollout.generation_batch_size, "dsrl.rollout.generation_batch_size", "the batch")
    _positive_int(cfg.rollout.logprob_micro_batch_size, "dsrl.rollout.logprob_micro_batch_size", "the batch")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"dsrl.rollout.temperature = {cfg.rollout.temperature} must be > 0.")
    _positive_int(cfg.data.max_prompt_tokens, "dsrl.data.max_prompt_tokens", "the prompt length")
    if cfg.data.task is None and cfg.data.path is None:
        cfg.data.task = "reverse"  # the embedded default: a built-in task, no downloads

    a = cfg.algorithm
    for name in ("clip_low", "clip_high"):
        v = getattr(a, name)
        if v is not None and not 0 <= v < 10:
            raise ConfigError(f"dsrl.algorithm.{name} = {v} must be in [0, 10).")
    if a.kl_coef < 0:
        raise ConfigError(f"dsrl.algorithm.kl_coef = {a.kl_coef} must be >= 0.")
    if a.overlong_buffer < 0 or a.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"dsrl.algorithm.overlong_buffer = {a.overlong_buffer} must be in "
            f"[0, rollout.max_new_tokens = {cfg.rollout.max_new_tokens})."
        )
    s = cfg.scheduler
    if s.warmup_steps is not None and s.warmup_ratio is not None:
        raise ConfigError(
            "dsrl.scheduler: set at most one of warmup_steps and warmup_ratio. Fix: remove one."
        )
    if s.warmup_ratio is not None and not 0 <= s.warmup_ratio < 1:
        raise ConfigError(f"dsrl.scheduler.warmup_ratio = {s.warmup_ratio} must be in [0, 1).")


# --------------------------------------------------------------------------------------------
# Reading files and overrides
# --------------------------------------------------------------------------------------------


def parse_override_value(text: str) -> Any:
    """Parse a command-line value as JSON when possible ('4', 'null', 'true', '[1,2]'), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``dsrl.batch.samples_per_prompt``) in a copy of ``raw``."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] != "dsrl" or len(parts) < 2:
            raise ConfigError(
                f"override --{dotted}: only keys of the dsrl section can be overridden "
                "(e.g. --dsrl.batch.samples_per_prompt 8); edit the JSON file for DeepSpeed keys."
            )
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{dotted}: {p} is not a section")
        node[parts[-1]] = value
    return out


def parse_override_args(args: list[str]) -> dict[str, Any]:
    """``['--dsrl.a.b', '4', '--dsrl.c=x']`` -> ``{'dsrl.a.b': 4, 'dsrl.c': 'x'}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--dsrl."):
            raise ConfigError(f"unknown argument {arg!r}; overrides look like --dsrl.batch.mini_batch_size 64")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            text = args[i + 1]
            i += 2
        out[key] = parse_override_value(text)
    return out


def load_config(
    source: str | os.PathLike | dict[str, Any] | Config, overrides: dict[str, Any] | None = None
) -> Config:
    """Read a run file (path or dict), apply dotted overrides, validate the "dsrl" section."""
    if isinstance(source, Config):
        if not overrides:
            return source
        source = source.to_dict()
    if isinstance(source, dict):
        raw, name = source, "<dict>"
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise ConfigError(f"--ds_config {name}: no such file")
        with open(name, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--ds_config {name} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: the run file must be a JSON object")
    if overrides:
        raw = apply_overrides(raw, overrides)
    ds_config = {k: copy.deepcopy(v) for k, v in raw.items() if k != "dsrl"}
    dsrl = build_section(DsrlConfig, raw.get("dsrl"), "dsrl")
    validate_dsrl(dsrl)
    return Config(ds_config=ds_config, dsrl=dsrl, source=name)


# --------------------------------------------------------------------------------------------
# The ds_config DeepSpeed is allowed to see
# --------------------------------------------------------------------------------------------

# Nested sections DeepSpeed parses with pydantic, where it silently drops "auto" (its default applies).
