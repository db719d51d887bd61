"""``dsrl.check`` on the Megatron engine (a run file with ``dsrl.engine.kind = "megatron"``).

The same check as on DeepSpeed (:mod:`dsrl.cli.check`): one mini-batch of deliberately uneven micro-batches through
the engine ``launch/train.py`` builds (:func:`dsrl.backends.megatron.engine.build_engine`: the run file's tensor and
pipeline sizes over the job's ranks, megatron-core's DDP and optimizer, dsrl's step core), with plain SGD at a large
power-of-two LR, and the applied update ``(p_before - p_after) / lr`` against a single-process float64 full-batch
reference on the same data. The parameters are read before and after as Hugging Face tensors
(:meth:`MegatronEngine.hf_weights`, gathered over the tensor and pipeline ranks), so the reference is the unsharded
Hugging Face model itself. The model is a tiny Llama (``--model llama``, the default; ``llama_untied`` with its own
vocabulary-parallel head, ``qwen2`` tied with q/k/v biases), with two layers under pipeline parallelism; ``--objective
value`` checks the critic's value model (the replicated value head). Every tensor and pipeline peer of a data-parallel
replica gets the replica's micro-batches.

``--method naive`` plants the common wrong recipe (each micro-batch's token mean, averaged over the micro-batches):
expected to fail, to show the check can. (DeepSpeed's ``world_count`` has no counterpart: the Megatron step counts
each sequence on one rank of its model-parallel group, so no group choice double-counts there.) On a machine without
CUDA megatron-core runs through the checkout's CPU shim: ``deepspeed launch/check.py --ds_config FILE``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

#: the built-in models the Megatron engine's map serves (dense Hugging Face Llama / Qwen2 / Qwen3)
MEGATRON_MODELS = ("llama", "llama_untied", "qwen2", "qwen3")
#: the --method values that mean something on the Megatron engine (no MoE routes, no count-group choice)
MEGATRON_METHODS = ("dsrl", "naive", "count_observations")
SGD_LR = float(2**20)  # as dsrl.check's: lr * g is exact


def megatron_model_for(requested: str) -> str:
    """``--model`` on the Megatron engine: ``auto`` is a tiny Llama; the tiny custom model and the MoE models have no
    megatron-core counterpart in dsrl's map."""
    if requested == "auto":
        return "llama"
    if requested not in MEGATRON_MODELS:
        raise ValueError(f"--model {requested!r} with dsrl.engine.kind = 'megatron': the engine builds megatron-core "
                         f"models of {', '.join(MEGATRON_MODELS)}. Fix: --model llama (or another of them).")
    return requested


def require_shim_without_cuda() -> None:
    """megatron-core needs CUDA, or the checkout's CPU shim installed before it is imported (launch/check.py)."""
    import sys

    shim = sys.modules.get("megatron_cpu_shim")
    if not torch.cuda.is_available() and not getattr(shim, "_INSTALLED", False):
        raise SystemExit("dsrl.check: a run file with dsrl.engine.kind = 'megatron' on a machine without CUDA needs "
                         "megatron-core's CPU shim. Fix: run `deepspeed launch/check.py --ds_config FILE` instead of "
                         "`--module dsrl.check`.")


def _model(arch: str, objective: str, layers: int) -> torch.nn.Module:
    from dsrl.cli.check_models import hf_model
    from dsrl.cli.check_objectives import value_model

    return value_model(arch, layers) if objective == "value" else hf_model(arch, layers)


def _with_rows(micro: dict[str, Any]) -> dict[str, Any]:
    """The check's right-padded micro-batch with the ``[b, s]`` attention mask and positions the engine's model
    takes (its causal mask alone is the attention: right padding never reaches a counted token)."""
    ids = micro["input_ids"]
    return {**micro, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.shape[1], device=ids.device).expand_as(ids)}


def _mean_of_micro_means(loss_fn: Any, seqs: list[dict], replicas: int, split: str) -> Any:
    """``loss_fn`` rescaled so that dsrl's token-mean of it is the naive recipe's loss: every micro-batch's token
    mean, averaged over all micro-batches of the mini-batch (wrong whenever their token counts differ)."""
    from dsrl.cli.check_data import split_for_rank

    parts = [p for r in range(replicas) for p in split_for_rank(seqs, replicas, r, split)]
    total = sum(float(s["loss_mask"].sum()) for s in seqs)

    def naive(module: Any, micro: dict[str, Any]) -> torch.Tensor:
        lt = loss_fn(module, micro)
        tokens = float(micro["loss_mask"].sum())
        return lt * (total / (max(tokens, 1.0) * len(parts)))

    return naive


def run_megatron_case(raw: dict, loss_agg: str, split: str, method: str, seed: int, arch: str,
                      objective: str, data: str) -> dict[str, Any]:
    """One case (module docstring): the result row :func:`dsrl.cli.check.main` prints and judges."""
    from dsrl.backends.megatron.engine import OptimizerSettings, build_engine, initialize_parallel
    from dsrl.backends.megatron.run_file import layout_of
    from dsrl.cli.check_data import (
        MAX_LEN,
        check_run_file,
        collate,
        make_sequences,
        prepare_split,
        reference_gradient,
        split_for_rank,
    )
    from dsrl.cli.check_measures import relative_error, update_ratio, worst_parameter
    from dsrl.cli.check_objectives import LOSSES, apply_correction
    from dsrl.config import load_config
    from dsrl.config.engine import EngineConfig
    from dsrl.core.logprobs import LOGPROB_MASK
    from dsrl.core.plan import BatchPlan

    engine_section = raw["dsrl"]["engine"]
    layout = layout_of(EngineConfig(**engine_section))
    tp, pp, cp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.context_parallel_size
    world = dist.get_world_size()
    replicas = world // (tp * pp * cp)
    B = 6 * replicas
    seqs = prepare_split(make_sequences(B, seed, empty=(split == "empty"), multiturn=(data == "multiturn")), replicas,
                         split)
    mine = [dict(s, loss_mask=s["planted_mask"]) for s in seqs] if method == "count_observations" else seqs
    corrected = apply_correction(mine, objective)
    torch.manual_seed(seed)
    model = _model(arch, objective, layers=2 if pp > 1 else 1)
    reference = copy.deepcopy(model)
    cfg = check_run_file({k: v for k, v in raw.items() if k != "zero_optimization"}, 0, loss_agg, B)
    cfg.pop("zero_optimization", None)
    cfg["dsrl"]["engine"] = engine_section
    plan = BatchPlan.from_config(load_config(cfg), replicas, None)
    initialize_parallel(layout, seed)
    gpu = torch.cuda.is_available()
    bf16 = (raw["dsrl"].get("model") or {}).get("dtype") == "bfloat16"  # mixed precision: the fp32 main weights' update
    settings = OptimizerSettings(lr=SGD_LR, min_lr=SGD_LR, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0,
                                 decay_every_parameter=True, bf16=bf16,
                                 use_distributed_optimizer=not bf16)  # bf16: the main weights whole on each rank
    engine = build_engine(model.config, model.state_dict(), plan, layout, settings, on_gpu=gpu,
                          value_model=objective == "value")
    before = {n: t.detach().double().cpu().clone() for n, t in engine.hf_weights(main=bf16)}
    micros = [_with_rows(collate(part)) for part in split_for_rank(corrected, replicas,
                                                                    engine.view.data_parallel_rank, split)]
    for mb in micros:
        mb.pop("reference_mask", None)  # the reference's, never dsrl's
    micros = [{k: v.to(engine.device) if torch.is_tensor(v) and k != LOGPROB_MASK else v for k, v in mb.items()}
              for mb in micros]
    loss_fn = LOSSES[objective]
    if method == "naive":  # the common wrong recipe, planted: the mean of the micro-batches' token means
        loss_fn = _mean_of_micro_means(loss_fn, corrected, replicas, split)
    metrics = engine.train_mini_batch(micros, loss_fn)
    after = {n: t.detach().double().cpu().clone() for n, t in engine.hf_weights(main=bf16)}
    update = {n: (before[n] - after[n]) / SGD_LR for n in before}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(before[name])
    ref = reference_gradient(reference, seqs, loss_agg, MAX_LEN, objective)
    return {"stage": 0, "loss_agg": loss_agg, "split": split, "method": method, "world_size": world,
            "objective": objective, "data": data, "replicas": replicas, "engine": "megatron",
            "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "context_parallel_size": cp, "model": arch,
            "expert_parallel_size": 1,
            "error": relative_error(update, ref), "worst_tensor_error": relative_error(update, ref),
            "ratio": update_ratio(update, ref), "float64_error": None, "worst_parameter": worst_parameter(update, ref),
            "dense_error": None, "expert_error": None, "micro_batches": len(micros), "tokens": metrics.get("tokens"),
            "logprob_head": "fused vocab-parallel" if objective != "value" else "value head", "routing_replay": False,
            "router_aux_loss_coef": 0.0, "lora": False, "adapter_error": None,
            "trainable_parameters": sum(p.numel() for p in reference.parameters()), "frozen_moved": 0.0}
