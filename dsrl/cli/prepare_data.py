"""``dsrl prepare-data NAME --out DIR [--source PATH_OR_HUB_NAME] [--subset NAME|none] [--overwrite]``: write a
known dataset as the parquet files the shipped run files read (``python -m dsrl.cli.prepare_data`` does the same).
``dsrl prepare-data chain_sum --out DIR [--train_size N] [--test_size M] [--seed S] [--option KEY=VALUE ...]`` (and
``reasoning_gym:TASK`` for any task of reasoning-gym) generates one instead, offline.

Known datasets (:data:`RECIPES`, read from the hub or a local copy):

- ``gsm8k``: the hub dataset ``openai/gsm8k``, subset ``main`` -> ``DIR/train.parquet`` (7,473 rows) and
  ``DIR/test.parquet`` (1,319 rows), columns ``question`` and ``answer`` as published (the answer is the worked
  solution, its final answer after ``####``, which the built-in ``math`` reward reads). configs/gsm8k_*.json read
  ``data/gsm8k``.

Generated datasets (:data:`GENERATED`, reasoning-gym's procedural generators, ``pip install -e ".[real]"``;
:mod:`dsrl.tasks.procedural`): ``DIR/train.parquet`` and ``DIR/test.parquet``, disjoint by construction (a question's
split is a function of its text), with the columns ``question``, ``answer``, ``task`` and ``metadata`` that the
built-in reward ``reasoning_gym`` reads:

- ``chain_sum``: sums and differences of two numbers of 1-2 digits, e.g. "State the final answer to the following
  arithmetic problem: 58 + 26 =" -> "84"; 2,000 train and 200 test questions (configs/smollm2_135m_chain_sum_cpu.json
  reads ``data/chain_sum``);
- ``reasoning_gym:TASK``: any of reasoning-gym's tasks with its default options, or those ``--option`` gives (its
  config's fields, e.g. ``--option max_terms=3``).

``--source`` reads the same dataset from elsewhere with the run's own readers (:mod:`dsrl.rl.data.sources`): a hub
snapshot directory, a ``save_to_disk`` directory, or the hub name (the default), which needs a network the first
time and then works offline from the local cache. Each file is written whole to a temporary name and then renamed,
and existing files are kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from dsrl.config import ConfigError


@dataclass(frozen=True)
class Recipe:
    """Where a known dataset lives, which splits and columns the run files read."""

    source: str
    subset: str | None
    splits: tuple[str, ...]
    columns: tuple[str, ...]
    about: str


RECIPES: dict[str, Recipe] = {
    "gsm8k": Recipe("openai/gsm8k", "main", ("train", "test"), ("question", "answer"),
                    "grade-school math word problems; the answer column is a worked solution ending in '#### <n>'"),
}


@dataclass(frozen=True)
class Generated:
    """A dataset generated offline by one of reasoning-gym's tasks, with its options and split sizes."""

    task: str
    options: dict[str, Any]
    train_size: int
    test_size: int
    about: str


GENERATED: dict[str, Generated] = {
    "chain_sum": Generated("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 2000, 200,
                           "reasoning-gym's chain sums: a + b or a - b with 1-2 digit numbers, answer a number"),
}
GYM_PREFIX = "reasoning_gym:"


def _targets(out: str, splits: tuple[str, ...] | list[str], overwrite: bool) -> dict[str, str]:
    targets = {split: os.path.join(out, f"{split}.parquet") for split in splits}
    existing = [p for p in targets.values() if os.path.exists(p)]
    if existing and not overwrite:
        raise ConfigError(f"dsrl prepare-data: {', '.join(existing)} exist{'s' if len(existing) == 1 else ''}. Fix: "
                          "pass --overwrite to replace them, or choose another --out.")
    return targets


def _write(tables: dict[str, Any], targets: dict[str, str], out: str) -> dict[str, int]:
    """Each split's table (a datasets.Dataset) to its parquet file, written whole to a temporary name, then renamed."""
    os.makedirs(out, exist_ok=True)
    for split, rows in tables.items():
        tmp = targets[split] + ".tmp"
        rows.to_parquet(tmp)
        os.replace(tmp, targets[split])
    return {split: len(rows) for split, rows in tables.items()}


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a dict; each value read as JSON where it parses (numbers, true/false, lists), else
    kept as text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {pair!r} is not KEY=VALUE. Fix: write e.g. --option max_terms=3.")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def generate(name: str, out: str, train_size: int | None = None, test_size: int | None = None, seed: int = 0,
             options: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, int]:
    """Write ``out/train.parquet`` and ``out/test.parquet`` of the generated dataset ``name`` (a key of
    :data:`GENERATED`, or ``reasoning_gym:TASK``); returns the rows written per split."""
    import datasets

    from dsrl.tasks.procedural import generate_splits

    if name in GENERATED:
        recipe = GENERATED[name]
    elif name.startswith(GYM_PREFIX) and name[len(GYM_PREFIX):]:
        recipe = Generated(name[len(GYM_PREFIX):], {}, 2000, 200, "")
    else:
        raise ConfigError(f"dsrl prepare-data: unknown dataset {name!r}. Fix: use one of "
                          f"{', '.join([*RECIPES, *GENERATED])}, or {GYM_PREFIX}TASK for a task of reasoning-gym.")
    train = recipe.train_size if train_size is None else train_size
    test = recipe.test_size if test_size is None else test_size
    if train <= 0 or test <= 0:
        raise ConfigError(f"--train_size {train} / --test_size {test}: both must be positive numbers of questions.")
    targets = _targets(out, ("train", "test"), overwrite)
    splits = generate_splits(recipe.task, train, test, seed, {**recipe.options, **(options or {})})
    return _write({split: datasets.Dataset.from_list(rows) for split, rows in splits.items()}, targets, out)


def prepare(name: str, out: str, source: str | None = None, overwrite: bool = False,
            subset: str | None = "recipe") -> dict[str, int]:
    """Write ``out/<split>.parquet`` for each split of the recipe ``name`` (its subset, unless ``subset`` names
    another or is None for a source without one); returns the rows written per split."""
    from dsrl.rl.data.sources import DatasetSource, read_rows

    if name not in RECIPES:
        raise ConfigError(f"dsrl prepare-data: unknown dataset {name!r}. Fix: use one of {', '.join(RECIPES)}.")
    recipe = RECIPES[name]
    subset = recipe.subset if subset == "recipe" else subset
    targets = _targets(out, recipe.splits, overwrite)
    tables = {}
    for split in recipe.splits:  # read everything first: a missing split writes nothing
        rows = read_rows(DatasetSource(source or recipe.source, subset, split, "prepare-data"), progress=True)
        missing = [c for c in recipe.columns if c not in rows.column_names]
        if missing:
            raise ConfigError(f"dsrl prepare-data {name}: the {split} split of {source or recipe.source!r} has no "
                              f"column {', '.join(missing)} (it has {', '.join(rows.column_names)}). Fix: point "
                              "--source at the dataset as published.")
        tables[split] = rows.select_columns(list(recipe.columns))
    return _write(tables, targets, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dsrl prepare-data", description="Write a known dataset as parquet files (one per split) for the "
        "shipped run files. Known: " + "; ".join(f"{k}: {r.source} ({r.about})" for k, r in RECIPES.items())
        + ". Generated offline (reasoning-gym): " + "; ".join(f"{k}: {g.about}" for k, g in GENERATED.items())
        + f"; {GYM_PREFIX}TASK: any reasoning-gym task.")
    parser.add_argument("name", help=f"the dataset: {', '.join([*RECIPES, *GENERATED])} or {GYM_PREFIX}TASK")
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet into, e.g. data/gsm8k")
    parser.add_argument("--source", default=None,
                        help="read it from here instead of the hub: a hub snapshot or save_to_disk directory, or "
                             "another hub name")
    parser.add_argument("--subset", default="recipe",
                        help="the configuration to read (default: the dataset's, e.g. main for gsm8k; none for a "
                             "--source without configurations)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    parser.add_argument("--train_size", type=int, default=None, help="generated datasets: questions in train.parquet")
    parser.add_argument("--test_size", type=int, default=None, help="generated datasets: questions in test.parquet")
    parser.add_argument("--seed", type=int, default=0, help="generated datasets: the generator's first seed")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="generated datasets: a field of the reasoning-gym task's config (repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.name in RECIPES:
            written = prepare(args.name, args.out, args.source, args.overwrite,
                              None if args.subset == "none" else args.subset)
        else:
            written = generate(args.name, args.out, args.train_size, args.test_size, args.seed,
                               parse_options(args.option), args.overwrite)
    except ConfigError as e:  # prepare-data.path / .subset / .split are --source, --subset and the recipe's splits
        print(f"dsrl: configuration error: {e} (prepare-data.path is --source, prepare-data.subset is --subset)",
              file=sys.stderr)
        return 2
    for split, n in written.items():
        print(f"wrote {os.path.join(args.out, split + '.parquet')} ({n:,} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
