"""Prompts and the prompt sampler: the prompt side of ``dsrl.data``.

Sources of prompts (exactly one of them):

- a built-in task, ``dsrl.data.task`` (``dsrl.tasks``): ``data.size`` prompts made from the run seed;
- a dataset, ``dsrl.data.path`` (+ ``subset``, ``split``): a file, a dataset directory or a hub dataset name, read
  offline (:mod:`.sources`), its rows made into records and checked (:mod:`.records`).

A prompt as the model sees it (:func:`encode`): text, or through the tokenizer's chat template (a message list
always, text with ``data.chat_template``), with ``data.system_prompt`` before it. With a tokenizer,
:func:`load_prompts` encodes every prompt once and applies ``data.prompt_truncation`` to those longer than
``data.max_prompt_tokens``: ``error`` (the default) refuses the run before any work, naming how many prompts, the
longest and the bound that fits; ``left`` warns once with the count, and :class:`PromptSource` counts the prompts it
cuts per rollout (:meth:`PromptSource.take_truncated`). A prompt is never cut silently.

Rewards come from the task, or from ``dsrl.data.reward_fn`` (required with a dataset): :mod:`dsrl.rl.rewards.functions`.
Every error is a :class:`dsrl.config.ConfigError` whose message names the ``dsrl.*`` field and the fix.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dsrl.config import ConfigError, DataConfig
from dsrl.rl.data.records import make_records
from dsrl.rl.data.sources import DatasetSource, read_rows

log = logging.getLogger("dsrl.data")
ENCODE_CHUNK = 1024  # prompts tokenized per call when every prompt is measured at load
PROGRESS_FROM = 20_000  # prompts from which measuring them shows a progress bar

# --------------------------------------------------------------------------------------------
# Prompt sources
# --------------------------------------------------------------------------------------------


def dataset_size(data_cfg: DataConfig, source: DatasetSource | None = None) -> int:
    """Number of prompts the run draws from: ``data.size`` for a task, the dataset's row count otherwise (of
    ``source`` when given: another split or dataset, read with the same readers)."""
    if source is None and data_cfg.task:
        return data_cfg.size
    return len(read_rows(source or DatasetSource.of(data_cfg)))


def load_prompts(data_cfg: DataConfig, seed: int, tokenizer: Any = None, *,
                 source: DatasetSource | None = None) -> list[dict[str, Any]]:
    """The prompt records in source order (the sampler shuffles): ``{"prompt", "answer"}`` for a task,
    ``{"prompt", "answer", "columns"}`` for a dataset (:mod:`.records`).

    A task's prompts are a pure function of ``(data.task, data.size, seed)``; a dataset's rows come in their order
    and ``seed`` is unused. ``source`` reads another dataset or split (an evaluation's) with the same readers,
    rendering and checks, the prompt settings taken from ``data_cfg``. With ``tokenizer`` every prompt is encoded
    once and ``data.prompt_truncation`` applied (module docstring). Every problem is a ConfigError raised here,
    before any work."""
    if source is None and data_cfg.task:
        from dsrl.tasks import get_task

        records = get_task(data_cfg.task).make_prompts(data_cfg.size, seed)
        where = f"the built-in task {data_cfg.task!r}"
    else:
        source = source or DatasetSource.of(data_cfg)
        records = make_records(read_rows(source), data_cfg, source)
        where = source.describe()
    field = DataConfig.PATH  # the prompt settings are dsrl.data's, whichever section named the dataset
    if data_cfg.system_prompt and not data_cfg.chat_template and any(isinstance(r["prompt"], str) for r in records):
        raise ConfigError(
            f"{field}.system_prompt is set but the prompts of {where} are text and {field}.chat_template is false, "
            f"so there is no chat template to put it in. Fix: set {field}.chat_template to true, or write the text "
            f"into {field}.prompt_template.")
    if tokenizer is not None:
        check_prompt_lengths(records, tokenizer, data_cfg, where, field)
    return records


def check_prompt_lengths(records: Sequence[dict[str, Any]], tokenizer: Any, data_cfg: DataConfig, where: str,
                         field: str = DataConfig.PATH) -> int:
    """How many prompts are longer than ``data.max_prompt_tokens`` as the model sees them; with
    ``prompt_truncation = "error"`` any is a ConfigError, with ``"left"`` a warning with the count (rank 0)."""
    limit = data_cfg.max_prompt_tokens
    longest, over = 0, []
    chunks = range(0, len(records), ENCODE_CHUNK)
    if len(records) >= PROGRESS_FROM and os.environ.get("RANK", "0") == "0":
        from tqdm import tqdm

        chunks = tqdm(chunks, desc="measuring prompts", unit="chunk")
    for start in chunks:
        part = [r["prompt"] for r in records[start:start + ENCODE_CHUNK]]
        for j, ids in enumerate(_token_ids(tokenizer, part, data_cfg.chat_template, data_cfg.system_prompt)):
            longest = max(longest, len(ids))
            if len(ids) > limit:
                over.append(start + j)
    if not over:
        return 0
    rows = ", ".join(str(i) for i in over[:5]) + (f" and {len(over) - 5:,} more" if len(over) > 5 else "")
    what = (f"{len(over):,} of the {len(records):,} prompts of {where} are longer than {field}.max_prompt_tokens = "
            f"{limit} tokens as the model sees them (rows {rows}; the longest has {longest})")
    if data_cfg.prompt_truncation == "error":
        raise ConfigError(
            f"{what}; a cut prompt loses its beginning, where a question states what it asks. Fix: set "
            f"{field}.max_prompt_tokens to at least {longest}, or {field}.prompt_truncation to 'left' to keep the "
            f"last {limit} tokens of each.")
    if os.environ.get("RANK", "0") == "0":
        log.warning("%s: each keeps its last %d tokens (%s.prompt_truncation = 'left'); prompts_truncated counts "
                    "them per rollout.", what, limit, field)
    return len(over)


# --------------------------------------------------------------------------------------------
# Prompt tokenization
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedPrompts:
    """Token ids per prompt (each at most ``max_prompt_tokens`` long) and how many were cut to fit."""

    ids: list[list[int]]
    truncated: int


def _token_ids(tokenizer: Any, prompts: Sequence[Any], chat_template: bool,
               system_prompt: str | None = None) -> list[list[int]]:
    """Each prompt's token ids, uncut: text as is, or through the chat template (message lists always, text with
    ``chat_template``), ``system_prompt`` first where a conversation has no system message."""
    chat = [isinstance(p, list) or chat_template for p in prompts]
    if any(chat) and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the prompts need the tokenizer's chat template (dsrl.data.chat_template = {str(chat_template).lower()}"
            f"{', and the prompts are message lists' if any(isinstance(p, list) for p in prompts) else ''}) but the "
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has none. Fix: set dsrl.data.chat_template to "
            "false and give text prompts, or use a chat tokenizer (dsrl.model.tokenizer).")
    if system_prompt and not all(chat):
        raise ConfigError("dsrl.data.system_prompt needs the chat template for text prompts. Fix: set "
                          "dsrl.data.chat_template to true.")
    out: list[list[int] | None] = [None] * len(prompts)
    plain = [i for i, c in enumerate(chat) if not c]
    if plain:
        for i, ids in zip(plain, tokenizer([prompts[i] for i in plain], add_special_tokens=True)["input_ids"]):
            out[i] = list(ids)
    templated = [i for i, c in enumerate(chat) if c]
    if templated:
        texts = []
        for i in templated:
            messages = prompts[i] if isinstance(prompts[i], list) else [{"role": "user", "content": prompts[i]}]
            if system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        for i, ids in zip(templated, tokenizer(texts, add_special_tokens=False)["input_ids"]):
            out[i] = list(ids)
    return out  # type: ignore[return-value]


def template_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the tokenizer's chat template puts before a conversation that has none (SmolLM2's "You are
    a helpful AI assistant named SmolLM, ..."), or None when it adds none. Found without knowing the template:
    a conversation rendered with a marker system message, and again without one; what the template writes where the
    marker stood is its own default."""
    marker, user = "\x00dsrl-system\x00", [{"role": "user", "content": "\x00dsrl-user\x00"}]
    try:
        given = tokenizer.apply_chat_template([{"role": "system", "content": marker}, *user], tokenize=False)
        plain = tokenizer.apply_chat_template(user, tokenize=False)
    except Exception:  # a template that refuses a system role has no default of its own to show
        return None
    before, found, after = given.partition(marker)
    if not found or not plain.endswith(after) or not plain.startswith(before):
        return None
    default = plain[len(before):len(plain) - len(after)]
    return default or None


def describe_rendering(tokenizer: Any, prompt: Any, data_cfg: DataConfig, limit: int = 400) -> str:
    """One sentence a user reads at the start of a run: the first prompt as the model sees it (chat template and
    generation prompt included, :func:`encode`'s tokens decoded), and, where the chat template puts a system prompt
    of its own before prompts that have none, that text and the setting that replaces it."""
    ids = encode(tokenizer, [prompt], 1 << 30, data_cfg.chat_template, data_cfg.system_prompt).ids[0]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    shown = repr(text if len(text) <= limit else text[:limit] + "...")
    out = f"the model sees each prompt as {len(ids)} tokens like {shown}"
    chat = data_cfg.chat_template or isinstance(prompt, list)
    has_own = isinstance(prompt, list) and bool(prompt) and prompt[0].get("role") == "system"
    default = template_system_prompt(tokenizer) if chat and not data_cfg.system_prompt and not has_own else None
    if default:
        out += (f"; the chat template puts its own system prompt before every prompt: {default.strip()!r} (set "
                "dsrl.data.system_prompt to replace it)")
    return out


def encode(tokenizer: Any, prompts: Sequence[Any], max_prompt_tokens: int, chat_template: bool,
           system_prompt: str | None = None) -> EncodedPrompts:
    """Token ids per prompt, at most ``max_prompt_tokens`` long, truncated on the left, and the count truncated.

    Special tokens follow the tokenizer's own convention: plain prompts use ``add_special_tokens=True`` (the tiny
    tokenizer and Llama-style ones prepend bos, Qwen-style ones add nothing); through the chat template the rendered
    text (which carries its own special tokens) is tokenized without adding any. Truncation keeps the *end* of the
    prompt; a leading bos survives it (bos + the last ``max_prompt_tokens - 1`` tokens).
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    out: list[list[int]] = []
    cut = 0
    for i, ids in enumerate(_token_ids(tokenizer, prompts, chat_template, system_prompt)):
        if len(ids) > max_prompt_tokens:
            cut += 1
            if bos is not None and ids[0] == bos and max_prompt_tokens > 1:
                ids = [bos] + ids[len(ids) - (max_prompt_tokens - 1):]
            else:
                ids = ids[len(ids) - max_prompt_tokens:]
        if not ids:
            raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens; generation needs at least one.")
        out.append(ids)
    return EncodedPrompts(out, cut)


def encode_prompts(tokenizer: Any, prompts: list[Any], max_prompt_tokens: int, chat_template: bool,
                   system_prompt: str | None = None) -> list[list[int]]:
    """The token ids of :func:`encode`."""
    return encode(tokenizer, prompts, max_prompt_tokens, chat_template, system_prompt).ids


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
        self.truncated = 0  # prompts encode() cut to data.max_prompt_tokens since the last take_truncated()

    @classmethod
    def load(cls, data_cfg: DataConfig, prompts_per_rollout: int, seed: int, last_rollout: Literal["drop", "wrap"],
             tokenizer: Any) -> PromptSource:
        """The run's prompt stream: ``data``'s prompts (:func:`load_prompts`) drawn ``batch.prompts_per_rollout`` at
        a time by a sampler seeded with ``run.seed`` (``run.last_rollout``: how ``run.epochs`` ends)."""
        records = load_prompts(data_cfg, seed=seed, tokenizer=tokenizer)
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
        """(the records, their prompt token ids) of ``indices``; the prompts cut to fit are counted."""
        records = [self.records[i] for i in indices]
        if not records:
            return [], []
        d = self.data_cfg
        encoded = encode(self.tokenizer, [r["prompt"] for r in records], d.max_prompt_tokens, d.chat_template,
                         d.system_prompt)
        self.truncated += encoded.truncated
        return records, encoded.ids

    def take_truncated(self) -> int:
        """Prompts cut to ``data.max_prompt_tokens`` since the last call (``prompts_truncated`` of a rollout's
        statistics; always 0 with ``prompt_truncation = "error"``, which refused them at load)."""
        n, self.truncated = self.truncated, 0
        return n
