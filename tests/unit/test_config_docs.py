"""docs/configuration.md documents every "dsrl" key and rule and is regenerated from the config models."""

from __future__ import annotations

from conftest import REPO

from dsrl.config.docs import render, rules
from dsrl.config.names import ALGORITHM_NAMES
from dsrl.config.root import DsrlConfig


def test_configuration_reference_is_current():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == render(), "docs/configuration.md is stale: run python -m dsrl.config.docs docs/configuration.md"
    for name, section in DsrlConfig.model_fields.items():
        model = section.annotation
        assert f"## `dsrl.{name}`" in text
        for key, info in model.model_fields.items():
            assert f"| `{key}` |" in text, (name, key)
            assert info.description, f"dsrl.{name}.{key} has no description"
        for rule in rules(model):
            assert rule in text
    for algo in ALGORITHM_NAMES:
        assert f"| `{algo}` |" in text
