"""Bytes received and peak host memory per rank of the rollout data path: all-gather vs all-to-all.

    python bench/datapath.py                       # D = 2, 4, 8 CPU ranks, R = 512, E = 1 (~2 min)
    python bench/datapath.py --epochs 2 --no-record

For each D it spawns D gloo ranks twice, once per path, on the same synthetic rollout: R samples
with RL-shaped lengths (bench/_common.py ``rl_lengths``, log-normal, max length ``--max_len``), each
with the payload the trainer moves: token ids (vocabulary 151,936), float32-exact old, reference and
behavior log-probs per completion token (the last from the rollout backend, ARCHITECTURE §8), an
advantage and the policy version; with ``--routes LAYERS,TOP_K`` also a mixture-of-experts policy's routes
(:mod:`dsrl.core.routes`: int16 ``[tokens - 1, LAYERS, TOP_K]``, what routing replay moves; 48,8 is Qwen3-30B-A3B's
shape: 768 bytes per token). Every source generates its R/D samples, then:

  all-gather: the data path before issue 11 (:class:`AllGatherRollout`, kept here and nowhere in
      the library): every source's samples are all-gathered to every rank as pickled objects and
      each rank keeps the whole rollout;
  all-to-all: dsrl's path (``dsrl.rl.data.replica.RolloutIndex``): all-gather the lengths and sizes,
      partition all E*R/B mini-batches (token budget), move each sample once to the ranks that train
      on it.

Per rank it records the bytes that arrive in receive buffers of the collectives (counted at
``torch.distributed``'s all_gather / all_to_all_single: what the network delivers, padding of
all_gather_object included), the peak RSS growth during the exchange (VmHWM after resetting it,
minus VmRSS before; fresh processes per path), and a digest of every step's micro-batch contents
(the two paths must agree). "ideal" is the R/D share: the rollout's encoded bytes / D in the
path's own encoding. Target (issue 11): all-to-all received bytes per rank within 10 % of the ideal
share (a rank receives less: a source keeps its own samples).

The projection for D up to 1,024 and 16k-token samples is derived from the measured bytes per
sample (a least-squares fit bytes = a + b * tokens per encoding) and printed with its formula.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import pickle
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import end_rank, report, rl_lengths, spawn_ranks, table

VOCAB = 151_936
TARGET = 0.10


# -- the old path (before issue 11), for the side-by-side and tests/distributed/test_datapath_ranks.py -----


class AllGatherRollout:
    """The whole rollout on every rank: the sources' samples all-gathered as pickled objects.

    Same interface as :class:`dsrl.rl.data.replica.RolloutIndex` (``gather``, ``lengths``, ``size``,
    ``exchange``), so it can stand in for it in the trainer.
    """

    def __init__(self, rollout: list[Any]):
        self.rollout = rollout
        self.lengths = [s.length for s in rollout]
        self.size = len(rollout)

    @classmethod
    def gather(cls, view: Any, local: list[Any]) -> AllGatherRollout:
        import torch.distributed as dist

        from dsrl.rl.data.replica import is_source

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(list(local))
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, list(local) if is_source(view) else [])
        return cls([s for part in parts for s in part])

    def exchange(self, partitions: Any, device: Any = "cpu") -> dict[int, Any]:
        return dict(enumerate(self.rollout))


# -- measurement --------------------------------------------------------------------------------------


@contextlib.contextmanager
def count_received(totals: dict[str, int]):
    """Add to ``totals['all_gather']`` / ``totals['all_to_all']`` the bytes this rank receives from
    other ranks in torch.distributed's all_gather and all_to_all_single (all_gather_object included)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    gather, a2a = c10d.all_gather, dist.all_to_all_single
    me = dist.get_rank()

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        totals["all_gather"] += sum(t.numel() * t.element_size() for r, t in enumerate(tensor_list) if r != me)
        return gather(tensor_list, tensor, group=group, async_op=async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        splits = output_split_sizes or [output.numel() // dist.get_world_size()] * dist.get_world_size()
        totals["all_to_all"] += (sum(splits) - splits[me]) * output.element_size()
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    c10d.all_gather, dist.all_to_all_single = all_gather, all_to_all_single
    try:
        yield totals
    finally:
        c10d.all_gather, dist.all_to_all_single = gather, a2a


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def synthetic_rollout(rollout: int, max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths (prompt + completion tokens) and prompt lengths of the whole rollout."""
    rng = np.random.default_rng(seed)
    lengths = rl_lengths(rollout, max_len, "lognormal", rng)
    prompts = np.minimum(rng.integers(max(8, max_len // 50), max(9, max_len // 8), rollout), lengths - 2)
    return lengths, prompts


def make_samples(indices: range, lengths: np.ndarray, prompts: np.ndarray, seed: int,
                 routes: tuple[int, int] | None = None) -> list[Any]:
    """Samples ``indices`` of the synthetic rollout, with the trainer's per-token payload: old and reference
    log-probs, and the rollout backend's behavior log-probs (ARCHITECTURE §8), all float32, and the version; with
    ``routes`` (MoE layers, top-k) the routes of every input position (int16, experts 0..127)."""
    import torch

    from dsrl.rl.data.batching import Sample

    out = []
    for i in indices:
        rng = np.random.default_rng([seed, i])
        n, p = int(lengths[i]), int(prompts[i])
        old, ref, behavior = (-rng.standard_exponential((3, n - p))).astype(np.float32).tolist()
        out.append(Sample(tokens=rng.integers(0, VOCAB, n).tolist(), prompt_len=p, group=i // 8,
                          reward=float(rng.random()), advantage=float(rng.standard_normal()),
                          old_logprobs=old, ref_logprobs=ref, behavior_logprobs=behavior, version=i % 3,
                          routes=(torch.from_numpy(rng.integers(0, 128, (n - 1, *routes), dtype=np.int16))
                                  if routes else None)))
    return out


def rank_main(rank: int, world: int, port: int, path: str, args: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from dsrl.core.parallel import ParallelView
    from dsrl.core.partition import mini_batches, partition_mini_batch
    from dsrl.rl.data.codec import encode_sample
    from dsrl.rl.data.replica import RolloutIndex, my_part

    dist.init_process_group("gloo", rank=rank, world_size=world)
    view = ParallelView(count_group=None, grad_scale=float(world), data_parallel_size=world, data_parallel_rank=rank)
    lengths, prompts = synthetic_rollout(args.rollout, args.max_len, args.seed)
    per = args.rollout // world
    routes = tuple(int(x) for x in args.routes.split(",")) if args.routes else None
    local = make_samples(range(rank * per, (rank + 1) * per), lengths, prompts, args.seed, routes)
    plan = SimpleNamespace(data_parallel_size=world, micro_batch_size_per_rank=None,
                           max_tokens_per_micro_batch=args.max_tokens, allow_oversize=True, balance_attention_coef=0.0,
                           packing=False)
    cls = AllGatherRollout if path == "all-gather" else RolloutIndex
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    totals = {"all_gather": 0, "all_to_all": 0}
    with count_received(totals):
        index = cls.gather(view, local)
        steps = [partition_mini_batch(mb, index.lengths, plan)
                 for mb in mini_batches(index.size, args.mini_batch, args.epochs, seed=args.seed)]
        samples = index.exchange(steps, "cpu")
        del index
    peak = _status_kb("VmHWM") - before
    # After the measurement: what this rank trains on, its digest, and the encodings' sizes.
    digest = hashlib.sha256()
    for per_rank in steps:
        for ids in my_part(view, per_rank):
            for i in ids:
                digest.update(encode_sample(samples[i]))
    trained = sorted({i for per_rank in steps for ids in my_part(view, per_rank) for i in ids})
    result = {"rank": rank, "path": path, "received": totals, "peak_rss_kb": peak, "digest": digest.hexdigest(),
              "trained_samples": len(trained), "held_samples": len(samples),
              "trained_codec_bytes": sum(len(encode_sample(samples[i])) for i in trained),
              "trained_pickle_bytes": sum(len(pickle.dumps(samples[i])) for i in trained),
              "local": [[len(s.tokens), s.completion_len, len(encode_sample(s)), len(pickle.dumps(s))] for s in local]}
    end_rank(Path(out_dir, f"{path}-{world}-{rank}.json"), result)


# -- the run ------------------------------------------------------------------------------------------


def _fit(rows: list[list[int]], col: int) -> tuple[float, float, float]:
    """Least squares bytes = a + b * tokens + c * completion tokens, bytes in column ``col`` of ``rows``."""
    x = np.asarray(rows, dtype=np.float64)
    design = np.stack([np.ones(len(x)), x[:, 0], x[:, 1]], axis=1)
    a, b, c = np.linalg.lstsq(design, x[:, col], rcond=None)[0]
    return float(a), float(b), float(c)


def _union(d: int, epochs: int) -> float:
    """Expected distinct samples a replica trains on over E reshuffled epochs, in units of R/D."""
    return d * (1 - (1 - 1 / d) ** epochs)


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _human(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated D (CPU ranks, one replica each)")
    ap.add_argument("--rollout", type=int, default=512, help="R: samples per rollout (a multiple of every D and B)")
    ap.add_argument("--mini_batch", type=int, default=128, help="B")
    ap.add_argument("--epochs", type=int, default=1, help="E: reshuffled passes per rollout")
    ap.add_argument("--max_len", type=int, default=8192, help="longest sample (prompt + completion tokens)")
    ap.add_argument("--max_tokens", type=int, default=16384, help="token budget per micro-batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routes", default=None,
                    help="LAYERS,TOP_K: samples carry an MoE policy's routes (routing replay), e.g. 48,8")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    rows, checks, fit_rows, meta_per_sample = [], [], None, []
    per_token: dict[str, list[float]] = {"all-gather": [], "all-to-all": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for world in ranks:
            got = {}
            for path in ("all-gather", "all-to-all"):
                spawn_ranks(rank_main, world, path, args, out_dir)
                got[path] = [json.loads(Path(out_dir, f"{path}-{world}-{r}.json").read_text()) for r in range(world)]
            local = [x for res in got["all-to-all"] for x in res["local"]]
            fit_rows = fit_rows or local
            tokens = sum(x[0] for x in local)
            same = all(a["digest"] == b["digest"] for a, b in zip(got["all-gather"], got["all-to-all"]))
            checks.append(same)
            for path, res in got.items():
                col = 3 if path == "all-gather" else 2
                ideal = sum(x[col] for x in local) / world
                recv = [r["received"]["all_gather"] + r["received"]["all_to_all"] for r in res]
                meta = max(r["received"]["all_gather"] for r in res) if path == "all-to-all" else 0
                if path == "all-to-all":
                    meta_per_sample.append(meta / (args.rollout * (1 - 1 / world)))
                # the tokens the path must hold: the rollout, or this rank's union of E shares
                share = tokens if path == "all-gather" else tokens / world * _union(world, args.epochs)
                per_token[path].append(max(r["peak_rss_kb"] for r in res) * 1024 / share)
                trained = max(r["trained_codec_bytes" if col == 2 else "trained_pickle_bytes"] for r in res)
                rows.append([world, args.rollout // world, path, _mb(max(recv)), _mb(sum(recv) / world), _mb(ideal),
                             f"{max(recv) / ideal:.3f}", f"{trained / ideal:.3f}",
                             f"{meta / 1024:.1f}" if path == "all-to-all" else "-",
                             f"{max(r['peak_rss_kb'] for r in res) / 1024:.1f}",
                             f"{max(r['held_samples'] for r in res)}", "yes" if same else "NO"])
            print(f"D={world}: {tokens} tokens in the rollout; micro-batches identical: {same}", flush=True)
    fit_p, fit_c = _fit(fit_rows, 3), _fit(fit_rows, 2)
    m = float(np.mean(meta_per_sample))
    heads = ["D", "R/D", "path", "received/rank max (MiB)", "mean (MiB)", "ideal R/D share (MiB)", "received/ideal",
             "trained-on/ideal", "metadata (KiB)", "peak RSS growth (MiB)", "samples held", "same micro-batches"]
    measured = table(heads, rows)
    per_sample = (f"Measured bytes per sample (least squares over {len(fit_rows)} samples, bytes = a + b * tokens + "
                  f"c * completion tokens): pickled `Sample` a = {fit_p[0]:.0f}, b = {fit_p[1]:.2f}, "
                  f"c = {fit_p[2]:.2f}; "
                  f"dsrl.rl.data.codec a = {fit_c[0]:.0f}, b = {fit_c[1]:.2f}, c = {fit_c[2]:.2f}; lengths and sizes "
                  f"metadata m = {m:.1f} bytes per sample of the rollout. Peak RSS growth of the worst rank per token "
                  f"it must hold: all-gather k = {max(per_token['all-gather']):.0f} bytes per token of the rollout, "
                  f"all-to-all k = {max(per_token['all-to-all']):.0f} bytes per token of the union of E R/D shares "
                  "(decoded samples are Python lists; the all-to-all figure also holds the encoded own samples and "
                  "buffers).")
    if args.routes:
        lay, k = (int(x) for x in args.routes.split(","))
        per_sample += (f" The samples carry MoE routes ({lay} layers x top-{k}, int16): {2 * lay * k} bytes per token "
                       "of b in the codec.")
    L, C, per_replica = 16384, 15360, 8
    s_p, s_c = (f[0] + f[1] * L + f[2] * C for f in (fit_p, fit_c))
    proj = []
    for d in (8, 64, 256, 1024):
        r = per_replica * d
        old = (1 - 1 / d) * r * s_p
        u = _union(d, args.epochs)
        new = (1 - 1 / d) * u * (r / d) * s_c + r * m
        mem_old = max(per_token["all-gather"]) * r * L
        mem_new = max(per_token["all-to-all"]) * u * (r / d) * L
        proj.append([d, r, _human(old), _human(new), f"{old / new:.0f}x", _human(mem_old), _human(mem_new)])
    projection = table(["D", "R", "all-gather: received/rank", "all-to-all: received/rank", "ratio",
                        "all-gather: host memory/rank", "all-to-all: host memory/rank"], proj)
    formula = (f"Projection: samples of L = {L} tokens ({C} completion tokens with old, reference and behavior "
               "log-probs): "
               f"S_pickle = {_human(s_p)}, S_codec = {_human(s_c)} per sample; R/D = {per_replica} samples per "
               "replica, one rank per replica. all-gather = (1 - 1/D) * R * S_pickle; "
               "all-to-all = (1 - 1/D) * u * (R/D) * S_codec + R * m, u = D * (1 - (1 - 1/D)^E) the expected union "
               f"of a rank's E reshuffled shares (u = 1 at E = 1; here E = {args.epochs}) "
               "(a source keeps its own samples; with tensor or sequence peers every rank of a replica receives the "
               "same R/D share). Host memory: all-gather k * R * L, all-to-all "
               "k * u * (R/D) * L.")
    target = all(float(r[6]) <= 1 + TARGET for r in rows if r[2] == "all-to-all")
    verdict = f"within {TARGET:.0%} of the ideal R/D share: {'met' if target else 'MISSED'}"
    if args.epochs > 1:
        union = ", ".join(f"{_union(d, args.epochs):.2f}" for d in ranks)
        verdict = (f"target not applicable at E = {args.epochs}: a rank trains on the union of its E reshuffled "
                   f"shares, expected D * (1 - (1 - 1/D)^E) = {union} x the R/D share for D = {args.ranks} (column "
                   "trained-on/ideal), and receives each of those samples once")
    body = (f"R = {args.rollout}, B = {args.mini_batch}, E = {args.epochs}, lengths log-normal up to {args.max_len} "
            f"tokens, token budget {args.max_tokens}, gloo CPU ranks.\n\n{measured}\n\n"
            f"all-to-all received bytes {verdict}; "
            f"micro-batch contents identical to the all-gather path on every rank and step: "
            f"{'yes' if all(checks) else 'NO'}.\n\n{per_sample}\n\n{formula}\n\n{projection}\n")
    report("Rollout data path: all-gather vs all-to-all (bench/datapath.py)", body, args.no_record)


if __name__ == "__main__":
    main()
