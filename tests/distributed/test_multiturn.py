"""Multi-turn rollouts on 2 CPU ranks (issue 21).

- a short run under ZeRO-3 with PPO (critic, GAE over model tokens), the KL penalty in the reward and the cb
  backend, whose ranks' trajectories take different numbers of turns (3 on rank 0, 1 on rank 1): the ranks still
  run the same generate calls (no hang), an environment call past data.environment_timeout_s on rank 1 masks its
  trajectory and is counted, and the multi-turn metrics are written;
- an environment that never returns on rank 1 (no environment timeout): rank 0 says every run.wait_report_s
  which rank it waits for, which sample that rank's environment is on and for how long, and the collective
  bound ends the job naming the environment phase and rank 1.
"""

from __future__ import annotations

import json
import time

from conftest import EXTENDED, REPO, launch

FIXTURE = "tests/data/environment_fixture.py"


def _config(tmp_path, **dsrl) -> str:
    raw = json.loads((REPO / "configs" / "tiny_tool_cpu.json").read_text())
    raw.pop("csv_monitor", None)
    raw.pop("scheduler")  # a short run: no warm-up longer than the run
    raw["dsrl"]["batch"].update(prompts_per_rollout=4, samples_per_prompt=4, mini_batch_size=8)
    raw["dsrl"]["sft"] = {"steps": 10}
    for key, value in dsrl.items():
        raw["dsrl"].setdefault(key, {}).update(value)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _rows(out, event):
    return [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def test_zero3_ppo_cb_trajectories_with_an_environment_timeout(tmp_path):
    out = tmp_path / "out"
    config = _config(tmp_path, algorithm={"name": "ppo", "kl_coef": 0.05, "kl_in": "reward"}, sft={"steps": 0})
    raw = json.loads(open(config).read())
    raw["zero_optimization"] = {"stage": 3}
    open(config, "w").write(json.dumps(raw))
    launch(["launch/train.py", "--ds_config", config, "--dsrl.run.rollouts", "2", "--dsrl.run.output_dir", str(out),
            "--dsrl.run.progress_bar", "false", "--dsrl.rollout.backend", "cb",
            "--dsrl.data.environment", f"{FIXTURE}:RankDependent", "--dsrl.data.environment_timeout_s", "2"],
           nprocs=2, timeout=400)
    rows = _rows(out, "rollout")
    assert [r["rollout"] for r in rows] == [1, 2]
    first, second = rows
    assert first["environment_timeouts"] == 1 and first["masked_samples"] >= 1 and second["environment_timeouts"] == 0
    for r in rows:  # rank 0's 8 trajectories take 3 turns (or end at the token bound), rank 1's 8 one
        assert 1.5 <= r["turns_per_trajectory"] <= 2.0 and r["observation_tokens_per_trajectory"] >= 2.0
        assert r["value_loss"] == r["value_loss"] and r["loss"] == r["loss"]  # finite: nothing non-finite trained
    assert first["environment_s"] >= 1.0  # the 2 s the slow call took on rank 1, averaged over 2 ranks
    for r in rows:  # every phase ran (PPO with a KL reference, multi-turn turns as generation), peaks known
        for p in ("generate", "reward", "old_logprobs", "ref_logprobs", "critic_values", "train"):
            assert r[f"phase_{p}_s"] > 0 and r[f"peak_{p}_mib"] > 0, (p, r)


@EXTENDED
def test_stuck_environment_is_reported_then_named_by_the_collective_bound(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = launch(["launch/train.py", "--ds_config", _config(tmp_path, sft={"steps": 0}), "--dsrl.run.rollouts", "1",
                   "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false",
                   "--dsrl.data.environment", f"{FIXTURE}:HangOnRank1", "--dsrl.data.environment_timeout_s", "null",
                   "--dsrl.run.collective_timeout_s", "9", "--dsrl.run.wait_report_s", "2",
                   "--dsrl.run.stop_grace_s", "2"], nprocs=2, timeout=300, check=False)
    wall = time.monotonic() - start
    assert proc.returncode != 0
    reports = [ln for ln in proc.stdout.splitlines() if "rank 0 has waited" in ln]
    assert len(reports) >= 3, proc.stdout[-3000:]
    first = reports[0]
    assert "at the end of the environment phase for rank 1 in environment for" in first, first
    assert f"calling dsrl.data.environment = '{FIXTURE}:HangOnRank1' step() of turn 0 for prompt" in first, first
    assert ", sample 1 of 4, model turn" in first and "(dsrl.run.collective_timeout_s)" in first, first
    assert "rank 1 did not finish the environment phase within 9 s" in proc.stderr, proc.stderr[-3000:]
    assert wall < 200, wall  # the hanging rank sleeps for an hour
