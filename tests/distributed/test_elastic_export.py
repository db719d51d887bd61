"""Elastic resume (2 -> 1 -> 2 ranks, ZeRO-2 and ZeRO-3) through DeepSpeed's universal checkpoint, and
export of the trained policy as a Hugging Face model directory (issue 12, items 2 and 7; the ZeRO-2
chain's first run also carries item 5's reward timeout, to save a launch).

One chain per stage: 2 ranks train rollout 1 and stop; 1 rank resumes it (the checkpoint is converted
to the universal format) and trains rollout 2; 2 ranks resume that one (converted again) and finish
rollout 3, exporting ``final_model``. At each resume the engine's full parameters equal the
checkpoint's consolidated fp32 weights bitwise, the optimizer step continues, and every optimizer
step of the whole run used the LR of the planned curve. The exported model reproduces the trained
engine's logits, and ``dsrl export`` writes the same weights from a ZeRO shard directory alone.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from conftest import EXTENDED, REPO, launch, one_rank

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

WORKER = "tests/workers/reliability_worker.py"
ROLLOUTS = 3


def run_file(tmp_path, stage: int) -> str:
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["sft"] = {"steps": 0}  # RL only (the default config's warm-up is not under test)
    raw["zero_optimization"] = {"stage": stage}
    raw["scheduler"]["params"]["warmup_num_steps"] = 3  # a warmup that ends mid-run, then cosine decay
    raw.pop("csv_monitor", None)
    raw["dsrl"]["batch"].update(prompts_per_rollout=8, samples_per_prompt=4, mini_batch_size=16)
    raw["dsrl"]["run"].update(rollouts=ROLLOUTS, save_every=1, keep_last=3)
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps(raw))
    return str(path)


def single(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """One rank with plain ``python`` (no launcher); must succeed."""
    proc = one_rank(args, timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def steps(out) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "step"]


def planned_lrs(config: str, n: int) -> list[float]:
    from dsrl.backends.deepspeed.schedule import lr_curve
    from dsrl.backends.deepspeed.validation import validated_deepspeed_config
    from dsrl.config import load_config
    from dsrl.core.plan import BatchPlan

    cfg = load_config(config)
    plan = BatchPlan.from_config(cfg, 2, cfg.dsrl.data.size)
    assert plan.total_optimizer_steps == n
    _, spec = validated_deepspeed_config(cfg, plan, on_gpu=False)
    return lr_curve(spec, cfg.ds_config["optimizer"]["params"]["lr"], list(range(1, n + 1)))


@pytest.mark.parametrize("stage", [2, 3])
def test_elastic_resume_and_export(stage, tmp_path):
    from dsrl.checkpoint.export import consolidated_state_dict

    config = run_file(tmp_path, stage)
    out = tmp_path / "out"
    common = [WORKER, "--ds_config", config, "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false"]
    # (ZeRO-2 only, to save a launch: item 5's reward timeout rides on the first run. Rank 1's first reward
    # call never returns; data.reward_timeout_s cuts it, masks that sample and counts it.)
    stuck = ["--dsrl.data.reward_fn", "tests/data/reward_fixture.py:hang_once_on_rank1",
             "--dsrl.data.reward_timeout_s", "2"] if stage == 2 else []
    first = launch([*common, "--dsrl.run.stop_after_rollouts", "1", *stuck], nprocs=2)
    if stuck:
        assert "did not return within 2 s (dsrl.data.reward_timeout_s)" in first.stdout, first.stdout[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        (row,) = [r for r in rows if r["event"] == "rollout"]
        assert row["reward_timeouts"] == 1 and row["masked_samples"] == 1
        # The same rewards for the rest of the run, from the fixture's non-hanging twin.
        common += ["--dsrl.data.reward_fn", "tests/data/reward_fixture.py:length_per_sample"]
    one = single([*common, "--dsrl.run.stop_after_rollouts", "1", "--dump_resumed", str(tmp_path / "r1.pt")])
    two = launch([*common, "--dump_resumed", str(tmp_path / "r2.pt"), "--dump_logits", str(tmp_path / "logits.pt")],
                 nprocs=2)
    ckpt = out / "checkpoints"
    for dump, tag, before, after, proc in (("r1.pt", "rollout1", 2, 1, one), ("r2.pt", "rollout2", 1, 2, two)):
        got = torch.load(tmp_path / dump, weights_only=False)
        notice = got["notice"] or ""
        assert f"written on {before} data-parallel rank(s) (ZeRO-{stage}), this run has {after}" in notice, notice
        assert "universal checkpoint" in notice and "elastic resume" in proc.stdout, notice
        assert (ckpt / tag / "universal").is_dir()
        # The engine holds the checkpoint's weights exactly, re-partitioned for the new rank count.
        want = consolidated_state_dict(str(ckpt / tag))
        assert got["params"] and set(got["params"]) <= set(want)
        assert all(torch.equal(got["params"][k], want[k]) for k in got["params"]), tag
        assert got["optimizer_steps"] == 2 * int(tag[-1])
    # Step counter and LR continue the planned curve across both changes of the rank count.
    rows = steps(out)
    assert [r["optimizer_step"] for r in rows] == list(range(1, 2 * ROLLOUTS + 1))
    lrs = planned_lrs(config, 2 * ROLLOUTS)
    assert all(math.isclose(r["lr"], lr, rel_tol=1e-12) for r, lr in zip(rows, lrs)), ([r["lr"] for r in rows], lrs)
    assert len(set(lrs)) > 3  # a real curve (warmup then decay), not a constant
    # Training continued after the second resume: the weights moved.
    final, resumed = consolidated_state_dict(str(ckpt / "rollout3")), consolidated_state_dict(str(ckpt / "rollout2"))
    assert any(not torch.equal(final[k], resumed[k]) for k in final)

    # Export: run.export_final wrote final_model; from_pretrained reproduces the trained engine's logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe = torch.load(tmp_path / "logits.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(out / "final_model", local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], use_cache=False).logits
    rel = ((logits - probe["logits"]).abs().max() / probe["logits"].abs().max()).item()
    print(f"ZeRO-{stage}: exported model vs trained engine, max relative logit difference {rel:.3g}")
    assert rel <= 1e-6, rel
    assert AutoTokenizer.from_pretrained(out / "final_model", local_files_only=True)("ab")["input_ids"]
    names = {p.name for p in (out / "final_model").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    # `dsrl export` from one ZeRO checkpoint directory (written by 1 rank; rollout3 by 2), in this process.
    from dsrl.cli.main import main as dsrl_cli

    target = tmp_path / "exported"
    assert dsrl_cli(["export", str(ckpt / "rollout2"), "--out", str(target)]) == 0
    assert dsrl_cli(["export", str(ckpt / "rollout2"), "--out", str(target)]) == 2  # exists: refused
    exported = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32).state_dict()
    want = consolidated_state_dict(str(ckpt / "rollout2"))
    assert all(torch.equal(exported[k], want[k]) for k in want if k in exported)
