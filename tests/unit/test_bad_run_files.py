"""A catalogue of bad run files: `dsrl plan` rejects each with exit status 2, no traceback, and a message
naming the field. Each case is a mutation of configs/tiny_grpo_cpu.json (planned on 2 ranks).

The cases run in-process through ``dsrl.cli.main`` (fast); tests/distributed/test_cli_processes.py runs two of
them through a real ``python -m dsrl.cli plan`` subprocess, and every file in configs/ without any warning.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from conftest import REPO

from dsrl.cli.main import main

BASE = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text(encoding="utf-8"))
DELETE = object()
NAN, INF = math.nan, math.inf

# (case id, {dotted path in the run file: new value (DELETE removes it)}, the field the message must name)
CASES = [
    # ---------------------------------------------------------------- the "dsrl" section: types and ranges
    ("P zero", {"dsrl.batch.prompts_per_rollout": 0}, "dsrl.batch.prompts_per_rollout"),
    ("G as string", {"dsrl.batch.samples_per_prompt": "4"}, "dsrl.batch.samples_per_prompt"),
    ("B as bool", {"dsrl.batch.mini_batch_size": True}, "dsrl.batch.mini_batch_size"),
    ("E as float", {"dsrl.batch.epochs_per_rollout": 1.5}, "dsrl.batch.epochs_per_rollout"),
    ("balance coef negative", {"dsrl.batch.balance_attention_coef": -1.0}, "dsrl.batch.balance_attention_coef"),
    ("rollouts zero", {"dsrl.run.rollouts": 0}, "dsrl.run.rollouts"),
    ("keep_last zero", {"dsrl.run.keep_last": 0}, "dsrl.run.keep_last"),
    ("max_new_tokens negative", {"dsrl.rollout.max_new_tokens": -1}, "dsrl.rollout.max_new_tokens"),
    ("temperature zero", {"dsrl.rollout.temperature": 0.0}, "dsrl.rollout.temperature"),
    ("top_p above one", {"dsrl.rollout.top_p": 1.5}, "dsrl.rollout.top_p"),
    ("clip_low negative", {"dsrl.algorithm.clip_low": -0.1}, "dsrl.algorithm.clip_low"),
    ("kl_coef NaN", {"dsrl.algorithm.kl_coef": NAN}, "dsrl.algorithm.kl_coef"),
    ("GAE gamma above one", {"dsrl.algorithm.gamma": 1.5}, "dsrl.algorithm.gamma"),
    ("sft steps negative", {"dsrl.sft.steps": -1}, "dsrl.sft.steps"),
    ("critic lr negative", {"dsrl.algorithm.name": "ppo", "dsrl.critic.lr": -1e-3}, "dsrl.critic.lr"),
    ("warmup_ratio one", {"dsrl.scheduler.warmup_ratio": 1.0, "scheduler": DELETE}, "dsrl.scheduler.warmup_ratio"),
    ("model.tiny not an object", {"dsrl.model.tiny": 3}, "dsrl.model.tiny"),
    ("section not an object", {"dsrl.run": [1]}, "dsrl.run"),
    # ---------------------------------------------------------------- the "dsrl" section: enums
    ("loss_agg typo", {"dsrl.batch.loss_agg": "token_mean"}, "dsrl.batch.loss_agg"),
    ("last_rollout unknown", {"dsrl.run.last_rollout": "keep"}, "dsrl.run.last_rollout"),
    ("rollout backend unknown", {"dsrl.rollout.backend": "sglang"}, "dsrl.rollout.backend"),
    ("tiny arch unknown", {"dsrl.model.arch": "gpt2"}, "dsrl.model.arch"),
    ("model dtype unknown", {"dsrl.model.dtype": "fp16"}, "dsrl.model.dtype"),
    ("task unknown", {"dsrl.data.task": "sort"}, "dsrl.data.task"),
    ("algorithm unknown", {"dsrl.algorithm.name": "trpo"}, "dsrl.algorithm.name"),
    ("ratio level unknown", {"dsrl.algorithm.ratio_level": "group"}, "dsrl.algorithm.ratio_level"),
    ("kl estimator unknown", {"dsrl.algorithm.kl_estimator": "k4"}, "dsrl.algorithm.kl_estimator"),
    # ---------------------------------------------------------------- the "dsrl" section: cross-field rules
    ("both micro-batch modes", {"dsrl.batch.micro_batch_size_per_rank": 2}, "dsrl.batch"),
    ("B does not divide R", {"dsrl.batch.mini_batch_size": 24}, "dsrl.batch.mini_batch_size"),
    ("token budget below one sequence", {"dsrl.batch.max_tokens_per_micro_batch": 8},
     "dsrl.batch.max_tokens_per_micro_batch"),
    ("epochs and rollouts", {"dsrl.run.epochs": 1}, "dsrl.run"),
    ("overlong buffer too long", {"dsrl.algorithm.overlong_buffer": 8}, "dsrl.algorithm.overlong_buffer"),
    ("file type unknown", {"dsrl.data.task": None, "dsrl.data.path": "prompts.csv", "dsrl.data.reward_fn": "m:f"},
     "dsrl.data.path"),
    ("task and path", {"dsrl.data.path": "prompts.jsonl", "dsrl.data.reward_fn": "m:f"}, "dsrl.data.task"),
    ("file without reward_fn", {"dsrl.data.task": None, "dsrl.data.path": "prompts.jsonl"}, "dsrl.data.reward_fn"),
    ("two schedule sources", {"dsrl.scheduler.name": "cosine"}, "dsrl.scheduler.name"),
    ("every reward weighted 0", {"dsrl.data.rule_reward_weight": 0.0}, "dsrl.data"),
    ("critic keys without a critic", {"dsrl.critic.lr": 1e-3}, "dsrl.critic"),
    ("turn bound without an environment", {"dsrl.rollout.max_turns": 3}, "dsrl.rollout.max_turns"),
    ("empty stop string", {"dsrl.rollout.stop_strings": [""]}, "dsrl.rollout.stop_strings"),
    ("environment timeout above the collective bound",
     {"dsrl.data.environment": "dsrl.tasks.calculator:Calculator", "dsrl.data.environment_timeout_s": 4000.0},
     "dsrl.data.environment_timeout_s"),
    ("critic warm-up as long as the run", {"dsrl.algorithm.name": "ppo", "dsrl.critic.warmup_rollouts": 200},
     "dsrl.critic.warmup_rollouts"),
    ("critic ZeRO stage unknown", {"dsrl.algorithm.name": "ppo", "dsrl.critic.zero_optimization": {"stage": 7}},
     "zero_optimization"),
    ("critic schedule warm-up too long", {"dsrl.algorithm.name": "ppo",
                                          "dsrl.critic.scheduler": {"type": "WarmupCosineLR",
                                                                    "params": {"warmup_num_steps": 500}}},
     "warmup_num_steps"),
    ("GRPO with G = 1", {"dsrl.batch.samples_per_prompt": 1, "dsrl.batch.mini_batch_size": 16},
     "dsrl.batch.samples_per_prompt"),
    ("GRPO by default with G = 1", {"dsrl.algorithm": DELETE, "dsrl.batch.samples_per_prompt": 1,
                                    "dsrl.batch.mini_batch_size": "auto"}, "dsrl.batch.samples_per_prompt"),
    ("DAPO with G = 1", {"dsrl.algorithm.name": "dapo", "dsrl.batch.samples_per_prompt": 1,
                         "dsrl.batch.mini_batch_size": 16}, "dsrl.batch.samples_per_prompt"),
    ("RLOO with G = 1", {"dsrl.algorithm.name": "rloo", "dsrl.batch.samples_per_prompt": 1,
                         "dsrl.batch.mini_batch_size": 16}, "dsrl.batch.samples_per_prompt"),
    # ---------------------------------------------------------------- the "dsrl" section: unknown keys
    ("unknown batch key", {"dsrl.batch.mini_batch_sise": 32}, "dsrl.batch.mini_batch_sise"),
    ("unknown section", {"dsrl.trainer": {}}, "dsrl.trainer"),
    # ---------------------------------------------------------------- optimizer
    ("optimizer type unknown", {"optimizer.type": "AdamQ"}, "optimizer.type"),
    ("optimizer type not a string", {"optimizer.type": 5}, "optimizer.type"),
    ("lr negative", {"optimizer.params.lr": -1e-3}, "optimizer.params.lr"),
    ("lr zero", {"optimizer.params.lr": 0}, "optimizer.params.lr"),
    ("lr NaN", {"optimizer.params.lr": NAN}, "optimizer.params.lr"),
    ("lr infinite", {"optimizer.params.lr": INF}, "optimizer.params.lr"),
    ("lr string", {"optimizer.params.lr": "3e-3"}, "optimizer.params.lr"),
    ("beta above one", {"optimizer.params.betas": [0.9, 1.5]}, "optimizer.params.betas"),
    ("betas not a pair", {"optimizer.params.betas": 0.9}, "optimizer.params.betas"),
    ("eps negative", {"optimizer.params.eps": -1e-8}, "optimizer.params.eps"),
    ("weight_decay negative", {"optimizer.params.weight_decay": -0.01}, "optimizer.params.weight_decay"),
    ("AdamW without momentum", {"optimizer.params.momentum": 0.9}, "optimizer.params.momentum"),
    ("max_grad_norm in the optimizer", {"optimizer.params.max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
    ("params typo", {"optimizer.parms": {"lr": 1e-3}}, "optimizer.parms"),
    ("untested optimizer under ZeRO", {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type"),
    ("Lamb has no CPU kernel", {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ("torch optimizer bad value", {"optimizer": {"type": "Adagrad", "params": {"lr": 1e-3, "lr_decay": -1}}},
     "optimizer.params.lr_decay"),
    # ---------------------------------------------------------------- scheduler
    ("scheduler type unknown", {"scheduler.type": "CosineLR"}, "scheduler.type"),
    ("scheduler params unknown key", {"scheduler.params.decay": 0.1}, "scheduler.params.decay"),
    ("warmup negative", {"scheduler.params.warmup_num_steps": -5}, "scheduler.params.warmup_num_steps"),
    ("warmup >= horizon", {"scheduler.params.warmup_num_steps": 440}, "scheduler.params.warmup_num_steps"),
    ("horizon contradicts the plan", {"scheduler.params.total_num_steps": 100}, "scheduler.params.total_num_steps"),
    ("warmup_type unknown (DeepSpeed would fall back to log)", {"scheduler.params.warmup_type": "cubic"},
     "scheduler.params.warmup_type"),
    ("cos_min_ratio string", {"scheduler.params.cos_min_ratio": "low"}, "scheduler.params.cos_min_ratio"),
    ("schedule with a negative LR", {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": -1.0,
                                                                                "warmup_num_steps": 5}}},
     "scheduler.params.warmup_min_lr"),
    ("schedule position set", {"scheduler.params.last_batch_iteration": 5}, "scheduler.params.last_batch_iteration"),
    # ---------------------------------------------------------------- zero_optimization
    ("ZeRO stage 4", {"zero_optimization.stage": 4}, "zero_optimization.stage"),
    ("ZeRO unknown key", {"zero_optimization.stage3_bogus": 1}, "zero_optimization.stage3_bogus"),
    ("offload device unknown", {"zero_optimization.offload_optimizer": {"device": "gpu"}},
     "zero_optimization.offload_optimizer.device"),
    ("bucket size negative", {"zero_optimization.reduce_bucket_size": -1}, "zero_optimization.reduce_bucket_size"),
    ("bucket size string", {"zero_optimization.allgather_bucket_size": "big"},
     "zero_optimization.allgather_bucket_size"),
    ("overlap_comm on ZeRO-1", {"zero_optimization.stage": 1, "zero_optimization.overlap_comm": True},
     "zero_optimization.overlap_comm"),
    ("sum all-reduce on ZeRO-3", {"zero_optimization.stage": 3, "gradient_allreduce_op": "sum"},
     "gradient_allreduce_op"),
    # ---------------------------------------------------------------- precision
    ("bf16 and fp16", {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled"),
    ("bf16 on ZeRO-0 (no fp32 accumulation)", {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
     "zero_optimization.stage"),
    ("loss_scale negative", {"fp16": {"enabled": False, "loss_scale": -1}}, "fp16.loss_scale"),
    ("loss_scale_window string", {"fp16": {"enabled": False, "loss_scale_window": "x"}}, "fp16.loss_scale_window"),
    ("bf16 unknown key", {"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale"),
    ("param_dtype contradicts precision", {"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype"),
    ("communication dtype unknown", {"communication_data_type": "fp8"}, "communication_data_type"),
    # ---------------------------------------------------------------- gradient clipping
    ("clipping negative", {"gradient_clipping": -1.0}, "gradient_clipping"),
    ("clipping NaN", {"gradient_clipping": NAN}, "gradient_clipping"),
    ("clipping string", {"gradient_clipping": "1.0"}, "gradient_clipping"),
    ("clipping typo", {"gradient_clippping": 0.5}, "gradient_clippping"),
    # ---------------------------------------------------------------- batch fields and the rest
    ("train_batch_size contradicts the plan", {"train_batch_size": 32}, "train_batch_size"),
    ("micro batch size in token-budget mode", {"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu"),
    ("accumulation contradicts the plan", {"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ("managed accumulation", {"managed_gradient_accumulation": True}, "managed_gradient_accumulation"),
    ("all-reduce op unknown", {"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
    ("pipeline engine", {"pipeline": {"stages": 2}}, "pipeline"),
    ("auto DeepSpeed cannot take", {"steps_per_print": "auto"}, "steps_per_print"),
    ("removed DeepSpeed feature", {"nebula": {"enabled": False}}, "nebula"),
    ("sequence parallel size zero", {"sequence_parallel_size": 0}, "sequence_parallel_size"),
    # ---------------------------------------------------------------- tensor / expert parallelism (2 ranks)
    ("autotp_size does not divide the world", {"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size"),
    ("autotp_size negative", {"tensor_parallel": {"autotp_size": -2}}, "tensor_parallel.autotp_size"),
    ("autotp_size as string", {"tensor_parallel": {"autotp_size": "2"}}, "tensor_parallel.autotp_size"),
    ("autotp with Ulysses SP", {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2},
     "tensor_parallel.autotp_size"),
    ("vocabulary-parallel output head", {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}},
     "tensor_parallel.vocab_parallel_lm_head"),
    ("tp_size contradicts autotp_size", {"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
     "tensor_parallel.tp.tp_size"),
    ("tensor_parallel typo", {"tensor_parallel": {"autotp_sise": 2}}, "tensor_parallel.autotp_sise"),
    ("autoep_size does not divide the world", {"expert_parallel": {"enabled": True, "autoep_size": 3}},
     "expert_parallel.autoep_size"),
    ("expert_parallel typo", {"expert_parallel": {"enabled": True, "autoep_sise": 2}}, "expert_parallel.autoep_sise"),
    ("checkpoint tag validation unknown", {"checkpoint": {"tag_validation": "sometimes"}}, "checkpoint.tag_validation"),
    ("activation checkpointing typo", {"activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation"),
    ("monitor unknown key", {"csv_monitor.bogus": 1}, "csv_monitor.bogus"),
]


def mutate(raw: dict, changes: dict) -> dict:
    out = copy.deepcopy(raw)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = copy.deepcopy(value)
    return out


def plan_in_process(path, capsys, *extra: str) -> tuple[int, str]:
    try:
        rc = main(["plan", "--ds_config", str(path), "--world_size", "2", *extra])
    except BaseException as e:  # noqa: BLE001 - any escaping exception is the failure this test looks for
        pytest.fail(f"dsrl plan raised {type(e).__name__}: {e} (the user would see a traceback)")
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_catalogue_is_large_and_its_base_is_valid(tmp_path, capsys):
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(BASE))
    rc, text = plan_in_process(path, capsys)
    assert rc == 0, text


@pytest.mark.parametrize("changes,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_run_file_is_rejected_naming_the_field(tmp_path, capsys, changes, field):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(mutate(BASE, changes)))  # NaN/Infinity as Python's json writes them
    rc, text = plan_in_process(path, capsys)
    assert rc == 2, text
    assert "Traceback" not in text, text
    assert "dsrl: configuration error:" in text, text
    assert field in text, (field, text)
    assert "Fix" in text, text


def test_fp16_is_planned_exactly_where_the_accelerator_has_it(tmp_path, capsys, fp16_supported):
    """fp16.enabled on the CPU accelerator follows its answer (the ``fp16_supported`` fixture: this machine's, then
    each answer patched in): without fp16 the run file is rejected like the catalogue's, naming the field; with it
    (a CPU with AVX512-FP16/AMX-FP16) the same run file plans, with nothing said about fp16."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(mutate(BASE, {"fp16": {"enabled": True}})))
    rc, text = plan_in_process(path, capsys)
    assert "Traceback" not in text, text
    if fp16_supported:
        assert rc == 0 and "dsrl plan for" in text, text
        assert "fp16.enabled" not in text and "not supported" not in text and "error" not in text, text
    else:
        assert rc == 2 and "dsrl: configuration error:" in text, text
        assert "fp16.enabled" in text and "not supported" in text and "Fix" in text, text


def test_world_size_rules_name_the_field(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(BASE))
    rc, text = plan_in_process(path, capsys, "--world_size", "3")  # P = 16 is not a multiple of D = 3
    assert rc == 2 and "Traceback" not in text and "dsrl.batch.prompts_per_rollout" in text, text
