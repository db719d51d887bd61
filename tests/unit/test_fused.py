"""apex is optional: dsrl swaps in apex's FusedAdam only when every condition holds, else DeepSpeed's path runs
unchanged (dsrl.backends.deepspeed.apex)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dsrl.backends.deepspeed import apex as fused

DS = {"zero_optimization": {"stage": 2},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}}}


class FakeFusedAdam(torch.optim.Optimizer):
    """Stands in for apex.optimizers.FusedAdam: records its arguments."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode, self.bias_correction = adam_w_mode, bias_correction


@pytest.fixture
def fake_apex(monkeypatch):
    """An importable apex whose CUDA extension is (or is not) available."""
    applier = types.SimpleNamespace(available=True)
    apex = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = FakeFusedAdam
    mta = types.ModuleType("apex.multi_tensor_apply")
    mta.multi_tensor_applier = applier
    apex.optimizers, apex.multi_tensor_apply = optimizers, mta
    for name, mod in (("apex", apex), ("apex.optimizers", optimizers), ("apex.multi_tensor_apply", mta)):
        monkeypatch.setitem(sys.modules, name, mod)
    return applier


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_without_apex_deepspeed_path_is_unchanged(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # import apex -> ImportError
    assert fused.apex_fused_adam() is None
    opt, ds = fused.apex_adam_for(DS, params(), "auto", on_gpu=True)
    assert opt is None and ds is DS
    assert "not importable" in fused.apex_adam_reason(DS, "auto", True, None)


def test_apex_fused_adam_takes_the_ds_config_hyperparameters(fake_apex):
    opt, ds = fused.apex_adam_for(DS, params(), "auto", on_gpu=True)
    assert isinstance(opt, FakeFusedAdam) and opt.adam_w_mode
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)
    assert "optimizer" not in ds and ds["zero_optimization"] == DS["zero_optimization"]
    assert "optimizer" in DS  # the caller's dict is not modified
    adam = {**DS, "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}}}
    assert not fused.apex_adam_for(adam, params(), "auto", on_gpu=True)[0].adam_w_mode


@pytest.mark.parametrize("change, reason", [
    ({"setting": "off"}, "'off'"),
    ({"on_gpu": False}, "not on a GPU"),
    ({"client": True}, "client optimizer"),
    ({"ds": {**DS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}}, "not Adam/AdamW"),
    ({"ds": {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}}}, "torch_adam"),
    ({"ds": {**DS, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}}, "offloaded"),
    ({"no_extension": True}, "not importable"),
])
def test_each_condition_keeps_deepspeeds_optimizer(fake_apex, change, reason):
    if change.get("no_extension"):
        fake_apex.available = False
    ds = change.get("ds", DS)
    client = torch.optim.SGD(params(), lr=0.1) if change.get("client") else None
    args = (ds, change.get("setting", "auto"), change.get("on_gpu", True), client)
    assert reason in fused.apex_adam_reason(*args)
    opt, out = fused.apex_adam_for(ds, params(), args[1], args[2], client)
    assert opt is None and out is ds
