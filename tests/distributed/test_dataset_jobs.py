"""Real 2-rank jobs on datasets as users hold them (extended tier): a hub snapshot directory with a subset and chat
message prompts, scored by the built-in ``math`` reward and by a TRL-style reward function that takes a column by
name; every dataset here is written by the test."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import EXTENDED, REPO, launch

from dsrl.tasks import verifiable

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
---
"""
REWARDS = '''
from dsrl.tasks import math_reward


def graded(completions, answer, level, **kwargs):
    """TRL-style: everything by name; the column level must arrive as a list of ints, one per completion."""
    assert len(level) == len(completions) and all(isinstance(x, int) for x in level), level
    assert "prompts" in kwargs and all(isinstance(p, list) for p in kwargs["prompts"])  # the message lists
    return [r * (1 + 0.1 * x) for r, x in zip(math_reward(kwargs["prompts"], completions, answer), level)]
'''


def snapshot(root: Path) -> Path:
    rows = []
    for i in range(32):
        a, b = i % 10, (3 * i) % 10
        rows.append({"messages": [{"role": "user", "content": f"add: {a}+{b} ="}],
                     "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}", "level": i % 3})
    (root / "main").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(root / "main" / "train-00000-of-00001.parquet")
    (root / "README.md").write_text(README, encoding="utf-8")
    return root


@EXTENDED
@pytest.mark.skipif(not verifiable.has_math_verify(), reason='needs pip install -e ".[math]"')
@pytest.mark.parametrize("reward", ["math", "graded"])
def test_a_snapshot_with_chat_prompts_trains_with_math_and_column_rewards(tmp_path, reward):
    data = snapshot(tmp_path / "snapshot")
    (tmp_path / "my_rewards.py").write_text(REWARDS, encoding="utf-8")
    spec = "math" if reward == "math" else f"{tmp_path / 'my_rewards.py'}:graded"
    out = tmp_path / "run"
    proc = launch(["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_cpu.json"),
                   "--dsrl.data.task", "null", "--dsrl.data.path", str(data), "--dsrl.data.subset", "main",
                   "--dsrl.data.prompt_key", "messages", "--dsrl.data.system_prompt", "answer with a number.",
                   "--dsrl.data.max_prompt_tokens", "64", "--dsrl.data.reward_fn", spec,
                   "--dsrl.run.rollouts", "3", "--dsrl.sft.steps", "20", "--dsrl.run.save_every", "0",
                   "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false"], nprocs=2, timeout=900)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert len(rollouts) == 3, proc.stdout[-3000:]
    assert all(r["reward_timeouts"] == 0 and 0 <= r["reward_mean"] <= 1.2 for r in rollouts), rollouts
    if reward == "math":  # the built-in reward is the accuracy too
        assert all(r["accuracy"] == r["reward_mean"] for r in rollouts), rollouts
    else:
        assert all(r["accuracy"] is None for r in rollouts)
