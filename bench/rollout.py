"""Rollout generation throughput: the ``hf`` backend (transformers ``generate``, static padded batches)
vs the ``cb`` backend (transformers continuous batching), side by side in one process.

    python bench/rollout.py             # tiny + scaled Qwen2 shapes, concurrency 8 / 32 / 128 / 512 (~15 min)
    python bench/rollout.py --quick     # tiny shape, concurrency 8 and 32, one repetition
    OMP_NUM_THREADS=2 python bench/rollout.py   # two intra-op threads (default: one, see below)
    python bench/rollout.py --device cuda --attn flash_attention_2   # on a GPU (bf16; not run yet)
    python bench/rollout.py --backends cb vllm   # a vLLM column too (where vllm imports; on the CPU use the
                                                 # tiny32 or scaled shape: vLLM's CPU kernels need head size >= 32)

Workload (the same for both backends): P prompts of 4-32 random tokens, G = 8 samples each
(N = P * G = max(128, C) sequences), sampled at temperature 1 with ``max_new_tokens`` = 128. Completion
lengths are long-tailed on purpose: the model's head gets a bias that gives the eos token a constant
probability ~1/24 per step (the other logits stay near 0), so lengths are geometric (mean ~24) and
a few run to the limit, the shape that makes a static batch decode padding until its longest member
ends. Concurrency C = ``generation_batch_size`` * G is the number of sequences decoded at once
(``hf``: one padded batch of C rows; ``cb``: at most C sequences per forward, refilled as others
finish), so both hold the same KV memory.

Per (shape, C): ``--repeats`` rounds, each running hf, then vllm, then cb under each ``--cb_attention`` on the
same model, prompts and seed (vLLM gets the head's bias as a logit bias, bench/_common.py serve_biased_head);
tokens/s = completion tokens generated / wall time of the ``generate`` call (all per-call costs
included: cb builds and tears down its paged cache and thread every call). The ratio column is the
median over rounds of cb/hf within a round. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
import types

# One intra-op thread unless told otherwise: on a shared 2-core machine two OpenMP threads spin-wait
# for each other and small ops slow down by up to 10x at random, which would swamp the comparison.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from _common import BOS, EOS, PAD, SHAPES, long_tailed_model, report, table  # noqa: E402

from dsrl.config import RolloutConfig  # noqa: E402
from dsrl.rollout.cb import ContinuousBatchingBackend  # noqa: E402
from dsrl.rollout.hf import HFRolloutBackend  # noqa: E402

MAX_PROMPT = 32  # prompts() draws 4-32 tokens


def vllm_skip_reason(shape: str, device: str) -> str | None:
    """Why the vllm column cannot run here (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable"
    if device == "cpu":
        from dsrl.rl.policy.model import TINY_DEFAULTS
        from dsrl.rollout.vllm import CPU_HEAD_SIZES

        spec = {**TINY_DEFAULTS, **SHAPES[shape]["tiny"]}
        head = spec["hidden_size"] // spec["num_attention_heads"]
        if head not in CPU_HEAD_SIZES:
            return f"head size {head} of shape {shape!r}: vLLM's CPU kernels need one of {CPU_HEAD_SIZES}"
    return None


def make_vllm(model, tok, cfg, g: int):
    from _common import serve_biased_head

    from dsrl.rollout.vllm import VLLMRolloutBackend

    serve_biased_head(model)
    backend = VLLMRolloutBackend(model, tok, cfg, max_model_len=MAX_PROMPT + cfg.max_new_tokens, samples_per_prompt=g)
    backend.sync_weights()
    return backend


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 33, (n,), generator=g).tolist()
    return [[BOS] + torch.randint(3, vocab, (k - 1,), generator=g).tolist() for k in lens]


def timed(backend, ps: list[list[int]], g: int, seed: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = backend.generate(ps, g, seed=seed)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "scaled"], choices=list(SHAPES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 32, 128, 512])
    ap.add_argument("--samples_per_prompt", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=128,
                    help="N = prompts * samples_per_prompt per call (at least the concurrency)")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--mean_len", type=float, default=24.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16; default float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--attn", default=None, help="model.attn_implementation, e.g. flash_attention_2 (default sdpa)")
    ap.add_argument("--backends", nargs="+", default=["cb"], choices=["cb", "vllm"],
                    help="measured against hf (always run): cb (one column per --cb_attention), vllm (where vllm "
                         "imports and can serve the shape; otherwise skipped with the reason)")
    ap.add_argument("--cb_attention", nargs="+", default=["model", "varlen"], choices=["model", "varlen"],
                    help="rollout.cb_attention settings to measure, each as its own cb column, in this order")
    ap.add_argument("--json", default=None, help="also write the measurements here (rewritten after each call)")
    ap.add_argument("--cuda_graphs", default="auto", choices=["auto", "off"],
                    help="off: continuous batching without CUDA graphs and asynchronous batching (attribution)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.concurrency, args.repeats = ["tiny"], [8, 32], 1
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.cuda_graphs == "off":
        make_config = ContinuousBatchingBackend.continuous_batching_config

        def without_graphs(self, *a, **kw):
            cfg = make_config(self, *a, **kw)
            cfg.use_cuda_graph, cfg.use_async_batching = False, False
            return cfg

        ContinuousBatchingBackend.continuous_batching_config = without_graphs
    g = args.samples_per_prompt
    tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    rows, cells, skipped = [], [], {}
    columns = ([] if "vllm" not in args.backends else ["vllm"]) + (
        [f"cb/{att}" for att in args.cb_attention] if "cb" in args.backends else [])
    for shape in args.shapes:
        dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
        model = long_tailed_model(shape, args.mean_len, args.device, dtype, args.attn)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        vllm_reason = vllm_skip_reason(shape, args.device) if "vllm" in args.backends else None
        if vllm_reason:
            skipped[f"vllm ({shape})"] = vllm_reason
        for c in args.concurrency:
            ps = prompts(max(args.sequences, c) // g, SHAPES[shape]["vocab"], seed=0)
            cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                generation_batch_size=max(1, c // g))
            backends: dict[str, object] = {"hf": HFRolloutBackend(model, tok, cfg)}
            if "vllm" in args.backends and not vllm_reason:
                backends["vllm"] = make_vllm(model, tok, cfg, g)
            if "cb" in args.backends:
                for att in args.cb_attention:
                    backends[f"cb/{att}"] = ContinuousBatchingBackend(model, tok, cfg.model_copy(
                        update={"cb_attention": att}))
            for be in backends.values():  # first-call imports/allocations/graph captures out of the measurement
                timed(be, ps[:1], 1, seed=0)
            cell = {"shape": shape, "params_m": params, "C": c, "N": len(ps) * g, "rates": {n: [] for n in backends},
                    "lengths": {n: [] for n in backends}}
            cells.append(cell)
            for r in range(args.repeats):
                for name, be in backends.items():
                    s, out = timed(be, ps, g, seed=100 + r)
                    print(f"  {shape} C={c} round {r} {name}: {s:.2f} s", flush=True)
                    cell["rates"][name].append(sum(len(o.completion_ids) for o in out) / s)
                    cell["lengths"][name] += [len(o.completion_ids) for o in out]
                    if args.json:
                        dump(args.json, args, cells, skipped)
            if "vllm" in backends:
                backends["vllm"].close()
            lengths = [n for per_backend in cell["lengths"].values() for n in per_backend]
            trunc = sum(n == args.max_new_tokens for n in lengths) / len(lengths)
            row = [shape, f"{params:.1f} M", c, len(ps) * g, f"{statistics.mean(lengths):.1f}", f"{trunc:.1%}",
                   f"{statistics.median(cell['rates']['hf']):.0f}"]
            for name in columns:
                if name not in cell["rates"]:
                    row += ["-", "-"]
                    continue
                ratios = [b / a for a, b in zip(cell["rates"]["hf"], cell["rates"][name])]
                row += [f"{statistics.median(cell['rates'][name]):.0f}", f"{statistics.median(ratios):.2f} "
                        f"({min(ratios):.2f}-{max(ratios):.2f})"]
            rows.append(row)
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
    body = (f"N sequences per call (N/{g} prompts x G = {g}), max_new_tokens = {args.max_new_tokens}, geometric "
            f"completion lengths (eos probability 1/{args.mean_len:g} per step), temperature 1, {args.device}, "
            f"{args.dtype or ('float32' if args.device == 'cpu' else 'bfloat16')}, attention "
            f"{model.config._attn_implementation}, CUDA graphs {args.cuda_graphs}, "
            f"{torch.get_num_threads()} torch thread(s), transformers {transformers.__version__}, {args.repeats} "
            "interleaved rounds. tokens/s = completion "
            "tokens / wall time of one generate call (median over rounds); cb/hf = median of the per-round ratios, "
            "then their range. cb model = continuous batching under the model's attention (sdpa: dense mask); "
            "cb varlen = under dsrl's packed attention (rollout.cb_attention, dsrl/rollout/varlen_attention.py)."
            "\n\n")
    if skipped:
        body += "Not measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ".\n\n"
    cols = []
    for name in columns:
        label = name.replace("/", " ")
        cols += [f"{label} tok/s", f"{label}/hf (range)"]
    body += table(["shape", "params", "C", "N", "mean len", "truncated", "hf tok/s", *cols], rows)
    if args.json:
        dump(args.json, args, cells, skipped)
    report("Rollout generation: hf generate vs continuous batching (bench/rollout.py)", body, args.no_record)


def dump(path: str, args: argparse.Namespace, cells: list[dict], skipped: dict[str, str]) -> None:
    """The measurements so far as JSON (bench/gpu/measure.py reads them, also from a run stopped at its time limit)."""
    meta = {k: getattr(args, k) for k in ("device", "dtype", "attn", "max_new_tokens", "mean_len", "samples_per_prompt",
                                          "repeats", "cuda_graphs")}
    with open(path + ".tmp", "w") as f:
        json.dump({"meta": meta, "cells": cells, "skipped": skipped}, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
