"""The names dsrl's config, losses, algorithms and docs share: one source, no torch, no pydantic.

Everything that lists loss aggregation modes, algorithms, their defaults, built-in tasks, tiny model
architectures or prompt file formats reads it from here: the config models (as ``Literal`` types),
:mod:`dsrl.loss`, :mod:`dsrl.algos`, :mod:`dsrl.tasks`, :mod:`dsrl.models`, :mod:`dsrl.data` and the
generated docs/configuration.md.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

# ---------------------------------------------------------------------------- loss aggregation (§2)
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)
TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM = LOSS_AGG_MODES

# ---------------------------------------------------------------------------- algorithms
AlgorithmName = Literal["grpo", "dr_grpo", "rloo", "dapo"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)

# Per-algorithm defaults for the keys left unset (null) in "dsrl.algorithm" / "dsrl.batch.loss_agg".
# group_relative: advantages are relative to the other samples of the same prompt, so a group of one
# sample (samples_per_prompt = 1) can never have a non-zero advantage.
# Sources: GRPO (DeepSeekMath; TRL/verl defaults), Dr. GRPO (Liu et al. 2025: no std division,
# constant-length token-sum normalisation), RLOO (Ahmadian et al. 2024: leave-one-out baseline, no
# std), DAPO (Yu et al. 2025: clip-higher 0.28, dynamic sampling, token-level loss; its overlong
# *filter* is an ablation there, so it stays off).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_agg": SEQ_MEAN_TOKEN_MEAN, "normalize_std": True, "clip_high": None,
             "dynamic_sampling": False, "overlong_filter": False, "group_relative": True},
    "dr_grpo": {"loss_agg": SEQ_MEAN_TOKEN_SUM_NORM, "normalize_std": False, "clip_high": None,
                "dynamic_sampling": False, "overlong_filter": False, "group_relative": True},
    "rloo": {"loss_agg": TOKEN_MEAN, "normalize_std": False, "clip_high": None,
             "dynamic_sampling": False, "overlong_filter": False, "group_relative": True},
    "dapo": {"loss_agg": TOKEN_MEAN, "normalize_std": True, "clip_high": 0.28,
             "dynamic_sampling": True, "overlong_filter": False, "group_relative": True},
}
# The loss aggregation each algorithm uses when "dsrl.batch.loss_agg" is left unset.
ALGORITHM_LOSS_AGG: dict[str, str] = {name: d["loss_agg"] for name, d in ALGORITHM_DEFAULTS.items()}
GROUP_RELATIVE_ALGORITHMS: tuple[str, ...] = tuple(n for n, d in ALGORITHM_DEFAULTS.items() if d["group_relative"])

# ---------------------------------------------------------------------------- everything else
TaskName = Literal["reverse", "copy", "add"]  # dsrl.tasks.TASKS holds exactly these
TASK_NAMES: tuple[str, ...] = get_args(TaskName)
DEFAULT_TASK: TaskName = "reverse"  # prompts come from it when neither dsrl.data.task nor data.path is set
TinyArch = Literal["llama", "qwen2"]  # dsrl.models.tiny_config builds exactly these
TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)
# Prompt file suffix -> the datasets builder that reads it (dsrl.data).
PROMPT_FILE_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
