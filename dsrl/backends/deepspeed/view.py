"""The :class:`dsrl.core.parallel.ParallelView` of a DeepSpeedEngine: its token-owning group and the
factor its gradient reduction really applies (read from the engine, never assumed)."""

from __future__ import annotations

from typing import Any

from dsrl.core.parallel import ParallelView, group_rank, group_size


def deepspeed_view(engine: Any) -> ParallelView:
    """The token-owning group and averaging factor of a DeepSpeedEngine.

    Gradients are reduced over ``engine.seq_data_parallel_group`` (DP x Ulysses-SP; with AutoTP the
    data-parallel group of the (data x tensor) mesh, world / autotp_size ranks). Net factors
    measured on DeepSpeed 0.19.8 (architecture §7, research §2, dsrl.backends.deepspeed.autotp):
      - ``gradient_allreduce_op: "sum"`` (ZeRO 0-2): no averaging, D = 1;
      - ZeRO 0/1/2 and ZeRO-3 with ``reduce_scatter: false``: sum / (|seq_dp| / sp);
      - ZeRO-3 with ``reduce_scatter: true`` (default): sum / |seq_dp| -- with sp > 1 this is an
        extra 1/sp that dsrl corrects by using D = |seq_dp|;
      - AutoTP: the same rules over the data-parallel group; tensor peers are not part of it;
      - AutoEP (expert parallelism): expert gradients come out with the same factor as dense ones.
    The layout is checked: world = replicas * sp * tp, or a RuntimeError says what was found.
    """
    group = engine.seq_data_parallel_group
    seq_dp = group_size(group)
    sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    tp = int(engine.autotp_size() or 1) if hasattr(engine, "autotp_size") else 1
    replicas = seq_dp // sp
    world = group_size(None)
    if replicas * sp * tp != world:
        raise RuntimeError(f"the engine's layout does not tile the world: {world} ranks, but |seq_dp| = {seq_dp} with "
                           f"sequence_parallel_size {sp} and autotp_size {tp}")
    stage = engine.zero_optimization_stage()
    if not getattr(engine, "gradient_average", True):
        scale, how = 1.0, "gradient_allreduce_op=sum"
    elif stage == 3 and engine.zero_reduce_scatter() and sp > 1:
        scale, how = float(seq_dp), f"ZeRO-3 reduce_scatter averages over |seq_dp|={seq_dp} (sp={sp})"
    else:
        scale, how = float(replicas), f"mean over {replicas} data-parallel replicas"
    if sp > 1:
        from deepspeed.utils import groups

        sp_rank = groups._get_sequence_parallel_rank()
        dp_rank = groups._get_data_parallel_rank()
    else:
        sp_rank, dp_rank = 0, group_rank(group)
    tp_rank, tp_group = 0, None
    if tp > 1:
        from deepspeed.utils import groups

        tp_group = groups.get_tensor_model_parallel_group()
        tp_rank = group_rank(tp_group)
        how += f"; AutoTP over {tp} ranks (tensor peers share data and are not counted)"
    return ParallelView(count_group=group, grad_scale=scale, data_parallel_size=replicas, data_parallel_rank=dp_rank,
                        tensor_parallel_size=tp, tensor_parallel_rank=tp_rank, tensor_parallel_group=tp_group,
                        sequence_parallel_size=sp, sequence_parallel_rank=sp_rank, description=f"ZeRO-{stage}, {how}")
