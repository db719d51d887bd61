"""One source of names: the config models, losses, algorithms, tasks and models all use dsrl.config.names."""

from __future__ import annotations

import typing

from dsrl.algos import ESTIMATORS, NORMALIZE_STD_DEFAULT
from dsrl.config import AlgorithmConfig, BatchConfig, DataConfig, ModelConfig, names
from dsrl.core import weights as loss
from dsrl.rl.policy.model import tiny_config
from dsrl.tasks import TASKS


def _choices(model, field):
    ann = model.model_fields[field].annotation
    return {a for arg in typing.get_args(ann) or (ann,) for a in typing.get_args(arg) or (arg,)} - {type(None)}


def test_every_consumer_uses_the_same_names():
    assert set(names.ALGORITHM_DEFAULTS) == set(names.ALGORITHM_NAMES)
    assert set(ESTIMATORS) | set(names.CRITIC_ALGORITHMS) == set(names.ALGORITHM_NAMES)
    assert _choices(AlgorithmConfig, "name") == set(names.ALGORITHM_NAMES)
    assert loss.LOSS_AGG_MODES == names.LOSS_AGG_MODES
    assert _choices(BatchConfig, "loss_agg") == set(names.LOSS_AGG_MODES)
    assert set(names.ALGORITHM_LOSS_AGG.values()) <= set(names.LOSS_AGG_MODES)
    assert NORMALIZE_STD_DEFAULT == {n: names.ALGORITHM_DEFAULTS[n]["normalize_std"] for n in ESTIMATORS}
    assert all(d["ratio_level"] in names.RATIO_LEVELS for d in names.ALGORITHM_DEFAULTS.values())
    assert set(TASKS) == set(names.TASK_NAMES) == _choices(DataConfig, "task")
    assert names.DEFAULT_TASK in TASKS
    assert _choices(ModelConfig, "arch") == set(names.TINY_ARCHS)
    for arch in names.TINY_ARCHS:
        assert tiny_config(arch, 16, 0, 1, 2).vocab_size == 16


def test_test_modules_have_unique_basenames():
    """pytest imports tests/ without packages, by basename: two files of one name stop collection (CI)."""
    import collections
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    names = collections.Counter(p.name for p in root.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
