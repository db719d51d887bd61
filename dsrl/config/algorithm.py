"""``dsrl.algorithm`` (advantages, filters, the policy loss), ``dsrl.critic`` (the value model of ppo) and
``dsrl.sft`` (the supervised warm-up)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from dsrl.config.names import (
    CORRECTION_NONE,
    TOKEN_LEVEL,
    AlgorithmName,
    CorrectionMode,
    Level,
    RatioLevel,
)
from dsrl.config.section import Section, setting


class RolloutCorrectionConfig(Section):
    """Off-policy correction of the rollout policy (docs/rollout.md): the samples were drawn by the rollout
    backend (its kernels, precision and, asynchronously, older weights), the loss uses the trainer's log-probs;
    w = pi_old / mu per token. The mismatch is measured and logged whatever the mode."""

    PATH: ClassVar[str] = "dsrl.algorithm.rollout_correction"

    mode: CorrectionMode = setting(
        CORRECTION_NONE, "none (loss untouched), tis (multiply the per-token policy loss by min(w, cap)) or mis "
                         "(remove tokens whose w leaves [1/cap, cap] from the loss and its counts)")
    level: Level = setting(TOKEN_LEVEL, "token: w per token; sequence: w = exp(sum of the sequence's log w), one per "
                                        "sequence")
    cap: float = setting(2.0, "C: the truncation bound (tis) or the acceptance band [1/C, C] (mis)", gt=1)


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
    max_staleness: int | None = setting(
        None, "k: a sample generated with policy version v is trained only while the trainer is at version <= v + k "
              "(version = weight syncs = rollouts trained); unset = 1 with rollout.placement 'disaggregated', 0 "
              "colocated (where generation is always current)", "versions", ge=0)
    rollout_correction: RolloutCorrectionConfig = setting(RolloutCorrectionConfig, RolloutCorrectionConfig.__doc__)


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
