"""Generation under AutoTP (``deepspeed --num_gpus 2``, autotp_size 2): the hf backend on a
tensor-sharded policy, for ZeRO-1 and ZeRO-3 in one launch.

Per stage and rank the report holds:
- ``same_seed``: the completions of several prompts (different lengths, sampled, some ending early at
  eos) and whether they equal (a) the other tensor peer's and (b) a plain unsharded copy's with the
  same seed; the number of tensor-group collectives each peer issued during the call;
- ``divergent``: the same call with a *different* seed on each peer (as if the peers' sampling had
  drifted apart): the synchronized stop must still take both peers through the same number of
  steps (equal collective counts, no hang), with rows ending where either peer produced eos;
- a training step after generation applies (the sharded model still trains).
"""

from __future__ import annotations

import argparse
import json
import types
from typing import Any

import torch
import torch.distributed as dist

VOCAB, PAD, BOS, EOS = 32, 0, 1, 2


def as_lists(completions: list[Any]) -> list[list[int]]:
    return [list(c.completion_ids) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    from rollout_worker import CollectiveCounter

    import dsrl
    from dsrl.backends.deepspeed.engine import ensure_distributed
    from dsrl.config import ModelConfig, RolloutConfig
    from dsrl.rl.policy.model import build_model, frozen_copy
    from dsrl.rollout.hf import HFRolloutBackend

    ensure_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    rollout = RolloutConfig(max_new_tokens=12, generation_batch_size=2, temperature=1.0)
    prompts = [[BOS] + [3 + (3 * i + j) % (VOCAB - 3) for j in range(1 + 2 * i)] for i in range(3)]
    report: dict[str, Any] = {"rank": rank, "stages": {}}
    for stage in [int(s) for s in args.stages.split(",")]:
        model = build_model(ModelConfig(arch="qwen2"), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=3)
        plain = frozen_copy(model)
        cfg = {
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": world},
            "zero_allow_untested_optimizer": True,
            "dsrl": {"batch": {"prompts_per_rollout": 1, "samples_per_prompt": 2, "mini_batch_size": 2,
                               "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1}},
        }
        engine = dsrl.initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        backend = HFRolloutBackend(engine, tok, rollout)
        counter = CollectiveCounter()
        entry: dict[str, Any] = {"view": {"replicas": engine.view.data_parallel_size,
                                          "replica": engine.view.data_parallel_rank,
                                          "tensor_rank": engine.view.tensor_parallel_rank,
                                          "count_group_size": engine.view.count_group_size}}
        for label, seed in (("same_seed", 7), ("divergent", 7 + 1000 * rank)):
            before = counter.calls
            with counter.counting():
                got = backend.generate(prompts, 4, seed)
            entry[label] = {"completions": as_lists(got), "finished": [c.finished for c in got],
                            "collectives": counter.calls - before}
        expect = HFRolloutBackend(plain, tok, rollout).generate(prompts, 4, 7)
        entry["same_seed"]["equals_plain"] = as_lists(expect) == entry["same_seed"]["completions"]

        ids = torch.tensor([[BOS, 5, 6, 7, 8]])
        micro = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}

        def loss_fn(eng: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = eng(input_ids=mb["input_ids"]).logits.float()
            return -torch.log_softmax(logits, -1).gather(-1, mb["input_ids"].unsqueeze(-1)).squeeze(-1)

        res = engine.train_mini_batch([micro], loss_fn)
        entry["train_step_applied"] = bool(res["step_applied"])
        report["stages"][str(stage)] = entry

    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
