"""``launch/train.py`` on the Megatron engine (``dsrl.engine.kind = "megatron"``), two CPU ranks, the CPU shim installed
by the entry point:

- the same run file on both engines gives the same supervised warm-up rows (loss, gradient norm with clipping
  active, LR, tokens) within 1e-5 relative: DeepSpeed at DP = 2 against Megatron at TP = 2 (README suite) and at
  DP = 2, PP = 2, TP = 2 with sequence parallelism and CP = 2 (extended). The data is the same and nothing is
  sampled; only the kernels differ;
- the run file's default job on Megatron at TP = 2 solves its task as DeepSpeed's does (last-10 exact match >= 95 %)
  and the rollout model's behaviour log-probs stay within 1e-5 of the trainer's at every rollout (the HF replica
  synced from the engine's weights);
- a run stopped after its checkpoint and resumed gives the rows and the final model of the run that was not
  stopped, bit for bit, and the exported final model loads with transformers;
- multi-turn tool rollouts run on it and match DeepSpeed's first rollout;
- PPO trains its critic on it as DeepSpeed does, and resumes bit for bit with both engines at PP = 2; sequence and
  context parallelism change no row of a PPO run beyond float rounding, and a CP = 2 run resumes bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXTENDED, REPO, launch, reward_model_job

pytest.importorskip("megatron.core")

ROW_KEYS = ("loss", "grad_norm", "lr", "tokens", "token_accuracy")
SFT_STEPS = 30


def _rows(out: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == event]


def _train(tmp_path: Path, name: str, run_file: str, *flags: str) -> Path:
    out = tmp_path / name
    launch(["launch/train.py", "--ds_config", str(REPO / "configs" / run_file), "--dsrl.run.output_dir", str(out),
            "--dsrl.run.progress_bar", "false", *flags], nprocs=2, timeout=900)
    return out


def _sft_rows(tmp_path: Path, name: str, run_file: str, *flags: str) -> list[dict]:
    out = _train(tmp_path, name, run_file, "--dsrl.run.rollouts", "1", "--dsrl.sft.steps", str(SFT_STEPS),
                 "--dsrl.run.save_every", "0", "--dsrl.run.save_final", "false", *flags)
    rows = _sft_rows_of(out)
    assert len(rows) == SFT_STEPS
    return rows


def _sft_rows_of(out: Path) -> list[dict]:
    return _rows(out, "sft")


def _timeless(rows: list[dict]) -> list[dict]:
    """The rows without their timings and memory figures (what a bit-for-bit comparison of two runs compares)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s") and "per_s" not in k and "mib" not in k} for r in rows]


def _worst(a: list[dict], b: list[dict]) -> dict[str, float]:
    return {k: max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for x, y in zip(a, b, strict=True)) for k in ROW_KEYS}


@pytest.fixture(scope="module")
def deepspeed_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The supervised warm-up of the default run file on DeepSpeed (ZeRO-2, DP = 2)."""
    return _sft_rows(tmp_path_factory.mktemp("deepspeed"), "ds", "tiny_grpo_cpu.json")


@pytest.mark.parametrize("layout", [
    ["--dsrl.engine.tensor_model_parallel_size", "2"],
    pytest.param(["--dsrl.engine.tensor_model_parallel_size", "1"], marks=EXTENDED, id="dp2"),
    pytest.param(["--dsrl.engine.tensor_model_parallel_size", "1", "--dsrl.engine.pipeline_model_parallel_size",
                  "2"], marks=EXTENDED, id="pp2"),
    pytest.param(["--dsrl.engine.sequence_parallel", "true"], marks=EXTENDED, id="tp2_sp"),
    pytest.param(["--dsrl.engine.tensor_model_parallel_size", "1", "--dsrl.engine.context_parallel_size", "2"],
                 marks=EXTENDED, id="cp2"),
], ids=["tp2", "dp2", "pp2", "tp2_sp", "cp2"])
def test_the_same_run_file_gives_the_same_warm_up_on_both_engines(tmp_path, deepspeed_rows, layout):
    """Gradient clipping (1.0) is active in these steps (norms near 5), so the norm itself, counted once per tensor
    shard, and the clipped step are compared; the LR of every step is dsrl's schedule on both engines."""
    rows = _sft_rows(tmp_path, "megatron", "tiny_grpo_megatron_cpu.json", *layout)
    worst = _worst(deepspeed_rows, rows)
    assert max(worst.values()) <= 1e-5, worst
    assert max(r["grad_norm"] for r in rows[:5]) > 1.0  # clipping did act
    assert [r["lr"] for r in rows] == [r["lr"] for r in deepspeed_rows]


@EXTENDED
def test_the_default_job_learns_on_megatron(tmp_path):
    """The README's job (200 warm-up steps, 120 GRPO rollouts) with the Megatron engine at TP = 2: last-10 exact
    match >= 95 % (DeepSpeed: 99.8 %), behaviour log-probs of the synced HF replica within 1e-5 of the trainer's."""
    out = _train(tmp_path, "run", "tiny_grpo_megatron_cpu.json", "--dsrl.run.save_every", "0",
                 "--dsrl.run.save_final", "false")
    rollouts = _rows(out, "rollout")
    assert len(rollouts) == 120
    last10 = sum(r["accuracy"] for r in rollouts[-10:]) / 10
    assert last10 >= 0.95, last10
    assert max(r["rollout_logprob_abs_diff"] for r in rollouts) <= 1e-5
    assert all(r["weight_sync_bytes"] > 0 for r in rollouts)  # every rollout copied the stepped weights


@EXTENDED
def test_the_same_run_file_gives_the_same_warm_up_in_mixed_precision(tmp_path):
    """``dsrl.model.dtype`` bfloat16 on both engines: DeepSpeed's bf16 (ZeRO-2, fp32 gradient accumulation) at DP = 2
    and megatron-core's mixed precision at TP = 2 give the same 30 warm-up rows within 1e-2 relative (seen: loss
    3.3e-4, gradient norm 3.5e-3; bf16 kernels on both sides), the same learning rates and token counts. (Token
    accuracy, an argmax, may flip on a near tie in bf16: one token in 30 did.)"""
    bf16 = ("--dsrl.model.dtype", "bfloat16")
    ds = _sft_rows(tmp_path, "deepspeed", "tiny_grpo_cpu.json", *bf16)
    rows = _sft_rows(tmp_path, "megatron", "tiny_grpo_megatron_cpu.json", *bf16)
    worst = _worst(ds, rows)
    assert max(worst["loss"], worst["grad_norm"]) <= 1e-2, worst
    assert worst["lr"] == 0.0 and worst["tokens"] == 0.0


@EXTENDED
@pytest.mark.parametrize("precision", [(), ("--dsrl.model.dtype", "bfloat16")], ids=["fp32", "bf16"])
def test_a_stopped_run_resumes_bit_for_bit_and_exports(tmp_path, precision):
    """Stopped after rollout 2's checkpoint and resumed, the run gives the rows and the final model of the run that
    was not stopped, bit for bit (so the Megatron checkpoint restored the weights, the optimizer, the schedule and
    the run's position, and the rollout model was synced from the restored weights); the final model loads with
    transformers, the checkpoint's manifest names the engine and its layout, and ``dsrl export`` of the last
    checkpoint (offline, from its dist-checkpoint) gives the final model's tensors bit for bit. In mixed precision
    (bf16) too: the fp32 main weights are the optimizer's state in the checkpoint."""
    import safetensors.torch

    flags = ("--dsrl.run.rollouts", "4", "--dsrl.sft.steps", "5", "--dsrl.run.save_every", "2", *precision)
    whole = _train(tmp_path, "whole", "tiny_grpo_megatron_cpu.json", *flags)
    parts = tmp_path / "parts"
    _train(tmp_path, "parts", "tiny_grpo_megatron_cpu.json", *flags, "--dsrl.run.stop_after_rollouts", "2")
    assert not (parts / "final_model").exists()
    _train(tmp_path, "parts", "tiny_grpo_megatron_cpu.json", *flags, "--resume", "auto")

    assert _timeless(_rows(parts, "rollout")) == _timeless(_rows(whole, "rollout"))
    a = safetensors.torch.load_file(whole / "final_model" / "model.safetensors")
    b = safetensors.torch.load_file(parts / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    manifest = json.loads((parts / "checkpoints" / "rollout4" / "MANIFEST.json").read_text())
    assert manifest["engines"]["."]["engine"] == "megatron"

    assert manifest["engines"]["."]["tensor_model_parallel_size"] == 2

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(whole / "final_model", dtype="auto")
    assert model.dtype == (torch.bfloat16 if precision else torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], a[k]) for k in a)  # what transformers loads is what was exported

    from dsrl.checkpoint.export import export_checkpoint

    exported = export_checkpoint(str(parts), str(tmp_path / "exported"))  # offline, from the dist-checkpoint
    c = safetensors.torch.load_file(Path(exported) / "model.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(c[k], a[k]) for k in a)  # the live export's tensors, bit for bit


@EXTENDED
def test_multi_turn_tool_rollouts_on_megatron_match_deepspeeds(tmp_path):
    """configs/tiny_tool_cpu.json (the calculator tool, 200 warm-up steps) on both engines at DP = 2: the tool is
    called (multi-turn episodes run through the synced rollout model), and the first rollout samples the same episodes
    and makes the same step (within 1e-5) as DeepSpeed's; behaviour log-probs within 1e-5 of the trainer's."""
    raw = json.loads((REPO / "configs" / "tiny_tool_cpu.json").read_text())
    megatron = {k: v for k, v in raw.items() if k != "zero_optimization"}
    megatron["dsrl"] = {**raw["dsrl"], "engine": {"kind": "megatron"}}
    rows = {}
    for name, run in (("deepspeed", raw), ("megatron", megatron)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(run))
        out = tmp_path / name
        launch(["launch/train.py", "--ds_config", str(path), "--dsrl.run.output_dir", str(out), "--dsrl.run.rollouts",
                "2", "--dsrl.run.save_every", "0", "--dsrl.run.save_final", "false", "--dsrl.run.progress_bar",
                "false"], nprocs=2, timeout=900)
        rows[name] = _rows(out, "rollout")
    ds, mg = rows["deepspeed"], rows["megatron"]
    assert len(mg) == 2 and mg[0]["tool_calls_per_trajectory"] > 0.1, mg[0]
    same = ("reward_mean", "response_len", "turns_per_trajectory", "tool_calls_per_trajectory")
    assert {k: mg[0][k] for k in same} == {k: ds[0][k] for k in same}
    for key in ("loss", "grad_norm"):
        assert abs(mg[0][key] - ds[0][key]) <= 1e-5 * max(abs(ds[0][key]), 1e-3), (key, mg[0][key], ds[0][key])
    assert max(r["rollout_logprob_abs_diff"] for r in mg) <= 1e-5


PPO_FLAGS = ("--dsrl.run.rollouts", "4", "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.samples_per_prompt",
             "4", "--dsrl.batch.mini_batch_size", "16", "--dsrl.batch.epochs_per_rollout", "2", "--dsrl.sft.steps", "2",
             "--dsrl.critic.warmup_rollouts", "1", "--dsrl.run.save_every", "2", "--dsrl.run.save_final", "false")


def _ppo_file(tmp_path: Path, engine: dict | None) -> str:
    """configs/tiny_ppo_cpu.json with a 2-step warm-up of its schedules, on DeepSpeed (ZeRO-2) or on ``engine``."""
    raw = json.loads((REPO / "configs" / "tiny_ppo_cpu.json").read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    if engine is not None:
        raw = {k: v for k, v in raw.items() if k != "zero_optimization"}
        raw["dsrl"]["engine"] = engine
    path = tmp_path / f"ppo_{'deepspeed' if engine is None else 'megatron'}.json"
    path.write_text(json.dumps(raw))
    return str(path)


@EXTENDED
def test_ppo_trains_its_critic_on_megatron_as_on_deepspeed_and_resumes_bit_for_bit(tmp_path):
    """PPO (configs/tiny_ppo_cpu.json, a critic-only first rollout) with the critic on the Megatron engine beside the
    policy: at DP = 2 every step row of 4 rollouts (policy and critic loss and gradient norm) is DeepSpeed ZeRO-2's
    within 1e-5 and every rollout samples the same rewards and values; at PP = 2 (the values pass through Megatron's
    forward-only schedule, the value head on the last stage) a run stopped after its rollout-2 checkpoint and resumed
    gives the rows of the run that was not stopped, bit for bit, so both engines' dist-checkpoints were restored."""
    rows = {}
    for name, engine in (("deepspeed", None), ("megatron", {"kind": "megatron"})):
        out = tmp_path / name
        launch(["launch/train.py", "--ds_config", _ppo_file(tmp_path, engine), "--dsrl.run.output_dir", str(out),
                "--dsrl.run.progress_bar", "false", *PPO_FLAGS], nprocs=2, timeout=900)
        rows[name] = (_rows(out, "step"), _rows(out, "rollout"))
    (ds_steps, ds_rollouts), (mg_steps, mg_rollouts) = rows["deepspeed"], rows["megatron"]
    assert len(mg_steps) == 16 and "critic_loss" in mg_steps[0] and "loss" not in mg_steps[0]
    for d, m in zip(ds_steps, mg_steps, strict=True):
        for key in ("loss", "grad_norm", "critic_loss", "critic_grad_norm"):
            assert (key in d) == (key in m)
            if key in d:
                assert abs(m[key] - d[key]) <= 1e-5 * max(abs(d[key]), 1e-2), (key, m, d)
        assert m.get("lr") == d.get("lr") and m["critic_lr"] == d["critic_lr"]
    for d, m in zip(ds_rollouts, mg_rollouts, strict=True):
        assert m["reward_mean"] == d["reward_mean"] and abs(m["value_mean"] - d["value_mean"]) <= 1e-5, (m, d)

    pp2 = _ppo_file(tmp_path, {"kind": "megatron", "pipeline_model_parallel_size": 2})
    whole, parts = tmp_path / "pp2_whole", tmp_path / "pp2_parts"
    common = ["launch/train.py", "--ds_config", pp2, "--dsrl.run.progress_bar", "false", *PPO_FLAGS]
    launch([*common, "--dsrl.run.output_dir", str(whole)], nprocs=2, timeout=900)
    launch([*common, "--dsrl.run.output_dir", str(parts), "--dsrl.run.stop_after_rollouts", "2"], nprocs=2,
           timeout=900)
    launch([*common, "--dsrl.run.output_dir", str(parts), "--resume", "auto"], nprocs=2, timeout=900)

    def untimed(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.endswith("_s") and "per_s" not in k and "mib" not in k}
                for r in rows]

    for event in ("step", "rollout"):
        assert untimed(_rows(parts, event)) == untimed(_rows(whole, event))
    manifest = json.loads((parts / "checkpoints" / "rollout4" / "MANIFEST.json").read_text())
    assert manifest["engines"]["critic"]["engine"] == "megatron"
    assert manifest["engines"]["critic"]["pipeline_model_parallel_size"] == 2


def _assert_same_ppo_rows(plain: tuple[list[dict], list[dict]], split: tuple[list[dict], list[dict]]) -> None:
    """Two PPO runs of one replica on different layouts, as ``(step rows, rollout rows)``: 16 steps, each within 1e-5
    (policy and critic), the same rewards, values within 1e-6, and the second run's behaviour log-probs within 1e-5
    of its trainer's."""
    (plain_steps, plain_rollouts), (steps, rollouts) = plain, split
    assert len(steps) == 16
    for d, m in zip(plain_steps, steps, strict=True):
        for key in ("loss", "grad_norm", "critic_loss", "critic_grad_norm"):
            if key in d:
                assert abs(m[key] - d[key]) <= 1e-5 * max(abs(d[key]), 1e-2), (key, m, d)
    assert [r["reward_mean"] for r in rollouts] == [r["reward_mean"] for r in plain_rollouts]
    assert max(abs(a["value_mean"] - b["value_mean"]) for a, b in zip(rollouts, plain_rollouts)) <= 1e-6
    assert max(r["rollout_logprob_abs_diff"] for r in rollouts) <= 1e-5


@EXTENDED
def test_sequence_parallelism_changes_no_row_of_a_ppo_run(tmp_path):
    """PPO at TP = 2 with and without megatron-core's sequence parallelism (the positions split over the tensor group
    for both the policy and the critic, dsrl.backends.megatron.sequence_parallel): one replica, so the same
    completions; every step row within 1e-5 (seen: 5.2e-7), the same rewards, the same values within 1e-6, and the
    synced replica's behaviour log-probs within 1e-5 of the trainer's."""
    rows = {}
    for name, split in (("plain", False), ("split", True)):
        engine = {"kind": "megatron", "tensor_model_parallel_size": 2, "sequence_parallel": split}
        out = tmp_path / name
        launch(["launch/train.py", "--ds_config", _ppo_file(tmp_path, engine), "--dsrl.run.output_dir", str(out),
                "--dsrl.run.progress_bar", "false", *PPO_FLAGS], nprocs=2, timeout=900)
        rows[name] = (_rows(out, "step"), _rows(out, "rollout"))
    _assert_same_ppo_rows(rows["plain"], rows["split"])


@EXTENDED
def test_context_parallelism_changes_no_row_of_a_ppo_run_and_resumes_bit_for_bit(tmp_path):
    """PPO with the policy and the critic at CP = 2 (each row cut into the context group's chunks, dsrl's all-gather
    attention, dsrl.backends.megatron.context_parallel) against TP = 2: one replica in both, so the same completions;
    every step row within 1e-5, the same rewards, values within 1e-6, behaviour log-probs within 1e-5 of the
    trainer's. Stopped after rollout 2's checkpoint and resumed, the CP run gives its own rows bit for bit, and the
    checkpoint's manifest records the context-parallel size."""
    runs = {}
    for name, engine, extra in (
            ("tp2", {"kind": "megatron", "tensor_model_parallel_size": 2}, ()),
            ("cp2", {"kind": "megatron", "context_parallel_size": 2}, ()),
            ("parts", {"kind": "megatron", "context_parallel_size": 2}, ("--dsrl.run.stop_after_rollouts", "2")),
            ("parts", {"kind": "megatron", "context_parallel_size": 2}, ("--resume", "auto"))):
        out = tmp_path / name
        launch(["launch/train.py", "--ds_config", _ppo_file(tmp_path, engine), "--dsrl.run.output_dir", str(out),
                "--dsrl.run.progress_bar", "false", *PPO_FLAGS, *extra], nprocs=2, timeout=900)
        runs[name] = (_rows(out, "step"), _rows(out, "rollout"))
    _assert_same_ppo_rows(runs["tp2"], runs["cp2"])
    steps, rollouts = runs["cp2"]

    assert _timeless(runs["parts"][1]) == _timeless(rollouts)
    assert _timeless(runs["parts"][0]) == _timeless(steps)
    manifest = json.loads((tmp_path / "parts" / "checkpoints" / "rollout4" / "MANIFEST.json").read_text())
    assert manifest["engines"]["."]["context_parallel_size"] == 2


@EXTENDED
def test_a_learned_reward_model_scores_beside_megatron_as_beside_deepspeed(tmp_path):
    """A tiny learned reward model (summed with the rule reward) placed by the Megatron engine (a frozen replica on
    every rank) with DAPO's dynamic sampling, whose redraws give the ranks different numbers of sequences to score:
    at DP = 2 every rollout has DeepSpeed ZeRO-2's rewards and steps within 1e-5."""
    raw = reward_model_job(tmp_path)
    rows = {}
    for name in ("deepspeed", "megatron"):
        run = raw if name == "deepspeed" else {k: v for k, v in raw.items() if k != "zero_optimization"}
        if name == "megatron":
            run["dsrl"] = {**raw["dsrl"], "engine": {"kind": "megatron"}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(run))
        out = tmp_path / name
        launch(["launch/train.py", "--ds_config", str(path), "--dsrl.run.rollouts", "3", "--dsrl.run.output_dir",
                str(out), "--dsrl.run.progress_bar", "false", "--dsrl.run.save_final", "false"], nprocs=2,
               timeout=900)
        rows[name] = _rows(out, "rollout")
    ds, mg = rows["deepspeed"], rows["megatron"]
    assert len(mg) == 3 and max(r["sampling_rounds"] for r in mg) > 1
    for d, m in zip(ds, mg, strict=True):
        assert m["sampling_rounds"] == d["sampling_rounds"]
        for key in ("reward_mean", "reward_std", "loss", "grad_norm"):
            assert abs(m[key] - d[key]) <= 1e-5 * max(abs(d[key]), 1e-2), (key, m[key], d[key])


@EXTENDED
def test_a_checkpoint_resumes_on_another_megatron_layout(tmp_path):
    """A run at TP = 2 stopped after its rollout-2 checkpoint resumes at PP = 2 (megatron-core's dist-checkpointing
    reshards the model and the optimizer) and continues as the run that was not stopped: the same rewards, LR and
    optimizer steps, losses and gradient norms within 1e-5 (one replica samples on rank 0 in both layouts; the
    kernels differ). The same checkpoint also resumes on one rank (TP = PP = 1), which has no random state saved for
    it, and finishes the run; both resumes say what they did."""
    import shutil

    flags = ("--dsrl.run.rollouts", "4", "--dsrl.sft.steps", "5", "--dsrl.run.save_every", "2",
             "--dsrl.run.save_final", "false")
    whole = _train(tmp_path, "whole", "tiny_grpo_megatron_cpu.json", *flags)
    parts = _train(tmp_path, "parts", "tiny_grpo_megatron_cpu.json", *flags, "--dsrl.run.stop_after_rollouts", "2")
    shutil.copytree(parts, tmp_path / "one_rank")
    pp2 = ("--dsrl.engine.tensor_model_parallel_size", "1", "--dsrl.engine.pipeline_model_parallel_size", "2")
    proc = launch(["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_megatron_cpu.json"),
                   "--dsrl.run.output_dir", str(parts), "--dsrl.run.progress_bar", "false", *flags, *pp2,
                   "--resume", "auto"], nprocs=2, timeout=900)
    said = "written on another Megatron layout (tensor_model_parallel_size 2 -> 1, pipeline_model_parallel_size 1 -> 2)"
    assert said in proc.stdout + proc.stderr
    want = _rows(whole, "rollout")

    def continues_as_whole(got: list[dict]) -> None:
        assert [r["rollout"] for r in got] == [1, 2, 3, 4]
        for w, g in zip(want[2:], got[2:], strict=True):
            assert (g["reward_mean"], g["lr"], g["optimizer_step"]) == (w["reward_mean"], w["lr"], w["optimizer_step"])
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - w[key]) <= 1e-5 * max(abs(w[key]), 1e-2), (key, g[key], w[key])

    continues_as_whole(_rows(parts, "rollout"))
    one = launch(["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_megatron_cpu.json"),
                  "--dsrl.run.output_dir", str(tmp_path / "one_rank"), "--dsrl.run.progress_bar", "false", *flags,
                  "--dsrl.engine.tensor_model_parallel_size", "1", "--resume", "auto"], nprocs=1, timeout=900)
    assert "written on another Megatron layout (tensor_model_parallel_size 2 -> 1)" in one.stdout + one.stderr
    continues_as_whole(_rows(tmp_path / "one_rank", "rollout"))
