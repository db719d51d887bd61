"""Worker of tests/distributed/test_device_syncs.py (``deepspeed --num_gpus 2``): what stalls a GPU, counted on CPU.

Builds a real :class:`dsrl.rl.trainer.Trainer` (tiny Qwen2, the reverse task, a KL reference, ZeRO ``--stage``),
makes one rollout and trains it (two optimizer steps: DeepSpeed's throughput timer, when on, synchronizes every
forward of its module from then on), then counts with :class:`device_traffic.DeviceTraffic`:

- ``hf`` and ``cb`` generation with 2 and with 6 new tokens: device synchronizations, and dsrl's device-to-host
  copies (which must not grow with the decode steps);
- the old and reference log-prob pass (``ExperienceMaker.score_logprobs``) over micro-batches of 1 and of 16
  sequences: synchronizations, and copies (which must not grow with the number of micro-batches);
- one more rollout's training (its forwards run through the engine's hooks).

Then, after each of three more optimizer steps, greedy completions of a kept ``cb`` backend (one manager for the
run) equal ``hf``'s. ``--timer_on`` turns DeepSpeed's throughput timer on in the ds_config (it must then be
counted in the training forwards only); ``--hooks_kept`` also leaves the engine's hooks on the module inside
generation and no-grad passes (a planted bug: syncs must then be counted there). Rank 0 writes the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from device_traffic import DeviceTraffic  # noqa: E402


def config(stage: int, timer_on: bool, out_dir: str) -> dict[str, Any]:
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "dsrl": {
            "batch": {"prompts_per_rollout": 4, "samples_per_prompt": 4, "mini_batch_size": 8,
                      "micro_batch_size_per_rank": 2},
            "run": {"rollouts": 4, "output_dir": out_dir, "seed": 0, "progress_bar": False, "save_final": False,
                    "overwrite": True},
            "model": {"arch": "qwen2"},
            "data": {"task": "reverse", "size": 64, "max_prompt_tokens": 16},
            "rollout": {"backend": "hf", "max_new_tokens": 6, "logprob_micro_batch_size": 16},
            "algorithm": {"name": "grpo", "kl_coef": 0.05},
        },
    }
    if timer_on:
        ds["timers"] = {"throughput": {"enabled": True}}
    return ds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--timer_on", action="store_true")
    parser.add_argument("--hooks_kept", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    import torch.distributed as dist

    from dsrl.config import RolloutConfig
    from dsrl.rl.trainer import Trainer
    from dsrl.rollout import make_backend
    from dsrl.rollout.cb import CallBounds

    if args.hooks_kept:
        import dsrl.backends.deepspeed.hooks as hooks

        hooks.engine_hooks = lambda engine: []  # planted: the engine's hooks stay on the module
    out_dir = os.path.join(os.path.dirname(args.out), f"run_stage{args.stage}")
    trainer = Trainer.from_config(config(args.stage, args.timer_on, out_dir))
    parts = trainer.parts
    traffic = DeviceTraffic()
    tok, maker, actor = parts.tokenizer, parts.experience, parts.actor
    local, _, _ = maker.make(0)
    trainer.train_rollout(local)
    report: dict[str, Any] = {"rank": dist.get_rank(), "optimizer_steps": actor.engine.optimizer_steps}
    prompts = sorted({tuple(s.tokens[:s.prompt_len]) for s in local})
    prompts = [list(p) for p in prompts]

    for backend in ("hf", "cb"):
        for new_tokens in (2, 6):
            rollout = RolloutConfig(backend=backend, max_new_tokens=new_tokens)
            be = make_backend(rollout, actor.engine, tok, bounds=CallBounds(16, 32))
            be.generate(prompts, 2, seed=1)  # the first call builds cb's manager (a warm-up on a GPU)
            traffic.reset()
            with traffic.counting():
                be.generate(prompts, 2, seed=1)
            be.close()
            report[f"{backend}_{new_tokens}"] = {"syncs": traffic.syncs, "copies": traffic.copies,
                                                 "where": traffic.where}
    for micro in (1, 16):
        actor.settings = dataclasses.replace(actor.settings, logprob_micro_batch_size=micro)
        traffic.reset()
        with traffic.counting():
            actor.add_logprobs(actor.pass_batches(local, tok.pad_token_id))
        report[f"logprobs_{micro}"] = {"syncs": traffic.syncs, "copies": traffic.copies, "where": traffic.where,
                                       "micro_batches": -(-len(local) // micro)}
    local, _, _ = maker.make(1)
    traffic.reset()
    with traffic.counting():
        trainer.train_rollout(local)
    report["training"] = {"syncs": traffic.syncs}

    greedy = RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=6).model_dump(), "temperature": 0.0})
    cb = make_backend(greedy.model_copy(update={"backend": "cb"}), actor.engine, tok, bounds=CallBounds(16, 32))
    hf = make_backend(greedy.model_copy(update={"backend": "hf"}), actor.engine, tok)
    equal, completions = [], []
    for rollout_index in (2, 3, 4):
        local, _, _ = maker.make(rollout_index)
        trainer.train_rollout(local)
        got = [c.completion_ids for c in cb.generate(prompts, 2, seed=0)]
        equal.append(got == [c.completion_ids for c in hf.generate(prompts, 2, seed=0)])
        completions.append(got)
    report.update(greedy_equal=equal, greedy_changed=len({json.dumps(c) for c in completions}) > 1,
                  cb_calls=cb.calls, cb_managers=cb.managers_built, final_steps=actor.engine.optimizer_steps)
    cb.close()
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(reports, f, indent=1)
    parts.close()
    return 0


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    leave(main())
