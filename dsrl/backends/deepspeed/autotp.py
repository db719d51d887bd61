"""DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``) as dsrl runs it.

What dsrl relies on (DeepSpeed 0.19.8, measured on 2 and 4 CPU ranks with gloo):

- AutoTP shards a Hugging Face model's ``nn.Linear`` layers over N ranks (column-parallel q/k/v and
  gate/up, row-parallel o/down) and builds a (data-parallel x tensor-parallel) device mesh: tensor
  peers are consecutive global ranks, and the engine's (seq_)data-parallel group has world / N ranks.
  Gradients are averaged over that group only; inside a tensor group the backward all-reduces make
  every replicated parameter's gradient complete on every peer. So D = world / (N * sp), the count
  group is the data-parallel group, and tensor peers must hold identical micro-batches
  (:mod:`dsrl.rl.data.replica` decides who gets what);
- with a tied embedding and output head, AutoTP follows the model's HF ``tp_plan`` and makes the head
  vocabulary-parallel: every rank then gets logits over its slice of the vocabulary only. The sampler
  needs the whole vocabulary, so dsrl sets ``tensor_parallel.vocab_parallel_lm_head: false`` and refuses
  ``true``: the tied head stays a replicated ``nn.Linear``. An untied head becomes a column-parallel layer
  that all-gathers its logits; dsrl's log-probs use its vocabulary shard directly (:func:`vocab_shard_of`);
- AutoTP replaces DeepSpeed's ``mpu`` with its own groups (``DeepSpeedEngine._configure_tensor_parallel_states``
  sets ``self.mpu = groups``), so a caller's mpu (Ulysses sequence parallelism included) cannot be
  combined with it: refused before work.

:func:`full_parameters` reassembles the full, unsharded parameters (ZeRO-3 partitions and AutoTP
shards) on every rank, for checks and tests.
"""

from __future__ import annotations

from typing import Any

import torch

from dsrl.config import ConfigError
from dsrl.core.logprobs import VocabShard, declare_vocab_shard

SECTION = "tensor_parallel"


def tensor_parallel_size(ds_config: dict[str, Any]) -> int:
    """``tensor_parallel.autotp_size`` (0 or 1 = off, returned as 1), checked to be a non-negative integer."""
    section = ds_config.get(SECTION)
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ConfigError(f"ds_config {SECTION} = {section!r} must be a section (an object), e.g. "
                          f'{{"autotp_size": 2}}. Fix: write it as an object or remove it.')
    size = section.get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"ds_config {SECTION}.autotp_size = {size!r} must be an integer >= 0 (0 or 1 = no tensor "
                          "parallelism). Fix: set it to the number of ranks that share one model replica.")
    return max(size, 1)


def data_parallel_replicas(ds_config: dict[str, Any], world_size: int, sequence_parallel: int = 1) -> int:
    """D = world / (autotp_size * sequence_parallel_size): the replicas that hold different sequences.

    Every layout rule that needs the world size is checked here, with the field named.
    """
    tp = tensor_parallel_size(ds_config)
    if tp > 1 and sequence_parallel > 1:
        raise ConfigError(
            f"ds_config {SECTION}.autotp_size = {tp} with sequence_parallel_size = {sequence_parallel}: DeepSpeed's "
            "AutoTP replaces the engine's mpu with its own (data x tensor) groups, so the Ulysses sequence-parallel "
            "groups would be lost. Fix: use one of them (set autotp_size to 1 or sequence_parallel_size to 1).")
    if world_size % (tp * sequence_parallel):
        what = (f"{SECTION}.autotp_size = {tp}" if sequence_parallel == 1
                else f"{SECTION}.autotp_size * sequence_parallel_size = {tp} * {sequence_parallel}")
        raise ConfigError(
            f"ds_config {what} does not divide the world size {world_size}: every rank must belong to exactly one "
            f"tensor-parallel group of {tp * sequence_parallel} ranks. Fix: choose a divisor of {world_size} or "
            "change the number of ranks.")
    return world_size // (tp * sequence_parallel)


def resolve_section(ds: dict[str, Any]) -> None:
    """Make the ``tensor_parallel`` section of the ds_config DeepSpeed will see dsrl-compatible (in place).

    With autotp_size > 1: ``vocab_parallel_lm_head`` defaults to false (dsrl needs full-vocabulary
    logits) and true is refused; a ``tp.tp_size`` other than autotp_size is refused (DeepSpeed only
    finds it while building the engine).
    """
    tp = tensor_parallel_size(ds)
    if tp <= 1:
        return
    section = ds[SECTION]
    vocab = section.setdefault("vocab_parallel_lm_head", False)
    if vocab is not False:
        raise ConfigError(
            f"ds_config {SECTION}.vocab_parallel_lm_head = {vocab!r}: a vocabulary-parallel output head gives every "
            "rank the logits of its slice of the vocabulary only, but dsrl's per-token log-probabilities, entropy and "
            "sampling need the whole vocabulary. Fix: remove the key or set it to false (dsrl's default).")
    inner = section.get("tp", section.get("tensor_parallel"))
    if isinstance(inner, dict) and inner.get("tp_size", 1) not in (1, tp):
        key = "tp" if "tp" in section else "tensor_parallel"
        raise ConfigError(f"ds_config {SECTION}.{key}.tp_size = {inner['tp_size']!r} differs from "
                          f"{SECTION}.autotp_size = {tp}. Fix: remove tp_size (autotp_size sets it).")


def check_model_for_tensor_parallel(model: torch.nn.Module, tp: int) -> None:
    """AutoTP shards a Hugging Face model through its ``config``: a module without one cannot be sharded.

    No head-count rule is needed: DeepSpeed splits heads unevenly when they do not divide ``tp`` and
    leaves ranks beyond the key-value head count without an attention shard (the row-parallel
    all-reduce still sums the right result). Measured exact with ``dsrl.check`` at tp = 2 for a Llama
    with 1 key-value head (of 4 and of 1 query heads) and with 3 of 6.
    """
    if tp > 1 and getattr(model, "config", None) is None:
        raise ConfigError(
            f"ds_config {SECTION}.autotp_size = {tp} needs a Hugging Face model (a transformers PreTrainedModel with "
            f"a config), got {type(model).__name__}: AutoTP finds the layers to shard from the model's config and "
            "tp_plan. Fix: pass a transformers model, or set autotp_size to 1.")


def vocab_shard_of(head: torch.nn.Module) -> VocabShard | None:
    """The vocabulary shard of AutoTP's column-parallel output head that gathers its output (what AutoTP makes of
    an untied ``lm_head``: each rank holds a slice of the vocabulary's rows, uneven slices allowed, and the full
    logits are all-gathered), read from DeepSpeed's universal-checkpoint metadata; None for any other module
    (a replicated head is a plain ``nn.Linear``). :mod:`dsrl.rl.policy.logprobs` then computes the log-probs
    vocabulary-parallel over the tensor group instead of gathering the logits."""
    try:
        from deepspeed.module_inject.layers import LinearLayer
    except ImportError:
        return None
    if type(head) is not LinearLayer or not head.gather_output or head.defer_collectives_to_compiler:
        return None
    meta = _tensor_parallel_meta(head.weight)
    if head.mp_group is None or meta is None or meta.get("partition_dim") != 0:
        return None
    sizes = list(meta["partition_sizes"])
    return VocabShard(group=head.mp_group, start=sum(sizes[:head.tp_index]), largest=max(sizes))


def declare_vocab_shard_of(module: torch.nn.Module) -> VocabShard | None:
    """Declare the vocabulary shard of ``module``'s output head to the log-probs
    (:func:`dsrl.core.logprobs.declare_vocab_shard`) when AutoTP made it column-parallel (:func:`vocab_shard_of`);
    every engine dsrl builds over a model calls it once, after DeepSpeed placed the model. Returns the shard
    (None: the head holds the whole vocabulary, or the model exposes none)."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    shard = vocab_shard_of(head) if isinstance(head, torch.nn.Module) else None
    if shard is not None:
        assert head is not None
        declare_vocab_shard(head, shard)
    return shard


def _tensor_parallel_meta(param: torch.Tensor) -> dict[str, Any] | None:
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    return getattr(param, DS_AUTOTP_UC_META, None)


def _gather_tensor_shard(shard: torch.Tensor, meta: dict[str, Any], group: Any) -> torch.Tensor:
    """The full tensor from this rank's AutoTP shard: an all-gather over the tensor group along the
    partition dimension (uneven shards padded to the largest, then trimmed)."""
    import torch.distributed as dist

    dim, sizes = meta["partition_dim"], list(meta["partition_sizes"])
    if meta.get("sub_param_sizes") or meta.get("sub_param_shard_widths"):
        raise ValueError("a fused AutoTP parameter (sub-parameter shards, e.g. a fused qkv) cannot be "
                                  "reassembled by dsrl.backends.deepspeed.autotp.full_parameters")
    padded_shape = list(shard.shape)
    padded_shape[dim] = max(sizes)
    padded = shard.new_zeros(padded_shape)
    padded.narrow(dim, 0, shard.shape[dim]).copy_(shard)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Full (unpartitioned, unsharded) float64 CPU copies of the module's parameters by name, on every rank.

    ZeRO-3 partitions are gathered with ``deepspeed.zero.GatheredParameters``; AutoTP shards
    (parameters carrying DeepSpeed's universal-checkpoint metadata with a partition dimension) are
    all-gathered over the tensor group. Collective: every rank of the job must call it.
    """
    module = engine.module
    named = list(module.named_parameters())
    tp_group = None
    if getattr(engine, "autotp_size", lambda: 0)() > 1:
        from deepspeed.utils import groups

        tp_group = groups.get_tensor_model_parallel_group()

    def copy_all() -> dict[str, torch.Tensor]:
        out = {}
        for name, p in named:
            t = p.detach()
            meta = _tensor_parallel_meta(p) if tp_group is not None else None
            if meta is not None and meta.get("partition_dim") is not None and not meta.get("replicated"):
                t = _gather_tensor_shard(t, meta, tp_group)
            out[name] = t.double().cpu().clone()
        return out

    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return copy_all()
    return copy_all()
