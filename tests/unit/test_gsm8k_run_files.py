"""The GSM8K run files in configs/: `dsrl plan` accepts each on its world size without the weights or the data, and
`dsrl prepare-data gsm8k` writes the parquet they read, here from a local dataset in the hub's layout (no network).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO

from dsrl.cli.main import main
from dsrl.config import ConfigError, ModelConfig, load_config
from dsrl.rl.data.evalset import load_eval_prompts
from dsrl.rl.data.prompts import load_prompts
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.tasks import verifiable

RUN_FILES = {"gsm8k_qwen2.5_1.5b_8gpu.json": 8, "gsm8k_qwen2.5_0.5b_vllm_1gpu.json": 1}
README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
"""


def gsm8k_like(n: int, offset: int) -> list[dict]:
    return [{"question": f"natalia sold clips to {48 + i} of her friends in april, and then she sold half as many "
                         f"clips in may. how many clips did natalia sell altogether in april and may?",
             "answer": f"natalia sold {48 + i}/2 = <<{48 + i}/2={(48 + i) // 2}>>{(48 + i) // 2} clips in may.\n"
                       f"#### {(48 + i) + (48 + i) // 2}"} for i in range(offset, offset + 2 * n, 2)]


def hub_snapshot(root: Path) -> Path:
    """openai/gsm8k as a hub snapshot lays it out: README configurations, one folder each."""
    for sub, split, n in (("main", "train", 6), ("main", "test", 2), ("socratic", "train", 3)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        pd.DataFrame(gsm8k_like(n, 100 * len(sub) + len(split))).to_parquet(
            root / sub / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(README, encoding="utf-8")
    return root


@pytest.mark.parametrize("name,world", RUN_FILES.items())
def test_dsrl_plan_accepts_each_run_file_without_weights_or_data(name, world, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # plan looks nothing up (a look-up would refuse)
    path = REPO / "configs" / name
    assert main(["plan", "--ds_config", str(path), "--world_size", str(world), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rollouts"] == 116 and plan["world_size"] == world
    cfg = load_config(str(path))
    d = cfg.dsrl
    assert (d.data.path, d.data.split, d.data.reward_fn) == ("data/gsm8k", "train", "math")
    assert not Path(d.model.path).is_absolute() and d.model.path.startswith("models/Qwen2.5-")
    assert d.data.max_prompt_tokens == 512 and d.data.prompt_truncation == "error"  # never cut silently
    assert d.data.max_prompt_tokens + d.rollout.max_new_tokens <= d.batch.max_tokens_per_micro_batch
    assert (d.eval.every, d.eval.split, d.eval.samples_per_prompt, d.eval.temperature) == (10, "test", 1, 0.0)


def test_prepare_data_writes_the_parquet_the_run_files_read_offline(tmp_path, capsys):
    source = hub_snapshot(tmp_path / "snapshot")
    out = tmp_path / "data" / "gsm8k"
    assert main(["prepare-data", "gsm8k", "--source", str(source), "--out", str(out)]) == 0
    assert "train.parquet (6 rows)" in capsys.readouterr().out
    train, test = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    assert list(train.columns) == ["question", "answer"] and (len(train), len(test)) == (6, 2)  # main only
    assert main(["prepare-data", "gsm8k", "--source", str(source), "--out", str(out)]) == 2  # kept unless --overwrite
    assert "exist. Fix: pass --overwrite" in capsys.readouterr().err
    assert main(["prepare-data", "gsm8k", "--source", str(source), "--out", str(out), "--overwrite"]) == 0
    for name in RUN_FILES:  # the run files' own data section reads what was written
        cfg = load_config(str(REPO / "configs" / name), {"dsrl.data.path": str(out)})
        records = load_prompts(cfg.dsrl.data, 0, load_tokenizer(ModelConfig()))  # a chat template, lengths checked
        assert len(records) == 6 and records[0]["prompt"].endswith('output the final answer after "####".')
        held_out = load_prompts(cfg.dsrl.data.model_copy(update={"split": "test"}), 0)
        assert len(held_out) == 2
        # the run file's eval section resolves to the test split, read and checked like the training prompts
        evaluated = load_eval_prompts(cfg.dsrl.eval, cfg.dsrl.data, 0, load_tokenizer(ModelConfig()))
        assert [r["prompt"] for r in evaluated.records] == [r["prompt"] for r in held_out]
        assert "split 'test'" in evaluated.where
    if verifiable.has_math_verify():
        gold = records[0]["answer"]
        final = gold.rsplit("#### ", 1)[1]
        assert verifiable.math_reward(["p"] * 2, [f"so the total is {final}", "#### 1"], [gold] * 2) == [1.0, 0.0]


def test_prepare_data_refuses_what_it_cannot_write(tmp_path):
    from dsrl.cli.prepare_data import prepare

    with pytest.raises(ConfigError, match="unknown dataset 'gsm9k'"):
        prepare("gsm9k", str(tmp_path / "out"))
    (tmp_path / "flat" / "main").mkdir(parents=True)
    pd.DataFrame(gsm8k_like(2, 0)).to_parquet(tmp_path / "flat" / "main" / "train.parquet")  # no test split
    with pytest.raises(ConfigError, match=r"split 'test'.*has no such split"):
        prepare("gsm8k", str(tmp_path / "out"), source=str(tmp_path / "flat"))
    assert not (tmp_path / "out").exists()  # nothing written when a split is missing


def test_the_quickstart_shows_the_8gpu_file_as_it_is():
    import re

    text = (REPO / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```json\n(.*?)```", text, re.S) if "gsm8k" in b)
    shown = json.loads(block)["dsrl"]
    actual = json.loads((REPO / "configs" / "gsm8k_qwen2.5_1.5b_8gpu.json").read_text(encoding="utf-8"))["dsrl"]
    for section, values in shown.items():
        for key, value in values.items():
            assert actual[section][key] == value, (section, key)

