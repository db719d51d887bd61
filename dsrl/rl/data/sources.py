"""Where a dataset's rows come from: one reader for every form users hold a dataset in, offline.

A :class:`DatasetSource` is ``(path, subset, split)`` plus the config field that names it (``dsrl.data`` for the
training prompts; an evaluation section names its own). ``path`` is, in the order tried:

- a **file** ``.jsonl`` / ``.json`` / ``.parquet``: one split, ``train``;
- a **saved dataset**, a directory ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote
  (``state.json`` / ``dataset_dict.json``): ``datasets.load_from_disk``, the split picked from a DatasetDict;
- a **directory of data files**, e.g. a hub snapshot (``data/train-00000-of-00001.parquet``,
  ``main/test-*.parquet``): ``datasets.load_dataset(path)``, splits from the file names; ``subset`` is a
  configuration of its README, else a sub-folder (``main``); a directory whose sub-folders hold several
  configurations and no README that names them must be given a ``subset`` (else their rows would be mixed);
- a **hub dataset name** (``openai/gsm8k``): ``datasets.load_dataset(name, subset, split=split)``, which without a
  network (``HF_DATASETS_OFFLINE=1``, or none at all) reads what an earlier load left in the local cache.

Every failure is one :class:`dsrl.config.ConfigError` naming the field, the value and the fix. :func:`read_rows`
reads, :func:`column_names` and :func:`split_names` look without keeping the rows in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from dsrl.config import ConfigError, DataConfig
from dsrl.config.data import is_hub_name
from dsrl.config.names import PROMPT_FILE_FORMATS

Kind = Literal["file", "saved", "directory", "hub"]
SINGLE_SPLIT = "train"


@dataclass(frozen=True)
class DatasetSource:
    """A dataset and the part of it to read; ``field`` is the config section that named it (for messages)."""

    path: str
    subset: str | None = None
    split: str = SINGLE_SPLIT
    field: str = "dsrl.data"

    @classmethod
    def of(cls, data_cfg: DataConfig, split: str | None = None) -> DatasetSource:
        """The training prompts' source (``data.path``/``subset``/``split``), or another split of it."""
        if data_cfg.path is None:
            raise ValueError("DatasetSource.of: data.path is unset (prompts come from a built-in task)")
        return cls(data_cfg.path, data_cfg.subset, split or data_cfg.split, DataConfig.PATH)

    def describe(self) -> str:
        """``dsrl.data.path = 'x'`` plus the subset and split where they matter."""
        parts = [f"{self.field}.path = {self.path!r}"]
        if self.subset:
            parts.append(f"subset {self.subset!r}")
        if self.kind() != "file":
            parts.append(f"split {self.split!r}")
        return ", ".join(parts)

    def kind(self) -> Kind:
        """Which reader applies (module docstring); a path that is none of them is a ConfigError."""
        if os.path.isfile(self.path):
            return "file"
        if os.path.isdir(self.path):
            saved = ("state.json", "dataset_dict.json")
            return "saved" if any(os.path.isfile(os.path.join(self.path, f)) for f in saved) else "directory"
        if is_hub_name(self.path) and os.path.splitext(self.path)[1].lower() not in PROMPT_FILE_FORMATS:
            return "hub"
        raise ConfigError(f"{self.field}.path = {self.path!r}: no such file or directory (working directory "
                          f"{os.getcwd()}). Fix: give the path of a prompts file or dataset directory, or a hub "
                          "dataset name such as openai/gsm8k.")


@contextlib.contextmanager
def _quiet_datasets(progress: bool = False):
    """datasets' cache notices (and, unless ``progress``, its progress bars) off while dsrl reads."""
    import datasets

    was = datasets.utils.logging.get_verbosity()
    bars = datasets.utils.is_progress_bar_enabled()
    datasets.utils.logging.set_verbosity(logging.ERROR)
    if not progress:
        datasets.utils.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.utils.logging.set_verbosity(was)
        if bars:
            datasets.utils.enable_progress_bars()


def _subset_dirs(path: str) -> list[str]:
    """The sub-folders of a data-file directory that each hold data files of their own (candidate subsets)."""
    out = []
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if os.path.isdir(sub) and not name.startswith((".", "_")):
            for _, _, files in os.walk(sub):
                if any(os.path.splitext(f)[1].lower() in (*PROMPT_FILE_FORMATS, ".csv", ".arrow") for f in files):
                    out.append(name)
                    break
    return out


def _load_args(source: DatasetSource, ds: Any) -> dict[str, Any]:
    """``datasets.load_dataset`` arguments for a directory of data files or a hub name (module docstring)."""
    if source.kind() == "hub":
        return {"path": source.path, "name": source.subset}
    configs = ds.get_dataset_config_names(source.path)
    if source.subset is None:
        subsets = _subset_dirs(source.path)
        if configs == ["default"] and len(subsets) > 1:
            raise ConfigError(
                f"{source.field}.subset is unset but {source.field}.path = {source.path!r} holds the sub-folders "
                f"{', '.join(subsets)}, each a configuration of its own, and no README names them; reading it whole "
                f"would mix their rows. Fix: set {source.field}.subset to one of them.")
        return {"path": source.path}
    if source.subset in configs:
        return {"path": source.path, "name": source.subset}
    if os.path.isdir(os.path.join(source.path, source.subset)):
        return {"path": source.path, "data_dir": source.subset}
    known = [c for c in configs if c != "default"] + _subset_dirs(source.path)
    raise ConfigError(
        f"{source.field}.subset = {source.subset!r}: {source.path!r} has no such configuration or sub-folder "
        f"(it has: {', '.join(known) or 'none, only its top level'}). Fix: set {source.field}.subset to one of "
        f"them{', or remove it' if not known else ''}.")


def _read_file(source: DatasetSource, ds: Any) -> Any:
    ext = os.path.splitext(source.path)[1].lower()
    if ext not in PROMPT_FILE_FORMATS:
        raise ConfigError(f"{source.field}.path = {source.path!r}: unsupported file type {ext or '(none)'!r}. Fix: use "
                          f"one of {', '.join(PROMPT_FILE_FORMATS)}, or a dataset directory.")
    if source.split != SINGLE_SPLIT or source.subset:
        key = "split" if source.split != SINGLE_SPLIT else "subset"
        value = source.split if key == "split" else source.subset
        raise ConfigError(
            f"{source.field}.{key} = {value!r} but {source.field}.path = {source.path!r} is a single file, which "
            f"holds one split ({SINGLE_SPLIT!r}) and no subsets. Fix: point {source.field}.path at the file or "
            f"directory that holds it, or remove {source.field}.{key}.")
    builder = PROMPT_FILE_FORMATS[ext]
    try:
        return ds.load_dataset(builder, data_files=os.path.abspath(source.path), split="train")
    except Exception as e:  # datasets raises many types; all are reported against the field
        raise ConfigError(f"{source.field}.path = {source.path!r}: cannot read it as {builder}: {e}") from e


def _read_saved(source: DatasetSource, ds: Any) -> Any:
    try:
        saved = ds.load_from_disk(source.path)
    except Exception as e:
        raise ConfigError(f"{source.field}.path = {source.path!r}: cannot read the saved dataset: {e}") from e
    if isinstance(saved, ds.DatasetDict):
        if source.split not in saved:
            raise _no_split(source, list(saved))
        return saved[source.split]
    if source.split != SINGLE_SPLIT:
        raise _no_split(source, [SINGLE_SPLIT])
    return saved


def _no_split(source: DatasetSource, splits: list[str]) -> ConfigError:
    return ConfigError(f"{source.field}.split = {source.split!r}: {source.describe()} has no such split (it has "
                       f"{', '.join(splits) or 'none'}). Fix: set {source.field}.split to one of them.")


def _load_error(source: DatasetSource, e: Exception) -> ConfigError:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    if source.kind() != "hub":
        return ConfigError(f"{source.describe()}: cannot read it: {text}")
    local = f"there is no local file or directory {source.path!r} (working directory {os.getcwd()}), and "
    if isinstance(e, (ConnectionError, FileNotFoundError)):
        return ConfigError(
            f"{source.describe()}: {local}as a hub dataset it is not in the local Hugging Face cache and the hub "
            f"cannot be reached ({text}). Fix: give the path of local files, or load the dataset once where a network "
            "exists (the same run, or `dsrl prepare-data` for the datasets it knows) or copy that cache "
            "(HF_DATASETS_CACHE) here.")
    return ConfigError(f"{source.describe()}: {local}reading it as a hub dataset failed: {text}")


def read_rows(source: DatasetSource, progress: bool = False) -> Any:
    """The rows of ``source`` as a ``datasets.Dataset`` (memory-mapped Arrow, nothing held twice); ``progress``
    shows datasets' download and preparation bars."""
    kind = source.kind()
    with _quiet_datasets(progress) as ds:
        if kind == "file":
            return _read_file(source, ds)
        if kind == "saved":
            return _read_saved(source, ds)
        args = _load_args(source, ds)
        try:
            return ds.load_dataset(**args, split=source.split)
        except ValueError as e:
            if "split" in str(e).lower():
                splits = split_names(source)
                if splits and source.split not in splits:
                    raise _no_split(source, splits) from None
            raise _load_error(source, e) from e
        except Exception as e:  # noqa: BLE001 - datasets raises many types; each becomes one sentence
            raise _load_error(source, e) from e


def split_names(source: DatasetSource) -> list[str]:
    """The splits ``source.path`` (and ``subset``) holds, e.g. ``["train", "test"]``: what an evaluation can ask for;
    a single file or a saved Dataset holds ``["train"]``."""
    kind = source.kind()
    with _quiet_datasets() as ds:
        if kind == "file":
            return [SINGLE_SPLIT]
        if kind == "saved":
            saved = os.path.isfile(os.path.join(source.path, "dataset_dict.json"))
            return list(ds.load_from_disk(source.path)) if saved else [SINGLE_SPLIT]
        args = _load_args(source, ds)
        try:
            builder = ds.load_dataset_builder(**args)
        except Exception as e:  # noqa: BLE001
            raise _load_error(source, e) from e
        if builder.info.splits:
            return list(builder.info.splits)
        return [str(s) for s in (builder.config.data_files or {})]


def column_names(source: DatasetSource) -> list[str]:
    """The columns of ``source``'s rows."""
    return list(read_rows(source).column_names)
