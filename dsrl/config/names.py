"""The names dsrl's config, losses, algorithms and docs share: one source, no torch, no pydantic.

Everything that lists loss aggregation modes, algorithms, their defaults, built-in tasks, tiny model
architectures or prompt file formats reads it from here: the config models (as ``Literal`` types),
:mod:`dsrl.core.weights`, :mod:`dsrl.algos`, :mod:`dsrl.tasks`, :mod:`dsrl.rl.policy.model`,
:mod:`dsrl.rl.data.prompts` and the
generated docs/configuration.md.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

# ---------------------------------------------------------------------------- loss aggregation (§2)
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)
TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM = LOSS_AGG_MODES

# ---------------------------------------------------------------------------- algorithms
AlgorithmName = Literal["grpo", "dr_grpo", "rloo", "dapo", "gspo", "ppo"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)

# Levels of a per-token quantity: "token" = each token its own; "sequence" = one value per sequence.
# The importance ratio (algorithm.ratio_level): token = pi/pi_old per token (PPO, GRPO); sequence = the
# length-normalised sequence likelihood ratio exp(mean_t log(pi/pi_old)), clipped per sequence (GSPO).
# The off-policy correction (algorithm.rollout_correction.level): dsrl.algos.correction.
Level = Literal["token", "sequence"]
LEVELS: tuple[str, ...] = get_args(Level)
TOKEN_LEVEL, SEQUENCE_LEVEL = LEVELS
RatioLevel = Level
RATIO_LEVELS = LEVELS

# Off-policy correction of the behavior policy (algorithm.rollout_correction.mode): none, tis
# (truncated importance sampling), mis (masked importance sampling).
CorrectionMode = Literal["none", "tis", "mis"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
CORRECTION_NONE, CORRECTION_TIS, CORRECTION_MIS = CORRECTION_MODES

# Per-algorithm defaults for the keys left unset (null) in "dsrl.algorithm" / "dsrl.batch.loss_agg".
# group_relative: advantages are relative to the other samples of the same prompt, so a group of one
# sample (samples_per_prompt = 1) can never have a non-zero advantage. critic: a value model is trained
# beside the policy and advantages come from GAE over its values (dsrl.critic, dsrl.algos.gae); for
# ppo, normalize_std = whiten the GAE advantages over the rollout's valid tokens.
# Sources: GRPO (DeepSeekMath; TRL/verl defaults), Dr. GRPO (Liu et al. 2025: no std division,
# constant-length token-sum normalisation), RLOO (Ahmadian et al. 2024: leave-one-out baseline, no
# std), DAPO (Yu et al. 2025: clip-higher 0.28, dynamic sampling, token-level loss; its overlong
# *filter* is an ablation there, so it stays off), GSPO (Zheng et al. 2025: sequence-level ratio, clip
# 3e-4 / 4e-4, group advantages, sequence-mean loss), PPO (Ouyang et al. 2022 / OpenRLHF / verl: GAE with
# a critic, whitened advantages, token-mean loss, clip 0.2).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_agg": SEQ_MEAN_TOKEN_MEAN, "normalize_std": True, "clip_low": 0.2, "clip_high": None,
             "ratio_level": "token", "dynamic_sampling": False, "overlong_filter": False, "group_relative": True,
             "critic": False},
    "dr_grpo": {"loss_agg": SEQ_MEAN_TOKEN_SUM_NORM, "normalize_std": False, "clip_low": 0.2, "clip_high": None,
                "ratio_level": "token", "dynamic_sampling": False, "overlong_filter": False, "group_relative": True,
                "critic": False},
    "rloo": {"loss_agg": TOKEN_MEAN, "normalize_std": False, "clip_low": 0.2, "clip_high": None,
             "ratio_level": "token", "dynamic_sampling": False, "overlong_filter": False, "group_relative": True,
             "critic": False},
    "dapo": {"loss_agg": TOKEN_MEAN, "normalize_std": True, "clip_low": 0.2, "clip_high": 0.28,
             "ratio_level": "token", "dynamic_sampling": True, "overlong_filter": False, "group_relative": True,
             "critic": False},
    "gspo": {"loss_agg": SEQ_MEAN_TOKEN_MEAN, "normalize_std": True, "clip_low": 3e-4, "clip_high": 4e-4,
             "ratio_level": "sequence", "dynamic_sampling": False, "overlong_filter": False, "group_relative": True,
             "critic": False},
    "ppo": {"loss_agg": TOKEN_MEAN, "normalize_std": True, "clip_low": 0.2, "clip_high": None,
            "ratio_level": "token", "dynamic_sampling": False, "overlong_filter": False, "group_relative": False,
            "critic": True},
}
# The loss aggregation each algorithm uses when "dsrl.batch.loss_agg" is left unset.
ALGORITHM_LOSS_AGG: dict[str, str] = {name: d["loss_agg"] for name, d in ALGORITHM_DEFAULTS.items()}
GROUP_RELATIVE_ALGORITHMS: tuple[str, ...] = tuple(n for n, d in ALGORITHM_DEFAULTS.items() if d["group_relative"])
CRITIC_ALGORITHMS: tuple[str, ...] = tuple(n for n, d in ALGORITHM_DEFAULTS.items() if d["critic"])

# ---------------------------------------------------------------------------- rollout backends
# hf: transformers generate; cb: transformers continuous batching; auto: hf or cb per call; vllm: a vLLM engine.
RolloutBackendName = Literal["hf", "cb", "auto", "vllm"]
ROLLOUT_BACKENDS: tuple[str, ...] = get_args(RolloutBackendName)
HF_BACKEND, CB_BACKEND, AUTO_BACKEND, VLLM_BACKEND = ROLLOUT_BACKENDS

# Where generation runs: every rank generates then trains (colocated), or rollout.generator_ranks
# ranks only generate and the others only train (disaggregated, asynchronous within algorithm.max_staleness).
Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
COLOCATED, DISAGGREGATED = PLACEMENTS

# ---------------------------------------------------------------------------- everything else
TaskName = Literal["reverse", "copy", "add", "calculator"]  # dsrl.tasks.TASKS holds exactly these
TASK_NAMES: tuple[str, ...] = get_args(TaskName)
DEFAULT_TASK: TaskName = "reverse"  # prompts come from it when neither dsrl.data.task nor data.path is set
TinyArch = Literal["llama", "qwen2", "qwen3_moe"]  # dsrl.rl.policy.model.tiny_config builds exactly these
TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)
MOE_TINY_ARCHS: tuple[str, ...] = ("qwen3_moe",)  # the mixture-of-experts ones among them
# Routing replay of a mixture-of-experts policy (model.routing_replay, dsrl.rollout.routes): off = the trainer's
# routers choose their own experts; rollout = every trainer forward uses the experts the rollout backend chose (R3).
RoutingReplay = Literal["off", "rollout"]
ROUTING_REPLAY_MODES: tuple[str, ...] = get_args(RoutingReplay)
REPLAY_OFF, REPLAY_ROLLOUT = ROUTING_REPLAY_MODES
# Prompt file suffix -> the datasets builder that reads it (dsrl.data).
PROMPT_FILE_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Verifiable rewards built in, named in dsrl.data.reward_fn instead of a dotted path (dsrl.tasks.verifiable; the
# procedural tasks' own scorers: dsrl.tasks.procedural).
BuiltinReward = Literal["math", "exact", "reasoning_gym"]
BUILTIN_REWARDS: tuple[str, ...] = get_args(BuiltinReward)
# What happens to a prompt longer than dsrl.data.max_prompt_tokens (dsrl.rl.data.prompts): the run is refused
# before any work, naming how many and the bound that fits (error), or the prompt keeps its last tokens and the
# prompts so cut are counted (left).
PromptTruncation = Literal["error", "left"]
PROMPT_TRUNCATIONS: tuple[str, ...] = get_args(PromptTruncation)
