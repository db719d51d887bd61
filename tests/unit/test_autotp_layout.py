"""AutoTP / AutoEP layout rules without a process group: D from the ds_config, the tensor_parallel section
DeepSpeed sees, who holds which data (dsrl.rl.data.replica), the AutoEP compatibility fix, `dsrl plan`."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from dsrl.backends.deepspeed.autoep import check_expert_layout, ensure_transformers_compat, expert_parallel_size
from dsrl.backends.deepspeed.autotp import data_parallel_replicas, resolve_section, tensor_parallel_size
from dsrl.backends.deepspeed.config import data_parallel_size
from dsrl.cli.main import build_plan_report
from dsrl.config import ConfigError, load_config
from dsrl.core.parallel import ParallelView
from dsrl.rl.data.replica import is_source, my_part, share_with_tensor_peers


@pytest.mark.parametrize("ds,world,want", [
    ({}, 4, 4),
    ({"tensor_parallel": {"autotp_size": 0}}, 4, 4),
    ({"tensor_parallel": {"autotp_size": 1}}, 4, 4),
    ({"tensor_parallel": {"autotp_size": 2}}, 4, 2),
    ({"tensor_parallel": {"autotp_size": 4}}, 8, 2),
    ({"sequence_parallel_size": 2}, 8, 4),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, 4),  # experts fold inside the replicas
])
def test_data_parallel_size(ds, world, want):
    assert data_parallel_size(ds, world) == want


@pytest.mark.parametrize("ds,world,field", [
    ({"tensor_parallel": {"autotp_size": 2}}, 3, "tensor_parallel.autotp_size"),
    ({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, 4, "tensor_parallel.autotp_size"),
    ({"tensor_parallel": 2}, 4, "tensor_parallel"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 4}}, 6, "expert_parallel.autoep_size"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 0}}, 4, "expert_parallel.autoep_size"),
])
def test_layout_errors_name_the_field(ds, world, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        data_parallel_size(ds, world)


def test_sizes_and_disabled_expert_parallelism():
    assert tensor_parallel_size({"tensor_parallel": {"autotp_size": 2}}) == 2
    assert data_parallel_replicas({"tensor_parallel": {"autotp_size": 2}}, 6) == 3
    assert expert_parallel_size({"expert_parallel": {"enabled": False, "autoep_size": 3}}) == 1
    check_expert_layout({"expert_parallel": {"enabled": False, "autoep_size": 3}}, 4)  # off: no rule


def test_resolved_section_keeps_full_vocabulary_logits():
    ds = {"tensor_parallel": {"autotp_size": 2}}
    resolve_section(ds)
    assert ds["tensor_parallel"]["vocab_parallel_lm_head"] is False
    off = {"tensor_parallel": {"autotp_size": 1}}
    resolve_section(off)
    assert "vocab_parallel_lm_head" not in off["tensor_parallel"]  # untouched without tensor parallelism
    with pytest.raises(ConfigError, match="vocab_parallel_lm_head"):
        resolve_section({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": None}})


def _view(replica: int, tp_rank: int, replicas: int = 2) -> ParallelView:
    return ParallelView(count_group=None, grad_scale=float(replicas), data_parallel_size=replicas,
                        data_parallel_rank=replica, tensor_parallel_size=2, tensor_parallel_rank=tp_rank)


def test_replica_data_rules_without_a_process_group():
    parts = [["a", "b"], ["c"]]
    for tp_rank in (0, 1):  # tensor peers of replica 1 take the same part
        assert my_part(_view(1, tp_rank), parts) == ["c"]
    assert is_source(_view(0, 0)) and not is_source(_view(0, 1))
    with pytest.raises(ValueError, match="partitioned into 3 parts"):
        my_part(_view(0, 0), [[], [], []])
    single = ParallelView(count_group=None, grad_scale=1.0, data_parallel_size=1, data_parallel_rank=0)
    assert share_with_tensor_peers(single, lambda: {"x": 1}) == {"x": 1}  # no tensor parallelism: no collective


def test_transformers_registry_accepts_deepspeeds_default_argument():
    output_capturing = pytest.importorskip("transformers.utils.output_capturing")  # transformers 5.x

    registry = output_capturing._CAN_RECORD_REGISTRY
    ensure_transformers_compat()
    sentinel = object()
    assert registry.get("<class 'not.registered.Anywhere'>", sentinel) is sentinel  # DeepSpeed's call
    assert ensure_transformers_compat() is False  # applied once (or never: a plain dict needs no fix)
    if type(registry) is not dict:  # transformers >= 5.23's _CanRecordRegistry; before, a dict keyed by class name
        assert registry.get(object()) == {}  # transformers' own call: a model object, unchanged meaning


def test_plan_reports_tensor_parallelism(tmp_path):
    raw = json.loads((REPO / "configs" / "tiny_grpo_autotp_cpu.json").read_text())
    plan, extra = build_plan_report(load_config(raw), 4, 512, on_gpu=False)
    assert plan.data_parallel_size == 2 and extra["tensor_parallel_size"] == 2 and extra["world_size"] == 4
    plan2, _ = build_plan_report(load_config(raw), 2, 512, on_gpu=False)
    assert plan2.data_parallel_size == 1 and plan2.prompts_per_rank == plan2.prompts_per_rollout
