"""dsrl.memory.offload_states where DeepSpeed 0.19.8 cannot offload: each refusal before any work, with DeepSpeed's
reason and the fix (ZeRO-0 by a support rule; ZeRO-1 with bf16 and fp32 accumulation, ZeRO-3 with offloaded
parameters by the DeepSpeed half's validation); and what is not refused: ZeRO-3 with any optimizer (dsrl moves its
master weights and optimizer states itself), with the same optimizer as the run without the offload (on the CPU
torch's AdamW: a run's numbers must not depend on the setting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrl.backends.deepspeed.engine import prepare
from dsrl.backends.deepspeed.offload import offload_refusal
from dsrl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def _raw(stage: int, **optimizer: object) -> dict:
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["zero_optimization"] = {"stage": stage}
    raw["optimizer"]["params"].update(optimizer)
    raw["dsrl"]["memory"] = {"offload_states": True}
    return raw


def test_zero0_is_refused_with_deepspeeds_reason():
    with pytest.raises(ConfigError, match=r"offload_states with zero_optimization.stage 0 .*: .*ZeRO-0 has none.*Fix"):
        load_config(_raw(0))


def test_zero3_offload_keeps_the_optimizer_of_the_run_without_it():
    for stage in (2, 3):
        on = prepare(load_config(_raw(stage)), world_size=2, on_gpu=False).ds_config
        off = json.loads(json.dumps(_raw(stage)))
        off["dsrl"]["memory"] = {"offload_states": False}
        assert on["optimizer"] == prepare(load_config(off), world_size=2, on_gpu=False).ds_config["optimizer"]
        assert on["optimizer"]["params"]["torch_adam"]  # torch's AdamW either way: no kernel to build
    prepare(load_config(_raw(3, torch_adam=True)), world_size=2, on_gpu=False)  # not refused


def test_what_deepspeed_cannot_offload_is_named():
    bf16 = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
            "optimizer": {"type": "AdamW", "params": {}}}
    assert "BF16_Optimizer, which has no offload_states" in offload_refusal(bf16)
    assert offload_refusal({**bf16, "zero_optimization": {"stage": 2}}) is None
    assert offload_refusal({**bf16, "data_types": {"grad_accum_dtype": "bf16"}}) is None
    z3 = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {}}}
    assert offload_refusal(z3) is None
    for optimizer in ({"type": "AdamW", "params": {"amsgrad": True}}, {"type": "AdamW", "params": {"torch_adam": True}},
                      {"type": "SGD", "params": {}}):
        assert offload_refusal({**z3, "optimizer": optimizer}) is None  # dsrl moves any optimizer's states
    param = {**z3, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert "not supported for offloaded parameters" in offload_refusal(param)
    host = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "SGD", "params": {}}}
    assert offload_refusal(host) is None  # DeepSpeed keeps optimizer states on the host itself
