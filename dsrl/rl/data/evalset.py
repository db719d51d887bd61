"""The evaluation prompts of ``dsrl.eval``: where they come from, and how a built-in task's are held out.

Sources, first match wins:

1. ``eval.path`` (+ ``eval.subset``, ``eval.split``): a file, dataset directory or hub dataset read with the readers
   of ``dsrl.data`` (:mod:`.sources`); ``eval.split`` unset = its ``test`` split, else its only split;
2. ``eval.split`` alone: that split of the training dataset (``data.path``, ``data.subset``);
3. neither, on a built-in task: the task's held-out prompts (below);
4. neither, on a dataset: its ``test`` split when it has one; otherwise there is nothing held out to evaluate on,
   a :class:`dsrl.config.ConfigError` naming the settings to set.

Every dataset row becomes a record through ``dsrl.data``'s prompt settings (prompt and answer columns, template,
system prompt, chat template) and is checked like a training row, lengths included (``data.max_prompt_tokens``,
``data.prompt_truncation``); the first ``eval.max_prompts`` records are kept, in the dataset's order.

Held-out prompts of a built-in task (the training prompts are ``make_prompts(data.size, run seed)``):

- a task whose every distinct prompt can be listed (:meth:`dsrl.tasks.base.Task.prompt_space`: ``reverse`` and
  ``copy``, 155 strings; ``add``, 100 sums) evaluates the prompts the training set lacks, in an order drawn from the
  run seed. When fewer than :data:`MIN_HELD_OUT` are left (``add`` at ``data.size`` 512 leaves 1), disjoint
  evaluation is impossible: the whole prompt space is evaluated instead, and :attr:`EvalPrompts.overlap` says why
  (logged when the run starts);
- a task with too many prompts to list (``calculator``: 900 x 900 products) draws :data:`TASK_DRAWS` prompts (or
  ``data.size`` when smaller) from a seed of its own and drops any that is a training prompt or drawn twice;
- ``eval.max_prompts`` then keeps the first ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from dsrl.config import ConfigError, DataConfig
from dsrl.config.evaluation import EvalConfig
from dsrl.core.seeds import derived_seed
from dsrl.rl.data.prompts import check_prompt_lengths, load_prompts, replica_share
from dsrl.rl.data.sources import DatasetSource, split_names

MIN_HELD_OUT = 16  # fewer unseen prompts than this: the task's prompt space is evaluated whole (module docstring)
HELD_OUT_SEED_TAG = 0xE7A15E7  # the held-out draws and order of a built-in task, apart from every training stream
TEST_SPLIT = "test"
TASK_DRAWS = 512  # held-out draws of a task whose prompts are too many to list (module docstring)


@dataclass(frozen=True)
class EvalPrompts:
    """The evaluation's records (``{"prompt", "answer"[, "columns"]}``, like the training prompts'), what they are
    (for messages), and, when they cannot be disjoint from the training prompts, why (None otherwise)."""

    records: list[dict[str, Any]]
    where: str
    overlap: str | None = None

    def __len__(self) -> int:
        return len(self.records)


def prompts_per_call(prompts_per_rank: int, samples_per_prompt: int, eval_samples_per_prompt: int) -> int:
    """Prompts per evaluation generate call: as many sequences as a training call (P/D prompts x G samples), the
    size continuous batching's bounds were made for; at least one prompt."""
    return max(1, prompts_per_rank * samples_per_prompt // eval_samples_per_prompt)


def replica_calls(n: int, replicas: int, replica: int, per_call: int) -> list[list[int]]:
    """Replica ``replica``'s evaluation calls over prompts ``0..n-1``: its contiguous share of ceil(n / replicas)
    prompts (:func:`dsrl.rl.data.prompts.replica_share`: each prompt evaluated by one replica) in calls of at most
    ``per_call``. Every replica gets the same number of calls (the largest share's), trailing ones empty: a rank
    with nothing left still calls generate (a ZeRO-3 parameter gather)."""
    share = -(-n // replicas)
    mine = replica_share(range(n), replica, share)
    return [mine[c * per_call:(c + 1) * per_call] for c in range(max(1, -(-share // per_call)))]


def eval_source(eval_cfg: EvalConfig, data_cfg: DataConfig, asked_by: str) -> DatasetSource | None:
    """The dataset (and split) the evaluation reads, or None for a built-in task's held-out prompts (module
    docstring). ``asked_by`` names what wants an evaluation in the refusal (``"dsrl.eval.every = 10"``)."""
    e = eval_cfg
    if e.path is not None:
        _not_the_training_prompts(e, data_cfg)
        if e.split is not None:
            return DatasetSource(e.path, e.subset, e.split, EvalConfig.PATH)
        probe = DatasetSource(e.path, e.subset, field=EvalConfig.PATH)
        if probe.kind() == "file":
            return probe
        splits = split_names(probe)
        if TEST_SPLIT in splits or len(splits) == 1:
            return DatasetSource(e.path, e.subset, TEST_SPLIT if TEST_SPLIT in splits else splits[0], EvalConfig.PATH)
        raise ConfigError(
            f"{EvalConfig.PATH}.split is unset and {probe.describe()} holds the splits {', '.join(splits)} but no "
            f"{TEST_SPLIT!r} split to evaluate by default. Fix: set {EvalConfig.PATH}.split to one of them.")
    if data_cfg.path is None:
        return None  # a built-in task: its held-out prompts (DsrlConfig refuses eval.split on a task)
    train = DatasetSource.of(data_cfg)
    if e.split is not None:
        splits = split_names(train)
        if e.split not in splits:
            raise ConfigError(
                f"{EvalConfig.PATH}.split = {e.split!r}: the training dataset {train.describe()} has no such split "
                f"(it has {', '.join(splits) or 'none'}). Fix: set {EvalConfig.PATH}.split to one of them other than "
                f"the training split, or {EvalConfig.PATH}.path to held-out prompts.")
        return DatasetSource.of(data_cfg, split=e.split)
    splits = split_names(train)
    if TEST_SPLIT in splits and data_cfg.split != TEST_SPLIT:
        return DatasetSource.of(data_cfg, split=TEST_SPLIT)
    has = f"it has {', '.join(splits)}" if splits else "it has none"
    raise ConfigError(
        f"{asked_by} but nothing held out is set to evaluate on: no {EvalConfig.PATH}.path or {EvalConfig.PATH}.split, "
        f"and the training dataset {train.describe()} has no {TEST_SPLIT!r} split other than the one it trains on "
        f"({has}). Fix: set {EvalConfig.PATH}.path to held-out prompts (a file or dataset), or {EvalConfig.PATH}.split "
        f"to another split of the training dataset{', or dsrl.eval.every to 0' if 'every' in asked_by else ''}.")


def _not_the_training_prompts(e: EvalConfig, data_cfg: DataConfig) -> None:
    """``eval.path`` is not the training dataset's file with the training split (the evaluation would measure the
    prompts the run trains on)."""
    import os

    if data_cfg.path is None or os.path.realpath(e.path) != os.path.realpath(data_cfg.path):
        return
    if e.subset == data_cfg.subset and e.split in (None, data_cfg.split) and (
            e.split is not None or DatasetSource.of(data_cfg).kind() == "file"):
        raise ConfigError(
            f"{EvalConfig.PATH}.path = {e.path!r} is the training dataset with the training split "
            f"{data_cfg.split!r}: the evaluation would measure the prompts the run trains on. Fix: point "
            f"{EvalConfig.PATH}.path at held-out prompts, or set {EvalConfig.PATH}.split to another split.")


def load_eval_prompts(eval_cfg: EvalConfig, data_cfg: DataConfig, seed: int, tokenizer: Any = None, *,
                      asked_by: str = "dsrl.eval.every > 0",
                      train_records: list[dict[str, Any]] | None = None) -> EvalPrompts:
    """The evaluation prompts (module docstring), checked before any work; ``seed``: the run's; ``tokenizer``:
    measure the prompts against ``data.max_prompt_tokens`` as the training prompts are; ``train_records``: the
    training prompts (a built-in task's are made again from ``data`` and ``seed`` when not given)."""
    source = eval_source(eval_cfg, data_cfg, asked_by)
    if source is not None:
        records = load_prompts(data_cfg, seed, tokenizer, source=source)
        if not records:
            raise ConfigError(f"{source.describe()} holds no rows to evaluate. Fix: point {source.field}.path at "
                              "held-out prompts.")
        out = EvalPrompts(records, source.describe())
    else:
        train = train_records if train_records is not None else load_prompts(data_cfg, seed)
        out = held_out(data_cfg, seed, train)
        if tokenizer is not None:
            check_prompt_lengths(out.records, tokenizer, data_cfg, out.where)
    if eval_cfg.max_prompts is not None and eval_cfg.max_prompts < len(out.records):
        out = EvalPrompts(out.records[:eval_cfg.max_prompts], f"the first {eval_cfg.max_prompts} of {out.where}",
                          out.overlap)
    return out


def held_out(data_cfg: DataConfig, seed: int, train_records: list[dict[str, Any]]) -> EvalPrompts:
    """A built-in task's held-out prompts for training prompts ``train_records`` (module docstring)."""
    from dsrl.tasks import get_task

    name = data_cfg.task
    assert name is not None, "held_out: prompts come from a dataset"
    task = get_task(name)
    seen = {r["prompt"] for r in train_records}
    order = random.Random(derived_seed(seed, HELD_OUT_SEED_TAG))
    space = task.prompt_space()
    if space is not None:
        unseen = [r for r in space if r["prompt"] not in seen]
        order.shuffle(unseen)
        if len(unseen) >= MIN_HELD_OUT:
            return EvalPrompts(unseen, f"{len(unseen)} held-out prompts of the built-in task {name!r} (none of its "
                                       f"{len(seen)} distinct training prompts)")
        whole = list(space)
        order.shuffle(whole)
        why = (f"the built-in task {name!r} has {len(space)} distinct prompts and its {len(train_records)} training "
               f"prompts (dsrl.data.size) hold {len(seen)} of them, leaving {len(unseen)} (fewer than {MIN_HELD_OUT}) "
               "to hold out")
        return EvalPrompts(whole, f"{len(whole)} prompts of the built-in task {name!r}, the training prompts among "
                                  "them", overlap=why)
    records, drawn = [], set(seen)
    for r in task.make_prompts(min(data_cfg.size, TASK_DRAWS), derived_seed(seed, HELD_OUT_SEED_TAG)):
        if r["prompt"] not in drawn:
            drawn.add(r["prompt"])
            records.append(r)
    return EvalPrompts(records, f"{len(records)} held-out prompts of the built-in task {name!r} (none of its training "
                                "prompts)")
