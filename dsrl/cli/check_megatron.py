"""dsrl's Megatron step on GPUs: gradient exactness against a float64 reference, and the real CP path.

    torchrun --nproc_per_node 1 -m dsrl.cli.check_megatron            # 1 GPU: fp32 and bf16, TP=PP=CP=1
    torchrun --nproc_per_node 2 -m dsrl.cli.check_megatron --cp 2     # 2 GPUs + Transformer Engine: CP=2
    python -m dsrl.cli.check_megatron --cpu-dry-run                   # no GPU: the fp32 path on CPU (gloo)

What runs (and what is skipped, with the reason, printed at the end):

1. ``fp32``: GPTModel (local spec) in fp32 with TF32 off, NCCL, one rank. dsrl's step with 3
   micro-batches of uneven lengths, both reduction conventions, all four loss_agg modes; the DDP's
   finalized gradient vs a float64 copy of the model over the unsplit mini-batch (the reference of
   :mod:`dsrl.cli.reference`, shared with ``dsrl.check`` and the tests). Expect ~1e-6.
2. ``bf16``: the same with ``bf16=True`` (Float16Module, fp32 grad reduction); the reference uses the
   bf16-rounded weights in float64. dsrl's error is bf16 rounding noise; the common naive recipe
   (mean of micro-batch means) is printed next to it to show what a structural error looks like.
3. ``cp2``: needs >= 2 GPUs, ``--cp 2`` and Transformer Engine (megatron-core's local attention
   refuses CP > 1). A TE GPTModel in bf16 with CP=2: dsrl shards whole sequences (load-balanced
   2*cp chunks, whole-sequence n_s); the reference is a CP=1 copy with the same weights.

megatron-core is imported from the environment; on a machine without it, put the wheel (or the
``megatron`` package directory) on PYTHONPATH. The CPU dry run uses the checkout's ``launch/megatron_cpu_shim.py``.
Prints one line per case and ``max relative
gradient error <case>: <float>`` lines, and exits non-zero if an exact-path case exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from dsrl.cli.check_measures import relative_error
from dsrl.cli.reference import reference_gradient
from dsrl.config.names import LOSS_AGG_MODES

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the shim's checkout

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 256, 128, 4, 2, 64
TOL = {"fp32": 1e-5, "bf16": 3e-2, "cp2": 3e-2}


def setup(dry: bool) -> torch.device:
    if dry:
        sys.path.insert(0, os.path.join(CHECKOUT, "launch"))
        import megatron_cpu_shim  # CPU-only shim for a dry run

        megatron_cpu_shim.install()
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29577")):
        os.environ.setdefault(k, v)
    if not dry:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo" if dry else "nccl")
    return torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())


def make_data(device: torch.device, n_micro: int = 3, b: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    micros = []
    for i in range(n_micro):
        mask = torch.zeros(b, SEQ)
        for r in range(b):
            p = int(torch.randint(4, 16, (1,), generator=g))
            c = 0 if (i == 0 and r == 0) else int(torch.randint(1, SEQ - p, (1,), generator=g))
            mask[r, p:p + c] = 1
        tokens = torch.randint(1, VOCAB, (b, SEQ), generator=g)
        micros.append({k: v.to(device) for k, v in {
            "tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask,
            "position_ids": torch.arange(SEQ).expand(b, SEQ).contiguous(),
            "old_logprobs": -5.5 + 0.3 * torch.randn(b, SEQ, generator=g), "advantages": torch.randn(b, generator=g),
        }.items()})
    return micros


def gpt_forward(model: Any, mb: dict) -> torch.Tensor:
    return model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None, labels=mb["labels"])


def ppo_loss(output: torch.Tensor, mb: dict) -> torch.Tensor:
    from dsrl.algos.losses import clipped_policy_loss

    logp = -output.to(torch.float64 if output.dtype == torch.float64 else torch.float32)
    loss, _ = clipped_policy_loss(logp, mb["old_logprobs"].to(logp.dtype), mb["advantages"].to(logp.dtype), 0.2, 0.28)
    return loss


def build_model(kind: str, per_token: bool = False, te: bool = False) -> Any:
    """A bare GPTModel (Float16Module-wrapped for bf16); same seed, so same weights, every call."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    bf16 = kind in ("bf16", "cp2")
    cpu = not torch.cuda.is_available()
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, calculate_per_token_loss=per_token, use_cpu_initialization=cpu,
                            context_parallel_size=2 if kind == "cp2" else 1)
    spec = specs.get_gpt_layer_with_transformer_engine_spec() if te else specs.get_gpt_layer_local_spec()
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if not cpu:
        model.cuda()
    return Float16Module(cfg, model) if bf16 else model


def build(kind: str, per_token: bool, te: bool = False) -> tuple[Any, Any, Any]:
    """(DDP model, megatron optimizer, OptimizerParamScheduler); lr 0 so weights stay put."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from dsrl.backends.megatron import build_param_scheduler

    model = build_model(kind, per_token, te)
    cfg = get_model_config(model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, min_lr=0.0, bf16=cfg.bf16,
                                                 clip_grad=0.0), [ddp])
    return ddp, opt, build_param_scheduler(opt, total_optimizer_steps=10, max_lr=0.0)


def _inner(ddp: Any) -> torch.nn.Module:
    m = ddp.module if hasattr(ddp, "ddp_config") else ddp
    return m.module if hasattr(m, "module") and not hasattr(m, "decoder") else m


def reference(ddp_or_params: Any, micros: list[dict], mode: str, naive: bool = False, te: bool = False) -> dict:
    """float64 grad of the mini-batch loss (:mod:`dsrl.cli.reference`; or, ``naive``, of the mean of micro-batch
    token means: the common wrong recipe, for contrast) at the same weights."""
    params = ({n: p.detach() for n, p in _inner(ddp_or_params).named_parameters()}
              if not isinstance(ddp_or_params, dict) else ddp_or_params)
    # No DDP here: its grad hooks move .grad into main_grad. TE runs the CP=1 reference in fp32.
    model = build_model("fp32", te=te)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n].float())
    model = model.double() if not te else model

    def per_token(m: Any, mb: dict) -> torch.Tensor:
        return ppo_loss(gpt_forward(m, mb), mb).double()

    if not naive:
        rows = sum(x["loss_mask"].shape[0] for x in micros)
        return reference_gradient(model, micros, per_token, mode, mini_batch_size=rows, norm_length=SEQ)
    total = 0.0
    for mb in micros:
        m = mb["loss_mask"].double()
        total = total + (per_token(model, mb) * m).sum() / m.sum().clamp(min=1) / len(micros)
    total.backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def grads(ddp: Any) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().double().clone() for n, p in _inner(ddp).named_parameters()}


def run_single(kind: str, micros: list[dict], results: list[tuple[str, float, float]]) -> None:
    from dsrl.backends.megatron import MegatronRLStep

    for conv in ("per_token", "average"):
        ddp, opt, sched = build(kind, conv == "per_token")
        step = MegatronRLStep(ddp, opt, sched, convention=conv, mini_batch_size=6, loss_agg_norm_length=SEQ)
        for mode in LOSS_AGG_MODES:
            step.loss_agg = mode
            step.train_step(micros, gpt_forward, ppo_loss)
            err = relative_error(grads(ddp), reference(ddp, micros, mode))
            results.append((f"{kind}/{conv}/{mode}", err, TOL[kind]))
            print(f"max relative gradient error {kind}/{conv}/{mode}: {err:.3e}", flush=True)
        if conv == "per_token":  # the structural error dsrl avoids, at the same precision
            naive = relative_error(grads(ddp), reference(ddp, micros, "token-mean", naive=True))
            print(f"  (for contrast) naive mean-of-micro-batch-means vs dsrl token-mean: {naive:.3e}", flush=True)


def run_cp2(micros: list[dict], results: list[tuple[str, float, float]]) -> None:
    from megatron.core import parallel_state as ps

    from dsrl.backends.megatron import MegatronRLStep

    for conv in ("per_token", "average"):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=2)
        ddp, opt, sched = build("cp2", conv == "per_token", te=True)
        step = MegatronRLStep(ddp, opt, sched, convention=conv, mini_batch_size=6, loss_agg_norm_length=SEQ)
        got: dict[str, dict] = {}
        params = {n: p.detach().clone() for n, p in _inner(ddp).named_parameters()}
        for mode in LOSS_AGG_MODES:
            step.loss_agg = mode
            step.train_step(micros, gpt_forward, ppo_loss)  # whole sequences: dsrl cuts them for CP
            got[mode] = grads(ddp)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel()  # CP=1 reference with the same weights on every rank
        for mode in LOSS_AGG_MODES:
            err = relative_error(got[mode], reference(params, micros, mode, te=True))
            results.append((f"cp2/{conv}/{mode}", err, TOL["cp2"]))
            if dist.get_rank() == 0:
                print(f"max relative gradient error cp2/{conv}/{mode}: {err:.3e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.cpu_dry_run or not torch.cuda.is_available()
    skipped: list[str] = []
    if dry and not args.cpu_dry_run:
        print("no CUDA device: running the CPU dry path (fp32 only)", flush=True)
    device = setup(dry)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    micros = make_data(device)
    world, n_gpu = dist.get_world_size(), (0 if dry else torch.cuda.device_count())
    have_te = importlib.util.find_spec("transformer_engine") is not None
    results: list[tuple[str, float, float]] = []
    if world == 1:
        run_single("fp32", micros, results)
        if dry:
            skipped.append("bf16: CPU dry path (bf16 matmuls on CPU say nothing about the GPU path)")
        else:
            run_single("bf16", micros, results)
    else:
        skipped.append(f"fp32/bf16 single-rank cases: run them with --nproc_per_node 1 (world is {world})")
    if args.cp == 2 and world == 2 and not dry and have_te and n_gpu >= 2:
        run_cp2(micros, results)
    else:
        why = []
        if args.cp != 2:
            why.append("--cp 2 not given")
        if dry or n_gpu < 2 or world != 2:
            why.append(f"CP=2 needs 2 GPUs and --nproc_per_node 2 (GPUs: {n_gpu}, world: {world})")
        if not have_te:
            why.append("Transformer Engine is not installed (megatron-core's local attention refuses CP > 1)")
        skipped.append("cp2: " + "; ".join(why))
    if dist.get_rank() == 0:
        print("\n== summary ==")
        for name, err, tol in results:
            print(f"{name:45s} {err:.3e}  (tol {tol:g}) {'ok' if err <= tol else 'FAIL'}")
        for s in skipped:
            print(f"SKIPPED {s}")
    bad = [r for r in results if r[1] > r[2]]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
