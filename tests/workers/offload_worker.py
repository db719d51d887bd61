"""Worker of tests/distributed/test_memory.py (one rank): dsrl.memory.offload_states releases what it moves.

Builds a :class:`dsrl.rl.trainer.Trainer` (tiny Qwen2, a frozen KL reference, ZeRO ``--stage``, offload on), makes
and trains one rollout (the optimizer states exist), then with Python's garbage collector off (so only reference
counting frees anything, as in :func:`dsrl.backends.deepspeed.offload.heap_frozen`):

- offloads the training state (``parts.memory.release()``) and looks for any live tensor still on a storage the
  state used before (none may be left: the device copy is really gone, not kept alive by a view DeepSpeed forgot);
- tries a training step while offloaded (refused by ``require_resident``);
- reloads and compares every state tensor with a copy taken before the offload (bit for bit; ZeRO-3's reduce
  buckets aside: DeepSpeed reallocates them empty, their contents are overwritten before use), and lists the keys of
  the optimizer's state (what a checkpoint saves: no host buffer of the offload among them);
- runs the frozen reference's pass twice around its offloads: the same log-probs bit for bit, its tensors 64-byte
  aligned views of one buffer per dtype while on the device, its host copy written once (the second offload
  copies nothing: the same host buffer).

Writes a JSON report to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any

import torch


def config(stage: int, out_dir: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    adam: dict[str, Any] = {"lr": 0.01}
    if stage == 3:  # every parameter partitioned; torch's AdamW (dsrl moves its states; DeepSpeed only FusedAdam's)
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "dsrl": {
            "batch": {"prompts_per_rollout": 4, "samples_per_prompt": 4, "mini_batch_size": 8,
                      "micro_batch_size_per_rank": 2},
            "run": {"rollouts": 4, "output_dir": out_dir, "seed": 0, "progress_bar": False, "save_final": False,
                    "overwrite": True},
            "model": {"arch": "qwen2"},
            "data": {"task": "reverse", "size": 64, "max_prompt_tokens": 16},
            "rollout": {"backend": "hf", "max_new_tokens": 6, "logprob_micro_batch_size": 4},
            "algorithm": {"name": "grpo", "kl_coef": 0.05},
            "memory": {"offload_states": True},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    from dsrl.backends.deepspeed.offload import ALIGN_BYTES, state_tensors
    from dsrl.rl.data.batching import chunks, collate

    trainer = Trainer.from_config(config(args.stage, os.path.join(os.path.dirname(args.out), f"run_stage{args.stage}")))
    parts = trainer.parts
    engine = parts.actor.engine.engine
    maker, memory = parts.experience, parts.memory
    memory.release()
    local, _, _ = maker.make(0)
    memory.reload()
    trainer.train_rollout(local)
    report: dict[str, Any] = {"steps": parts.actor.engine.optimizer_steps}

    gc.collect()
    gc.disable()  # from here only reference counting frees memory
    old = {t.untyped_storage().data_ptr() for t in state_tensors(engine) if t.numel()}
    snapshot = [t.detach().clone() for t in state_tensors(engine, scratch=False)]  # reduce buckets: not kept
    memory.release()
    moved = memory.meter.take()
    after = {t.untyped_storage().data_ptr() for t in state_tensors(engine) if t.numel()}
    live = {o.untyped_storage().data_ptr() for o in gc.get_objects() if torch.is_tensor(o) and o.numel()}
    report.update(state_storages=len(old), still_alive=len((old & live) - after), offload_bytes=moved.offload_bytes)
    try:
        trainer.train_rollout(local)
        report["step_while_offloaded"] = "ran"
    except RuntimeError as e:
        report["step_while_offloaded"] = str(e)
    memory.reload()
    back = state_tensors(engine, scratch=False)
    report["reloaded_equal"] = len(back) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(back, snapshot))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    report["optimizer_state_keys"] = sorted({k for st in inner.state.values() for k in st})  # what a checkpoint saves
    gc.enable()

    ref = parts.actor.reference
    groups = chunks(local, 4)
    micros = [collate(g, parts.tokenizer.pad_token_id, parts.actor.device, with_logprobs=False) for g in groups]
    fn = parts.actor._logprob_fn()
    first = [t.clone() for t in ref.forward_no_grad(micros, fn)]
    weights = ref.offload
    hosts = {dt: buf.data_ptr() for dt, buf in weights._host.items()}
    weights.reload()
    aligned = all(t.data_ptr() % ALIGN_BYTES == 0 for t, *_ in weights._layout)
    weights.offload()
    again = ref.forward_no_grad(micros, fn)
    report.update(reference_equal=all(torch.equal(a, b) for a, b in zip(first, again)), reference_aligned=aligned,
                  reference_host_reused={dt: buf.data_ptr() for dt, buf in weights._host.items()} == hosts,
                  reference_resident=weights.resident, reference_tensors=len(weights._layout))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    parts.close()
    return 0


if __name__ == "__main__":
    from dsrl.rl.trainer import Trainer
    from dsrl.runtime.process_exit import leave

    leave(main())
