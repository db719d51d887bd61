"""Disaggregated generation without processes: the layouts that cannot work fail before work naming the field,
`dsrl plan` shows both roles and the trainer side's D, the staleness default, and the wire formats are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrl.cli.main import build_plan_report
from dsrl.config import ConfigError, load_config
from dsrl.rl.disagg.remote import replica_owner
from dsrl.rl.disagg.wire import WeightLayout, decode_completions, encode_completions
from dsrl.rollout.base import Completion

CONFIG = json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_async_cpu.json").read_text())


def _cfg(**rollout):
    raw = json.loads(json.dumps(CONFIG))
    raw["dsrl"]["rollout"].update(rollout)
    return load_config(raw)


def test_plan_splits_the_world_and_counts_trainers_only():
    plan, extra = build_plan_report(_cfg(), world_size=3, dataset_size=None, on_gpu=False)
    assert (extra["trainer_ranks"], extra["generator_ranks"], plan.data_parallel_size) == (2, 1, 2)
    assert plan.placement == "disaggregated" and plan.max_staleness == 1
    rows = dict(plan.describe())
    assert rows["placement"].startswith("disaggregated: 1 generator rank(s)") and "k = 1" in rows["placement"]
    assert rows["data-parallel size D"] == "2 (trainer ranks)"
    plan4, _ = build_plan_report(_cfg(generator_ranks=2), world_size=6, dataset_size=None, on_gpu=False)
    assert plan4.data_parallel_size == 4 and plan4.generator_ranks == 2


def test_layouts_that_cannot_work_fail_naming_the_field():
    with pytest.raises(ConfigError, match=r"dsrl.rollout.generator_ranks = 3 leaves no trainer among the job's 3"):
        build_plan_report(_cfg(generator_ranks=3), world_size=3, dataset_size=None, on_gpu=False)
    raw = json.loads(json.dumps(CONFIG))
    raw["dsrl"]["rollout"]["generator_ranks"] = 2
    raw["dsrl"]["batch"].update(prompts_per_rollout=18, mini_batch_size=144)
    with pytest.raises(ConfigError, match=r"generator_ranks = 2 does not divide the trainer side's 3 data-parallel"):
        build_plan_report(load_config(raw), world_size=5, dataset_size=None, on_gpu=False)
    with pytest.raises(ConfigError, match=r"dsrl.rollout.placement = 'disaggregated' needs dsrl.rollout.generator_"):
        _cfg(generator_ranks=0)
    raw = json.loads(json.dumps(CONFIG))
    raw["dsrl"]["algorithm"]["name"] = "dapo"
    with pytest.raises(ConfigError, match=r"dynamic_sampling is on \(dapo's default\) with rollout.placement"):
        load_config(raw)
    raw["dsrl"]["algorithm"]["dynamic_sampling"] = False
    assert load_config(raw).dsrl.max_staleness == 1
    raw = json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["algorithm"]["max_staleness"] = 1
    with pytest.raises(ConfigError, match=r"max_staleness = 1 with rollout.placement 'colocated'"):
        load_config(raw)


def test_replicas_are_split_into_contiguous_blocks_per_generator():
    assert [replica_owner(d, 4, 2) for d in range(4)] == [0, 0, 1, 1]
    assert [replica_owner(d, 4, 1) for d in range(4)] == [0] * 4


@pytest.mark.parametrize("bound", [16, 40, 100, 2**20])
def test_weights_and_completions_cross_bit_for_bit(bound):
    """Every bucket bound (16 bytes: every tensor split over buckets; 1 MiB: one bucket) carries the weights bit for
    bit, in buckets no larger than the bound, through two staging buffers (bucket i reuses bucket i - 2's)."""
    state = {"a": torch.randn(3, 4), "tied.a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16),
             "n": torch.arange(3)}
    layout = WeightLayout.from_json(json.loads(json.dumps(WeightLayout.of(state, bound).to_json())))
    assert layout.bucket_bytes == bound and max(layout.bucket_sizes()) <= bound
    assert (len(layout.buckets) > 4) == (bound == 16) and (len(layout.buckets) == 1) == (bound == 2**20)
    staging = layout.staging()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    for i in range(len(layout.buckets)):
        sent = layout.pack(state, i, staging[i % 2])
        assert sent.numel() == layout.bucket_sizes()[i]
        layout.unpack(staging[i % 2], i, target)
    assert all(torch.equal(target[k], state[k]) for k in state)
    with pytest.raises(RuntimeError, match="has no tensor 'n' of the trainer's policy"):
        layout.unpack(staging[0], 0, {k: v for k, v in target.items() if k != "n"})
    cs = [Completion(0, [1, 2], [5, 6, 2], True, [-0.1234567, -1e-30, -3.0], version=7),
          Completion(1, [1], [], False, [], version=None)]
    back = decode_completions(encode_completions(cs))
    assert back == cs and back[0].behavior_logprobs == cs[0].behavior_logprobs


def test_autotp_trainers_are_refused_naming_the_fix():
    raw = json.loads((Path(__file__).parents[2] / "configs" / "tiny_grpo_autotp_cpu.json").read_text())
    raw["dsrl"]["rollout"].update(placement="disaggregated", generator_ranks=1)
    with pytest.raises(ConfigError, match=r"placement = 'disaggregated' with tensor_parallel.autotp_size = 2.*Fix"):
        build_plan_report(load_config(raw), world_size=5, dataset_size=None, on_gpu=False)
