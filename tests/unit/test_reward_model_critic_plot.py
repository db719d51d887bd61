"""The reward model scores at the last valid token (whatever the padding and the pad-token convention), the
critic's run file is the policy's with dsrl.critic swapped in, and `dsrl plot` draws a run's curves."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO

from dsrl.backends.deepspeed.engine import RLEngine
from dsrl.config import ConfigError, ModelConfig, load_config
from dsrl.core.plan import BatchPlan
from dsrl.rl.critic import critic_config
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rl.rewards.model import RewardModel, save_tiny_reward_model


class _PlainEngine:
    """A policy engine that does not shard (ZeRO < 3), placing frozen models as the DeepSpeed engine does."""

    zero_stage, device = 2, "cpu"
    frozen = RLEngine.frozen


PLAIN = _PlainEngine()


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    tok = load_tokenizer(ModelConfig())
    path = save_tiny_reward_model(str(tmp_path_factory.mktemp("rm")), tok)
    return path, tok


def test_score_is_read_at_the_last_valid_token(tiny_rm):
    from transformers import AutoModelForSequenceClassification

    path, tok = tiny_rm
    rm = RewardModel.load(path, tok, PLAIN, on_gpu=False, micro_batch_size=2)
    # the third sequence ends with the pad id (0): transformers' own pooling would skip it, dsrl must not
    seqs = [[1, 5, 6, 7, 2], [1, 5], [3, 4, 5, 6, 7, 8, 0], [9]]
    got = rm.score(seqs)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    want = []
    with torch.no_grad():
        for s in seqs:
            hidden = model.model(input_ids=torch.tensor([s])).last_hidden_state
            want.append(float(model.score(hidden)[0, -1, 0]))
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 4  # the tiny model's scores differ visibly


def test_reward_model_errors_name_the_field(tiny_rm, tmp_path):
    path, tok = tiny_rm
    with pytest.raises(ConfigError, match="dsrl.data.reward_model"):
        RewardModel.load(str(tmp_path / "missing"), tok, PLAIN, on_gpu=False, micro_batch_size=2)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    cfg.num_labels = 3
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="num_labels = 3"):
        RewardModel.load(str(tmp_path), tok, PLAIN, on_gpu=False, micro_batch_size=2)


def test_critic_run_file_takes_the_critic_sections_and_its_own_horizon():
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["algorithm"] = {"name": "ppo"}
    raw["dsrl"]["sft"] = {"steps": 10}
    raw["dsrl"]["critic"] = {"zero_optimization": {"stage": 3}, "lr": 1e-2, "warmup_rollouts": 5,
                             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    cfg = load_config(raw)
    critic = critic_config(cfg)
    assert critic.ds_config["zero_optimization"] == {"stage": 3}
    assert critic.ds_config["optimizer"]["params"]["lr"] == 1e-2 and cfg.ds_config["optimizer"]["params"]["lr"] == 2e-3
    assert critic.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.95]  # the rest is the policy's
    assert critic.ds_config["scheduler"]["type"] == "WarmupLR" and "csv_monitor" not in critic.ds_config
    assert critic.dsrl.loss_agg == "token-mean"
    policy, value = BatchPlan.from_config(cfg, 2, 512), BatchPlan.from_config(critic, 2, 512)
    rollouts = cfg.dsrl.run.rollouts
    assert policy.total_optimizer_steps == 10 + (rollouts - 5) * 2 and policy.critic_optimizer_steps == 2 * rollouts
    assert value.total_optimizer_steps == 2 * rollouts  # every rollout, no supervised warm-up


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from dsrl.runtime.plot import plot_run

    rows = [{"event": "sft", "sft_step": 1, "call": 1, "optimizer_step": 1, "loss": 3.0, "lr": 1e-3}]
    for r in range(1, 4):
        rows.append({"event": "step", "rollout": r, "call": r, "optimizer_step": r + 1, "lr": 1e-3 * r,
                     "critic_lr": 2e-3})
        rows.append({"event": "rollout", "rollout": r, "optimizer_step": r + 1, "reward_mean": 0.1 * r,
                     "accuracy": 0.05 * r, "entropy": 1.0 / r, "kl": None, "value_loss": 0.5 / r,
                     "phase_generate_s": 0.5, "phase_old_logprobs_s": 0.1 * r, "phase_train_s": 1.0,
                     "peak_mib": 500.0 + r})  # the phases panel (dsrl.runtime.phases)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n{cut by a crash")
    out = plot_run(str(tmp_path))
    assert out == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        plot_run(str(tmp_path / "nothing"))
