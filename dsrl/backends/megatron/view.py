"""Megatron's :class:`dsrl.core.parallel.ParallelView`: which ranks own tokens, what the DDP really does to
gradients, and the construction checks.

:func:`megatron_view` reads everything from the live megatron-core objects, never assumes it:

- the count group is ``get_data_parallel_group(with_context_parallel=True)``: ranks with the same
  tensor-parallel shard and pipeline stage. Tensor-parallel peers hold the same tokens and would be
  counted twice (gradients off by the TP factor); :func:`validate_count_group` refuses any group that
  spans different (TP rank, PP rank) positions;
- the DDP's gradient factor f (what a rank's gradient is multiplied by before the sum over DP x CP)
  comes from its grad buffers: ``gradient_scaling_factor``, divided by ``|DP x CP|`` when
  ``average_in_collective`` turns the collective into an average; the view's ``grad_scale`` is 1/f;
- the chosen reduction convention must match the config and the DDP: ``"per_token"`` needs
  ``calculate_per_token_loss=True`` *and* a DDP built with it (f = 1); ``"average"`` needs the flag off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsrl.backends.megatron.deps import require_megatron
from dsrl.core.parallel import ParallelView, PipelineView


def validate_count_group(group: Any) -> None:
    """Refuse a count group whose members differ in tensor-parallel rank or pipeline stage.

    Such a group counts the same tokens once per TP peer (N_M too large by the TP factor) or mixes
    stages; one small all-gather, done once at construction.
    """
    from megatron.core import parallel_state as ps

    size = dist.get_world_size(group=group)
    if size == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()],
                        dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    positions = {tuple(p.tolist()) for p in parts}
    if len(positions) > 1:
        raise ValueError(
            f"the token-count group spans different (tensor-parallel rank, pipeline stage) positions "
            f"{sorted(positions)}: tensor-parallel peers hold the same tokens and would be counted "
            f"{ps.get_tensor_model_parallel_world_size()}x. Count over "
            f"parallel_state.get_data_parallel_group(with_context_parallel=True)."
        )


def ddp_grad_factor(chunk: Any) -> float:
    """The factor f this DDP chunk applies to a rank's dense gradient before summing over DP x CP."""
    factors = {float(buf.gradient_scaling_factor) for buf in getattr(chunk, "buffers", [])}
    if not factors:
        raise ValueError("the DDP chunk has no dense gradient buffers; nothing to train")
    if len(factors) > 1:
        raise ValueError(f"the DDP chunk's dense grad buffers use different scaling factors {sorted(factors)}")
    f = factors.pop()
    if chunk.ddp_config.average_in_collective:
        f /= chunk.dp_cp_group.size()
    return f


def megatron_view(
    model: list[Any], convention: str, *, count_group: Any = None, check_count_group: bool = True,
    context_parallel_in_model: bool = False,
) -> ParallelView:
    """Read and validate the layout of DDP-wrapped ``model`` chunks for ``convention`` (``"per_token"``
    or ``"average"``); every mismatch is an error naming the flag and the fix. ``count_group``
    overrides DP x CP (validated unless ``check_count_group`` is False). ``context_parallel_in_model``: the model
    cuts rows for context parallelism and gathers them back (:mod:`dsrl.backends.megatron.context_parallel`), so
    context peers hold whole rows: the count group is the data-parallel group without them."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is not initialised: call parallel_state.initialize_model_parallel")
    for i, chunk in enumerate(model):
        if not (hasattr(chunk, "finish_grad_sync") and hasattr(chunk, "ddp_config")):
            raise TypeError(
                f"model chunk {i} ({type(chunk).__name__}) is not wrapped in megatron.core.distributed."
                f"DistributedDataParallel; dsrl relies on its grad buffers and finalize_model_grads"
            )
    config = get_model_config(model[0])
    per_token_flag = bool(config.calculate_per_token_loss)
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    factors = {ddp_grad_factor(chunk) for chunk in model}
    if len(factors) > 1:
        raise ValueError(f"model chunks were wrapped with different DDP gradient factors {sorted(factors)}")
    f = factors.pop()
    dp_cp_size = dist.get_world_size(group=dp_cp)
    ddp_size = model[0].dp_cp_group.size()
    if ddp_size != dp_cp_size:
        raise ValueError(
            f"the DDP reduces over {ddp_size} ranks but parallel_state's DP x CP group has {dp_cp_size}; "
            f"wrap the model after initialize_model_parallel with the default process groups"
        )
    avg_in_coll = bool(model[0].ddp_config.average_in_collective)
    if convention == "per_token":
        if not per_token_flag:
            raise ValueError(
                "convention='per_token' needs TransformerConfig.calculate_per_token_loss=True, set before the "
                "model is wrapped in DistributedDataParallel (or use convention='average')"
            )
        if abs(f - 1.0) > 1e-12:
            why = ("average_in_collective=True averages the reduction" if avg_in_coll
                   else "the DDP was built while calculate_per_token_loss was still False")
            raise ValueError(
                f"calculate_per_token_loss=True but the DDP scales gradients by {f:g} instead of summing them "
                f"({why}); finalize_model_grads would then divide an average by the token count. Set the flag "
                f"on the TransformerConfig and average_in_collective=False before wrapping the model in DDP."
            )
    elif convention == "average":
        if per_token_flag:
            raise ValueError(
                "convention='average' needs calculate_per_token_loss=False (with it set, finalize_model_grads "
                "divides by the token count); use convention='per_token' instead"
            )
        if f <= 0:
            raise ValueError(f"the DDP gradient factor {f} is not positive")
        backend = dist.get_backend(dp_cp)
        if avg_in_coll and backend == "gloo" and dp_cp_size > 1:
            raise ValueError("average_in_collective=True needs ReduceOp.AVG, which gloo lacks; set it False on CPU")
    else:
        raise ValueError(f"unknown convention {convention!r}")
    if count_group is None and context_parallel_in_model:
        count_group = ps.get_data_parallel_group(with_context_parallel=False)
    group = dp_cp if count_group is None else count_group
    if check_count_group:
        validate_count_group(group)
    cp_size = ps.get_context_parallel_world_size()
    cp_rank = ps.get_context_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    tp_size = ps.get_tensor_model_parallel_world_size()
    counted = ("DPxCP" if count_group is None else
               "DP (context parallelism inside the model)" if context_parallel_in_model else "a custom group")
    desc = (f"tp={tp_size} pp={pp_size} cp={cp_size} dp={ps.get_data_parallel_world_size()}; counts over "
            f"{counted} ({dist.get_world_size(group=group)} ranks); DDP factor {f:g}"
            f"{' (average_in_collective)' if avg_in_coll else ''}; convention={convention}")
    pipeline = None
    if pp_size > 1:
        pipeline = PipelineView(size=pp_size, is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
                                group=ps.get_pipeline_model_parallel_group(),
                                last_stage_global_rank=ps.get_pipeline_model_parallel_last_rank(),
                                stage=ps.get_pipeline_model_parallel_rank())
    # f multiplies each rank's gradient before the sum over the group: the scale that undoes it is 1/f.
    return ParallelView(count_group=group, grad_scale=1.0 / f, data_parallel_size=ps.get_data_parallel_world_size(),
                        data_parallel_rank=ps.get_data_parallel_rank(), tensor_parallel_size=tp_size,
                        tensor_parallel_rank=ps.get_tensor_model_parallel_rank(),
                        tensor_parallel_group=ps.get_tensor_model_parallel_group() if tp_size > 1 else None,
                        sequence_parallel_size=cp_size, sequence_parallel_rank=cp_rank,
                        sequence_peers_hold_whole_rows=context_parallel_in_model, pipeline=pipeline,
                        description=desc)
