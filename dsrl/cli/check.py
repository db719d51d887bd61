"""Exactness self-check: ``deepspeed --num_gpus N --module dsrl.check --ds_config FILE``.

On the user's own cluster and ds_config (ZeRO stage, precision, communication settings), runs one
mini-batch of a tiny causal model through :class:`dsrl.RLEngine` with deliberately uneven
micro-batches (different counts per rank, a rank holding only padding, fully masked sequences) and
compares the *applied* update with a single-process float64 full-batch reference on the same data.

The update is measured with plain SGD at a large power-of-two LR (no momentum, no weight decay, no
clipping), so ``(p_before - p_after) / lr`` is the applied gradient to float32 rounding. The
reference implements each aggregation mode from its definition, independently of dsrl.core.weights.

The model is a tiny custom one, or a tiny Hugging Face model built from a config when the ds_config
shards the model by name: a Llama under AutoTP (``tensor_parallel.autotp_size > 1``), a Mixtral
(MoE) under AutoEP (``expert_parallel``) or with ``--model mixtral``. A run file with ``dsrl.model.lora``
gets a tiny Qwen2 (or ``--model llama``) carrying the run's adapters, which are then the only trainable
parameters (:mod:`dsrl.cli.check_lora`). The reference is the same model,
unsharded, in float64. Under AutoTP the mini-batch is split over the D data-parallel replicas and
every tensor peer of a replica gets the same micro-batches; the gathered update is compared per
parameter (dense and expert parameters alike).

``--objective`` picks the per-token loss whose normalization is checked: ``policy`` (``-A log pi``, the
default), ``gspo`` (the sequence-level clipped ratio of :func:`dsrl.algos.losses.sequence_clipped_policy_loss`)
or ``value`` (the critic's clipped value loss, :func:`dsrl.algos.losses.clipped_value_loss`, on a tiny
``AutoModelForTokenClassification`` value model). Each reference is written from the definition,
not with dsrl.algos.losses. A run file with ``dsrl.model.routing_replay = "rollout"`` or
``router_aux_loss_coef > 0`` (or ``--routing_replay`` / ``--router_aux_loss_coef``) checks a mixture-of-experts
policy (:mod:`dsrl.cli.check_moe`: a 2-layer Mixtral with random forced routes, under AutoEP when the ds_config
enables it, against MoE blocks computed from their definition in float64; ``--method replay_off,routes_shifted``
are its planted bugs). ``--data multiturn`` makes the sequences multi-turn trajectories (observation spans with
loss mask 0, empty model turns, a trajectory without model tokens: :mod:`dsrl.cli.check_trajectories`).

``--model DIR`` checks a real pretrained causal LM (a Hugging Face directory, e.g. ``dsrl prepare-model``'s) in
float32. A deep model's float32 step is itself about 1e-4 from float64 (SmolLM2-135M: 5.6e-4 for the worst tensor,
0.99977 for the update ratio, on one process with the whole batch), so its reference is the mini-batch loss from
its definition over the very micro-batches dsrl's ranks run, computed in one process in float32
(:func:`micro_batch_reference`): only the normalization and the summation over ranks can differ. Its error is that
of the update as one vector (a small tensor whose gradient cancels over many tokens, e.g. a norm's weight, differs
by float32 summation order alone by up to 5e-5), at most 1e-6 like every float32 case. On ZeRO-3 the reference runs
through the identity autograd nodes ZeRO-3's hooks add at every module's inputs and outputs
(:func:`dsrl.cli.check_models.with_zero3_autograd_nodes`): they change the order in which autograd sums a tensor's
gradients in float32, which alone moves SmolLM2-135M's gradient by 1.0e-6 on one micro-batch (bit for bit the ZeRO-3
engine's difference from the plain module). SmolLM2-135M, 2026-12-02, uneven split: ZeRO-2 4.8e-8 on one rank and
7.9e-8 on two; ZeRO-3 5.2e-8 and 7.1e-8 (against the plain module's reference: 5.6e-6 and 1.6e-6). The error
against the float64 full-batch reference is printed beside it.

The last line printed is ``max relative gradient error: <float>``; the exit code is non-zero when
it exceeds the tolerance (1e-6 in float32; looser in bf16/fp16, where the model runs in 16 bits).
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch
import torch.distributed as dist

from dsrl.cli.check_data import (
    EXTRA_SPLITS,
    FLOAT_KEYS,
    SPLITS,
    check_run_file,
    collate,
    make_sequences,
    prepare_split,
    reference_gradient,
    split_for_rank,
)
from dsrl.cli.check_lora import adapter_parameters, lora_model_for, lora_settings, with_adapters
from dsrl.cli.check_measures import (
    full_parameters,
    global_relative_error,
    is_expert,
    relative_error,
    update_ratio,
    worst_parameter,
)
from dsrl.cli.check_models import build_model, is_model_dir, logprob_head, model_for, with_zero3_autograd_nodes
from dsrl.cli.check_moe import (
    MOE_ARCHS,
    PLANTED,
    MoESettings,
    attach_routes,
    moe_layout,
    routed_loss,
    settings_from,
)
from dsrl.cli.check_moe import mini_batch_load as moe_mini_batch_load
from dsrl.cli.check_objectives import (
    LOSSES,
    MAX_LEN,
    OBJECTIVES,
    apply_correction,
    per_token_loss,
    reference_correction,
)
from dsrl.cli.reference import mini_batch_loss
from dsrl.config.names import (
    LOSS_AGG_MODES,
)
from dsrl.core.logprobs import LOGPROB_MASK

# Powers of two: lr * g is exact. With 2**20, p_after - p_before is dominated by lr * g even for small
# gradients (the float32 read-back of p_after then costs ~2**-24 relative); fp16 parameters would overflow
# (max 65504), so fp16 runs keep 2**10.
LR = float(2**20)
LR_FP16 = float(2**10)
MODELS = ("auto", "tiny", "llama", "llama_untied", "qwen2", "qwen3", *MOE_ARCHS)
# --method values: dsrl; naive (per-micro-batch mean, expected to fail); world_count (dsrl's step with the
# counts summed over the whole world instead of the data-parallel group: under TP the wrong factor 1/tp);
# count_observations (--data multiturn: dsrl's step on samples whose observation tokens are counted, a planted bug);
# replay_off / routes_shifted (routing replay: dsrl's side routes freely, or with every route one token late)
METHODS = ("dsrl", "naive", "world_count", "count_observations", *PLANTED)
DATA = ("single", "multiturn")  # --data: one completion per sequence, or multi-turn trajectories


def micro_batch_reference(model: torch.nn.Module, parts: list[list[list[dict]]], loss_agg: str,
                          loss_agg_norm_length: int, mini_batch_size: int, objective: str = "policy",
                          zero3: bool = False) -> dict[str, torch.Tensor]:
    """A real model's reference (``--model DIR``): the gradient of the mini-batch loss from its definition
    (:func:`dsrl.cli.reference.mini_batch_loss`: the aggregation weights in float64) over the very micro-batches
    dsrl's ranks run (``parts[rank]``), each micro-batch's per-token losses from the check's own loss function in
    the model's float32 kernels, in one process. A deep model's float32 step is itself some 1e-4 from float64, and
    another log-prob kernel (full logits instead of the fused head) moves it by 1e-5, either of which would hide a
    normalization error that small; against this reference only the normalization (the weights and the counts over
    ranks and micro-batches) and the summation over ranks differ. ``zero3``: through the autograd nodes ZeRO-3 adds
    (:func:`dsrl.cli.check_models.with_zero3_autograd_nodes`), whose float32 summation order alone is 1e-6 away."""
    ref = copy.deepcopy(model)
    if zero3:
        with_zero3_autograd_nodes(ref)
    loss_fn = LOSSES[objective]
    per_token, masks = [], []
    for micros in parts:
        for part in micros:
            batch = collate(part)
            per_token.append(loss_fn(ref, batch))
            masks.append(reference_correction(batch, objective)[1])
    loss = mini_batch_loss(per_token, masks, loss_agg, mini_batch_size=mini_batch_size,
                           norm_length=loss_agg_norm_length)
    loss.backward()
    return {n: (p.grad.detach().double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64))
            for n, p in ref.named_parameters()}


def naive_step(engine: Any, micros: list[dict], n_max: int, loss_fn: Any = per_token_loss) -> None:
    """The common wrong recipe: token-mean per micro-batch, averaged over the rank's micro-batches,
    then DeepSpeed's average over ranks (kept here to show the check can fail)."""
    fillers = n_max - len(micros)
    template = micros[0]
    for mb in micros + [dict(template, loss_mask=torch.zeros_like(template["loss_mask"]))] * fillers:
        lt = loss_fn(engine, mb)
        mask = mb["loss_mask"].to(lt.dtype)
        loss = (lt * mask).sum() / mask.sum().clamp(min=1) / len(micros)
        engine.backward(loss, scale_wrt_gas=False)
    engine.step()


def run_case(ds_config: dict, stage: int, loss_agg: str, split: str, method: str, seed: int,
             arch: str = "tiny", objective: str = "policy", data: str = "single",
             moe: MoESettings | None = None) -> dict[str, Any]:
    import dataclasses

    import dsrl
    from dsrl.backends.deepspeed.autoep import expert_parallel_enabled, expert_parallel_size, moe_optimizer
    from dsrl.backends.deepspeed.autotp import tensor_parallel_size
    from dsrl.backends.deepspeed.config import data_parallel_size

    world = dist.get_world_size()
    replicas = data_parallel_size(ds_config, world)  # tensor peers of a replica get the same data
    B = 6 * replicas
    seqs = prepare_split(make_sequences(B, seed, empty=(split == "empty"), multiturn=(data == "multiturn")), replicas,
                         split)
    moe = moe if moe is not None and moe.active and arch in MOE_ARCHS else None
    mine = [dict(s, loss_mask=s["planted_mask"]) for s in seqs] if method == "count_observations" else seqs
    corrected = apply_correction(mine, objective)  # dsrl's experience-side step; the reference gets ``seqs``
    torch.manual_seed(seed)
    model = build_model(arch, objective, moe)
    if moe is not None:  # routes for every sequence: forced (replay) and counted (load-balancing loss)
        attach_routes(seqs, moe_layout(model), seed)
        corrected = [dict(c, routes=s["routes"]) for c, s in zip(corrected, seqs)]
    lora = lora_settings(ds_config)
    if lora is not None:  # the run's adapters: only they train (dsrl.cli.check_lora)
        model = with_adapters(model, lora, seed)
    reference = copy.deepcopy(model)  # unsharded: AutoTP/AutoEP replace the original's layers in place
    cfg = check_run_file(ds_config, stage, loss_agg, B, lora)
    fp16 = isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") in (True, "auto")
    lr = LR_FP16 if fp16 else LR
    if expert_parallel_enabled(cfg):
        optimizer: Any = moe_optimizer(lambda groups: torch.optim.SGD(groups, lr=lr))
    else:
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = dsrl.initialize(model, cfg, optimizer=optimizer)
    replica = engine.view.data_parallel_rank
    before = full_parameters(engine.engine)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(before[name])
    micros = [collate(part) for part in split_for_rank(corrected, replicas, replica, split)]
    for mb in micros:
        mb.pop("reference_mask", None)  # the reference's, never dsrl's
    dtype = next(engine.module.parameters()).dtype
    dev = engine.device
    micros = [{k: v if k == LOGPROB_MASK else v.to(dev) for k, v in mb.items()} for mb in micros]
    for mb in micros:
        for key in ("advantages", *FLOAT_KEYS):
            if key in mb:
                mb[key] = mb[key].to(dtype)
    metrics: Any = {}
    loss_fn = LOSSES[objective]
    routing = None
    if moe is not None:
        from dsrl.rollout.routes import MoERouting

        routing = MoERouting.of(engine.engine)
        load = moe_mini_batch_load(engine, routing, micros) if moe.aux_coef > 0 else None
        loss_fn = routed_loss(loss_fn, routing, moe, load, method)
    if method == "naive":
        naive_step(engine.engine, micros, engine.global_counts(micros).max_micro_batches, loss_fn)
    else:
        if method == "world_count":  # the double count dsrl must avoid: tensor peers counted as replicas
            engine.view = dataclasses.replace(engine.view, count_group=None)
        metrics = engine.train_mini_batch(micros, loss_fn)
    if routing is not None:
        routing.force(None)
        routing.close()
    after = full_parameters(engine.engine)
    if is_model_dir(arch):  # a real model's ZeRO-3 hooks and partitions would keep its engine alive into the next case
        engine.engine.destroy()
    update = {n: (before[n] - after[n]) / lr for n in before}
    ref = reference_gradient(reference, seqs, loss_agg, MAX_LEN, objective, moe)
    float64_error = None
    if is_model_dir(arch):  # a real model: float32 itself is far from float64 (micro_batch_reference)
        float64_error = relative_error(update, ref)
        ref = micro_batch_reference(reference, [split_for_rank(seqs, replicas, r, split) for r in range(replicas)],
                                    loss_agg, MAX_LEN, len(seqs), objective, zero3=stage == 3)
    has_experts = any(is_expert(n) for n in ref)
    return {"stage": stage, "loss_agg": loss_agg, "split": split, "method": method, "world_size": world,
            "objective": objective, "data": data,
            "replicas": replicas, "tensor_parallel_size": tensor_parallel_size(cfg), "model": arch,
            "expert_parallel_size": expert_parallel_size(cfg),
            "expert_parallel_layers": sum(type(m).__name__ == "AutoEPMoELayer" for m in engine.module.modules()),
            "error": global_relative_error(update, ref) if float64_error is not None else relative_error(update, ref),
            "worst_tensor_error": relative_error(update, ref),
            "ratio": update_ratio(update, ref), "float64_error": float64_error,
            "worst_parameter": worst_parameter(update, ref),
            "dense_error": relative_error(update, ref, lambda n: not is_expert(n)) if has_experts else None,
            "expert_error": relative_error(update, ref, is_expert) if has_experts else None,
            "micro_batches": len(micros), "tokens": metrics.get("tokens"), "logprob_head": logprob_head(engine.module),
            "routing_replay": bool(moe and moe.replay), "router_aux_loss_coef": moe.aux_coef if moe else 0.0,
            "lora": lora is not None,
            "adapter_error": relative_error(update, ref, set(adapter_parameters(ref)).__contains__) if lora else None,
            "trainable_parameters": sum(p.numel() for p in reference.parameters() if p.requires_grad),
            "frozen_moved": max((float((update[n]).abs().max()) for n, p in reference.named_parameters()
                                 if not p.requires_grad), default=0.0)}


def release_case_memory() -> None:
    """Give back what a case held before the next one builds its engine: a real model's case holds several full
    copies (the engine's, the references', float64 gradients), and two ZeRO-3 cases of SmolLM2-135M on 2 ranks ran a
    24 GiB host out of memory while the first case's engine and buffers stayed resident."""
    import gc

    from dsrl.runtime.phases import trim_heap

    gc.collect()
    trim_heap()


def _moe_tag(res: dict[str, Any]) -> str:
    tag = f" ep={res['expert_parallel_size']}" if res["expert_parallel_size"] > 1 else ""
    tag += "+replay" if res["routing_replay"] else ""
    return tag + (f"+aux{res['router_aux_loss_coef']:g}" if res["router_aux_loss_coef"] else "")


def tolerance_for(ds_config: dict) -> float:
    """1e-6 in float32 (a real model's too: module docstring); 2e-2 where the model runs in 16 bits (a ds_config
    ``bf16`` / ``fp16`` section, or ``dsrl.model.dtype`` bfloat16: the Megatron engine's mixed precision)."""
    model = (ds_config.get("dsrl") or {}).get("model") or {}
    low_precision = any(isinstance(ds_config.get(k), dict) and ds_config[k].get("enabled") in (True, "auto")
                        for k in ("bf16", "fp16")) or model.get("dtype") == "bfloat16"
    return 2e-2 if low_precision else 1e-6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsrl.check", description=__doc__.splitlines()[0])
    parser.add_argument("--ds_config", required=True, help="the run file (ds_config with a dsrl section)")
    parser.add_argument("--zero_stages", default=None, help="comma list overriding the config's stage, e.g. 0,1,2,3")
    parser.add_argument("--loss_agg", default="all", help=f"'all' or one of {', '.join(LOSS_AGG_MODES)}")
    parser.add_argument("--splits", default=",".join(SPLITS),
                        help=f"comma list of {', '.join(SPLITS + EXTRA_SPLITS)} (default: {', '.join(SPLITS)})")
    parser.add_argument("--method", default="dsrl",
                        help="comma list of dsrl, naive, world_count, count_observations, replay_off, routes_shifted; "
                             "naive = per-micro-batch mean, world_count = counts summed over the whole world (wrong "
                             "under tensor parallelism), replay_off / routes_shifted = routing replay claimed but not "
                             "done / one token late; all but dsrl are expected to fail (they show the check can fail); "
                             "only dsrl results count towards the exit code")
    parser.add_argument("--model", default="auto",
                        help="tiny (custom), llama, llama_untied (its own output head), qwen2, qwen3, mixtral or "
                             "qwen3_moe (tiny Hugging Face models); auto = tiny, or llama under AutoTP, mixtral under "
                             "AutoEP or with routing replay / a load-balancing loss (2 layers then); or a Hugging Face "
                             "model directory: a real pretrained causal LM (e.g. dsrl prepare-model's), checked in "
                             "float32 against the float32 mini-batch loss over the same micro-batches (the error "
                             "against float64 printed beside it)")
    parser.add_argument("--routing_replay", default=None, choices=("off", "rollout"),
                        help="MoE: force random routes in dsrl's forwards and the reference's (default: the run "
                             "file's dsrl.model.routing_replay)")
    parser.add_argument("--router_aux_loss_coef", type=float, default=None,
                        help="MoE: the load-balancing loss coefficient (default: the run file's "
                             "dsrl.model.router_aux_loss_coef)")
    parser.add_argument("--objective", default="policy",
                        help=f"comma list of {', '.join(OBJECTIVES)}: the per-token loss checked (policy = -A log pi; "
                             "gspo = sequence-level clipped ratio; value = the critic's clipped value loss)")
    parser.add_argument("--data", default="single", choices=DATA,
                        help="single = one completion per sequence; multiturn = multi-turn trajectories (observation "
                             "spans with loss mask 0, empty model turns, a trajectory without model tokens)")
    parser.add_argument("--tolerance", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every case's result to this file (rank 0)")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model not in MODELS and not is_model_dir(args.model):
        parser.error(f"--model {args.model!r}: not one of {', '.join(MODELS)} and not a model directory (no "
                     "config.json there)")

    from dsrl.backends.deepspeed.engine import ensure_distributed
    from dsrl.config import load_config

    raw = load_config(args.ds_config).to_dict()
    ensure_distributed()
    stage0 = (raw.get("zero_optimization") or {}).get("stage", 0)
    stages = [int(s) for s in args.zero_stages.split(",")] if args.zero_stages else [int(stage0)]
    loss_aggs = list(LOSS_AGG_MODES) if args.loss_agg == "all" else args.loss_agg.split(",")
    splits = args.splits.split(",")
    tol = args.tolerance if args.tolerance is not None else tolerance_for(raw)
    rank = dist.get_rank()
    results, worst = [], 0.0
    methods = args.method.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--method {','.join(unknown)}: not one of {', '.join(METHODS)}")
    objectives = args.objective.split(",")
    unknown = sorted(set(objectives) - set(OBJECTIVES))
    if unknown:
        parser.error(f"--objective {','.join(unknown)}: not one of {', '.join(OBJECTIVES)}")
    moe = settings_from(raw, args.routing_replay, args.router_aux_loss_coef)
    megatron = (raw["dsrl"].get("engine") or {}).get("kind") == "megatron"
    if megatron:  # dsrl.cli.check_engine_megatron: the engine launch/train.py builds
        from dsrl.cli.check_engine_megatron import (
            MEGATRON_METHODS,
            megatron_model_for,
            require_shim_without_cuda,
            run_megatron_case,
        )

        require_shim_without_cuda()
        if set(methods) - set(MEGATRON_METHODS):
            parser.error(f"--method {','.join(sorted(set(methods) - set(MEGATRON_METHODS)))} with dsrl.engine.kind = "
                         f"'megatron': use {', '.join(MEGATRON_METHODS)}")
        try:
            arch = megatron_model_for(args.model)
        except ValueError as e:
            parser.error(str(e))
        stages = [0]
    else:
        arch = (model_for(raw, args.model, moe) if lora_settings(raw) is None
                else lora_model_for(args.model, args.objective))
    if moe.active and arch not in MOE_ARCHS:
        parser.error(f"routing replay / a load-balancing loss needs an MoE model: --model {arch} is dense (use "
                     f"{' or '.join(MOE_ARCHS)})")
    for objective in objectives:
        for stage in stages:
            for loss_agg in loss_aggs:
                for split in splits:
                    for method in methods:
                        res = (run_megatron_case(raw, loss_agg, split, method, args.seed, arch, objective,
                                                 args.data) if megatron else
                               run_case(raw, stage, loss_agg, split, method, args.seed, arch, objective, args.data,
                                        moe))
                        if is_model_dir(arch):
                            release_case_memory()
                        results.append(res)
                        if method == "dsrl":
                            worst = max(worst, res["error"])
                        if rank == 0:
                            where = (f"megatron tp={res['tensor_parallel_size']} pp={res['pipeline_parallel_size']}"
                                     + (f" cp={res['context_parallel_size']}" if res.get("context_parallel_size", 1) > 1
                                        else "")
                                     if megatron else f"ZeRO-{stage}")
                            print(f"{objective:<6} {args.data} {where} {loss_agg:<24} {split:<9} "
                                  f"ranks={res['world_size']} tp={res['tensor_parallel_size']} "
                                  f"{arch}{'+lora' if res['lora'] else ''}{_moe_tag(res)} {method:<11} relative error "
                                  f"{res['error']:.3e} (update/reference {res['ratio']:.7f})"
                                  + ("" if res["float64_error"] is None else
                                     f"; against float64 {res['float64_error']:.3e}"), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"tolerance": tol, "results": results}, f, indent=1)
    if "dsrl" not in methods:
        worst = max(r["error"] for r in results)
    if rank == 0:
        print(f"max relative gradient error: {worst:.3e}", flush=True)
    dist.barrier()
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    leave(main())  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
