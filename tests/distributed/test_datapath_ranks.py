"""The point-to-point data path trains exactly like the old all-gather path: the same main job run twice,
once per path (tests/workers/datapath_worker.py), gives bitwise-identical per-step losses and final
checkpoint tensors -- on AutoTP 2 x DP 2 (4 ranks, ZeRO-3, token budget), with E = 2 reshuffled epochs per
rollout. (A 2-rank ZeRO-2 fixed-micro-batch case ran here until the suite neared its time budget; fixed
partitions are routed by the same code, which tests/unit/test_datapath.py checks rank by rank in both
modes.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXTENDED, REPO, launch, write_json

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

ROLLOUTS = 1  # 4 optimizer steps over 2 reshuffled epochs
CASES = {  # name: (ranks, run file, extra overrides)
    "autotp2xdp2-zero3-tokens": (4, "tiny_grpo_autotp_cpu.json", []),
}


def _run(tmp_path, ranks: int, config: str, extra: list[str], path: str):
    raw = json.loads((REPO / "configs" / config).read_text())
    raw["dsrl"]["sft"] = {"steps": 0}  # RL only (the default config's warm-up is not under test)
    raw["scheduler"]["params"]["warmup_num_steps"] = 2  # of 4 steps
    out = tmp_path / path
    launch(["tests/workers/datapath_worker.py", "--datapath", path,
            "--ds_config", str(write_json(tmp_path / "run.json", raw)), "--dsrl.run.rollouts", str(ROLLOUTS),
            "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.samples_per_prompt", "4",
            "--dsrl.batch.mini_batch_size", "16", "--dsrl.batch.epochs_per_rollout", "2",
            "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false", *extra], nprocs=ranks, timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["optimizer_step"], r["loss"], r["tokens"]) for r in rows if r["event"] == "step"]
    files = sorted((out / "checkpoints" / f"rollout{ROLLOUTS}").glob("*_states.pt"))
    return steps, {f.name: torch.load(f, map_location="cpu", weights_only=False) for f in files}


def _tensors(node, path: str = "") -> dict[str, torch.Tensor]:
    if torch.is_tensor(node):
        return {path: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
    return {k: v for key, child in items for k, v in _tensors(child, f"{path}/{key}").items()}


@pytest.mark.parametrize("case", list(CASES))
def test_all_to_all_trains_bitwise_like_all_gather(tmp_path, case):
    ranks, config, extra = CASES[case]
    new_steps, new_state = _run(tmp_path, ranks, config, extra, "all-to-all")
    old_steps, old_state = _run(tmp_path, ranks, config, extra, "all-gather")
    assert len(new_steps) == ROLLOUTS * 2 * 32 // 16
    assert new_steps == old_steps  # (step, loss, tokens), bitwise
    assert sorted(new_state) == sorted(old_state) and new_state
    new, old = _tensors(new_state), _tensors(old_state)
    assert new.keys() == old.keys() and sum(t.numel() for t in new.values()) > 10_000
    assert all(torch.equal(new[k], old[k]) for k in new), [k for k in new if not torch.equal(new[k], old[k])][:5]
