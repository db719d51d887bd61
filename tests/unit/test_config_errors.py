"""Every validation error path: bad input raises ConfigError naming the field (and a fix), before any work."""

from __future__ import annotations

import copy
import json

import pytest

from dsrl.backends.deepspeed.config import resolve_deepspeed_config
from dsrl.backends.deepspeed.schedule import schedule_spec
from dsrl.backends.deepspeed.validation import validated_deepspeed_config
from dsrl.config import ConfigError, load_config, parse_override_args
from dsrl.core.plan import BatchPlan

BASE = {
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "dsrl": {
        "batch": {"prompts_per_rollout": 8, "samples_per_prompt": 4, "mini_batch_size": 16,
                  "micro_batch_size_per_rank": 2},
        "run": {"rollouts": 3},
    },
}


def _cfg(**changes):
    """BASE with dotted-path changes, e.g. {"dsrl.batch.mini_batch_size": 7}; value None deletes."""
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return raw


_DELETE = object()


def _plan(raw, world=2, dataset_size=None):
    cfg = load_config(raw)
    return cfg, BatchPlan.from_config(cfg, world, dataset_size)


# (changes, world size, expected fragments) for errors raised by load_config or BatchPlan.
CONFIG_AND_PLAN_ERRORS = [
    ({"dsrl__batch__prompts_per_rollout": 0}, 2, ["dsrl.batch.prompts_per_rollout", "positive integer"]),
    ({"dsrl__batch__samples_per_prompt": -1}, 2, ["dsrl.batch.samples_per_prompt"]),
    ({"dsrl__batch__mini_batch_size": 0}, 2, ["dsrl.batch.mini_batch_size"]),
    ({"dsrl__batch__epochs_per_rollout": 0}, 2, ["dsrl.batch.epochs_per_rollout"]),
    ({"dsrl__batch__micro_batch_size_per_rank": 0}, 2, ["dsrl.batch.micro_batch_size_per_rank"]),
    ({"dsrl__batch__max_tokens_per_micro_batch": 512}, 2,
     ["micro_batch_size_per_rank", "max_tokens_per_micro_batch", "exactly one"]),
    ({"dsrl__batch__micro_batch_size_per_rank": None}, 2,
     ["micro_batch_size_per_rank", "max_tokens_per_micro_batch", "exactly one"]),
    ({"dsrl__batch__micro_batch_size_per_rank": None, "dsrl__batch__max_tokens_per_micro_batch": -5}, 2,
     ["dsrl.batch.max_tokens_per_micro_batch"]),
    ({"dsrl__batch__loss_agg": "token_mean"}, 2, ["dsrl.batch.loss_agg", "did you mean 'token-mean'"]),
    ({"dsrl__batch__loss_agg_norm_length": 0}, 2, ["dsrl.batch.loss_agg_norm_length"]),
    ({"dsrl__batch__balance_attention_coef": -1.0}, 2, ["dsrl.batch.balance_attention_coef"]),
    ({"dsrl__batch__mini_batch_sise": 4}, 2, ["dsrl.batch.mini_batch_sise", "mini_batch_size"]),
    ({"dsrl__batch__prompts_per_rollout": "8"}, 2, ["dsrl.batch.prompts_per_rollout", "wrong type"]),
    ({"dsrl__batch": [1, 2]}, 2, ["dsrl.batch", "JSON object"]),
    ({"dsrl__run__epochs": 1}, 2, ["dsrl.run", "epochs", "rollouts", "exactly one"]),
    ({"dsrl__run__rollouts": None}, 2, ["dsrl.run", "epochs", "rollouts"]),
    ({"dsrl__run__rollouts": 0}, 2, ["dsrl.run.rollouts"]),
    ({"dsrl__run__rollouts": None, "dsrl__run__epochs": -1}, 2, ["dsrl.run.epochs"]),
    ({"dsrl__run__save_every": -1}, 2, ["dsrl.run.save_every"]),
    ({"dsrl__run__keep_last": 0}, 2, ["dsrl.run.keep_last"]),
    ({"dsrl__run__log_every": 0}, 2, ["dsrl.run.log_every"]),
    ({"dsrl__run__last_rollout": "keep"}, 2, ["dsrl.run.last_rollout"]),
    ({"dsrl__rollout__max_new_tokens": 0}, 2, ["dsrl.rollout.max_new_tokens"]),
    ({"dsrl__rollout__generation_batch_size": 0}, 2, ["dsrl.rollout.generation_batch_size"]),
    ({"dsrl__rollout__logprob_micro_batch_size": 0}, 2, ["dsrl.rollout.logprob_micro_batch_size"]),
    ({"dsrl__rollout__temperature": 0.0}, 2, ["dsrl.rollout.temperature"]),
    ({"dsrl__data__max_prompt_tokens": 0}, 2, ["dsrl.data.max_prompt_tokens"]),
    ({"dsrl__algorithm__clip_low": -0.1}, 2, ["dsrl.algorithm.clip_low"]),
    ({"dsrl__algorithm__clip_high": 11.0}, 2, ["dsrl.algorithm.clip_high"]),
    ({"dsrl__algorithm__kl_coef": -1.0}, 2, ["dsrl.algorithm.kl_coef"]),
    ({"dsrl__algorithm__overlong_buffer": 100}, 2, ["dsrl.algorithm.overlong_buffer", "max_new_tokens"]),
    ({"dsrl__algorithm__name": "ppo2"}, 2, ["dsrl.algorithm.name"]),
    ({"dsrl__scheduler__warmup_steps": 2, "dsrl__scheduler__warmup_ratio": 0.1}, 2,
     ["dsrl.scheduler", "warmup_steps", "warmup_ratio"]),
    ({"dsrl__scheduler__warmup_ratio": 1.5}, 2, ["dsrl.scheduler.warmup_ratio"]),
    ({"dsrl__bogus": {}}, 2, ["dsrl.bogus", "not a known setting"]),
    # Plan-level (needs the world size)
    ({"dsrl__batch__mini_batch_size": 12}, 2, ["dsrl.batch.mini_batch_size", "R = P*G", "32"]),
    ({"dsrl__batch__prompts_per_rollout": 9, "dsrl__batch__mini_batch_size": 12}, 2,
     ["dsrl.batch.prompts_per_rollout", "D = 2"]),
    ({"dsrl__batch__micro_batch_size_per_rank": 3}, 2,
     ["dsrl.batch.mini_batch_size", "micro_batch_size_per_rank", "3 * 2"]),
    ({"dsrl__batch__mini_batch_size": 8, "dsrl__batch__micro_batch_size_per_rank": None,
      "dsrl__batch__max_tokens_per_micro_batch": 512, "dsrl__batch__prompts_per_rollout": 16,
      "dsrl__batch__samples_per_prompt": 2}, 16, ["dsrl.batch.mini_batch_size", "D = 16"]),
    ({"dsrl__batch__micro_batch_size_per_rank": None, "dsrl__batch__max_tokens_per_micro_batch": 32}, 2,
     ["dsrl.batch.max_tokens_per_micro_batch", "allow_oversize", "max_prompt_tokens"]),
    ({"dsrl__run__rollouts": None, "dsrl__run__epochs": 1}, 2, ["dsrl.run.epochs", "--dataset_size"]),
]


@pytest.mark.parametrize("changes,world,fragments", CONFIG_AND_PLAN_ERRORS)
def test_config_and_plan_errors_name_the_field(changes, world, fragments):
    with pytest.raises(ConfigError) as err:
        _plan(_cfg(**changes), world)
    msg = str(err.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_epochs_too_small_for_one_rollout():
    raw = _cfg(dsrl__run__rollouts=None, dsrl__run__epochs=0.01)
    with pytest.raises(ConfigError, match=r"dsrl\.run\.epochs.*no full rollout.*wrap"):
        _plan(raw, 2, dataset_size=100)


def test_world_size_must_be_positive():
    cfg = load_config(_cfg())
    with pytest.raises(ConfigError, match="data-parallel size D"):
        BatchPlan.from_config(cfg, 0)


DEEPSPEED_ERRORS = [
    ({"train_batch_size": 64}, ["train_batch_size = 64", "mini_batch_size B = 16", "Fix"]),
    ({"train_micro_batch_size_per_gpu": 4}, ["train_micro_batch_size_per_gpu = 4", "m = 2"]),
    ({"gradient_accumulation_steps": 8}, ["gradient_accumulation_steps = 8", "B/(m*D) = 4"]),
    ({"managed_gradient_accumulation": True}, ["managed_gradient_accumulation", "false"]),
    ({"gradient_clipping": -1}, ["gradient_clipping"]),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, ["bf16.enabled", "fp16.enabled"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage"]),
    ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, ["zero_optimization.overlap_comm", '"stage": 1',
                                                                  "only with ZeRO stage 2"]),
    ({"pipeline": {"stages": 2}}, ["pipeline", "docs/megatron.md"]),
    ({"gradient_allreduce_op": "max"}, ["gradient_allreduce_op"]),
    ({"steps_per_print": "auto"}, ["steps_per_print", "auto"]),
]


@pytest.mark.parametrize("ds_changes,fragments", DEEPSPEED_ERRORS)
def test_deepspeed_section_errors_name_the_field(ds_changes, fragments):
    raw = copy.deepcopy(BASE)
    raw.update(ds_changes)
    cfg, plan = _plan(raw, 2)
    with pytest.raises(ConfigError) as err:  # what dsrl.initialize and dsrl plan run (DeepSpeed's own checks)
        validated_deepspeed_config(cfg, plan, on_gpu=False)
    for frag in fragments:
        assert frag in str(err.value), (frag, str(err.value))


def test_fp16_is_refused_exactly_where_the_accelerator_has_none(fp16_supported):
    """fp16.enabled is DeepSpeed's engine check's to refuse, by the accelerator's answer (the ``fp16_supported``
    fixture: this machine's, then each answer patched in): refused naming the field and the accelerator where it
    has no fp16; where it has (a CPU with AVX512-FP16/AMX-FP16, a GPU) the same config is accepted as it is."""
    from deepspeed.accelerator import get_accelerator

    raw = copy.deepcopy(BASE)
    raw["fp16"] = {"enabled": True}
    cfg, plan = _plan(raw, 2)
    if not fp16_supported:
        with pytest.raises(ConfigError) as err:
            validated_deepspeed_config(cfg, plan, on_gpu=False)
        for frag in ["fp16.enabled", f"{get_accelerator().device_name().upper()} accelerator", "not supported",
                     "Fix"]:
            assert frag in str(err.value), (frag, str(err.value))
    else:
        ds, _ = validated_deepspeed_config(cfg, plan, on_gpu=False)
        assert ds["fp16"]["enabled"] is True and not ds.get("bf16", {}).get("enabled")


SCHEDULER_ERRORS = [
    ({"type": "Cosine"}, ["scheduler.type", "WarmupCosineLR"]),
    ({"params": {}}, ["scheduler", "type"]),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5}}, ["total_num_steps = 5", "12"]),
    ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 12}}, ["warmup_num_steps = 12", "12"]),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_num_steps": 2}}, ["warmup_min_lr", "auto"]),
]


@pytest.mark.parametrize("sched,fragments", SCHEDULER_ERRORS)
def test_scheduler_errors_name_the_field(sched, fragments):
    raw = _cfg()
    raw["scheduler"] = sched
    raw["dsrl"]["run"]["rollouts"] = 6  # 6 rollouts x E=1 x R/B = 32/16 -> 12 steps
    cfg, plan = _plan(raw, 2)
    assert plan.total_optimizer_steps == 12
    with pytest.raises(ConfigError) as err:
        schedule_spec(cfg, plan.total_optimizer_steps)
    for frag in fragments:
        assert frag in str(err.value), (frag, str(err.value))


def test_scheduler_both_sources_and_warmup_without_lr():
    raw = _cfg(dsrl__scheduler__name="cosine")
    raw["scheduler"] = {"type": "WarmupCosineLR", "params": {}}
    with pytest.raises(ConfigError, match="dsrl.scheduler.name"):  # a rule of the run file (dsrl.config.Config)
        load_config(raw)
    raw = _cfg(dsrl__scheduler__name="cosine", dsrl__scheduler__warmup_steps=6)
    cfg, plan = _plan(raw)
    with pytest.raises(ConfigError, match="warmup_steps"):
        schedule_spec(cfg, plan.total_optimizer_steps)
    raw = _cfg(optimizer=_DELETE)
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1}}
    cfg, plan = _plan(raw)
    with pytest.raises(ConfigError, match="warmup_max_lr"):
        schedule_spec(cfg, plan.total_optimizer_steps)


def test_file_and_override_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(arr))
    with pytest.raises(ConfigError, match="--dsrl.batch.mini_batch_size"):
        parse_override_args(["positional"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_override_args(["--dsrl.batch.mini_batch_size"])
    with pytest.raises(ConfigError, match="unknown argument '--zero_optimization.stage'"):
        parse_override_args(["--zero_optimization.stage", "3"])
    with pytest.raises(ConfigError, match="only keys of the dsrl section"):
        load_config(_cfg(), {"zero_optimization.stage": 3})
    with pytest.raises(ConfigError, match="not a section"):
        load_config(_cfg(), parse_override_args(["--dsrl.batch.mini_batch_size.x", "3"]))
    # A valid override takes effect and is type-checked like the file.
    cfg = load_config(_cfg(), parse_override_args(["--dsrl.batch.samples_per_prompt", "8"]))
    assert cfg.dsrl.batch.samples_per_prompt == 8
    with pytest.raises(ConfigError, match="dsrl.batch.samples_per_prompt"):
        load_config(_cfg(), parse_override_args(["--dsrl.batch.samples_per_prompt", "eight"]))


def test_auto_batch_fields_are_resolved_not_passed_to_deepspeed():
    raw = _cfg(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    raw["bf16"] = {"enabled": "auto"}
    cfg, plan = _plan(raw, 2)
    ds = resolve_deepspeed_config(cfg, plan, on_gpu=False)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in ds and ds["managed_gradient_accumulation"] is False
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] is False
    assert ds["optimizer"]["params"]["torch_adam"] is True and "scheduler" not in ds
    on_gpu = resolve_deepspeed_config(cfg, plan, on_gpu=True, bf16_supported=True)
    assert on_gpu["bf16"]["enabled"] is True
    assert on_gpu["data_types"]["grad_accum_dtype"] == "fp32" and on_gpu["communication_data_type"] == "fp32"
