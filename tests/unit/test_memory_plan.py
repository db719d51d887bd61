"""`dsrl plan`'s memory per phase (dsrl.core.memory, dsrl.cli.memory): the model-state rows held to DeepSpeed's own
estimators, exact parameter counts without weights, every shipped config planned, a run that cannot fit refused
with its numbers and the settings to change, one that barely fits warned about, and each setting moving the part it
should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrl.cli.main import main
from dsrl.config import load_config
from dsrl.core.memory import GIB, MIB, MemorySetup, ModelShape, estimate, fit, model_states
from dsrl.core.plan import BatchPlan

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.json"))


@pytest.mark.parametrize("params", [10**6, 494_032_768, 7_615_616_512])
@pytest.mark.parametrize("ranks", [1, 2, 8, 64])
def test_model_state_rows_are_deepspeeds_estimates(params, ranks):
    """16-bit weights with Adam: ZeRO-2 (optimizer on the device or offloaded) and ZeRO-3 (nothing offloaded, the
    optimizer offloaded, optimizer and parameters offloaded) per GPU, as DeepSpeed 0.19.8's estimators (the
    functions behind estimate_zero2/3_model_states_mem_needs_all_cold) give them, to the byte (integer rounding)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = params // 20
    for offload in (False, True):
        mine = sum(model_states(params, params, largest, ranks, 2, 2, offload_optimizer=offload).values())
        _, theirs = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=ranks, cpu_offload=offload)
        assert abs(mine - theirs) <= 3, (offload, mine, theirs)
    for optimizer, param in ((False, False), (True, False), (True, True)):
        mine = sum(model_states(params, params, largest, ranks, 3, 2, offload_optimizer=optimizer,
                                offload_param=param).values())
        _, theirs, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=ranks,
                                                             cpu_offload=optimizer, cpu_offload_params=param)
        assert abs(mine - theirs) <= 3, (optimizer, param, mine, theirs)


def test_the_printed_all_cold_tables_agree(capsys):
    """The tables DeepSpeed prints for a hypothetical model (estimate_zero2/3_model_states_mem_needs_all_cold), per
    GPU in GB with two decimals, for Qwen2.5-7B's parameter count on 8 GPUs."""
    import re

    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    params, largest, ranks = 7_615_616_512, 544_997_376, 8
    estimate_zero2_model_states_mem_needs_all_cold(params, num_gpus_per_node=ranks)
    estimate_zero3_model_states_mem_needs_all_cold(params, largest, num_gpus_per_node=ranks)
    text = capsys.readouterr().out.replace("OffloadDeviceEnum.", "")
    printed = {m[1]: float(m[0]) for m in re.findall(r"\|\s+([\d.]+)GB \| (.+?)\n", text)}
    mine = {"offload_optimizer=cpu": (2, True, False), "offload_optimizer=none": (2, False, False),
            "offload_param=none, offload_optimizer=none, zero_init=1": (3, False, False),
            "offload_param=none, offload_optimizer=cpu, zero_init=1": (3, True, False),
            "offload_param=cpu, offload_optimizer=cpu, zero_init=1": (3, True, True)}
    assert set(mine) <= set(printed), printed
    for options, (stage, optimizer, param) in mine.items():
        got = sum(model_states(params, params, largest, ranks, stage, 2, offload_optimizer=optimizer,
                               offload_param=param).values())
        assert round(got / 2**30, 2) == printed[options], (options, got / 2**30, printed[options])


def test_lora_states_count_the_adapters_only():
    full = model_states(10**6, 10**6, 10**5, 2, 2, 2)
    lora = model_states(10**6, 10**4, 10**5, 2, 2, 2)
    assert lora["weights"] == full["weights"] == 2 * 10**6  # the frozen base stays whole under ZeRO-2
    assert lora["optimizer_states"] == full["optimizer_states"] // 100


def _cfg(name: str = "tiny_grpo_cpu.json", **dsrl: dict) -> dict:
    raw = json.loads((REPO / "configs" / name).read_text())
    for section, values in dsrl.items():
        raw["dsrl"].setdefault(section, {}).update(values)
    return raw


def _phases(raw: dict, ranks: int = 1, on_gpu: bool = False, device_gib: float = 80.0) -> tuple:
    from dsrl.cli.memory import memory_report

    cfg = load_config(raw)
    plan = BatchPlan.from_config(cfg, ranks, 512)
    phases, verdict, extra = memory_report(cfg, plan, on_gpu=on_gpu, world_size=ranks, device_memory_gib=device_gib)
    return phases, verdict, extra


def test_parameters_are_counted_exactly_without_weights():
    """The meta-device count equals the built tiny model's, LoRA's trained count the PEFT model's."""
    from dsrl.config import ModelConfig
    from dsrl.rl.policy.model import build_model
    from dsrl.rl.policy.tokenizer import load_tokenizer

    for name in ("tiny_grpo_cpu.json", "tiny_grpo_lora_cpu.json", "tiny_moe_cpu.json"):
        raw = _cfg(name)
        _, _, extra = _phases(raw, ranks=2)
        model_cfg = ModelConfig(**raw["dsrl"]["model"])
        tok = load_tokenizer(model_cfg)
        model = build_model(model_cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, on_gpu=False)
        params = {id(p): p for p in model.parameters()}.values()
        assert extra["memory_params"] == sum(p.numel() for p in params), name
        assert extra["memory_trainable_params"] == sum(p.numel() for p in params if p.requires_grad), name


def _model_args(path: Path) -> tuple[str, ...]:
    """A real model's run file whose weights are not on this machine (CI's clean clone has no `dsrl prepare-model`
    output): the shipped copy of its config.json; a GPU file (every one not named `*_cpu.json`) on an 80 GiB card."""
    model_path = json.loads(path.read_text())["dsrl"].get("model", {}).get("path")
    if not model_path or (REPO / model_path).exists():
        return ()
    config = REPO / "configs" / "models" / Path(model_path).name / "config.json"
    assert config.is_file(), f"{path.name}: ship {config.relative_to(REPO)} so its plan is tested without the weights"
    if path.stem.endswith("_cpu"):
        return ("--model_config", str(config))
    return ("--model_config", str(config), "--device_memory_gib", "80", "--accelerator", "gpu")


def _plan_json(capsys, path: Path, *args: str) -> tuple[int, dict | None, str]:
    args = (*args, *_model_args(path))
    found = None
    for ranks in ("1", "2", "4", "8"):  # the smallest world each shipped layout accepts and fits in
        code = main(["plan", "--ds_config", str(path), "--world_size", ranks, "--json", *args])
        out, err = capsys.readouterr()
        found = code, json.loads(out) if out.strip() else None, err
        if code != 2:
            return found
    if found is not None and "does not fit" in found[2]:
        return found
    raise AssertionError(f"{path.name}: no world size of 1-8 plans")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_plan_prints_the_memory_of_every_phase_for_every_shipped_config(capsys, path):
    code, doc, err = _plan_json(capsys, path)
    assert code == 0, err
    memory = doc["memory"]
    assert set(memory) == {"generation", "logprobs", "training"}
    for phase in memory.values():
        assert phase["parts"] and phase["total_mib"] == pytest.approx(sum(phase["parts"].values()), abs=0.6)
        assert phase["total_mib"] > 0
    assert doc["memory_device_mib"] > 0 and doc["memory_refusals"] == []
    human = main(["plan", "--ds_config", str(path), "--world_size", str(doc["world_size"]), *_model_args(path)])
    out, _ = capsys.readouterr()
    assert human == 0 and "memory: training" in out and "memory: generation" in out and "MiB (" in out


def test_a_run_that_cannot_fit_is_refused_with_its_numbers_and_the_fix(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_cfg()))
    code = main(["plan", "--ds_config", str(path), "--device_memory_gib", "0.004"])
    out, err = capsys.readouterr()
    assert code == 2 and "memory: training" in out  # the numbers are printed, then the refusal
    assert "does not fit the device:\n  - the generation phase needs" in err and "  - the training phase needs" in err
    assert "MiB on every rank (" in err and "but the device has 4 MiB (--device_memory_gib 0.004)" in err, err
    assert "Fix: dsrl.model.gradient_checkpointing = true" in err and "dsrl.memory.offload_states = true" in err, err
    training = json.loads(_json(capsys, path, "0.004"))["memory"]["training"]["total_mib"]
    code = main(["plan", "--ds_config", str(path), "--device_memory_gib", str(training / 0.95 / 1024 * 1.0)])
    _, err = capsys.readouterr()
    assert code == 0 and "warning: the training phase needs" in err and "95%" in err, err


def _json(capsys, path: Path, gib: str) -> str:
    main(["plan", "--ds_config", str(path), "--json", "--device_memory_gib", gib])
    return capsys.readouterr().out


def test_settings_move_the_parts_they_should():
    base, _, _ = _phases(_cfg())
    off, _, _ = _phases(_cfg(memory={"offload_states": True}, algorithm={"kl_coef": 0.05}))
    kl, _, _ = _phases(_cfg(algorithm={"kl_coef": 0.05}))
    assert "training_state" in base["generation"].parts and "training_state" not in off["generation"].parts
    assert "reference" in kl["generation"].parts and "reference" not in off["generation"].parts
    assert "reference" in off["logprobs"].parts  # on the device during its own pass
    assert off["training"].parts["optimizer_states"] == base["training"].parts["optimizer_states"]
    ckpt, _, _ = _phases(_cfg(model={"gradient_checkpointing": True}))
    assert ckpt["training"].parts["activations"] < base["training"].parts["activations"]  # 2 layers: 0.57x
    raw3 = _cfg()
    raw3["zero_optimization"]["stage"] = 3
    z3, _, _ = _phases(raw3, ranks=2)
    z2, _, _ = _phases(_cfg(), ranks=2)
    assert z3["training"].parts["weights"] * 2 == z2["training"].parts["weights"]
    assert z3["generation"].parts["gathered_weights"] == z2["generation"].parts["weights"]
    cb, _, _ = _phases(_cfg(rollout={"backend": "cb"}))
    assert cb["training"].parts["cb_kv_cache"] == cb["generation"].parts["cb_kv_cache"] > 0  # kept all run
    cb_off, _, _ = _phases(_cfg(rollout={"backend": "cb"}, memory={"offload_states": True}))
    assert cb_off["generation"].parts["cb_kv_cache"] > 0 and "cb_kv_cache" not in cb_off["training"].parts
    assert "kv_cache" not in base["training"].parts


def test_vllm_on_a_gpu_reserves_its_share_unless_asleep():
    shape = ModelShape(params=10**9, trainable=10**9, largest_layer=5 * 10**7, layers=24, hidden=2048,
                       mlp_width=8192, heads=16, kv_heads=2, head_dim=128, vocab=151936)
    raw = _cfg("tiny_grpo_vllm_cpu.json")
    cfg = load_config(raw)
    plan = BatchPlan.from_config(cfg, 1, 512)
    device = 80 * GIB
    awake = estimate(MemorySetup.of(cfg, plan, shape, on_gpu=True), device)
    raw["dsrl"]["memory"] = {"vllm_sleep_level": 1}
    asleep = estimate(MemorySetup.of(load_config(raw), plan, shape, on_gpu=True), device)
    share = int(cfg.dsrl.rollout.vllm_gpu_memory_utilization * device)
    assert awake["generation"].parts["vllm_engine"] == share == awake["training"].parts["vllm_engine"]
    assert asleep["generation"].parts["vllm_engine"] == share and "vllm_engine" not in asleep["training"].parts
    verdict = fit(awake, 4 * GIB, MemorySetup.of(cfg, plan, shape, on_gpu=True))
    assert any("vllm_sleep_level = 1" in r for r in verdict.refusals), verdict.refusals
    assert awake["training"].total / MIB > 0


def test_a_model_path_missing_here_is_planned_from_model_config(capsys, tmp_path):
    """Only config.json is read: a directory without weights plans; a missing one leaves the memory unestimated
    (said, status 0) unless --model_config points at a config."""
    from transformers import Qwen2Config

    config_dir = tmp_path / "model"
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=300).save_pretrained(config_dir)
    raw = _cfg()
    raw["dsrl"]["model"] = {"path": str(tmp_path / "elsewhere")}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    code = main(["plan", "--ds_config", str(path), "--json", "--dataset_size", "512"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["memory"] is None and "--model_config" in doc["memory_unknown"]
    code = main(["plan", "--ds_config", str(path), "--json", "--dataset_size", "512", "--model_config",
                 str(config_dir)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["memory"]["training"]["total_mib"] > 0
    assert doc["memory_params"] == 300 * 64 + 2 * (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 128) \
        + 64 + (0 if Qwen2Config().tie_word_embeddings else 300 * 64)


def test_the_megatron_engine_holds_its_shard_and_a_full_replica():
    """On the Megatron engine a rank holds 1 / (TP x PP) of the float32 model states (weights, DDP's gradient buffer,
    Adam's moments; on GPUs the distributed optimizer splits the moments over the D replicas) and, in every phase, the
    rollout model: a full replica, whose KV cache is not split over the tensor ranks."""
    from dsrl.core.memory import megatron_states

    one = _cfg("tiny_grpo_megatron_cpu.json", engine={"tensor_model_parallel_size": 1})
    tp2 = _cfg("tiny_grpo_megatron_cpu.json")  # TP = 2
    pp2 = _cfg("tiny_grpo_megatron_cpu.json", engine={"tensor_model_parallel_size": 1,
                                                      "pipeline_model_parallel_size": 2})
    base, _, _ = _phases(one, ranks=2)  # D = 2 replicas in every layout (the plan's data-parallel size)
    for layout in (tp2, pp2):
        split, _, _ = _phases(layout, ranks=2)
        for part in ("weights", "gradients", "optimizer_states"):
            assert abs(split["training"].parts[part] * 2 - base["training"].parts[part]) <= 8, part
        for phase in ("generation", "logprobs", "training"):
            assert split[phase].parts["rollout_replica"] == base[phase].parts["rollout_replica"] > 0
        assert split["generation"].parts["kv_cache"] == base["generation"].parts["kv_cache"]
    assert base["training"].parts["master_weights"] == 0 and "allreduce_buffer" not in base["training"].parts
    assert base["generation"].parts["rollout_replica"] == base["training"].parts["weights"]  # both float32, N
    states = megatron_states(1000, 1000, 4, 2, 4, distributed_optimizer=True)
    assert states == {"weights": 2000, "gradients": 2000, "master_weights": 0, "optimizer_states": 1000}
    mixed = megatron_states(1000, 1000, 4, 2, 2, distributed_optimizer=True)  # bf16 weights, fp32 main weights
    assert mixed == {"weights": 1000, "gradients": 2000, "master_weights": 500, "optimizer_states": 1000}


def test_sequence_parallelism_splits_the_hidden_sized_activations_over_the_tensor_group():
    """Without it megatron-core's tensor group holds every token's norm inputs and residual stream whole; with it each
    rank holds 1 / TP of them, as of the attention and MLP activations, and nothing else changes."""
    plain, _, _ = _phases(_cfg("tiny_grpo_megatron_cpu.json"), ranks=2)  # TP = 2
    split, _, _ = _phases(_cfg("tiny_grpo_megatron_cpu.json", engine={"sequence_parallel": True}), ranks=2)
    assert split["training"].parts["activations"] < plain["training"].parts["activations"]
    assert {k: v for k, v in split["training"].parts.items() if k != "activations"} == \
        {k: v for k, v in plain["training"].parts.items() if k != "activations"}


def test_context_parallelism_splits_the_trunks_activations_but_keeps_every_positions_keys_and_values():
    """One replica either way: the context group holds 1 / CP of the decoder layers' activations per rank, plus
    every position's all-gathered keys and values, so between half and all of them at CP = 2; the head's logit chunk
    (it runs on every position) and the model states do not change."""
    one = {"tensor_model_parallel_size": 1}
    plain, _, _ = _phases(_cfg("tiny_grpo_megatron_cpu.json", engine=one), ranks=1)
    split, _, _ = _phases(_cfg("tiny_grpo_megatron_cpu.json", engine={**one, "context_parallel_size": 2}), ranks=2)
    whole, halved = plain["training"].parts["activations"], split["training"].parts["activations"]
    assert whole / 2 < halved < whole
    assert split["logprobs"].parts["activations"] == plain["logprobs"].parts["activations"] // 2
    assert {k: v for k, v in split["training"].parts.items() if k != "activations"} == \
        {k: v for k, v in plain["training"].parts.items() if k != "activations"}
