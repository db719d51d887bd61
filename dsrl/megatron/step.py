"""One exact RL optimizer step inside a Megatron training loop.

:class:`MegatronRLStep.train_step` runs a mini-batch (this rank's micro-batches) through
``get_forward_backward_func()`` in a single call and keeps these invariants (architecture §2, §3):

- **Counts.** N_M (valid tokens), S_M (non-empty sequences), the largest micro-batch count and the
  global sample count come from *one* all-gather per mini-batch over
  ``get_data_parallel_group(with_context_parallel=True)``: every token is counted once (CP ranks
  count their shard's tokens; only CP rank 0 counts sequences, using whole-sequence n_s), tensor-
  parallel peers are never in the group, and every pipeline stage reads the counts from
  ``loss_mask`` before the schedule, so all stages agree.
- **Exact gradient.** With local weighted sum ``S_w = sum_{t in micro} w_t l_t`` (w from
  :func:`dsrl.loss.token_weights`), the loss_func returns

  ``"per_token"`` (``calculate_per_token_loss=True``): ``(N_M * S_w, n_local, log)`` with ``n_local``
  the micro-batch's integer valid-token count on this CP shard. Megatron does not rescale the loss,
  DDP sums over DP x CP, and ``finalize_model_grads`` divides by ``sum n_local = N_M``:
  gradient = sum over ranks of grad S_w = grad L_M. (Megatron's own MoE/MTP auxiliary scaling keeps
  working because ``num_tokens`` means what Megatron expects.)

  ``"average"`` (default DDP): ``(S_w * M / f, 1, log)`` where M is this call's ``num_microbatches``
  and f the DDP's real gradient factor read from its buffers (``1/|DP x CP|``, from the pre-scale or
  ``average_in_collective``). The schedule divides by 1 and by M, DDP multiplies by f and sums:
  gradient = grad L_M again.
- **Equal micro-batch counts.** Ranks with fewer micro-batches run zero-weight fillers (same shape,
  ``loss_mask`` all zero; the masked positions are selected away, so their gradient is exactly 0).
- **One finalize per step.** ``config.finalize_model_grads_func`` is wrapped so that a second call
  between two optimizer steps raises (in per-token mode it would re-sum already reduced
  buffers); dsrl checks after the schedule that it ran exactly once.
- **Scheduler.** Advanced only after ``optimizer.step()`` returns ``update_successful``, by 1 or by
  the mini-batch's samples (:mod:`dsrl.megatron.sched`). A non-finite loss on any rank skips the
  update on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsrl.loss import (
    MODES,
    GlobalCounts,
    check_micro_batch,
    local_counts,
    masked_sum,
    token_weights,
    valid_mask,
    weighted_sum,
    zero_weight_micro_batch,
)
from dsrl.megatron.cp import shard_for_context_parallel
from dsrl.megatron.layout import MegatronLayout, megatron_layout
from dsrl.megatron.sched import OPTIMIZER_STEPS, SchedulerDriver

PER_TOKEN = "per_token"
AVERAGE = "average"
CONVENTIONS = (PER_TOKEN, AVERAGE)

MicroBatch = Mapping[str, Any]
ForwardFn = Callable[[Any, MicroBatch], torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def require_megatron() -> None:
    """Raise a clear ImportError when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "dsrl.megatron needs megatron-core (0.16.1). Install it with: pip install 'dsrl[megatron]'"
        ) from exc


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


def zero_weight_filler(micro: MicroBatch) -> dict[str, Any]:
    """A same-shape copy of ``micro`` with an all-zero loss mask (pipeline P2P shapes stay equal)."""
    return zero_weight_micro_batch(micro, one_row=False)


class MegatronRLStep:
    """dsrl's exact mini-batch step for megatron-core model chunks, optimizer and LR scheduler.

    ``model``: the DDP-wrapped chunks (``megatron.core.distributed.DistributedDataParallel``; a list
    for virtual pipeline stages). ``optimizer``: from ``get_megatron_optimizer``. ``scheduler``: an
    ``OptimizerParamScheduler`` (see :func:`dsrl.megatron.build_param_scheduler`), which dsrl owns.
    ``convention``: ``"per_token"`` needs ``calculate_per_token_loss=True`` set before the DDP wrap;
    ``"average"`` needs it False. ``mini_batch_size``/``norm_length`` are needed by
    ``seq-mean-token-sum-norm`` only. ``cp_shard``: micro-batches hold whole sequences and dsrl cuts
    them for context parallelism itself (after counting n_s on the whole sequence).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        *,
        loss_agg: str = "token-mean",
        convention: str = PER_TOKEN,
        schedule_unit: str = OPTIMIZER_STEPS,
        mini_batch_size: int | None = None,
        norm_length: int | None = None,
        cp_shard: bool = True,
        count_group: Any = None,
        check_count_group: bool = True,
    ):
        require_megatron()
        if loss_agg not in MODES:
            raise ValueError(f"loss_agg {loss_agg!r} is not one of {MODES}")
        if convention not in CONVENTIONS:
            raise ValueError(f"convention {convention!r} must be one of {CONVENTIONS}")
        self.model = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.driver = SchedulerDriver(scheduler, schedule_unit)
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("the scheduler was built for a different optimizer than the one given")
        self.loss_agg = loss_agg
        self.convention = convention
        self.mini_batch_size = mini_batch_size
        self.norm_length = norm_length
        self.cp_shard = cp_shard
        self.layout: MegatronLayout = megatron_layout(
            self.model, convention, count_group=count_group, check_count_group=check_count_group
        )
        self.config = self.layout.config
        self._wire_hooks()
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._template: MicroBatch | None = None

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

    # -- counting -------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if torch.cuda.is_available() and dist.get_backend(self.layout.count_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_counts(self, micro_batches: Sequence[MicroBatch]) -> tuple[GlobalCounts, int, int]:
        """(N_M, S_M), the largest micro-batch count, and the global sample count: one all-gather."""
        tok = seq = samples = 0
        own = self.layout.owns_sequences
        for i, mb in enumerate(micro_batches):
            check_micro_batch(mb, i)
            t, s = local_counts(mb, own)
            tok, seq = tok + t, seq + s
            samples += int(mb["loss_mask"].shape[0]) if own else 0
        local = torch.tensor([tok, seq, len(micro_batches), samples], dtype=torch.float64, device=self._device())
        if self.layout.count_group_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.layout.count_group_size)]
            dist.all_gather(parts, local, group=self.layout.count_group)
            stats = torch.stack(parts).cpu()
        else:
            stats = local.unsqueeze(0).cpu()
        counts = GlobalCounts(tokens=int(stats[:, 0].sum()), sequences=int(stats[:, 1].sum()))
        return counts, int(stats[:, 2].max()), int(stats[:, 3].sum())

    # -- the step -------------------------------------------------------------------------------
    def _prepare(self, micros: list[MicroBatch]) -> list[MicroBatch]:
        """Attach whole-sequence n_s and cut for context parallelism (before counting)."""
        lay = self.layout
        out = []
        for mb in micros:
            if lay.cp_size > 1 and self.cp_shard:
                mb = shard_for_context_parallel(mb, lay.cp_size, lay.cp_rank)
            elif lay.cp_size > 1 and "seq_valid_tokens" not in mb and self.loss_agg == "seq-mean-token-mean":
                raise ValueError(
                    "cp_shard=False with context parallelism: micro-batches are CP shards, so seq-mean-token-mean "
                    "needs the whole sequence's counts in micro['seq_valid_tokens'] (shard_for_context_parallel "
                    "adds them)"
                )
            out.append(mb)
        return out

    def _fillers(self, micros: list[MicroBatch], n_max: int) -> list[MicroBatch]:
        if len(micros) >= n_max:
            return []
        template = micros[0] if micros else self._template
        if template is None:
            raise ValueError(
                "this rank got no micro-batch while other data-parallel ranks did, and none is known from an "
                "earlier step to build zero-weight fillers from; give every rank at least one micro-batch"
            )
        return [zero_weight_filler(template)] * (n_max - len(micros))

    def _shapes(self, micros: list[MicroBatch]) -> tuple[int, int]:
        shapes = {tuple(mb["loss_mask"].shape) for mb in micros}
        if len(shapes) > 1 and self.layout.pp_size > 1 and not getattr(self.config, "variable_seq_lengths", False):
            raise ValueError(
                f"pipeline parallelism sends fixed-shape activations but the micro-batches have shapes "
                f"{sorted(shapes)}; pad them to one shape or set TransformerConfig.variable_seq_lengths=True"
            )
        b = max(s[0] for s in shapes)
        t = max(s[1] for s in shapes)
        return t * self.layout.cp_size, b  # Megatron divides seq_length by the CP size itself

    def train_step(self, micro_batches: Sequence[MicroBatch], forward_fn: ForwardFn, loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches of a mini-batch.

        ``forward_fn(model_chunk, micro)`` runs the chunk's forward and returns its output tensor
        (on every pipeline stage). ``loss_fn(output, micro)`` runs on the last stage only and returns
        per-token losses ``[b, t]`` (or ``(losses, metrics)`` with per-token metric tensors, reported as
        global token means); ``micro`` is this CP rank's shard. dsrl applies the weights.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micros = self._prepare(list(micro_batches))
        counts, n_max, samples = self.global_counts(micros)
        if micros:
            self._template = micros[0]
        fillers = self._fillers(micros, n_max)
        items = []
        for mb in micros + fillers:
            w = token_weights(self.loss_agg, mb, counts, mini_batch_size=self.mini_batch_size,
                              norm_length=self.norm_length)
            if self.convention == PER_TOKEN:
                factor = float(counts.tokens)
                n_local = int(valid_mask(mb["loss_mask"]).sum())
            else:
                factor = n_max / self.layout.grad_factor
                n_local = 1
            items.append((mb, w, factor, n_local))
        seq_length, mbs = self._shapes([it[0] for it in items])

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        for chunk in self.model:
            chunk.train()
        self.finalize.reset()

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            mb, w, factor, n_local = next(data_iterator)
            output = forward_fn(model, mb)

            def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                out = loss_fn(output_tensor, mb)
                per_token, metrics = out if isinstance(out, tuple) else (out, {})
                mask = mb["loss_mask"].to(per_token.device)
                if per_token.shape != mask.shape:
                    raise ValueError(
                        f"loss_fn returned per-token losses of shape {tuple(per_token.shape)} for a micro-batch "
                        f"whose loss_mask is {tuple(mask.shape)}; they must match (this CP rank's shard)"
                    )
                s_w = weighted_sum(per_token, w.to(per_token.device), mask)
                log = {"loss": s_w.detach().double()}
                for name, value in metrics.items():
                    log[name] = masked_sum(value.detach().double(), mask)
                num = torch.tensor(n_local, dtype=torch.int, device=per_token.device)
                return s_w * factor, num, log

            return output, loss_func

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
        try:
            return self._finish(store, counts, n_max, len(fillers), samples)
        finally:
            self.finalize.reset()  # the step is over: the next step may finalize once again

    def _finish(self, store: list[Any], counts: GlobalCounts, n_max: int, n_fill: int, samples: int) -> dict:
        lay = self.layout
        names: list[str] = sorted({k for d in store for k in d if k != "loss"}) if lay.is_last_stage else []
        loss = sum((d["loss"] for d in store), torch.zeros((), dtype=torch.float64))
        vec = [loss.cpu(), (~torch.isfinite(loss)).double().cpu()]
        vec += [sum((d[n] for d in store if n in d), torch.zeros((), dtype=torch.float64)).cpu() for n in names]
        stats = torch.stack([v.reshape(()).double() for v in vec]).to(self._device())
        if lay.count_group_size > 1:
            dist.all_reduce(stats, group=lay.count_group)
        payload = [names, stats.cpu().tolist()]
        if lay.pp_size > 1:
            dist.broadcast_object_list(payload, src=lay.pp_last_global_rank, group=lay.pp_group)
        names, values = payload
        skipped_nonfinite = values[1] > 0 or not math.isfinite(values[0])

        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm: Any = None
        applied = False
        if skipped_nonfinite:
            for chunk in self.model:
                chunk.zero_grad_buffer()
        else:
            update_successful, grad_norm, _ = self.optimizer.step()
            applied = bool(update_successful)
        self.driver.after_optimizer_step(applied, samples)
        if applied:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        if torch.is_tensor(grad_norm):
            grad_norm = grad_norm.item()
        n = counts.tokens
        result: dict[str, Any] = {
            "loss": values[0],
            "tokens": n,
            "sequences": counts.sequences,
            "samples": samples,
            "micro_batches": n_max,
            "filler_micro_batches": n_fill,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "step_applied": applied,
            "skipped_nonfinite": skipped_nonfinite,
            "optimizer_step": self.optimizer_steps,
            "scheduler_position": self.driver.position,
        }
        for i, name in enumerate(names):
            result[name] = values[2 + i] / n if n else 0.0
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """dsrl's state beyond the model/optimizer (which Megatron's checkpointing saves)."""
        return {
            "schedule": self.driver.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "loss_agg": self.loss_agg,
            "convention": self.convention,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the scheduler lands on the saved position exactly (no double count)."""
        self.driver.load_state_dict(state["schedule"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
