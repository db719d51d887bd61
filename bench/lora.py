"""Optimizer state and peak memory per rank: LoRA (``dsrl.model.lora``) vs full fine-tuning, same model and batch.

    python bench/lora.py                                   # 2 CPU ranks, the 'scaled' shape, ZeRO-2 and 3 (~1 min)
    python bench/lora.py --zero_stages 2,3 --no-record
    python bench/lora.py --device cuda --shape 0.5b --ranks 2 --zero_stages 2,3   # GPU (not run here)

For each ZeRO stage and each mode it spawns ``--ranks`` fresh processes (so each peak is its own) that build the
same random-weight Qwen2 shape (bench/_common.py ``SHAPES``: 'scaled' ~17 M parameters on the CPU, Qwen2.5-0.5B's
shape on a GPU), with LoRA adapters (``--r``, ``--alpha``, all linear layers) or without, wrap it with
``dsrl.initialize`` (AdamW, fp32 on the CPU, bf16 with fp32 master weights on a GPU) and take ``--steps`` optimizer
steps on the same micro-batches (``--micro`` sequences of ``--seq_len`` random tokens per micro-batch, ``--accum``
micro-batches per rank per step). Per rank it reports:

- trainable parameters (held by the optimizer) and the optimizer state's bytes on this rank: every tensor in the
  torch optimizer's ``state`` (Adam's two moments) plus, under a 16-bit model, the fp32 master copy DeepSpeed keeps
  of the trainable parameters this rank owns;
- peak memory: on the CPU the growth of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs just
  before the model is built) over the build, ``dsrl.initialize`` and the steps; on a GPU
  ``torch.cuda.max_memory_allocated`` over the same span;
- the mean step time (after one warm-up step), as a side figure.

The ratios LoRA / full are measured side by side in one run; nothing asserts an absolute figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import PAD, REPO, SHAPES, end_rank, make_micro, per_token_nll, report, spawn_ranks, table

BOS, EOS = 1, 2


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def optimizer_state_bytes(rl: Any) -> int:
    """Bytes of the optimizer state on this rank: the torch optimizer's ``state`` tensors (ZeRO 1-3 hold only this
    rank's partition) plus DeepSpeed's fp32 master partitions of a 16-bit model."""
    import torch

    engine = rl.engine
    inner = engine.optimizer
    torch_opt = getattr(inner, "optimizer", inner)
    total = 0
    for state in torch_opt.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    if next(engine.module.parameters()).dtype != torch.float32:  # fp32 master weights of the trainable parameters
        for group in torch_opt.param_groups:
            total += sum(p.numel() * p.element_size() for p in group["params"] if p.dtype == torch.float32)
    return total


def rank_main(rank: int, world: int, port: int, mode: str, stage: int, args: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    import dsrl
    from dsrl.backends.deepspeed.engine import ensure_distributed
    from dsrl.config import LoraConfig, ModelConfig
    from dsrl.rl.policy.model import build_model

    ensure_distributed()
    spec = SHAPES[args.shape]
    gpu = args.device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    lora = LoraConfig(r=args.r, alpha=float(2 * args.r)) if mode == "lora" else None
    micros = [make_micro([args.seq_len] * args.micro, None, spec["vocab"], seed=100 * rank + i, device="cpu")
              for i in range(args.accum)]
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    rss0 = _status_kb("VmRSS")
    model = build_model(ModelConfig(arch="qwen2", dtype=dtype, tiny={**spec["tiny"], "tie_word_embeddings": False},
                                    lora=lora), spec["vocab"], PAD, BOS, EOS, on_gpu=gpu, seed=0)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    B = args.micro * args.accum * world
    cfg = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "dsrl": {"batch": {"prompts_per_rollout": B // 2, "samples_per_prompt": 2, "mini_batch_size": B,
                           "micro_batch_size_per_rank": args.micro, "loss_agg": "token-mean"},
                 "run": {"rollouts": args.steps}, "model": {"dtype": dtype}},
    }
    if gpu:
        cfg["bf16"] = {"enabled": True}
    if lora is not None:
        cfg["dsrl"]["model"]["lora"] = lora.model_dump()
    rl = dsrl.initialize(model, cfg)
    dev = rl.device
    micros = [{k: v.to(dev) for k, v in m.items()} for m in micros]
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        rl.train_mini_batch(micros, per_token_nll)
        times.append(time.perf_counter() - t0)
    peak = (_status_kb("VmHWM") - rss0) * 1024
    result = {"rank": rank, "mode": mode, "stage": stage, "parameters": params, "trainable": trainable,
              "optimizer_state_bytes": optimizer_state_bytes(rl), "peak_rss_bytes": peak,
              "step_s": sum(times[1:]) / max(1, len(times) - 1)}
    if gpu:
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated() - base_gpu
    end_rank(Path(out_dir, f"{mode}-{stage}-{rank}.json"), result)


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default=None, help="bench/_common.py SHAPES name (default: scaled on cpu, 0.5b on cuda)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--zero_stages", default="2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r, all linear layers)")
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per rank per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    args.shape = args.shape or ("0.5b" if args.device == "cuda" else "scaled")
    import sys

    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.path.insert(0, str(REPO))
    stages = [int(s) for s in args.zero_stages.split(",")]
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as out_dir:
        for stage in stages:
            got = {}
            for mode in ("full", "lora"):
                spawn_ranks(rank_main, args.ranks, mode, stage, args, out_dir)
                got[mode] = [json.loads(Path(out_dir, f"{mode}-{stage}-{r}.json").read_text())
                             for r in range(args.ranks)]
            peak_key = "peak_gpu_bytes" if args.device == "cuda" else "peak_rss_bytes"
            worst = {m: {k: max(r[k] for r in res) for k in ("optimizer_state_bytes", peak_key, "step_s")}
                     for m, res in got.items()}
            for mode in ("full", "lora"):
                res = got[mode][0]
                rows.append([f"ZeRO-{stage}", mode, f"{res['parameters']:,}", f"{res['trainable']:,}",
                             _mib(worst[mode]["optimizer_state_bytes"]), _mib(worst[mode][peak_key]),
                             f"{worst[mode]['step_s']:.3f}"])
            ratios.append(f"ZeRO-{stage}: optimizer state LoRA/full "
                          f"{worst['lora']['optimizer_state_bytes'] / worst['full']['optimizer_state_bytes']:.4f}, "
                          f"peak memory LoRA/full {worst['lora'][peak_key] / worst['full'][peak_key]:.3f}, "
                          f"step time LoRA/full {worst['lora']['step_s'] / worst['full']['step_s']:.2f}")
    peak_name = "peak GPU memory (MiB)" if args.device == "cuda" else "peak RSS growth (MiB)"
    body = (f"{args.ranks} ranks, shape {args.shape!r} (untied head), {args.device}, LoRA r = {args.r}, alpha = "
            f"{2 * args.r}, all linear layers; AdamW; per rank per step {args.accum} micro-batches x {args.micro} "
            f"sequences x {args.seq_len} tokens; {args.steps} steps. Per rank, the largest over ranks:\n\n"
            + table(["ZeRO", "mode", "parameters", "trainable", "optimizer state (MiB)", peak_name, "step (s)"], rows)
            + "\n\n" + "\n".join(f"- {r}" for r in ratios) + "\n")
    report("LoRA vs full fine-tuning: optimizer state and peak memory per rank (bench/lora.py)", body,
           dry_run=args.no_record)


if __name__ == "__main__":
    main()
