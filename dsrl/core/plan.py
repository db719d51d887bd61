"""BatchPlan: the rollout -> mini-batch -> micro-batch hierarchy and all run accounting.

Pure Python: no torch.distributed, no DeepSpeed. Every count the trainer, the scheduler and the
progress bar use comes from here, so they agree by construction:

    R                      = P * G                       (sequences per rollout = episodes per rollout)
    optimizer steps/rollout = E * R / B
    total optimizer steps  = sft + (rollouts - K) * E*R/B (the policy's scheduler horizon, progress-bar total)
    critic optimizer steps = rollouts * E * R / B        (with a critic: its scheduler horizon)
    episodes               = rollouts * R
    prompt epochs          = rollouts * P / dataset size

With ``run.epochs`` the number of rollouts follows ``run.last_rollout``: ``drop`` takes
floor(epochs * N / P) rollouts (at most P - 1 prompts stay unused), ``wrap`` takes the ceiling
(the last rollout draws its missing prompts from the next reshuffled pass). The prompt sampler
walks an endless stream of reshuffled passes either way, so a rollout may straddle a pass boundary.

K = ``critic.warmup_rollouts`` (algorithms with a critic, else 0): the first K rollouts train only
the critic, so the policy takes no step in them; K < rollouts. sft = ``sft.steps``: supervised
warm-up steps of the policy before rollout 1 (:mod:`dsrl.sft`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dsrl.config import DS_BATCH_KEYS, Config, ConfigError, DsrlConfig
from dsrl.config.names import COLOCATED, DISAGGREGATED


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class BatchPlan:
    """Every row of the architecture's vocabulary table, validated against the data-parallel size D."""

    prompts_per_rollout: int
    samples_per_prompt: int
    rollout_size: int
    mini_batch_size: int
    epochs_per_rollout: int
    mini_batches_per_rollout: int
    optimizer_steps_per_rollout: int
    micro_batch_size_per_rank: int | None
    max_tokens_per_micro_batch: int | None
    micro_batches_per_step: int | None  # per rank, fixed mode; None = varies (token budget)
    sequences_per_rank_per_step: float
    data_parallel_size: int
    loss_agg: str
    loss_agg_norm_length: int
    dataset_size: int | None
    rollouts: int
    rollout_rule: str
    total_optimizer_steps: int
    episodes: int
    prompt_epochs: float | None
    prompts_per_rank: int
    critic_warmup_rollouts: int = 0  # K: critic-only rollouts at the start (part of `rollouts`)
    critic_optimizer_steps: int = 0  # the critic's scheduler horizon: rollouts * E*R/B (0 = no critic)
    sft_steps: int = 0  # supervised warm-up steps of the policy before rollout 1
    allow_oversize: bool = False  # token budget: a sequence longer than T is placed alone
    balance_attention_coef: float = 0.0  # token budget: rank cost = tokens + coef * tokens^2 / T
    packing: bool = False  # micro-batches are padding-free packed rows (dsrl.model.packing)
    share_prompts: bool = False  # a prompt's samples together, one run of each prompt per micro-batch
    placement: str = COLOCATED  # rollout.placement (ARCHITECTURE §8)
    generator_ranks: int = 0  # ranks that only generate (disaggregated); D counts the trainer ranks only
    max_staleness: int = 0  # k: a sample of version v is trained while the trainer is at version <= v + k
    # Multi-turn trajectories (data.environment, ARCHITECTURE §8): at most max_turns model turns and
    # max_trajectory_tokens tokens after the prompt per trajectory (one sequence); None without an environment.
    max_turns: int | None = None
    max_trajectory_tokens: int | None = None

    @property
    def token_budget_mode(self) -> bool:
        return self.max_tokens_per_micro_batch is not None

    @classmethod
    def from_config(
        cls, cfg: Config | DsrlConfig, data_parallel_size: int, dataset_size: int | None = None
    ) -> BatchPlan:
        """Build the plan and check what needs the data-parallel size D or the dataset size (the config
        models checked everything else). Errors name the field, the values and the fix."""
        d = cfg.dsrl if isinstance(cfg, Config) else cfg
        b = d.batch
        D = data_parallel_size
        if not isinstance(D, int) or D <= 0:
            raise ConfigError(f"world size: the data-parallel size D = {D!r} must be a positive integer")
        P, G, E = b.prompts_per_rollout, b.samples_per_prompt, b.epochs_per_rollout
        R = P * G
        B = R if b.mini_batch_size == "auto" else b.mini_batch_size  # BatchConfig guarantees R % B == 0
        if P % D != 0:
            raise ConfigError(
                f"dsrl.batch.prompts_per_rollout = {P} is not a multiple of the data-parallel size D = {D}; "
                f"every rank generates whole prompt groups. Fix: use a multiple of {D} "
                f"(e.g. {math.ceil(P / D) * D})."
            )
        N = d.rollout.generator_ranks
        if N and D % N != 0:
            good = [x for x in _divisors(D)]
            raise ConfigError(
                f"dsrl.rollout.generator_ranks = {N} does not divide the trainer side's {D} data-parallel replicas: "
                f"each generator rank generates the prompts of D/N whole replicas. Fix: choose generator_ranks among "
                f"{good} (or change the number of trainer ranks)."
            )
        m, T = b.micro_batch_size_per_rank, b.max_tokens_per_micro_batch
        micro_per_step: int | None = None
        if m is not None:
            if B % (m * D) != 0:
                ok_m = [x for x in _divisors(B // D) if B % D == 0] if B % D == 0 else []
                fix = (
                    f"choose micro_batch_size_per_rank among {ok_m}"
                    if ok_m
                    else f"make mini_batch_size a multiple of m*D = {m * D}"
                )
                raise ConfigError(
                    f"dsrl.batch.mini_batch_size B = {B} is not a multiple of micro_batch_size_per_rank * D "
                    f"= {m} * {D} = {m * D}: with fixed micro-batches every rank runs B/(m*D) equal "
                    f"micro-batches per optimizer step. Fix: {fix}, or use max_tokens_per_micro_batch."
                )
            micro_per_step = B // (m * D)
        elif B < D:
            raise ConfigError(
                f"dsrl.batch.mini_batch_size B = {B} is smaller than the data-parallel size D = {D}: some "
                f"rank would hold no sequence in every step. Fix: B >= {D}."
            )

        loss_agg = d.loss_agg
        r = d.run
        if r.rollouts is not None:
            rollouts, rule = r.rollouts, "run.rollouts"
            prompt_epochs = rollouts * P / dataset_size if dataset_size else None
        else:
            if not dataset_size:
                raise ConfigError(
                    "dsrl.run.epochs needs the prompt dataset size to derive the number of rollouts. "
                    "Fix: pass --dataset_size N (dsrl plan) or set dsrl.run.rollouts instead."
                )
            exact = r.epochs * dataset_size / P
            if r.last_rollout == "drop":
                rollouts = math.floor(exact + 1e-9)
                rule = f"floor(epochs*N/P) = floor({r.epochs}*{dataset_size}/{P})"
            else:
                rollouts = math.ceil(exact - 1e-9)
                rule = f"ceil(epochs*N/P) = ceil({r.epochs}*{dataset_size}/{P})"
            if rollouts < 1:
                raise ConfigError(
                    f"dsrl.run.epochs = {r.epochs} over {dataset_size} prompts gives no full rollout of "
                    f"P = {P} prompts. Fix: raise epochs, lower prompts_per_rollout, or use last_rollout='wrap'."
                )
            prompt_epochs = rollouts * P / dataset_size
        steps_per_rollout = E * R // B
        warmup = d.critic.warmup_rollouts if d.has_critic else 0
        if warmup >= rollouts:
            raise ConfigError(
                f"dsrl.critic.warmup_rollouts = {warmup} is not smaller than the run's {rollouts} rollouts "
                f"({rule}): the policy would never train. Fix: lower warmup_rollouts or raise the rollouts."
            )
        return cls(
            prompts_per_rollout=P,
            samples_per_prompt=G,
            rollout_size=R,
            mini_batch_size=B,
            epochs_per_rollout=E,
            mini_batches_per_rollout=R // B,
            optimizer_steps_per_rollout=steps_per_rollout,
            micro_batch_size_per_rank=m,
            max_tokens_per_micro_batch=T,
            micro_batches_per_step=micro_per_step,
            sequences_per_rank_per_step=B / D,
            data_parallel_size=D,
            loss_agg=loss_agg,
            loss_agg_norm_length=d.loss_agg_norm_length,
            dataset_size=dataset_size,
            rollouts=rollouts,
            rollout_rule=rule,
            total_optimizer_steps=d.sft.steps + (rollouts - warmup) * steps_per_rollout,
            episodes=rollouts * R,
            prompt_epochs=prompt_epochs,
            prompts_per_rank=P // D,
            critic_warmup_rollouts=warmup,
            critic_optimizer_steps=rollouts * steps_per_rollout if d.has_critic else 0,
            sft_steps=d.sft.steps,
            allow_oversize=b.allow_oversize,
            balance_attention_coef=b.balance_attention_coef,
            packing=d.model.packing,
            share_prompts=d.model.share_prompts,
            placement=d.rollout.placement,
            generator_ranks=N,
            max_staleness=d.max_staleness,
            max_turns=d.rollout.max_turns if d.multi_turn else None,
            max_trajectory_tokens=d.rollout.max_trajectory_tokens if d.multi_turn else None,
        )

    def deepspeed_batch_fields(self) -> dict[str, Any]:
        """DeepSpeed's batch fields as the plan defines them (what `dsrl plan` shows).

        ``train_batch_size`` is B; in fixed mode the micro size is m and the accumulation B/(m*D);
        in token-budget mode both vary per step and are reported as None.
        """
        return {
            "train_batch_size": self.mini_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size_per_rank,
            "gradient_accumulation_steps": self.micro_batches_per_step,
        }

    def check_user_batch_fields(self, ds_config: dict[str, Any]) -> None:
        """An explicit DeepSpeed batch field that contradicts the plan is an error naming both values."""
        mine = self.deepspeed_batch_fields()
        for key in DS_BATCH_KEYS:
            if key not in ds_config or ds_config[key] == "auto":
                continue
            given, want = ds_config[key], mine[key]
            if given != want:
                meaning = {
                    "train_batch_size": f"mini_batch_size B = {self.mini_batch_size} sequences per optimizer step",
                    "train_micro_batch_size_per_gpu": (
                        f"micro_batch_size_per_rank m = {self.micro_batch_size_per_rank}"
                        if want is not None
                        else "a micro-batch size that varies per step (token-budget mode)"
                    ),
                    "gradient_accumulation_steps": (
                        f"B/(m*D) = {want} micro-batches per optimizer step"
                        if want is not None
                        else "a micro-batch count that varies per step (token-budget mode)"
                    ),
                }[key]
                raise ConfigError(
                    f"ds_config {key} = {given!r} contradicts the dsrl plan, which gives {meaning}. "
                    f"Fix: remove {key} (dsrl derives it) or set it to \"auto\""
                    + (f" or {want}." if want is not None else ".")
                )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(self.deepspeed_batch_fields())
        return out

    def describe(self) -> list[tuple[str, str]]:
        """Human-readable rows for `dsrl plan`."""
        P, G, R, B, E, D = (
            self.prompts_per_rollout,
            self.samples_per_prompt,
            self.rollout_size,
            self.mini_batch_size,
            self.epochs_per_rollout,
            self.data_parallel_size,
        )
        if self.token_budget_mode:
            micro = f"token budget T = {self.max_tokens_per_micro_batch} tokens; count varies, equal on all ranks"
        else:
            micro = (
                f"m = {self.micro_batch_size_per_rank} sequences; {self.micro_batches_per_step} per rank per step"
            )
        pe = "unknown (no dataset size)" if self.prompt_epochs is None else f"{self.prompt_epochs:.4g}"
        roles = ([("placement", f"disaggregated: {self.generator_ranks} generator rank(s) (the job's last), the "
                               f"rest train; max staleness k = {self.max_staleness} version(s)")]
                 if self.placement == DISAGGREGATED else [])
        return [
            *roles,
            ("data-parallel size D", str(D) + (" (trainer ranks)" if roles else "")),
            ("prompts per rollout P", str(P)),
            ("samples per prompt G", str(G)),
            ("rollout size R = P*G", str(R)),
            ("mini-batch size B", f"{B} sequences ({self.sequences_per_rank_per_step:g} per rank)"),
            ("epochs per rollout E", str(E)),
            ("optimizer steps per rollout E*R/B", str(self.optimizer_steps_per_rollout)),
            ("micro-batches", micro),
            ("loss aggregation", self.loss_agg),
            ("rollouts", f"{self.rollouts} ({self.rollout_rule})"),
            ("total optimizer steps", str(self.total_optimizer_steps)
             + (f" (including {self.sft_steps} supervised warm-up steps)" if self.sft_steps else "")
             + (f" (policy; after {self.critic_warmup_rollouts} critic-only rollouts)" if self.critic_warmup_rollouts
                else "")),
            *([("critic optimizer steps", str(self.critic_optimizer_steps))] if self.critic_optimizer_steps else []),
            ("episodes (sequences generated)", str(self.episodes)),
            *([("multi-turn trajectories", f"at most {self.max_turns} model turns and {self.max_trajectory_tokens} "
                                           "tokens after the prompt each (model and observation tokens; one sequence)")]
              if self.max_turns is not None else []),
            ("prompt epochs", pe),
        ]


def trainer_world_size(cfg: Config | DsrlConfig, world_size: int) -> int:
    """The ranks that train (the DeepSpeed engine's world): the job's ranks minus ``rollout.generator_ranks``,
    which must leave at least one."""
    d = cfg.dsrl if isinstance(cfg, Config) else cfg
    n = d.rollout.generator_ranks
    if n >= world_size:
        raise ConfigError(f"dsrl.rollout.generator_ranks = {n} leaves no trainer among the job's {world_size} rank(s). "
                          f"Fix: launch more ranks (e.g. --num_gpus {n + 1}) or lower generator_ranks.")
    return world_size - n
