"""dsrl.memory.offload_states on 2 CPU ranks: training is bitwise the same with it on or off.

Each case trains the same run twice, offload off and on, and compares every sft, step and rollout row of
metrics.jsonl (timings, peak memory and the traffic fields aside) and every exported weight, bit for bit; the run
with the offload on must have moved bytes in every rollout (on the CPU accelerator device and host are one memory,
but DeepSpeed's offload still copies the buffers into fresh host buffers, and the frozen models' reload copies
into fresh device buffers), the run without it none.

- ZeRO-2 with a frozen KL reference and a learned reward model (both plain modules: they leave the "device"
  between their passes), in the README suite;
- ZeRO-1 with LoRA (the adapters' optimizer states), ZeRO-3 with PPO (the policy's and the critic's engines, and
  the KL reference as a sharded ZeRO-3 engine; every parameter partitioned; DeepSpeed's FusedAdam on both runs),
  and the default ZeRO-3 config (``{"stage": 3}`` alone: DeepSpeed's persistence threshold keeps the tiny model's
  parameters gathered; torch's AdamW, dsrl's CPU default, on both runs: an offloading ZeRO-3 run used to get
  DeepSpeed's FusedAdam instead, and differed from the first update on), in the extended tier.

A planted bug fails these tests: a reload that does nothing is refused at the next step (the engine still
reports offloaded states), and a reload that restores the first offload's optimizer states changes the steps.

One rank, ZeRO-2 and ZeRO-3, in the extended tier (tests/workers/offload_worker.py): with Python's
garbage collector off, the offload leaves no live tensor on a storage the training state used (reference counting
releases it: the garbage collections inside DeepSpeed's offload_states are made to scan nothing), a step while
offloaded is refused, the reload gives every state tensor back bit for bit (and leaves none of the offload's host
buffers in the optimizer's state, which a checkpoint would save), and the frozen reference's pass gives
the same log-probs around its offloads, from aligned views, with its host copy written once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import EXTENDED, REPO, launch, write_json

TIMED = ("_s", "tokens_per_s", "_mib", "_bytes")
ARGS = ["--dsrl.run.rollouts", "3", "--dsrl.sft.steps", "4", "--dsrl.run.progress_bar", "false",
        "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.mini_batch_size", "32"]


def _rows(out: Path, event: str, keep_timed: bool = False) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if keep_timed or not k.endswith(TIMED)} for r in rows if r["event"] == event]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final_model" / "model.safetensors"))


def _run_file(tmp: Path, case: str) -> Path:
    name = "tiny_grpo_lora_cpu.json" if case == "zero1-lora" else "tiny_grpo_cpu.json"
    raw = json.loads((REPO / "configs" / name).read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    d = raw["dsrl"]
    if case == "zero2-kl-rm":
        from dsrl.config import ModelConfig
        from dsrl.rl.policy.tokenizer import load_tokenizer
        from dsrl.rl.rewards.model import save_tiny_reward_model

        d["algorithm"]["kl_coef"] = 0.05
        d["data"].update(reward_model=save_tiny_reward_model(str(tmp / "rm"), load_tokenizer(ModelConfig())),
                         reward_model_weight=0.1)
    elif case == "zero1-lora":
        raw["zero_optimization"]["stage"] = 1
    elif case == "zero3-default":  # DeepSpeed's defaults: the tiny model's parameters all stay gathered (persistent)
        raw["zero_optimization"] = {"stage": 3}
    else:  # zero3-ppo: every parameter partitioned; DeepSpeed's FusedAdam on both runs (dsrl moves any optimizer's)
        raw["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        raw["optimizer"]["params"]["torch_adam"] = False
        d["algorithm"] = {"name": "ppo", "gamma": 1.0, "lam": 0.95, "kl_coef": 0.05}
        d["critic"] = {"warmup_rollouts": 1, "value_clip": 0.2}
    return write_json(tmp / f"{case}.json", raw)


def _same_training(tmp: Path, case: str) -> None:
    run_file = _run_file(tmp, case)
    outs = {}
    for offload in ("false", "true"):
        outs[offload] = tmp / f"offload_{offload}"
        launch(["launch/train.py", "--ds_config", str(run_file), *ARGS, "--dsrl.run.output_dir", str(outs[offload]),
                "--dsrl.memory.offload_states", offload], nprocs=2, timeout=900)
    off, on = outs["false"], outs["true"]
    for event in ("sft", "step", "rollout"):
        want, got = _rows(off, event), _rows(on, event)
        assert len(got) == len(want) and got == want, (event, [(a, b) for a, b in zip(want, got) if a != b][:1])
    moved = _rows(on, "rollout", keep_timed=True)
    assert len(moved) == 3 and all(r["offload_bytes"] > 0 for r in moved), moved  # it really ran, every rollout
    assert all(r["offload_bytes"] == 0 and r["reload_bytes"] == 0 for r in _rows(off, "rollout", keep_timed=True))
    a, b = _weights(off), _weights(on)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_offload_is_bitwise_the_same_zero2_with_reference_and_reward_model(tmp_path):
    _same_training(tmp_path, "zero2-kl-rm")


@EXTENDED
@pytest.mark.parametrize("case", ["zero1-lora", "zero3-ppo", "zero3-default"])
def test_offload_is_bitwise_the_same(tmp_path, case):
    _same_training(tmp_path, case)


@EXTENDED
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_releases_the_state_and_gives_it_back(tmp_path, stage):
    out = tmp_path / "report.json"
    launch(["tests/workers/offload_worker.py", "--out", str(out), "--stage", str(stage)], nprocs=1, timeout=600)
    r = json.loads(out.read_text())
    assert r["steps"] > 0 and r["state_storages"] > 0 and r["offload_bytes"] > 0, r
    assert r["still_alive"] == 0, r  # no view kept a moved buffer alive
    assert "were offloaded to the host" in r["step_while_offloaded"], r
    assert r["reloaded_equal"], r
    assert not [k for k in r["optimizer_state_keys"] if "offload" in k], r  # checkpoints hold no host copies
    assert r["reference_equal"] and r["reference_aligned"] and r["reference_host_reused"], r
    assert not r["reference_resident"] and r["reference_tensors"] > 0, r
