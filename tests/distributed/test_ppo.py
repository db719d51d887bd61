"""PPO with a critic, and a learned reward model, on 2 CPU ranks: a kill -9 mid-checkpoint then resume continues
bitwise (policy and critic, losses and weights); PPO learns under ZeRO-3 with the critic's counts kept equal; a
reward model sharded under ZeRO-3 scores uneven prompt counts per rank. (Value-loss and GSPO exactness:
test_exactness.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import EXTENDED, REPO, launch, reward_model_job

PPO = REPO / "configs" / "tiny_ppo_cpu.json"


def _rows(out: Path, event: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == event]


def _run_file(tmp_path: Path, stage: int = 2, critic_stage: int | None = None, warmup: int = 1) -> Path:
    raw = json.loads(PPO.read_text())
    # persistence threshold 0: ZeRO-3 partitions even the tiny model's parameters and gathers them in every forward
    raw["zero_optimization"] = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    if critic_stage is not None:
        raw["dsrl"]["critic"]["zero_optimization"] = {
            "stage": critic_stage, **({"stage3_param_persistence_threshold": 0} if critic_stage == 3 else {})}
    raw["dsrl"]["critic"]["warmup_rollouts"] = warmup
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return path


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .pt file under ``directory`` (model, optimizer and ZeRO shards), by file and key --
    except ZeRO's flat fp32 partitions, whose alignment padding DeepSpeed leaves uninitialized (it differs between
    runs; the parameters in them are compared consolidated, see _fp32_weights)."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj) -> None:
        if prefix.endswith("fp32_flat_groups"):
            return
        if torch.is_tensor(obj):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    for f in sorted(directory.rglob("*.pt")):
        walk(str(f.relative_to(directory)), torch.load(f, map_location="cpu", weights_only=False))
    return out


def _fp32_weights(checkpoints: Path, tag: str, sub: str = "") -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of one engine of a checkpoint (DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if sub:
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoints / tag), tag=sub)
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag)


RESUME_ARGS = ["--dsrl.run.rollouts", "4", "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.samples_per_prompt",
               "4", "--dsrl.batch.mini_batch_size", "16", "--dsrl.batch.epochs_per_rollout", "2",
               "--dsrl.sft.steps", "2", "--dsrl.run.save_every", "1", "--dsrl.run.keep_last", "4",
               "--dsrl.run.progress_bar", "false"]


@EXTENDED
def test_ppo_kill_mid_checkpoint_then_resume_is_bitwise(tmp_path):
    """Policy on ZeRO-2, critic on ZeRO-3 (its own section), one critic-only rollout: rank 0 is killed with SIGKILL
    while writing the rollout-3 checkpoint; the resumed run's step losses (policy and critic) and every tensor of
    the final checkpoint (both engines' weights, optimizer states, schedules) equal an uninterrupted run's."""
    run_file = _run_file(tmp_path, stage=2, critic_stage=3, warmup=1)
    ref, cut = tmp_path / "reference", tmp_path / "killed"
    launch(["launch/train.py", "--ds_config", str(run_file), *RESUME_ARGS, "--dsrl.run.output_dir", str(ref)],
           nprocs=2, timeout=600)
    proc = launch(["launch/train.py", "--ds_config", str(run_file), *RESUME_ARGS, "--dsrl.run.output_dir", str(cut)],
                  nprocs=2, timeout=600, env={"DSRL_FAULT_KILL_DURING_SAVE": "rollout3"}, check=False)
    assert proc.returncode != 0
    assert (cut / "checkpoints" / "latest").read_text().strip() == "rollout2"
    launch(["launch/train.py", "--ds_config", str(run_file), *RESUME_ARGS, "--dsrl.run.output_dir", str(cut),
            "--resume", "auto"], nprocs=2, timeout=600)

    want, got = _rows(ref, "step"), _rows(cut, "step")
    # 4 rollouts x 4 mini-batches; the first rollout trains only the critic (no policy loss in its rows)
    assert len(want) == 16 and all("loss" not in r for r in want[:4]) and all("loss" in r for r in want[4:])
    assert [r["optimizer_step"] for r in want] == [2] * 4 + list(range(3, 15))  # 2 supervised warm-up steps first
    keys = ("optimizer_step", "loss", "critic_loss", "lr", "critic_lr", "critic_grad_norm")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in want]  # bitwise on CPU
    untimed = [[{k: v for k, v in r.items() if k != "step_s"} for r in _rows(o, "sft")] for o in (cut, ref)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2
    a, b = _tensors(ref / "checkpoints" / "rollout4"), _tensors(cut / "checkpoints" / "rollout4")
    assert a.keys() == b.keys() and any(k.startswith("critic/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    for sub in ("", "critic"):  # master weights of the policy (ZeRO-2) and the critic (ZeRO-3)
        wa, wb = (_fp32_weights(o / "checkpoints", "rollout4", sub) for o in (ref, cut))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "score.weight" in _fp32_weights(ref / "checkpoints", "rollout4", "critic")


@EXTENDED
def test_ppo_learns_under_zero3(tmp_path):
    """PPO from scratch (no supervised warm-up) with policy and critic both on ZeRO-3 and token-budget
    micro-batches (per-rank counts differ, fillers keep forwards/backwards equal): the mean reward of the last 10
    of 40 rollouts is at least twice the first 10's and 0.05 higher, and the critic's values rise with it."""
    out = tmp_path / "out"
    rollouts = 40
    launch(["launch/train.py", "--ds_config", str(_run_file(tmp_path, stage=3, warmup=2)), "--dsrl.run.rollouts",
            str(rollouts), "--dsrl.sft.steps", "0", "--dsrl.batch.samples_per_prompt", "4",
            "--dsrl.batch.mini_batch_size", "32", "--dsrl.batch.max_tokens_per_micro_batch", "256",
            "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false", "--dsrl.run.save_final", "false"],
           nprocs=2, timeout=900)
    rollout_rows = _rows(out, "rollout")
    rewards = [r["reward_mean"] for r in rollout_rows]
    assert len(rewards) == rollouts
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last - first > 0.05, (first, last, rewards)
    values = [r["value_mean"] for r in rollout_rows]
    assert sum(values[-10:]) / 10 - sum(values[:10]) / 10 > 0.02, values
    assert rollout_rows[-1]["critic_optimizer_step"] == 2 * rollouts  # the critic stepped on every mini-batch
    assert rollout_rows[-1]["optimizer_step"] == 2 * (rollouts - 2)  # the policy after 2 critic-only rollouts


def test_reward_model_zero3_uneven_prompt_counts(tmp_path):
    """A tiny learned reward model (built from a config, saved with save_pretrained) summed with the task's rule
    reward, sharded under ZeRO-3 (every parameter partitioned). DAPO's dynamic sampling redraws different numbers
    of prompts per rank, so the ranks score different numbers of sequences: filler forwards keep the sharded
    model's forwards equal (without them the job hangs)."""
    raw = reward_model_job(tmp_path)
    # persistence threshold 0: the tiny models' parameters are partitioned and gathered in every forward
    raw["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    (tmp_path / "run.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(tmp_path / "run.json"), "--dsrl.run.rollouts", "3",
            "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false", "--dsrl.run.save_final", "false"],
           nprocs=2, timeout=600)
    rollouts = _rows(out, "rollout")
    assert len(rollouts) == 3
    assert sum(r["reward_model_fillers"] for r in rollouts) > 0, rollouts  # uneven counts happened
    assert max(r["sampling_rounds"] for r in rollouts) > 1
