"""What reliability costs at checkpoint time: a save, its manifest checksums, the universal conversion
an elastic resume needs, and loads, side by side on one model (docs/reliability.md quotes the result).

``deepspeed --num_gpus 2 bench/checkpoint_costs.py [--hidden 512] [--layers 8] [--vocab 32000] [--stage 2]``

Each rank builds the same Llama-shaped model, wraps it in a DeepSpeed ZeRO engine with AdamW, takes one
step (so the optimizer holds moments), then rank 0 prints seconds for: the DeepSpeed save with dsrl's
commit and size-only manifest; the same with CRC-32 checksums; converting the checkpoint to DeepSpeed's
universal format (rank 0 alone, what the first elastic resume pays once); a plain load and a universal
load into the same engine. Ratios to the plain save are what the on-the-fly vs at-save choice rests on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    import deepspeed
    import torch.distributed as dist

    from dsrl.backends.deepspeed.engine import ensure_distributed
    from dsrl.checkpoint import commit as ckpt
    from dsrl.checkpoint.elastic import _universal_loading, convert_to_universal
    from dsrl.rl.policy.model import tiny_config

    ensure_distributed()
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", args.vocab, 0, 1, 2, {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                                      "intermediate_size": int(args.hidden * 2.75),
                                                      "num_attention_heads": 8, "num_key_value_heads": 8})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": args.stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, args.vocab, (1, 16))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    root = args.dir or (tempfile.mkdtemp(prefix="dsrl-ckpt-bench-") if rank == 0 else None)
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    times: dict[str, float] = {}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times[name] = time.perf_counter() - t0
        return out

    timed("save (DeepSpeed + dsrl commit, sizes only)", lambda: ckpt.save(engine, root, "plain", {}, checksums=False))
    timed("save with CRC-32 checksums", lambda: ckpt.save(engine, root, "crc", {}, checksums=True))
    if rank == 0:
        t0 = time.perf_counter()
        convert_to_universal(os.path.join(root, "crc"))
        times["universal conversion (rank 0 alone)"] = time.perf_counter() - t0
    dist.barrier()
    timed("load, same rank count", lambda: engine.load_checkpoint(root, tag="crc"))

    def universal():
        with _universal_loading(engine):
            return engine.load_checkpoint(os.path.join(root, "crc"), tag="universal")

    timed("load from the universal checkpoint", universal)
    if rank == 0:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "crc"))
                   for f in fs if "universal" not in d)
        base = times["save (DeepSpeed + dsrl commit, sizes only)"]
        print(f"\n{n / 1e6:.1f} M parameters, ZeRO-{args.stage}, {dist.get_world_size()} ranks, checkpoint "
              f"{size / 2**20:.0f} MiB")
        print("| step | seconds | x plain save |\n| --- | --- | --- |")
        for name, sec in times.items():
            print(f"| {name} | {sec:.2f} | {sec / base:.2f} |")
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
