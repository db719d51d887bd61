"""Prompts and the prompt sampler: the prompt side of ``dsrl.data``.

Sources of prompts (exactly one of them):

- a built-in task, ``dsrl.data.task`` (``dsrl.tasks``): ``data.size`` prompts made from the run seed;
- a local file, ``dsrl.data.path`` (``.jsonl``, ``.json`` or ``.parquet``), read offline with
  ``datasets.load_dataset``; ``data.prompt_key`` and ``data.answer_key`` name the columns.

Rewards come from the task, or from ``dsrl.data.reward_fn`` (required with a file): :mod:`dsrl.rl.rewards.functions`.
Every error is a
:class:`dsrl.config.ConfigError` whose message names the ``dsrl.data.*`` field and the fix.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from typing import Any, Literal

from dsrl.config import ConfigError, DataConfig
from dsrl.config.names import PROMPT_FILE_FORMATS

# --------------------------------------------------------------------------------------------
# Prompt sources
# --------------------------------------------------------------------------------------------


def _check_source(data_cfg: DataConfig) -> str:
    """'task' or 'path'. ``DataConfig`` guarantees exactly one source with a known task name or file
    suffix; what is left to check here needs the file system: the file must exist."""
    if data_cfg.task:
        return "task"
    if not os.path.isfile(data_cfg.path):
        raise ConfigError(f"dsrl.data.path = {data_cfg.path!r}: no such file (working directory {os.getcwd()}).")
    return "path"


def _read_file(data_cfg: DataConfig) -> Any:
    """The file as a ``datasets.Dataset`` (split "train"), loaded from local files only."""
    import datasets

    path = data_cfg.path
    builder = PROMPT_FILE_FORMATS[os.path.splitext(path)[1].lower()]
    try:
        return datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train")
    except Exception as e:  # datasets raises many types; all are reported against the field
        raise ConfigError(f"dsrl.data.path = {path!r}: cannot read it as {builder}: {e}") from e


def _check_columns(data_cfg: DataConfig, columns: Sequence[str]) -> None:
    for field_name in ("prompt_key", "answer_key"):
        key = getattr(data_cfg, field_name)
        if key not in columns:
            raise ConfigError(
                f"dsrl.data.{field_name} = {key!r}: no such column in {data_cfg.path!r} "
                f"(columns: {', '.join(columns)}). Fix: set dsrl.data.{field_name} to one of them."
            )


def dataset_size(data_cfg: DataConfig) -> int:
    """Number of prompts the run draws from: ``data.size`` for a task, the file's row count otherwise."""
    if _check_source(data_cfg) == "task":
        return data_cfg.size
    return len(_read_file(data_cfg))


def load_prompts(data_cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    """``[{"prompt": str, "answer": Any}, ...]`` in source order (the sampler shuffles).

    A task's prompts are a pure function of ``(data.task, data.size, seed)``; a file's rows are
    returned in file order and ``seed`` is unused. ``len(result) == dataset_size(data_cfg)``.
    """
    if _check_source(data_cfg) == "task":
        from dsrl.tasks import get_task

        return get_task(data_cfg.task).make_prompts(data_cfg.size, seed)
    ds = _read_file(data_cfg)
    _check_columns(data_cfg, ds.column_names)
    try:  # datasets decodes text lazily: invalid UTF-8 surfaces here
        prompts = list(ds[data_cfg.prompt_key])
        answers = list(ds[data_cfg.answer_key])
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"dsrl.data.path = {data_cfg.path!r} is not valid UTF-8 ({e.reason}: byte "
            f"{e.object[e.start:e.start + 1]!r} in {bytes(e.object[max(e.start - 20, 0):e.start + 10])!r}). "
            "Fix: re-encode the file as UTF-8, e.g. "
            "iconv -f latin1 -t utf-8."
        ) from None
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ConfigError(
                f"dsrl.data.prompt_key = {data_cfg.prompt_key!r}: row {i} of {data_cfg.path!r} holds "
                f"{type(p).__name__} {p!r}, not a string. Fix: point prompt_key at a text column."
            )
    return [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]


# --------------------------------------------------------------------------------------------
# Prompt tokenization
# --------------------------------------------------------------------------------------------


def encode_prompts(tokenizer: Any, prompts: list[str], max_prompt_tokens: int, chat_template: bool) -> list[list[int]]:
    """Token ids per prompt, at most ``max_prompt_tokens`` long, truncated on the left.

    Special tokens follow the tokenizer's own convention: plain prompts use
    ``add_special_tokens=True`` (the tiny tokenizer and Llama-style ones prepend bos, Qwen-style
    ones add nothing); with ``chat_template`` the rendered template (which carries its own special
    tokens) is tokenized without adding any. Truncation keeps the *end* of the prompt; a leading
    bos survives truncation (bos + the last ``max_prompt_tokens - 1`` tokens).
    """
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"dsrl.data.chat_template = true but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has "
                "no chat template. Fix: set dsrl.data.chat_template to false or use a chat tokenizer."
            )
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        encoded = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    out: list[list[int]] = []
    for i, ids in enumerate(encoded):
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            if bos is not None and ids[0] == bos and max_prompt_tokens > 1:
                ids = [bos] + ids[len(ids) - (max_prompt_tokens - 1):]
            else:
                ids = ids[len(ids) - max_prompt_tokens:]
        if not ids:
            raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens; generation needs at least one.")
        out.append(ids)
    return out


# --------------------------------------------------------------------------------------------
# The prompt sampler
# --------------------------------------------------------------------------------------------


def rollouts_for_epochs(epochs: float, num_prompts: int, prompts_per_rollout: int,
                        last_rollout: Literal["drop", "wrap"]) -> int:
    """Rollouts that ``run.epochs`` gives; the same rule as :meth:`dsrl.core.plan.BatchPlan.from_config`.

    ``drop``: floor(epochs * N / P); ``wrap``: ceil(epochs * N / P) (tolerance 1e-9 either way).
    """
    exact = epochs * num_prompts / prompts_per_rollout
    return math.floor(exact + 1e-9) if last_rollout == "drop" else math.ceil(exact - 1e-9)


class PromptSampler:
    """Deterministic prompt indices for each rollout, resumable exactly.

    The sampler walks one endless stream: pass (epoch) ``e`` is a permutation of ``range(N)``
    drawn from ``random.Random(f"dsrl-prompts:{seed}:{e}")`` (stable across platforms), and pass
    ``e + 1`` follows pass ``e``. :meth:`next_indices` returns the next ``P`` entries of the stream,
    so a rollout may straddle a pass boundary (and, when ``P`` does not divide ``N``, may then hold
    the same prompt twice). Consequently after ``k * N`` drawn indices every prompt was drawn exactly
    ``k`` times, and each pass covers every prompt once.

    ``last_rollout`` does not change the order; it only decides how many rollouts ``run.epochs``
    gives (:meth:`rollouts_for_epochs`, identical to ``dsrl.core.plan``): ``drop`` = floor(epochs*N/P),
    leaving at most P - 1 prompts of the last pass undrawn; ``wrap`` = ceil(epochs*N/P), the last
    rollout completing itself from the start of the next pass.
    """

    def __init__(self, num_prompts: int, prompts_per_rollout: int, seed: int = 0,
                 last_rollout: Literal["drop", "wrap"] = "drop"):
        # prompts_per_rollout and last_rollout come validated from the config; the data may still be empty.
        if num_prompts <= 0:
            raise ConfigError(f"the prompt dataset is empty (N = {num_prompts}); check dsrl.data.")
        self.num_prompts = num_prompts
        self.prompts_per_rollout = prompts_per_rollout
        self.seed = seed
        self.last_rollout = last_rollout
        self.epoch = 0  # the pass the next index comes from
        self.offset = 0  # position of the next index within that pass
        self.rollouts = 0  # next_indices() calls so far
        self._perm: list[int] | None = None
        self._perm_epoch = -1

    def permutation(self, epoch: int) -> list[int]:
        """The order of pass ``epoch``: a pure function of (seed, epoch, N)."""
        if self._perm_epoch != epoch or self._perm is None:
            perm = list(range(self.num_prompts))
            random.Random(f"dsrl-prompts:{self.seed}:{epoch}").shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def next_indices(self) -> list[int]:
        """The ``P`` prompt indices of the next rollout (advances the stream)."""
        out: list[int] = []
        while len(out) < self.prompts_per_rollout:
            perm = self.permutation(self.epoch)
            take = min(self.prompts_per_rollout - len(out), self.num_prompts - self.offset)
            out.extend(perm[self.offset:self.offset + take])
            self.offset += take
            if self.offset == self.num_prompts:
                self.epoch, self.offset = self.epoch + 1, 0
        self.rollouts += 1
        return out

    def rollouts_for_epochs(self, epochs: float) -> int:
        """Rollouts ``run.epochs = epochs`` gives under this sampler's ``last_rollout`` rule."""
        return rollouts_for_epochs(epochs, self.num_prompts, self.prompts_per_rollout, self.last_rollout)

    @property
    def prompt_epochs(self) -> float:
        """Passes over the dataset drawn so far (fractional)."""
        return self.epoch + self.offset / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream exactly (plain ints and strings)."""
        return {
            "num_prompts": self.num_prompts,
            "prompts_per_rollout": self.prompts_per_rollout,
            "seed": self.seed,
            "last_rollout": self.last_rollout,
            "epoch": self.epoch,
            "offset": self.offset,
            "rollouts": self.rollouts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. Dataset size and seed must match (else the order would differ);
        ``prompts_per_rollout`` may change, the stream simply continues in chunks of the new size."""
        for key in ("num_prompts", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"cannot resume the prompt sampler: the checkpoint has {key} = {state[key]!r}, this run has "
                    f"{getattr(self, key)!r} (dsrl.data / dsrl.run.seed changed). Fix: resume with the same data and "
                    "seed, or start a fresh run (dsrl.run.resume = 'never')."
                )
        self.epoch, self.offset, self.rollouts = int(state["epoch"]), int(state["offset"]), int(state["rollouts"])
        if not 0 <= self.offset < self.num_prompts:
            raise ConfigError(f"corrupt prompt-sampler state: offset {self.offset} outside [0, {self.num_prompts}).")


def replica_share(indices: Sequence[int], replica: int, per_replica: int) -> list[int]:
    """Data-parallel replica ``replica``'s contiguous share of a rollout's prompt indices: ``per_replica`` (P / D)
    of them, the same slice whichever rank (a trainer, or the generator serving that replica) cuts it."""
    return list(indices[replica * per_replica:(replica + 1) * per_replica])


class PromptSource:
    """The run's prompts as the experience maker and a generator rank see them: the records, the resumable stream
    of indices (:class:`PromptSampler`) and their encoding by the run's tokenizer (``data.max_prompt_tokens``,
    ``data.chat_template``). Every rank holds the same one, so every rank draws the same indices; build it with
    :meth:`load` on every role."""

    def __init__(self, records: list[dict[str, Any]], sampler: PromptSampler, tokenizer: Any, data_cfg: DataConfig):
        self.records, self.sampler, self.tokenizer, self.data_cfg = records, sampler, tokenizer, data_cfg

    @classmethod
    def load(cls, data_cfg: DataConfig, prompts_per_rollout: int, seed: int, last_rollout: Literal["drop", "wrap"],
             tokenizer: Any) -> PromptSource:
        """The run's prompt stream: ``data``'s prompts (:func:`load_prompts`) drawn ``batch.prompts_per_rollout`` at
        a time by a sampler seeded with ``run.seed`` (``run.last_rollout``: how ``run.epochs`` ends)."""
        records = load_prompts(data_cfg, seed=seed)
        return cls(records, PromptSampler(len(records), prompts_per_rollout, seed=seed, last_rollout=last_rollout),
                   tokenizer, data_cfg)

    def __len__(self) -> int:
        return len(self.records)

    def next_indices(self) -> list[int]:
        """The next rollout's ``P`` prompt indices (advances the sampler)."""
        return self.sampler.next_indices()

    def next_share(self, replica: int, per_replica: int) -> list[int]:
        """The next rollout's ``P`` indices (advances the sampler, as on every rank) cut to ``replica``'s share
        (:func:`replica_share`)."""
        return replica_share(self.next_indices(), replica, per_replica)

    @property
    def drawn(self) -> int:
        """Prompt indices drawn so far (every draw, dynamic-sampling refills included)."""
        return self.sampler.epoch * self.sampler.num_prompts + self.sampler.offset

    def encode(self, indices: list[int]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """(the records, their prompt token ids) of ``indices``."""
        records = [self.records[i] for i in indices]
        if not records:
            return [], []
        d = self.data_cfg
        return records, encode_prompts(self.tokenizer, [r["prompt"] for r in records], d.max_prompt_tokens,
                                       d.chat_template)
