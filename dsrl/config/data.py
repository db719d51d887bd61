"""``dsrl.data``: where prompts and rewards come from."""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.names import (
    BUILTIN_REWARDS,
    DEFAULT_TASK,
    PROMPT_FILE_FORMATS,
    PROMPT_TRUNCATIONS,
    TASK_NAMES,
    PromptTruncation,
    TaskName,
)
from dsrl.config.section import Section, setting

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # a {column} of data.prompt_template


def is_hub_name(path: str) -> bool:
    """Whether ``path`` can name a dataset on the Hugging Face hub (``name`` or ``namespace/name``, relative, no
    ``.``/``..`` prefix): the form ``datasets.load_dataset`` tries on the hub when no local path matches."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", path)) and ".." not in path


class DataConfig(Section):
    """Where prompts and rewards come from."""

    PATH: ClassVar[str] = "dsrl.data"

    task: TaskName | None = setting(
        None, f"built-in task (dsrl/tasks): {' | '.join(TASK_NAMES)}; unset = {DEFAULT_TASK} when path is unset")
    path: str | None = setting(
        None, f"prompts from a local file ({', '.join(PROMPT_FILE_FORMATS)}), a dataset directory (save_to_disk "
              "output, or a folder of parquet/jsonl shards as a hub snapshot lays them out) or a Hugging Face hub "
              "dataset name (read from the local cache when offline), read when the run starts (docs/data.md)")
    subset: str | None = setting(
        None, "with path: the dataset's configuration (a hub dataset's name argument, e.g. main for openai/gsm8k; "
              "in a directory, a configuration of its README or a sub-folder); unset = the only one")
    split: str = setting(
        "train", "with path: the split the prompts come from (a directory or hub dataset; a single file or a saved "
                 "Dataset holds one split, train)")
    prompt_key: str = setting(
        "prompt", "column holding the prompt: text, or a list of {role, content} messages (always rendered with "
                  "the tokenizer's chat template)")
    answer_key: str = setting(
        "answer", "column passed to the reward function as answers (required, also with a reward model alone)")
    prompt_template: str | None = setting(
        None, "the prompt text made from each row: every {column} is replaced by that column's value, other braces "
              "are kept as written (e.g. 'Solve: {question}'); unset = the prompt_key column")
    system_prompt: str | None = setting(
        None, "a system message put before every prompt that has none, through the chat template (text prompts "
              "need chat_template = true)")
    reward_fn: str | None = setting(
        None, f"the rule reward: a built-in, {' or '.join(BUILTIN_REWARDS)} (docs/data.md), or the dotted path "
              "'pkg.module:function' (or pkg.module.function, or path/to/file.py:function) of your own; with path, "
              "it, reward_model or environment is required")
    reward_model: str | None = setting(
        None, "local directory of a Hugging Face AutoModelForSequenceClassification (num_labels 1) sharing the "
              "policy's tokenizer: each sample's score is read at its last valid token; ZeRO-3 shards it like the "
              "policy (docs/ppo.md)")
    reward_model_weight: float = setting(1.0, "reward = reward_model_weight * score + rule_reward_weight * rule reward")
    rule_reward_weight: float = setting(
        1.0, "weight of the rule reward: reward_fn, or the task's, and with an environment the sum of its episode's "
             "rewards (plus reward_fn of the last turn when set); 0 with a task = the reward model alone")
    environment: str | None = setting(
        None, "multi-turn rollouts: dotted path 'pkg.module:Factory' (or 'path/to/file.py:Factory') of an "
              "environment factory, called with (prompt, answer) once per sample; its episode's step(turn) returns "
              "the next observation, a reward and whether it is done (docs/environments.md); unset = one completion "
              "per sample")
    environment_timeout_s: float | None = setting(
        120.0, "limit on one call of the environment (the factory or one step); a call past it ends its "
               "trajectory, masks it and counts it in environment_timeouts (null = no limit)", "seconds", gt=0)
    size: int = setting(512, "number of prompts a built-in task generates", "prompts", gt=0)
    max_prompt_tokens: int = setting(
        64, "the most tokens a prompt may hold as the model sees it (chat template and system prompt included); a "
            "longer one is refused before any work, or cut with prompt_truncation = left", "tokens", gt=0)
    prompt_truncation: PromptTruncation = setting(
        "error", f"{' | '.join(PROMPT_TRUNCATIONS)}: a prompt longer than max_prompt_tokens refuses the run, naming "
                 "how many and the bound that fits (error), or keeps its last max_prompt_tokens tokens (left: a "
                 "warning with the count when the prompts are read, and prompts_truncated per rollout)")
    chat_template: bool = setting(
        False, "apply the tokenizer's chat template to text prompts (message-list prompts always use it)")
    reward_timeout_s: float | None = setting(
        600.0, "limit on one call of reward_fn (per sample for a per-sample function, per batch for a batched "
               "one); a call past it masks its samples and counts them in reward_timeouts (null = no limit); the "
               "built-in math also gives each comparison at most the smaller of this and 10 s (then it scores 0)",
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
        """A `path` with a file suffix ends in one of the readable ones (a directory or a hub dataset name may hold
        dots)."""
        if path is not None:
            ext = os.path.splitext(path)[1].lower()
            if ext and ext not in PROMPT_FILE_FORMATS and not os.path.isdir(path) and not (
                    is_hub_name(path) and "/" in path):
                raise ConfigError(
                    f"{cls.PATH}.path = {path!r}: unsupported file type {ext or '(none)'!r}. "
                    f"Fix: use one of {', '.join(PROMPT_FILE_FORMATS)}."
                )
        return path

    @field_validator("prompt_template", "system_prompt", "subset")
    @classmethod
    def _not_blank(cls, value: str | None, info: Any) -> str | None:
        """`prompt_template`, `system_prompt` and `subset`, when set, are not blank; a `prompt_template` names at
        least one {column}."""
        where = f"{cls.PATH}.{info.field_name}"
        if value is not None and not value.strip():
            raise ConfigError(f"{where} is blank. Fix: write its text, or remove {where}.")
        if info.field_name == "prompt_template" and value is not None and not PLACEHOLDER.search(value):
            raise ConfigError(
                f"{where} = {value!r} names no column, so every prompt would be the same text. Fix: put the column "
                "holding each row's question in braces, e.g. '{question}'.")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        """Prompts come from exactly one source; a built-in task takes no `subset`, `split` or `prompt_template`; a
        dataset (`path`) needs `reward_fn`, `reward_model` or `environment` (it has no built-in reward)."""
        if self.task and self.path:
            raise ConfigError(
                f"{self.PATH}.task = {self.task!r} and {self.PATH}.path = {self.path!r} are both set; prompts come "
                f"from exactly one source. Fix: set {self.PATH}.task to null to read the file, or remove "
                f"{self.PATH}.path."
            )
        dataset_only = {"subset": self.subset is not None, "split": self.split != "train",
                        "prompt_template": self.prompt_template is not None}
        if self.task and any(dataset_only.values()):
            key = next(k for k, v in dataset_only.items() if v)
            raise ConfigError(
                f"{self.PATH}.{key} is set but prompts come from the built-in task {self.task!r}, which writes "
                f"its own prompts and has no subsets or splits. Fix: remove {self.PATH}.{key}, or set "
                f"{self.PATH}.task to null and {self.PATH}.path to the dataset.")
        if self.path and not self.reward_fn and not self.reward_model and not self.environment:
            raise ConfigError(
                f"{self.PATH}.reward_fn, {self.PATH}.reward_model and {self.PATH}.environment are unset but prompts "
                f"come from {self.PATH}.path = {self.path!r}, which has no built-in reward. Fix: set "
                f"{self.PATH}.reward_fn to a built-in ('math', 'exact' or 'reasoning_gym') or to "
                "'package.module:function' taking (prompts, completions, answers) and "
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
