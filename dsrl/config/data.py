"""``dsrl.data``: where prompts and rewards come from."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.names import DEFAULT_TASK, PROMPT_FILE_FORMATS, TASK_NAMES, TaskName
from dsrl.config.section import Section, setting


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
    environment: str | None = setting(
        None, "multi-turn rollouts: dotted path 'pkg.module:Factory' (or 'path/to/file.py:Factory') of an "
              "environment factory, called with (prompt, answer) once per sample; its episode's step(turn) returns "
              "the next observation, a reward and whether it is done (docs/environments.md); unset = one completion "
              "per sample")
    environment_timeout_s: float | None = setting(
        120.0, "limit on one call of the environment (the factory or one step); a call past it ends its "
               "trajectory, masks it and counts it in environment_timeouts (null = no limit)", "seconds", gt=0)
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
        """Prompts come from exactly one source, and a file needs `reward_fn`, `reward_model` or `environment` (it
        has no built-in reward)."""
        if self.task and self.path:
            raise ConfigError(
                f"{self.PATH}.task = {self.task!r} and {self.PATH}.path = {self.path!r} are both set; prompts come "
                f"from exactly one source. Fix: set {self.PATH}.task to null to read the file, or remove "
                f"{self.PATH}.path."
            )
        if self.path and not self.reward_fn and not self.reward_model and not self.environment:
            raise ConfigError(
                f"{self.PATH}.reward_fn, {self.PATH}.reward_model and {self.PATH}.environment are unset but prompts "
                f"come from {self.PATH}.path = {self.path!r}, which has no built-in reward. Fix: set "
                f"{self.PATH}.reward_fn to 'package.module:function' taking (prompts, completions, answers) and "
                f"returning one float per completion, {self.PATH}.reward_model to a local sequence-classification "
                f"model directory, or {self.PATH}.environment to an environment factory whose episodes give rewards."
            )
        return self

    @property
    def has_rule_reward(self) -> bool:
        """Whether a rule reward (``reward_fn``, the environment's or the task's) enters the reward with a non-zero
        weight."""
        return self.rule_reward_weight != 0 and (self.task is not None or self.reward_fn is not None
                                                 or self.environment is not None)

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
