"""``dsrl.eval``: held-out evaluation during training, and of a model by ``dsrl eval``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.section import Section, setting


class EvalConfig(Section):
    """Held-out evaluation: during training every `every` rollouts (docs/evaluation.md), and of a model by `dsrl eval`.
    The prompts come from `path` (with `subset`, `split`), else from the split `split` of the training dataset, else
    from a built-in task's held-out prompts or the training dataset's test split; prompt settings (`prompt_key`,
    templates, `max_prompt_tokens`) and the reward are `dsrl.data`'s."""

    PATH: ClassVar[str] = "dsrl.eval"

    every: int = setting(
        0, "evaluate every N rollouts, and also before the first rollout and after the last (0 = off; `dsrl eval` "
           "evaluates once whatever its value)", "rollouts", ge=0)
    samples_per_prompt: int = setting(
        1, "n: completions generated per evaluation prompt (accuracy is their mean, pass_at_k is estimated from them)",
        "samples", gt=0)
    pass_k: int | None = setting(
        None, "k of pass_at_k, the unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over prompts (n = "
              "samples_per_prompt, c = correct samples of the prompt); unset = samples_per_prompt", gt=0)
    temperature: float = setting(0.0, "sampling temperature; 0 = greedy decoding", ge=0)
    top_p: float = setting(1.0, "nucleus sampling (with temperature > 0)", gt=0, le=1)
    top_k: int = setting(0, "top-k sampling (with temperature > 0; 0 = off)", ge=0)
    max_new_tokens: int | None = setting(
        None, "completion length limit (with data.environment: per model turn); unset = rollout.max_new_tokens",
        "tokens", gt=0)
    max_prompts: int | None = setting(
        None, "evaluate the first max_prompts prompts of the set (a built-in task's: in its held-out order); "
              "unset = all", "prompts", gt=0)
    log_samples: int = setting(
        0, "write the first N evaluation prompts' completions of every evaluation to <run.output_dir>/"
           "eval_samples.jsonl (with dsrl eval: to --out): rollout, prompt index, prompt, completion, reward, "
           "accuracy; 0 = none", "prompts", ge=0)
    path: str | None = setting(
        None, "evaluation prompts from a file or dataset (the forms dsrl.data.path takes, read with the same "
              "readers); unset = split of the training dataset, else the built-in task's held-out prompts or the "
              "training dataset's test split")
    subset: str | None = setting(None, "with path: the dataset's configuration (as dsrl.data.subset)")
    split: str | None = setting(
        None, "the split to evaluate: of path (unset = its test split, else its only one), or without path of the "
              "training dataset dsrl.data.path (a split other than dsrl.data.split)")

    @model_validator(mode="after")
    def _settings_that_act(self) -> EvalConfig:
        """Greedy decoding (`temperature` 0) takes `samples_per_prompt` 1 and neither `top_p` nor `top_k` (its samples
        would be identical and nothing is sampled); `pass_k` is at most `samples_per_prompt`; `subset` needs
        `path`."""
        p = self.PATH
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ConfigError(
                f"{p}.samples_per_prompt = {self.samples_per_prompt} with {p}.temperature = 0 (greedy decoding): every "
                f"sample of a prompt would be the same completion. Fix: set {p}.temperature > 0 (e.g. 0.6) to draw "
                f"{self.samples_per_prompt} different samples, or {p}.samples_per_prompt to 1.")
        changed = [k for k, neutral in (("top_p", 1.0), ("top_k", 0)) if getattr(self, k) != neutral]
        if self.temperature == 0 and changed:
            raise ConfigError(
                f"{p}.{changed[0]} is set but {p}.temperature = 0 decodes greedily, which it does not change. Fix: "
                f"set {p}.temperature > 0, or remove {p}.{changed[0]}.")
        if self.pass_k is not None and self.pass_k > self.samples_per_prompt:
            raise ConfigError(
                f"{p}.pass_k = {self.pass_k} is more than {p}.samples_per_prompt = {self.samples_per_prompt}: pass@k "
                f"is estimated from the samples of each prompt. Fix: set {p}.samples_per_prompt >= {self.pass_k}, or "
                f"lower {p}.pass_k.")
        if self.subset is not None and self.path is None:
            raise ConfigError(
                f"{p}.subset = {self.subset!r} names a configuration of {p}.path, which is unset. Fix: set {p}.path "
                f"to the dataset, or remove {p}.subset (the training dataset's subset is dsrl.data.subset).")
        if self.split is not None and not self.split.strip():
            raise ConfigError(f"{p}.split is blank. Fix: name a split (e.g. test), or remove it.")
        return self

    @property
    def k(self) -> int:
        """k of pass@k, resolved."""
        return self.pass_k if self.pass_k is not None else self.samples_per_prompt
