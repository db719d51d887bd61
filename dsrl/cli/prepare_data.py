"""``dsrl prepare-data NAME --out DIR [--source PATH_OR_HUB_NAME] [--subset NAME|none] [--overwrite]``: write a
known dataset as the parquet files the shipped run files read (``python -m dsrl.cli.prepare_data`` does the same).

Known datasets (:data:`RECIPES`):

- ``gsm8k``: the hub dataset ``openai/gsm8k``, subset ``main`` -> ``DIR/train.parquet`` (7,473 rows) and
  ``DIR/test.parquet`` (1,319 rows), columns ``question`` and ``answer`` as published (the answer is the worked
  solution, its final answer after ``####``, which the built-in ``math`` reward reads). configs/gsm8k_*.json read
  ``data/gsm8k``.

``--source`` reads the same dataset from elsewhere with the run's own readers (:mod:`dsrl.rl.data.sources`): a hub
snapshot directory, a ``save_to_disk`` directory, or the hub name (the default), which needs a network the first
time and then works offline from the local cache. Each file is written whole to a temporary name and then renamed,
and existing files are kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

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


def prepare(name: str, out: str, source: str | None = None, overwrite: bool = False,
            subset: str | None = "recipe") -> dict[str, int]:
    """Write ``out/<split>.parquet`` for each split of the recipe ``name`` (its subset, unless ``subset`` names
    another or is None for a source without one); returns the rows written per split."""
    from dsrl.rl.data.sources import DatasetSource, read_rows

    if name not in RECIPES:
        raise ConfigError(f"dsrl prepare-data: unknown dataset {name!r}. Fix: use one of {', '.join(RECIPES)}.")
    recipe = RECIPES[name]
    subset = recipe.subset if subset == "recipe" else subset
    targets = {split: os.path.join(out, f"{split}.parquet") for split in recipe.splits}
    existing = [p for p in targets.values() if os.path.exists(p)]
    if existing and not overwrite:
        raise ConfigError(f"dsrl prepare-data: {', '.join(existing)} exist{'s' if len(existing) == 1 else ''}. Fix: "
                          "pass --overwrite to replace them, or choose another --out.")
    tables = {}
    for split in recipe.splits:  # read everything first: a missing split writes nothing
        rows = read_rows(DatasetSource(source or recipe.source, subset, split, "prepare-data"), progress=True)
        missing = [c for c in recipe.columns if c not in rows.column_names]
        if missing:
            raise ConfigError(f"dsrl prepare-data {name}: the {split} split of {source or recipe.source!r} has no "
                              f"column {', '.join(missing)} (it has {', '.join(rows.column_names)}). Fix: point "
                              "--source at the dataset as published.")
        tables[split] = rows.select_columns(list(recipe.columns))
    os.makedirs(out, exist_ok=True)
    for split, rows in tables.items():
        tmp = targets[split] + ".tmp"
        rows.to_parquet(tmp)
        os.replace(tmp, targets[split])
    return {split: len(rows) for split, rows in tables.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dsrl prepare-data", description="Write a known dataset as parquet files (one per split) for the "
        "shipped run files. Known: " + "; ".join(f"{k}: {r.source} ({r.about})" for k, r in RECIPES.items()))
    parser.add_argument("name", choices=sorted(RECIPES), help="the dataset")
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet into, e.g. data/gsm8k")
    parser.add_argument("--source", default=None,
                        help="read it from here instead of the hub: a hub snapshot or save_to_disk directory, or "
                             "another hub name")
    parser.add_argument("--subset", default="recipe",
                        help="the configuration to read (default: the dataset's, e.g. main for gsm8k; none for a "
                             "--source without configurations)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    try:
        written = prepare(args.name, args.out, args.source, args.overwrite,
                          None if args.subset == "none" else args.subset)
    except ConfigError as e:  # prepare-data.path / .subset / .split are --source, --subset and the recipe's splits
        print(f"dsrl: configuration error: {e} (prepare-data.path is --source, prepare-data.subset is --subset)",
              file=sys.stderr)
        return 2
    for split, n in written.items():
        print(f"wrote {os.path.join(args.out, split + '.parquet')} ({n:,} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
