"""The Megatron engine under launch/train.py, the parts that need no process group:

- ``dsrl.engine``: megatron's sizes belong to kind 'megatron'; context, expert and sequence parallelism are refused,
  all at once, with their reasons;
- the ds_config's optimizer and clipping as megatron-core's (every problem at once);
- dsrl's schedule drives megatron's step through the driver (position restored by a load, not added to);
- the rollout model's weight sync: copied only when the trainer stepped, shared by the backends of one replica,
  and a name it lacks or a parameter never reached is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrl.config import ConfigError, load_config
from dsrl.rollout.base import RolloutBackend
from dsrl.rollout.replica import ReplicaSync, copy_weights

REPO = Path(__file__).resolve().parents[2]
MEGATRON_RUN_FILE = REPO / "configs" / "tiny_grpo_megatron_cpu.json"


def _raw(**engine) -> dict:
    raw = json.loads(MEGATRON_RUN_FILE.read_text())
    raw["dsrl"]["engine"] = engine
    return raw


def test_the_shipped_megatron_run_file_is_the_default_job_on_another_engine():
    megatron, default = _raw(), json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    del megatron["dsrl"]["engine"], megatron["dsrl"]["run"]["output_dir"], default["dsrl"]["run"]["output_dir"]
    del default["zero_optimization"]  # ZeRO is DeepSpeed's
    assert megatron == default
    assert load_config(str(MEGATRON_RUN_FILE)).dsrl.engine.tensor_model_parallel_size == 2


def test_the_engine_section_refuses_what_it_cannot_lay_out_all_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(_raw(kind="megatron", context_parallel_size=2, expert_model_parallel_size=2,
                         sequence_parallel=True))  # with tensor_model_parallel_size = 1: nothing to split over
    text = str(e.value)
    assert text.startswith("2 problems:") and "context_parallel_size" not in text  # context parallelism runs
    assert "expert_model_parallel_size = 2" in text and text.count("Fix:") == 2
    assert "sequence_parallel with dsrl.engine.tensor_model_parallel_size = 1" in text
    sp = load_config(_raw(kind="megatron", tensor_model_parallel_size=2, sequence_parallel=True)).dsrl.engine
    assert sp.sequence_parallel and sp.model_parallel_size == 2  # the tensor group splits the positions too
    cp = load_config(_raw(kind="megatron", tensor_model_parallel_size=2, context_parallel_size=2)).dsrl.engine
    assert cp.model_parallel_size == 4
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size set with dsrl.engine.kind = 'deepspeed'"):
        load_config(_raw(tensor_model_parallel_size=2))


def test_megatron_refuses_deepspeeds_own_layouts():
    raw = _raw(kind="megatron")
    raw["zero_optimization"] = {"stage": 3}
    raw["tensor_parallel"] = {"autotp_size": 2}
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert "zero_optimization.stage = 3: ZeRO is DeepSpeed's" in str(e.value)
    assert "tensor_parallel.autotp_size = 2: AutoTP is DeepSpeed's" in str(e.value)


def _settings(ds: dict, bf16: bool = False):
    pytest.importorskip("megatron.core")
    from dsrl.backends.megatron.run_file import optimizer_settings

    return optimizer_settings(ds, bf16=bf16)


def test_the_ds_config_optimizer_becomes_megatrons():
    s = _settings({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
                   "gradient_clipping": 1.0})
    assert (s.optimizer, s.lr, s.betas, s.weight_decay, s.clip_grad) == ("adam", 2e-3, (0.9, 0.95), 0.1, 1.0)
    assert s.decay_every_parameter  # as DeepSpeed's optimizer decays every parameter
    sgd = _settings({"optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}})
    from deepspeed.runtime.config import get_gradient_clipping

    # unset clipping is DeepSpeed's default on both engines (1.0 in DeepSpeed 0.19, so a default of 0 fails)
    assert (sgd.optimizer, sgd.sgd_momentum, sgd.clip_grad) == ("sgd", 0.9, get_gradient_clipping({}))
    assert sgd.clip_grad > 0


def test_what_megatron_cannot_take_is_named_at_once():
    with pytest.raises(ConfigError, match=r"optimizer.type = 'Lamb'.*Adam\(W\) and SGD"):
        _settings({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    with pytest.raises(ConfigError) as e:
        _settings({"optimizer": {"type": "Adam", "params": {"lr": 0, "adam_w_mode": False, "amsgrad": True}},
                   "bf16": {"enabled": True}})
    text = str(e.value)
    assert text.startswith("5 problems:") and "amsgrad" in text and "adam_w_mode = false" in text
    assert "weight_decay is unset" in text  # DeepSpeed's default differs between its CPU and GPU classes
    assert "lr = 0" in text and "bf16.enabled" in text
    with pytest.raises(ConfigError, match='no "optimizer" section'):
        _settings({})


def test_the_precision_follows_the_models_dtype_and_a_section_that_contradicts_it_is_named():
    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    assert _settings({**adamw, "bf16": {"enabled": "auto"}}, bf16=True).bf16  # mixed precision
    assert not _settings({**adamw, "bf16": {"enabled": "auto"}}).bf16  # auto on the CPU: float32
    with pytest.raises(ConfigError) as e:
        _settings({**adamw, "bf16": {"enabled": False}, "fp16": {"enabled": True}}, bf16=True)
    text = str(e.value)
    assert text.startswith("2 problems:") and "fp16.enabled" in text and "dynamic loss scale" in text
    assert "bf16.enabled = false with dsrl.model.dtype bfloat16" in text


def test_dsrls_schedule_drives_megatrons_step_and_resumes_in_place():
    pytest.importorskip("megatron.core")
    from dsrl.backends.deepspeed.schedule import PlannedScheduler, ScheduleSpec
    from dsrl.backends.megatron.schedule import SchedulerDriver
    from dsrl.rl.run.engines import PlannedParamScheduler

    def fresh():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        spec = ScheduleSpec("deepspeed", "WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 10,
                                                            "warmup_min_ratio": 0.1, "cos_min_ratio": 0.1})
        return opt, PlannedScheduler(spec, opt)

    opt, planned = fresh()
    want = []
    for _ in range(10):
        want.append(opt.param_groups[0]["lr"])
        planned.step()
    opt, planned = fresh()
    driver = SchedulerDriver(PlannedParamScheduler(planned))
    got = []
    for k in range(10):
        got.append(opt.param_groups[0]["lr"])
        driver.after_optimizer_step(update_successful=k != 4, global_samples=8)  # step 5 skipped: no advance
    assert got[:5] == want[:5] and got[5:] == want[4:9] and driver.position == 9
    saved = driver.state_dict()
    opt2, planned2 = fresh()
    resumed = SchedulerDriver(PlannedParamScheduler(planned2))
    resumed.load_state_dict(saved)
    resumed.load_state_dict(saved)  # twice: the position is the saved one, not twice it
    assert resumed.position == 9 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


class _Recorder(RolloutBackend):
    def __init__(self):
        self.synced = 0

    def generate(self, prompt_ids, samples_per_prompt, seed):
        return []

    def sync_weights(self):
        self.synced += 1

    def with_sampling(self, rollout_cfg):
        return _Recorder()


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))
    model[1].weight = torch.nn.Parameter(model[0].weight.T.detach().clone())
    return model


def test_the_rollout_model_takes_the_trainers_weights_only_after_a_step():
    replica, trained = _model(), _model()
    streams, steps = [], [0]

    def weights():
        streams.append(1)
        return iter(trained.state_dict().items())

    backend = ReplicaSync(_Recorder(), replica, weights, lambda: steps[0])
    backend.sync_weights()
    assert all(torch.equal(a, b) for a, b in zip(replica.state_dict().values(), trained.state_dict().values()))
    evaluation = backend.with_sampling(None)  # an evaluation's backend shares the replica and its sync
    evaluation.sync_weights()
    backend.sync_weights()
    assert len(streams) == 1 and backend.inner.synced == 2  # the inner backend is told every time
    timing = backend.take_timing()
    assert timing["weight_sync_bytes"] == sum(t.numel() * 4 for t in trained.state_dict().values())
    steps[0] = 1
    evaluation.sync_weights()
    assert len(streams) == 2


def test_a_weight_the_rollout_model_lacks_or_never_gets_is_named():
    replica, trained = _model(), _model()
    state = trained.state_dict()
    with pytest.raises(KeyError, match="'head.weight' has no counterpart"):
        copy_weights(replica, iter([("head.weight", state["0.weight"])]))
    partial = {k: v for k, v in state.items() if k != "1.bias"}
    with pytest.raises(RuntimeError, match=r"never reached 1 parameters of the rollout model \(1.bias\)"):
        copy_weights(replica, iter(partial.items()))
    with pytest.raises(ValueError, match=r"'0.bias' has shape \(3,\), the rollout model's \(4,\)"):
        copy_weights(replica, iter([("0.bias", torch.zeros(3))]))


def test_the_plan_counts_megatron_replicas_refuses_what_the_engine_cannot_run_and_takes_the_models_dtype():
    pytest.importorskip("megatron.core")
    from dsrl.cli.main import build_plan_report
    from dsrl.rl.run.engines import prepare_engine

    cfg = load_config(str(MEGATRON_RUN_FILE))
    plan, extra = build_plan_report(cfg, 4, 512, on_gpu=False)
    assert plan.data_parallel_size == 2 and extra["engine"] == "megatron"
    assert extra["tensor_model_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"2 ranks per model replica does not divide the job's 3 ranks"):
        prepare_engine(cfg, 3, 512, gpu=False)
    assert not prepare_engine(cfg, 2, 512, gpu=False).settings.bf16  # auto on the CPU: float32
    bf16 = load_config(str(MEGATRON_RUN_FILE), {"dsrl.model.dtype": "bfloat16"})
    assert prepare_engine(bf16, 2, 512, gpu=False).settings.bf16  # megatron-core's mixed precision


def test_dsrl_check_on_megatron_names_its_model_and_its_entry_without_cuda(monkeypatch):
    import sys

    from dsrl.cli.check_engine_megatron import megatron_model_for, require_shim_without_cuda

    assert megatron_model_for("auto") == "llama"
    with pytest.raises(ValueError, match=r"--model 'tiny' with dsrl.engine.kind = 'megatron'.*Fix: --model llama"):
        megatron_model_for("tiny")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delitem(sys.modules, "megatron_cpu_shim", raising=False)
    with pytest.raises(SystemExit, match=r"needs megatron-core's CPU shim. Fix: run `deepspeed launch/check.py"):
        require_shim_without_cuda()


def test_the_documented_sequence_parallel_spec_runs_as_written():
    """docs/megatron.md's snippet of sequence_parallel_spec, executed as written: a block spec whose norms (and final
    norm) are dsrl's, for a user's own GPTModel without Transformer Engine."""
    pytest.importorskip("megatron.core")
    import re

    doc = (REPO / "docs" / "megatron.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "sequence_parallel_spec(" in b]
    scope: dict = {}
    exec(block, scope)  # noqa: S102 - the documentation's own code
    spec = scope["spec"]
    assert len(spec.layer_specs) == 2 and spec.layer_norm.__name__ == "SequenceParallelNorm"
