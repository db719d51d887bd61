"""dsrl's exact RL step embedded in a plain Megatron-style training loop (tiny GPT, random weights).

    torchrun --nproc_per_node 2 launch/train_megatron.py --tp 2
    torchrun --nproc_per_node 2 launch/train_megatron.py --pp 2 --convention average --loss_agg seq-mean-token-mean

Runs on GPUs (NCCL) or, without CUDA, on CPU with gloo through the CPU shim beside it, launch/megatron_cpu_shim.py (the
dsrl package itself never patches megatron-core). Each rollout is synthetic: random prompts and
completions of random length, random rewards, GRPO group-normalised advantages, on-policy (the old
log-probs are the current ones, detached). The loop is Megatron's own: build the model, wrap it in
DDP, ``get_megatron_optimizer``, an ``OptimizerParamScheduler`` with the plan's horizon; dsrl owns
the normalisation, the single ``forward_backward_func`` call per optimizer step and the scheduler.
Each rollout's mini-batches and each replica's micro-batches come from :mod:`dsrl.core.partition`, the split dsrl's
own RL loop uses (:func:`~dsrl.core.partition.mini_batches`, then :func:`~dsrl.core.partition.partition_mini_batch`
by the plan: fixed micro-batches of ``--micro_batch_size`` rows, one shape for pipeline parallelism).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--convention", choices=("per_token", "average"), default="per_token")
    ap.add_argument("--loss_agg", default="token-mean")
    ap.add_argument("--schedule_unit", choices=("optimizer_steps", "samples"), default="optimizer_steps")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--prompts_per_rollout", type=int, default=4)
    ap.add_argument("--samples_per_prompt", type=int, default=4)
    ap.add_argument("--mini_batch_size", type=int, default=8)
    ap.add_argument("--micro_batch_size", type=int, default=2, help="rows per micro-batch (fixed shape for PP)")
    ap.add_argument("--seq_len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup_steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def setup_distributed() -> bool:
    """NCCL on GPUs, gloo + the test shim on CPU. Returns whether CUDA is used."""
    cuda = torch.cuda.is_available()
    if not cuda:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import megatron_cpu_shim  # CPU-demo shim beside this example, never part of the package

        megatron_cpu_shim.install()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return cuda


def build(args: argparse.Namespace, cuda: bool, plan: Any) -> tuple[Any, Any, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from dsrl.backends.megatron import build_param_scheduler

    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=2 * args.pp, hidden_size=64, num_attention_heads=4, use_cpu_initialization=not cuda,
        # The flag must be set before the DDP wrap: DDP reads it to choose sum vs average.
        calculate_per_token_loss=args.convention == "per_token",
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=args.pp, tensor_model_parallel_size=args.tp,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                     max_sequence_length=args.seq_len, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    if cuda:
        model.cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    # Gradient clipping asserts CUDA tensors in megatron-core 0.16.1, so it is off on CPU.
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=0.0,
                                                 clip_grad=1.0 if cuda else 0.0), [ddp])
    sched = build_param_scheduler(opt, total_optimizer_steps=plan.total_optimizer_steps, max_lr=args.lr,
                                  warmup_steps=args.warmup_steps, unit=args.schedule_unit,
                                  samples_per_step=plan.mini_batch_size, init_lr=args.lr / 10)
    return ddp, opt, sched


def synthetic_rollout(args: argparse.Namespace, rollout: int) -> list[dict[str, torch.Tensor]]:
    """R = P*G sequences (identical on every rank): tokens, loss_mask on the completion, advantages."""
    gen = torch.Generator().manual_seed(1000 * args.seed + rollout)
    P, G, S = args.prompts_per_rollout, args.samples_per_prompt, args.seq_len
    rewards = torch.rand(P, G, generator=gen).round()
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    seqs = []
    for i in range(P * G):
        prompt = int(torch.randint(2, S // 4, (1,), generator=gen))
        completion = int(torch.randint(0, S - prompt, (1,), generator=gen))  # 0: an overlong-filtered sample
        mask = torch.zeros(S)
        mask[prompt:prompt + completion] = 1
        seqs.append({"tokens": torch.randint(1, 128, (S,), generator=gen), "loss_mask": mask,
                     "advantages": adv.flatten()[i]})
    return seqs


def collate(chunk: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch of equal-length rows: tokens, next-token labels, the loss mask, positions, advantages."""
    tokens = torch.stack([c["tokens"] for c in chunk])
    b, s = tokens.shape
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),
            "loss_mask": torch.stack([c["loss_mask"] for c in chunk]),
            "position_ids": torch.arange(s).expand(b, s).contiguous(),
            "advantages": torch.stack([c["advantages"] for c in chunk])}


def main() -> None:
    args = parse_args()
    cuda = setup_distributed()
    from megatron.core import parallel_state as ps

    from dsrl import BatchPlan, load_config
    from dsrl.algos.losses import clipped_policy_loss
    from dsrl.backends.megatron import MegatronRLStep
    from dsrl.core.partition import mini_batches, partition_mini_batch

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    dp = ps.get_data_parallel_world_size()
    cfg = load_config({"dsrl": {"batch": {
        "prompts_per_rollout": args.prompts_per_rollout, "samples_per_prompt": args.samples_per_prompt,
        "mini_batch_size": args.mini_batch_size, "micro_batch_size_per_rank": args.micro_batch_size,
        "loss_agg": args.loss_agg, "loss_agg_norm_length": args.seq_len},
        "run": {"rollouts": args.rollouts}}})
    plan = BatchPlan.from_config(cfg, dp)
    ddp, opt, sched = build(args, cuda, plan)
    step = MegatronRLStep(ddp, opt, sched, loss_agg=plan.loss_agg, convention=args.convention,
                          schedule_unit=args.schedule_unit, mini_batch_size=plan.mini_batch_size,
                          loss_agg_norm_length=plan.loss_agg_norm_length)
    rank0 = dist.get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if rank0:
        print(f"[dsrl] {step.view.description}; plan: {plan.total_optimizer_steps} optimizer steps, "
              f"B={plan.mini_batch_size}, loss_agg={plan.loss_agg}, schedule unit={args.schedule_unit}", flush=True)

    def forward_fn(model: Any, mb: dict) -> torch.Tensor:  # every pipeline stage
        return model(input_ids=mb["tokens"].to(device), position_ids=mb["position_ids"].to(device),
                     attention_mask=None, labels=mb["labels"].to(device))

    def loss_fn(output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # last stage
        logp = -output.float()  # GPTModel(labels=...) returns per-token cross entropy [b, s]
        loss, info = clipped_policy_loss(logp, logp.detach(), mb["advantages"].to(logp.device), 0.2, 0.28)
        return loss, {"neg_logp": output.detach().float()}

    t0 = time.time()
    for rollout in range(plan.rollouts):
        seqs = synthetic_rollout(args, rollout)
        # the rollout's mini-batches (each epoch reshuffled), then this replica's micro-batches of each, as dsrl's
        # own loop cuts them (dsrl.core.partition); the sequences share one length (the fixed shape)
        for k, indices in enumerate(mini_batches(len(seqs), plan.mini_batch_size, plan.epochs_per_rollout,
                                                 seed=1000 * args.seed + rollout)):
            epoch = k // plan.mini_batches_per_rollout
            replicas = partition_mini_batch(indices, [args.seq_len] * len(indices), plan)
            mine = [collate([seqs[i] for i in micro]) for micro in replicas[ps.get_data_parallel_rank()]]
            out = step.train_step(mine, forward_fn, loss_fn)
            if rank0:
                print(f"[dsrl] rollout {rollout} epoch {epoch} step {out['optimizer_step']}: "
                      f"micro-batches per replica {[len(r) for r in replicas]} (fillers here "
                      f"{out['filler_micro_batches']}), tokens {out['tokens']}, loss {out['loss']:+.6f}, "
                      f"nll {out['neg_logp']:.4f}, grad_norm {out['grad_norm']:.4e}, lr {out['lr']:.2e}, "
                      f"scheduler at {out['scheduler_position']}", flush=True)
    if rank0:
        print(f"[dsrl] done: {step.optimizer_steps} optimizer steps, {step.skipped_steps} skipped, "
              f"{time.time() - t0:.1f}s", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
