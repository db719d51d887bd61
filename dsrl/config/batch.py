"""``dsrl.batch``: the batch hierarchy rollout -> mini-batch (optimizer step) -> micro-batch (architecture §1)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.names import LossAgg
from dsrl.config.section import Section, exactly_one, setting


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
        None, "L_norm of seq-mean-token-sum-norm (Dr. GRPO); unset = rollout.max_new_tokens (with data.environment: "
              "rollout.max_trajectory_tokens)", "tokens", gt=0)
    allow_oversize: bool = setting(False, "token-budget mode: place a sequence longer than T alone instead of failing")
    balance_attention_coef: float = setting(
        0.0, "token-budget mode: rank-balancing cost = tokens + coef * tokens^2 / T (attention's quadratic share; "
             "0 = tokens only)", ge=0)
    shuffle: bool = setting(True, "reshuffle the rollout before every epoch")

    @model_validator(mode="after")
    def _one_micro_batch_mode(self) -> BatchConfig:
        """Exactly one of `micro_batch_size_per_rank` (fixed micro-batches) and `max_tokens_per_micro_batch`
        (token budget) is set."""
        exactly_one(self.PATH, "micro_batch_size_per_rank", self.micro_batch_size_per_rank, "fixed micro-batches",
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
