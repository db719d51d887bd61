"""The rules of dsrl.config.support and the matrix of dsrl.config.matrix, without processes.

- every rule refuses its own smallest run through the configuration's validation (load_config), with its sentence,
  and a run file breaking several rules gets every sentence in one error;
- every sentence names the settings its condition reads and the fix (so the docs, rendered from the condition,
  and the sentence cannot disagree about what is refused);
- each axis value means what it says: the Setup the rules read back from a cell's run file is the cell's own;
- the matrices are pairwise: every pair of values of two axes is in some cell, every pair an allowed cell can
  hold is in a running cell, every rule the matrix can reach has a cell it alone refuses, and the choice is
  deterministic;
- docs/support.md is the rendered file;
- each guard fails on a planted bug (a dropped cell, a rule whose sentence misses a setting, a rule whose
  predicate no longer matches the docs).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import REPO

from dsrl.config import ConfigError, load_config, support
from dsrl.config import matrix as matrix_module
from dsrl.config.matrix import CPU_MATRIX, MATRICES, VLLM_MATRIX, Matrix, apply_patch, missing_pairs, render
from dsrl.config.root import DsrlConfig
from dsrl.config.support import RULES, AtLeast, Is, Rule, Setup

BASE = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())


def _base() -> dict:
    raw = json.loads(json.dumps(BASE))
    raw.pop("scheduler")
    raw["dsrl"]["batch"].update(prompts_per_rollout=4, samples_per_prompt=4, mini_batch_size=8)
    raw["dsrl"]["sft"] = {"steps": 0}
    return raw


def _run_file(setup: Setup) -> dict:
    """A run file with exactly these features (the matrix's patches, plus the features no axis carries)."""
    features = dataclasses.asdict(setup)
    values = []
    for axis in CPU_MATRIX.axes + VLLM_MATRIX.axes:
        values += [v for v in axis.values if all(features[k] == x for k, x in v.setup.items())][:1]
    raw = _base()
    for value in values:
        raw = apply_patch(raw, value.patch)
    if setup.expert_parallel:
        raw["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    if setup.dynamic_sampling:
        raw["dsrl"]["algorithm"]["dynamic_sampling"] = True
    raw["dsrl"]["algorithm"]["name"] = setup.algorithm
    if setup.sequence_parallel_size > 1:
        raw["sequence_parallel_size"] = setup.sequence_parallel_size
    if setup.max_staleness:  # colocated with k > 0: no placement value of the matrix has it
        raw["dsrl"]["algorithm"]["max_staleness"] = setup.max_staleness
    raw["dsrl"].setdefault("model", {})["routing_replay"] = setup.routing_replay
    if setup.router_aux_loss:
        raw["dsrl"]["model"]["router_aux_loss_coef"] = 0.01
    if setup.offload_states:
        raw["dsrl"]["memory"] = {"offload_states": True}
    if setup.share_prompts:
        raw["dsrl"]["model"]["share_prompts"] = True
    if setup.engine != "deepspeed":
        raw["dsrl"]["engine"] = {"kind": setup.engine}
    return raw


def _setup_of(raw: dict) -> Setup:
    """The features the rules read from a run file (its "dsrl" section validated without the combination rules)."""
    return Setup.of(DsrlConfig(**raw["dsrl"]), {k: v for k, v in raw.items() if k != "dsrl"})


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_each_rule_refuses_its_smallest_run_with_its_sentence(rule):
    setup = rule.example()
    assert rule.applies(setup) and support.refusals(setup) == [rule]
    raw = _run_file(setup)
    assert _setup_of(raw) == setup
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert str(e.value) == rule.message(setup)


def test_every_refusal_of_a_run_file_is_reported_at_once():
    setup = Setup(placement="disaggregated", max_staleness=1, lora=True, multi_turn=True, autotp_size=2,
                  backend="vllm", expert_parallel=True)
    broken = support.refusals(setup)
    assert [r.name for r in broken] == ["multi-turn-disaggregated", "autotp-disaggregated", "autotp-vllm",
                                        "autotp-lora", "autoep-lora", "autoep-vllm", "autoep-disaggregated"]
    with pytest.raises(ConfigError) as e:
        load_config(_run_file(setup))
    text = str(e.value)
    assert text.startswith("7 problems:\n") and all(r.message(setup) in text for r in broken), text


def _sentence_problems(rule: Rule) -> list[str]:
    """What is wrong with a rule's sentence: a setting of its condition it does not name, no fix, not one line."""
    text = rule.message(rule.example())
    problems = [f"does not name {Setup.setting(f)}" for f in rule.when if Setup.setting(f) not in text]
    if "Fix: " not in text or not text.endswith(".") or "\n" in text:
        problems.append("no 'Fix: ...' sentence")
    return problems


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_each_sentence_names_its_settings_and_the_fix(rule):
    assert _sentence_problems(rule) == []
    assert re.fullmatch(r"[a-z0-9-]+", rule.name) and [r.name for r in RULES].count(rule.name) == 1


def test_planted_sentence_that_misses_a_setting_is_caught():
    rule = next(r for r in RULES if r.name == "autotp-lora")
    planted = dataclasses.replace(rule, when={**rule.when, "zero_stage": Is(3)})  # the predicate grew, the text not
    assert _sentence_problems(planted) == ["does not name zero_optimization.stage"]


@pytest.mark.parametrize("matrix", MATRICES, ids=[m.name for m in MATRICES])
def test_each_cell_run_file_has_the_cell_setup(matrix):
    for cell in matrix.cells():
        assert _setup_of(cell.run_file(_base())) == cell.setup, cell.name
        if cell.runs:
            load_config(cell.run_file(_base()))
        else:
            with pytest.raises(ConfigError) as e:
                load_config(cell.run_file(_base()))
            assert all(r.message(cell.setup) in str(e.value) for r in cell.refusals), (cell.name, str(e.value))


def _coverage_problems(matrix: Matrix, cells: list) -> list[str]:
    problems = []
    if missing_pairs(matrix.axes, cells):
        problems.append(f"pairs in no cell: {sorted(missing_pairs(matrix.axes, cells))}")
    if missing_pairs(matrix.axes, cells, runnable_only=True):
        problems.append(f"allowed pairs in no running cell: {sorted(missing_pairs(matrix.axes, cells, True))}")
    reachable = {r for c in matrix.product() if len(c.refusals) == 1 for r in c.refusals}
    alone = {r for c in cells if len(c.refusals) == 1 for r in c.refusals}
    if reachable - alone:
        problems.append(f"rules with no cell of their own: {sorted(r.name for r in reachable - alone)}")
    return problems


@pytest.mark.parametrize("matrix", MATRICES, ids=[m.name for m in MATRICES])
def test_the_matrix_is_pairwise_and_deterministic(matrix):
    cells = matrix.cells()
    assert _coverage_problems(matrix, cells) == []
    assert [c.index for c in cells] == [c.index for c in matrix.cells()]
    assert len({c.index for c in cells}) == len(cells)
    running = [c for c in cells if c.runs]
    assert len(running) <= len([c for c in matrix.product() if c.runs]) / 4  # the point: far fewer than the product


def test_cpu_matrix_size():
    """13 running cells: at least 12 (3 placements x 4 ZeRO stages); the test's time budget is sized on it."""
    assert sum(c.runs for c in CPU_MATRIX.cells()) == 13


def test_planted_dropped_cell_breaks_coverage():
    cells = CPU_MATRIX.cells()
    for i, cell in enumerate(cells):
        assert _coverage_problems(CPU_MATRIX, cells[:i] + cells[i + 1:]), f"cell {cell.name} is redundant"


def test_support_docs_are_current():
    text = (REPO / "docs" / "support.md").read_text(encoding="utf-8")
    assert text == render(), "docs/support.md is stale: run python -m dsrl.config.matrix docs/support.md"
    for rule in RULES:
        assert f"| `{rule.name}` | {rule.condition()} | {rule.message(rule.example())} |" in text


def test_planted_rule_whose_predicate_and_docs_disagree_is_caught(monkeypatch):
    """A predicate changed without regenerating the docs: the staleness check fails (the condition the docs show
    is rendered from the predicate's own data)."""
    rule = next(r for r in RULES if r.name == "autotp-disaggregated")
    planted = dataclasses.replace(rule, when={**rule.when, "autotp_size": AtLeast(4)})
    rules = tuple(planted if r is rule else r for r in RULES)
    monkeypatch.setattr(matrix_module, "RULES", rules)
    text = (REPO / "docs" / "support.md").read_text(encoding="utf-8")
    assert render() != text
    assert "`tensor_parallel.autotp_size` >= 4" in render() and "`tensor_parallel.autotp_size` >= 4" not in text
