"""Ulysses sequence parallelism (sp = world = 2) on CPU: every rank holds one token shard of every
sequence; the applied update must equal a float64 full-sequence reference on ZeRO-2 and on ZeRO-3
with reduce_scatter (where DeepSpeed averages over the whole sequence-data-parallel group and dsrl
must correct by D = |seq_dp|). The model is per-token (no mixing across positions), so sharding the
sequence is exact without an attention all-to-all."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

LR, V, H = 1024.0, 16, 8


class PerTokenModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.mix = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))))


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(4):
        n = 6 + 2 * i
        mask = torch.ones(n, dtype=torch.long)
        mask[: 1 + i] = 0
        seqs.append({"ids": torch.randint(0, V, (n,), generator=g), "targets": torch.randint(0, V, (n,), generator=g),
                     "mask": mask, "adv": torch.randn((), generator=g)})
    return seqs


def nll(logits, targets, adv):
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -adv.unsqueeze(-1) * logp


def reference(model, seqs, mode):
    ref = PerTokenModel().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    N = sum(int(s["mask"].sum()) for s in seqs)
    S = sum(1 for s in seqs if s["mask"].sum() > 0)
    total = 0
    for s in seqs:
        loss = nll(ref(s["ids"][None]), s["targets"][None], s["adv"][None].double())[0]
        w = s["mask"].double() / (N if mode == "token-mean" else S * s["mask"].sum())
        total = total + (w * loss).sum()
    total.backward()
    return {k: p.grad for k, p in ref.named_parameters()}


def shard(s, rank, world):
    n = s["ids"].shape[0]
    lo, hi = rank * n // world, (rank + 1) * n // world
    return {"input_ids": s["ids"][lo:hi][None], "targets": s["targets"][lo:hi][None],
            "loss_mask": s["mask"][lo:hi][None], "seq_valid_tokens": s["mask"].sum()[None],
            "advantages": s["adv"][None]}


def main():
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_mpu

    import dsrl

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    from dsrl.backends.deepspeed.engine import ensure_distributed

    ensure_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for stage, rs in ((2, True), (3, True), (3, False)):
        for mode in ("token-mean", "seq-mean-token-mean"):
            sp_mpu.initialize_sequence_parallel(world)
            torch.manual_seed(0)
            model = PerTokenModel()
            ref_grads = reference(model, data(), mode)
            cfg = {"zero_optimization": {"stage": stage, "reduce_scatter": rs}, "gradient_clipping": 0.0,
                   "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
                   "dsrl": {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "mini_batch_size": 4,
                                      "micro_batch_size_per_rank": 2, "loss_agg": mode},
                            "run": {"rollouts": 1}}}
            eng = dsrl.initialize(model, cfg, mpu=sp_mpu)
            params = dict(eng.engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
                before = {k: p.detach().clone().double() for k, p in params.items()}
            # two micro-batches of 1 sequence shard each... and one of 2: uneven on purpose
            shards = [shard(s, rank, world) for s in data()]
            micros = [shards[0], shards[1], shards[2], shards[3]]
            eng.train_mini_batch(micros, lambda m, mb: nll(m(mb["input_ids"]), mb["targets"], mb["advantages"]))
            with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
                after = {k: p.detach().clone().double() for k, p in params.items()}
            err = 0.0
            for k, g in ref_grads.items():
                applied = (before[k] - after[k]) / LR
                err = max(err, ((applied - g).norm() / g.norm()).item())
            results.append({"stage": stage, "reduce_scatter": rs, "mode": mode, "error": err,
                            "grad_scale": eng.view.grad_scale, "D": eng.plan.data_parallel_size})
            sp_mpu._release_sequence_parallel_groups()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
