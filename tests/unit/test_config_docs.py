"""docs/configuration.md documents every "dsrl" key and is regenerated from the code."""

from __future__ import annotations

import dataclasses

from conftest import REPO

from dsrl.config import DsrlConfig
from dsrl.config_docs import render


def test_configuration_reference_is_current():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == render(), "docs/configuration.md is stale: run python -m dsrl.config_docs docs/configuration.md"
    for section in dataclasses.fields(DsrlConfig):
        assert f"## `dsrl.{section.name}`" in text
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                    type(getattr(DsrlConfig(), section.name))):
            assert f"| `{f.name}` |" in text, (section.name, f.name)
            assert f.metadata.get("doc"), f"dsrl.{section.name}.{f.name} has no description"
