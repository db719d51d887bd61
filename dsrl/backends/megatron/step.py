"""One exact RL optimizer step inside a Megatron training loop.

:class:`MegatronRLStep.train_step` runs a mini-batch (this rank's micro-batches) through
``get_forward_backward_func()`` in a single call. The counts (one collective over
``get_data_parallel_group(with_context_parallel=True)``, see :mod:`dsrl.backends.megatron.view`), the
zero-weight fillers, the weights, the all-rank non-finite skip and the metric token means are
:mod:`dsrl.core.step`'s. What is Megatron's (architecture §2, §3):

- **Counts on every stage.** CP ranks count their shard's tokens; only CP rank 0 counts sequences,
  using whole-sequence n_s (dsrl cuts whole sequences for CP itself, :mod:`dsrl.backends.megatron.cp`);
  every pipeline stage reads the counts from ``loss_mask`` before the schedule, so all agree.
- **Exact gradient.** With local weighted sum ``S_w = sum_{t in micro} w_t l_t``, the loss_func
  returns

  ``"per_token"`` (``calculate_per_token_loss=True``): ``(N_M * S_w, n_local, log)`` with ``n_local``
  the micro-batch's integer valid-token count on this CP shard. Megatron does not rescale the loss,
  DDP sums over DP x CP, and ``finalize_model_grads`` divides by ``sum n_local = N_M``:
  gradient = sum over ranks of grad S_w = grad L_M. (Megatron's own MoE/MTP auxiliary scaling keeps
  working because ``num_tokens`` means what Megatron expects.)

  ``"average"`` (default DDP): ``(S_w * M / f, 1, log)`` where M is this call's ``num_microbatches``
  and f the DDP's real gradient factor read from its buffers (``1/|DP x CP|``, from the pre-scale or
  ``average_in_collective``; the view's ``grad_scale`` is 1/f). The schedule divides by 1 and by M,
  DDP multiplies by f and sums: gradient = grad L_M again.
- **Same-shape fillers.** Fillers keep the template's shape, so pipeline P2P shapes stay equal.
- **One finalize per step.** ``config.finalize_model_grads_func`` is wrapped so that a second call
  between two optimizer steps raises (in per-token mode it would re-sum already reduced
  buffers); dsrl checks after the schedule that it ran exactly once.
- **Scheduler.** Advanced only after ``optimizer.step()`` returns ``update_successful``, by 1 or by
  the mini-batch's samples (:mod:`dsrl.backends.megatron.schedule`). A skipped step zeroes the grad buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsrl.backends.megatron.cp import shard_for_context_parallel
from dsrl.backends.megatron.deps import require_megatron
from dsrl.backends.megatron.schedule import OPTIMIZER_STEPS, SchedulerDriver
from dsrl.backends.megatron.view import megatron_view
from dsrl.config.names import SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN
from dsrl.core.step import Log, MiniBatchCounts, StepCore, StepInputs, StepResult, Update
from dsrl.core.weights import valid_mask

PER_TOKEN = "per_token"
AVERAGE = "average"
CONVENTIONS = (PER_TOKEN, AVERAGE)

log = logging.getLogger("dsrl.backends.megatron")
MicroBatch = Mapping[str, Any]
ForwardFn = Callable[[Any, MicroBatch], torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"]


class FinalizeOnce:
    """Wraps ``finalize_model_grads``: at most one call between two :meth:`reset` s.

    In per-token mode a second finalize in the same optimizer step re-reduces already summed
    grad buffers and divides by a partial token count (research: gradients ~90% off); with the
    distributed optimizer even the averaging mode breaks. dsrl makes one schedule call per step,
    so a second call means a caller ran ``forward_backward_func`` again: refuse it loudly.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls >= 1:
            raise RuntimeError(
                "finalize_model_grads ran twice in one optimizer step: forward_backward_func was called again "
                "before optimizer.step(). dsrl runs a mini-batch in a single forward_backward_func call (any "
                "number of micro-batches); a second call would re-reduce the summed gradients and normalise by "
                "a partial token count. Pass all micro-batches of the step to MegatronRLStep.train_step."
            )
        self.calls += 1
        return self.fn(*args, **kwargs)


def _check_optimizer(optimizer: Any) -> None:
    """Refuse, before any forward, an optimizer that is not megatron-core's: the step calls ``optimizer.step()`` for
    Megatron's ``(update_successful, grad_norm, num_zeros)``, and only Megatron's optimizer steps from the DDP's grad
    buffers (``main_grad``); a torch optimizer reads ``param.grad``, which Megatron's DDP leaves empty."""
    from megatron.core.optimizer import MegatronOptimizer

    if not isinstance(optimizer, MegatronOptimizer):
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise TypeError(
            f"MegatronRLStep needs megatron-core's optimizer, not {kind}: Megatron's DDP keeps the gradients in its "
            "grad buffers (param.main_grad), which only Megatron's optimizer steps from, so a torch optimizer would "
            "never see them. Fix: opt = get_megatron_optimizer(OptimizerConfig(optimizer=\"adam\", lr=..., "
            "min_lr=...), [ddp]) (megatron.core.optimizer), and drop the loop's own optimizer.step()."
        )


def _warn_dropout(config: Any) -> None:
    """Dropout draws new masks in every forward: the step is then not the gradient of one fixed L_M (nor are the
    PPO ratios those of the policy that sampled). Say so once, at construction."""
    rates = {name: getattr(config, name, 0.0) or 0.0 for name in ("hidden_dropout", "attention_dropout")}
    if any(rate > 0 for rate in rates.values()):
        log.warning("MegatronRLStep: TransformerConfig %s: dropout makes every forward random, so the step is not "
                    "exact (a float64 reference of the same mini-batch differs) and the PPO ratio mixes in the dropout "
                    "noise. Set hidden_dropout=0.0 and attention_dropout=0.0 (docs/megatron.md).",
                    ", ".join(f"{k} = {v}" for k, v in rates.items()))


class MegatronRLStep(StepCore):
    """dsrl's exact mini-batch step for megatron-core model chunks, optimizer and LR scheduler.

    ``model``: the DDP-wrapped chunks (``megatron.core.distributed.DistributedDataParallel``; a list
    for virtual pipeline stages). ``optimizer``: from ``get_megatron_optimizer``. ``scheduler``: an
    ``OptimizerParamScheduler`` (see :func:`dsrl.backends.megatron.build_param_scheduler`), which dsrl owns.
    ``convention``: ``"per_token"`` needs ``calculate_per_token_loss=True`` set before the DDP wrap;
    ``"average"`` needs it False. ``mini_batch_size``/``loss_agg_norm_length`` are needed by
    ``seq-mean-token-sum-norm`` only. ``cp_shard``: micro-batches hold whole sequences and dsrl cuts
    them for context parallelism itself (after counting n_s on the whole sequence). ``context_parallel_in_model``
    (the Megatron engine's): the model cuts and gathers rows itself (:mod:`dsrl.backends.megatron.context_parallel`),
    every context peer computes the same loss on whole rows, tokens are counted over the data-parallel group, and
    only context rank 0 gives ``finalize_model_grads`` its token count (which it sums over DP x CP).
    """

    same_shape_fillers = True

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        *,
        loss_agg: str = TOKEN_MEAN,
        convention: str = PER_TOKEN,
        schedule_unit: str = OPTIMIZER_STEPS,
        mini_batch_size: int | None = None,
        loss_agg_norm_length: int | None = None,
        cp_shard: bool = True,
        count_group: Any = None,
        check_count_group: bool = True,
        context_parallel_in_model: bool = False,
    ):
        require_megatron()
        from megatron.core.utils import get_model_config

        _check_optimizer(optimizer)
        if convention not in CONVENTIONS:
            raise ValueError(f"convention {convention!r} must be one of {CONVENTIONS}")
        self.model = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.driver = SchedulerDriver(scheduler, schedule_unit)
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("the scheduler was built for a different optimizer than the one given")
        self.convention = convention
        self.cp_shard = cp_shard and not context_parallel_in_model
        self.context_parallel_in_model = context_parallel_in_model
        view = megatron_view(self.model, convention, count_group=count_group, check_count_group=check_count_group,
                             context_parallel_in_model=context_parallel_in_model)
        super().__init__(view, self.driver, loss_agg=loss_agg, mini_batch_size=mini_batch_size,
                         loss_agg_norm_length=loss_agg_norm_length)
        self.config = get_model_config(self.model[0])
        _warn_dropout(self.config)
        self._wire_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _wire_hooks(self) -> None:
        """Set the three hooks Megatron-LM's loop sets, and guard finalize."""
        from megatron.core.distributed import finalize_model_grads

        cfg = self.config
        fn = cfg.finalize_model_grads_func
        if isinstance(fn, FinalizeOnce):
            self.finalize = fn
        else:
            self.finalize = FinalizeOnce(fn if fn is not None else finalize_model_grads)
            cfg.finalize_model_grads_func = self.finalize
        if cfg.no_sync_func is None:
            syncs = [chunk.no_sync for chunk in self.model]
            cfg.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
        if cfg.grad_scale_func is None and hasattr(self.optimizer, "scale_loss"):
            cfg.grad_scale_func = self.optimizer.scale_loss

    @property
    def collective_device(self) -> torch.device:
        if torch.cuda.is_available() and dist.get_backend(self.view.count_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- the step -------------------------------------------------------------------------------
    def _prepare(self, micros: list[MicroBatch]) -> list[MicroBatch]:
        """Attach whole-sequence n_s and cut for context parallelism (before counting)."""
        cp_size, cp_rank = self.view.sequence_parallel_size, self.view.sequence_parallel_rank
        if self.context_parallel_in_model:
            return micros  # whole rows on every context rank: the model cuts them
        out = []
        for mb in micros:
            if cp_size > 1 and self.cp_shard:
                mb = shard_for_context_parallel(mb, cp_size, cp_rank)
            elif cp_size > 1 and "seq_valid_tokens" not in mb and self.loss_agg == SEQ_MEAN_TOKEN_MEAN:
                raise ValueError(
                    "cp_shard=False with context parallelism: micro-batches are CP shards, so seq-mean-token-mean "
                    "needs the whole sequence's counts in micro['seq_valid_tokens'] (shard_for_context_parallel "
                    "adds them)"
                )
            out.append(mb)
        return out

    def _shapes(self, micros: list[MicroBatch]) -> tuple[int, int]:
        shapes = {tuple(mb["loss_mask"].shape) for mb in micros}
        if len(shapes) > 1 and self.view.pipeline is not None and not getattr(self.config, "variable_seq_lengths",
                                                                               False):
            raise ValueError(
                f"pipeline parallelism sends fixed-shape activations but the micro-batches have shapes "
                f"{sorted(shapes)}; pad them to one shape or set TransformerConfig.variable_seq_lengths=True"
            )
        b = max(s[0] for s in shapes)
        t = max(s[1] for s in shapes)
        # Megatron divides seq_length by the CP size itself (the model's own cut pads first: variable shapes then)
        return t * (1 if self.context_parallel_in_model else self.view.sequence_parallel_size), b

    def train_step(self, micro_batches: Sequence[MicroBatch], forward_fn: ForwardFn, loss_fn: LossFn) -> StepResult:
        """One optimizer step over this rank's micro-batches of a mini-batch.

        ``forward_fn(model_chunk, micro)`` runs the chunk's forward and returns its output tensor
        (on every pipeline stage). ``loss_fn(output, micro)`` runs on the last stage only and returns
        per-token losses ``[b, t]`` (or ``(losses, metrics)`` with per-token metric tensors, reported as
        global token means on every stage); ``micro`` is this CP rank's shard. dsrl applies the weights.
        The result is a :class:`dsrl.core.step.StepResult` (a mapping), with ``scheduler_position``.
        """
        try:
            return self.run_step(self._prepare(list(micro_batches)), forward_fn, loss_fn)
        finally:
            self.finalize.reset()  # the step is over: the next step may finalize once again

    def _forward_backward(self, inputs: StepInputs, forward_fn: ForwardFn, loss_fn: LossFn) -> tuple[list[Log], None]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        counts = inputs.counts
        per_token = self.convention == PER_TOKEN
        # per_token: finalize divides by sum n_local = N_M; average: the schedule divides by M, DDP scales by f.
        factor = float(counts.tokens) if per_token else counts.max_micro_batches * self.view.grad_scale
        # finalize_model_grads sums the micro-batches' counts over DP x CP: context peers holding the same whole rows
        # would be counted once each
        gives_count = not self.context_parallel_in_model or self.view.sequence_parallel_rank == 0
        seq_length, mbs = self._shapes([it.micro for it in inputs.items])

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        for chunk in self.model:
            chunk.train()
        self.finalize.reset()

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            item = next(data_iterator)
            output = forward_fn(model, item.micro)

            def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Log]:
                s_w, log = self.micro_loss(loss_fn(output_tensor, item.micro), item)
                n_local = (int(valid_mask(item.micro["loss_mask"]).sum()) if gives_count else 0) if per_token else 1
                return s_w * factor, torch.tensor(n_local, dtype=torch.int, device=s_w.device), log

            return output, loss_func

        items = inputs.items
        n_chunks = len(self.model)
        iterator: Any = iter(items) if n_chunks == 1 else [iter(list(items)) for _ in range(n_chunks)]
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterator,
            model=self.model if n_chunks > 1 else self.model[0],
            num_microbatches=len(items),
            seq_length=seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
        if self.finalize.calls != 1:
            raise RuntimeError(
                f"finalize_model_grads ran {self.finalize.calls} times in this step (expected exactly 1); "
                "is TransformerConfig.finalize_model_grads_func replaced after MegatronRLStep was built?"
            )
        return (list(store) if self.view.is_last_stage else []), None

    def _update(self, skip: bool, counts: MiniBatchCounts) -> Update:
        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm: Any = None
        applied = False
        if skip:
            for chunk in self.model:
                chunk.zero_grad_buffer()
        else:
            update_successful, grad_norm = self._optimizer_step()
            applied = bool(update_successful)
        self.driver.after_optimizer_step(applied, counts.samples)
        return Update(applied, grad_norm, lr, {"scheduler_position": self.driver.position})

    def _optimizer_step(self) -> tuple[bool, Any]:
        """megatron-core's ``optimizer.step()``: ``(update successful, gradient norm or None)``."""
        update_successful, grad_norm, _ = self.optimizer.step()
        return update_successful, grad_norm

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """dsrl's state beyond the model/optimizer (which Megatron's checkpointing saves)."""
        return {**super().state_dict(), "convention": self.convention}
