"""``dsrl.run`` (how long, where, checkpoints, bounds) and ``dsrl.scheduler`` (a named LR schedule)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.section import Section, exactly_one, setting


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
        None, "the start-up preflight: how long rank 0 waits for every rank to check in before any work (a host "
              "that never does ends the job, named); unset = $DSRL_INIT_TIMEOUT_S, else 60", "seconds", gt=0)
    collective_timeout_s: float = setting(
        1800.0, "a rank that has not reached a collective (or the end of a phase: generation, reward, step, save) "
                "this long after the first rank ends the job with a message naming the phase and the rank",
        "seconds", gt=0)
    wait_report_s: float = setting(
        30.0, "a rank waiting at the end of a phase for another says, every this many seconds until "
              "collective_timeout_s, which rank it waits for, what that rank is doing (e.g. the sample its reward "
              "function or environment is working on) and for how long", "seconds", gt=0)
    max_empty_rollouts: int = setting(
        3, "rollouts in a row that train on nothing (every sample masked, e.g. a NaN reward, or every step skipped) "
           "before the run stops with an error; each is warned about, and a run whose rollouts all trained on "
           "nothing never ends with status 0", "rollouts", gt=0)
    stop_grace_s: float = setting(
        25.0, "after SIGTERM/SIGINT or the death of the launcher: finish the rollout and checkpoint if that fits "
              "in this time, else stop at the next mini-batch boundary; a rank still running 5 s after it exits with "
              "128 + the signal's number",
        "seconds", gt=0)

    @model_validator(mode="after")
    def _one_length(self) -> RunConfig:
        """Exactly one of `epochs` and `rollouts` is set."""
        exactly_one(self.PATH, "epochs", self.epochs, "passes over the prompts", "rollouts", self.rollouts,
                     "a rollout count")
        return self


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
