"""The exact RL optimizer step, shared by the DeepSpeed (:mod:`dsrl.backends.deepspeed.engine`) and Megatron
(:mod:`dsrl.backends.megatron`) backends.

:class:`StepCore` runs one optimizer step over a mini-batch given as this rank's micro-batches and
keeps these invariants (architecture §2, §3); a backend only says how forward/backward and the
optimizer step are called (:meth:`StepCore._forward_backward`, :meth:`StepCore._update`):

- **Counts, one collective.** N_M (valid tokens), S_M (non-empty sequences), the largest per-rank
  micro-batch count and the global sample count come from *one* all-gather per mini-batch over the
  view's count group (:class:`dsrl.core.parallel.ParallelView`), before the first forward: every token
  is counted once, and only ranks that own sequences count them.
- **Equal forward/backward counts.** Ranks with fewer micro-batches run zero-weight fillers (copies
  of one of their micro-batches, or of one kept from an earlier step, with an all-zero loss mask):
  ZeRO-2/3 reduce on every backward and Megatron's collectives run per micro-batch, so a mismatch
  hangs. A filler's masked positions are selected away, so its gradient is exactly zero.
- **Weights.** Each micro-batch's per-token losses ``[b, t]`` (checked against ``loss_mask``) are
  turned into ``S_w = sum_{t in micro} w_t l_t`` with w from :func:`dsrl.core.weights.token_weights` and the
  global counts; summed over micro-batches and ranks this is exactly L_M. The backend scales S_w
  by its reduction's factor (the view's ``grad_scale``, plus its own conventions).
- **Non-finite skip.** A non-finite loss (or a backend's own non-finite signal) on any rank is
  detected by the one end-of-step reduction, so every rank skips the update together.
- **Metrics.** Per-token metrics are reduced in that same collective to global token means
  (sums over valid tokens / N_M); with pipeline stages the last stage's values are broadcast.
- **Counters.** ``optimizer_steps`` counts applied updates, ``skipped_steps`` the others; both are
  saved with the backend's schedule by :meth:`StepCore.state_dict`.

Pure torch and torch.distributed: no DeepSpeed or Megatron import.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dsrl.core.parallel import ParallelView
from dsrl.core.weights import (
    GlobalCounts,
    check_micro_batch,
    local_counts,
    masked_sum,
    token_weights,
    weighted_sum,
    zero_weight_micro_batch,
)

MicroBatch = Mapping[str, Any]
Log = dict[str, torch.Tensor]  # one micro-batch's "loss" (S_w) and per-token metric sums, float64


@dataclass(frozen=True)
class MiniBatchCounts:
    """Counts of one whole mini-batch over the count group (fillers excluded)."""

    tokens: int  # N_M
    sequences: int  # S_M
    max_micro_batches: int  # the largest per-rank micro-batch count: every rank runs this many
    samples: int  # rows of loss_mask on sequence-owning ranks (sequences, counting fully masked ones)

    @property
    def global_counts(self) -> GlobalCounts:
        return GlobalCounts(tokens=self.tokens, sequences=self.sequences)


@dataclass(frozen=True)
class WeightedMicroBatch:
    """A micro-batch to run and its per-token weights ``[b, t]`` (float64; all zero for fillers)."""

    micro: MicroBatch
    weights: torch.Tensor
    filler: bool


@dataclass(frozen=True)
class StepInputs:
    """What every rank runs in one step: its micro-batches then its fillers, all weighted."""

    counts: MiniBatchCounts
    items: list[WeightedMicroBatch]

    @property
    def n_fillers(self) -> int:
        return sum(1 for it in self.items if it.filler)


@dataclass(frozen=True)
class StepTotals:
    """The end-of-step reduction: L_M, whether any rank saw a non-finite value, metric token means."""

    loss: float
    skipped_nonfinite: bool
    metrics: dict[str, float]


@dataclass(frozen=True)
class Update:
    """What the backend's optimizer step did."""

    applied: bool
    grad_norm: Any  # float, 0-dim tensor, or None when no update was applied
    lr: float  # the learning rate the update used (read before the step)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific result entries


@dataclass
class StepResult(MutableMapping[str, Any]):
    """The result of one step; also a mapping, so ``res["loss"]``, ``res["kl"]`` and ``**res`` work.

    Keys: the fields below (except ``metrics``/``extra``), then every metric name (global token
    means), then ``extra`` (backend entries such as Megatron's ``scheduler_position``, and whatever a
    caller stores, e.g. ``res["step_s"] = ...``). Fields can be reassigned but not deleted.
    """

    loss: float  # L_M
    tokens: int  # N_M
    sequences: int  # S_M
    samples: int
    micro_batches: int  # forwards/backwards every rank ran (the largest per-rank count)
    filler_micro_batches: int  # how many of them were zero-weight fillers on this rank
    grad_norm: float  # nan when no update was applied
    lr: float
    step_applied: bool
    skipped_nonfinite: bool
    optimizer_step: int  # applied updates so far
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in _RESULT_FIELDS:
            return getattr(self, key)
        if key in self.metrics:
            return self.metrics[key]
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _RESULT_FIELDS:
            setattr(self, key, value)
        elif key in self.metrics:
            self.metrics[key] = value
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _RESULT_FIELDS:
            raise KeyError(f"{key!r} is a field of the step result and cannot be deleted")
        if key in self.metrics:
            del self.metrics[key]
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from _RESULT_FIELDS
        yield from self.metrics
        yield from (k for k in self.extra if k not in self.metrics)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.items())


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(StepResult) if f.name not in ("metrics", "extra"))
RESERVED_NAMES = frozenset(_RESULT_FIELDS) | {"metrics", "extra"}


class StepCore(ABC):
    """Everything the exact step does that does not depend on the training framework.

    A backend subclasses it, passes its ``view`` and ``schedule`` (the object holding its LR
    schedule's state, ``state_dict``/``load_state_dict``, saved with the counters), provides
    :attr:`collective_device` (where count/metric tensors live for the view's collectives),
    :meth:`_forward_backward` and :meth:`_update`, and calls :meth:`run_step`.
    ``loss_agg``, ``mini_batch_size`` (B) and ``loss_agg_norm_length`` (L_norm; both only needed by
    ``seq-mean-token-sum-norm``) are plain attributes and may be changed between steps.
    """

    #: fillers keep the template's shape (pipeline P2P needs equal shapes); else one row (cheapest)
    same_shape_fillers: bool = False

    def __init__(self, view: ParallelView, schedule: Any, *, loss_agg: str, mini_batch_size: int | None,
                 loss_agg_norm_length: int | None):
        self.view, self.schedule = view, schedule
        self.loss_agg, self.mini_batch_size = loss_agg, mini_batch_size
        self.loss_agg_norm_length = loss_agg_norm_length
        self.optimizer_steps = self.skipped_steps = 0  # applied / not applied updates
        self._template: MicroBatch | None = None

    # -- what a backend provides ----------------------------------------------------------------
    @property
    @abstractmethod
    def collective_device(self) -> torch.device:
        """The device of the tensors given to collectives over ``view.count_group``."""

    @abstractmethod
    def _forward_backward(self, inputs: StepInputs, *fns: Callable[..., Any]) -> tuple[list[Log], Any]:
        """Run every item of ``inputs`` forward and backward; return the logs of :meth:`micro_loss`
        (empty on ranks that compute no loss) and a local non-finite flag (tensor) or None."""

    @abstractmethod
    def _update(self, skip: bool, counts: MiniBatchCounts) -> Update:
        """Step the optimizer unless ``skip`` (then drop the gradients), and the schedule if applied."""

    # -- counting and fillers -------------------------------------------------------------------
    def gather_stats(self, values: Sequence[float]) -> torch.Tensor:
        """All-gather a small float64 vector over the count group -> ``[group size, len]`` on the CPU."""
        local = torch.tensor(list(values), dtype=torch.float64, device=self.collective_device)
        if self.view.count_group_size == 1:
            return local.unsqueeze(0).cpu()
        parts = [torch.empty_like(local) for _ in range(self.view.count_group_size)]
        dist.all_gather(parts, local, group=self.view.count_group)
        return torch.stack(parts).cpu()

    def sum_over_count_group(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float64) summed over the count group -- every token of the mini-batch once: one all-reduce,
        on the CPU."""
        local = values.to(device=self.collective_device, dtype=torch.float64, copy=True)
        if self.view.count_group_size > 1:
            dist.all_reduce(local, group=self.view.count_group)
        return local.cpu()

    def max_micro_batches(self, n: int) -> int:
        """The largest ``n`` over the count group (one collective)."""
        return int(self.gather_stats([n])[:, 0].max())

    def global_counts(self, micro_batches: Sequence[MicroBatch]) -> MiniBatchCounts:
        """N_M, S_M, the largest micro-batch count and the global sample count: one all-gather."""
        tok = seq = samples = 0
        own = self.view.owns_sequences
        for i, mb in enumerate(micro_batches):
            check_micro_batch(mb, i)
            t, s = local_counts(mb, own)
            tok, seq = tok + t, seq + s
            samples += int(mb["loss_mask"].shape[0]) if own else 0
        stats = self.gather_stats([tok, seq, len(micro_batches), samples])
        return MiniBatchCounts(tokens=int(stats[:, 0].sum()), sequences=int(stats[:, 1].sum()),
                               max_micro_batches=int(stats[:, 2].max()), samples=int(stats[:, 3].sum()))

    def remember_template(self, micro: MicroBatch) -> None:
        """Keep ``micro`` to build fillers from on a later step where this rank gets none."""
        self._template = micro

    def fillers(self, micro_batches: Sequence[MicroBatch], n_max: int) -> list[dict[str, Any]]:
        """``n_max - len(micro_batches)`` zero-weight copies of this rank's first (or a remembered) micro-batch."""
        if len(micro_batches) >= n_max:
            return []
        template = micro_batches[0] if micro_batches else self._template
        if template is None:
            raise ValueError(
                "this rank got no micro-batch while other ranks of its count group did, and no earlier "
                "micro-batch can serve as a zero-weight filler; give every rank at least one micro-batch "
                "(dsrl.core.partition does)"
            )
        filler = zero_weight_micro_batch(template, one_row=not self.same_shape_fillers)
        return [filler] * (n_max - len(micro_batches))

    def prepare_step(self, micro_batches: Sequence[MicroBatch]) -> StepInputs:
        """Count (one collective), add fillers, and weigh every micro-batch with the global counts."""
        micros = list(micro_batches)
        counts = self.global_counts(micros)
        if micros:
            self.remember_template(micros[0])
        runs = [(mb, False) for mb in micros] + [(f, True) for f in self.fillers(micros, counts.max_micro_batches)]
        items = [
            WeightedMicroBatch(mb, token_weights(self.loss_agg, mb, counts.global_counts,
                                                 mini_batch_size=self.mini_batch_size,
                                                 loss_agg_norm_length=self.loss_agg_norm_length), filler)
            for mb, filler in runs
        ]
        return StepInputs(counts, items)

    # -- one micro-batch's loss -----------------------------------------------------------------
    def micro_loss(self, out: Any, item: WeightedMicroBatch) -> tuple[torch.Tensor, Log]:
        """``(S_w, log)`` from a loss_fn's output: per-token losses ``[b, t]`` or ``(losses, metrics)``.

        S_w keeps the graph (the backend scales and backpropagates it); ``log`` holds S_w and each
        per-token metric's sum over valid tokens, detached, in float64.
        """
        per_token, metrics = out if isinstance(out, tuple) else (out, {})
        mask = item.micro["loss_mask"].to(per_token.device)
        if per_token.shape != mask.shape:
            raise ValueError(f"loss_fn returned per-token losses of shape {tuple(per_token.shape)} for a micro-batch "
                             f"whose loss_mask is {tuple(mask.shape)}; they must match (under sequence/context "
                             f"parallelism: this rank's shard)")
        s_w = weighted_sum(per_token, item.weights.to(per_token.device), mask)
        log = {"loss": s_w.detach().double()}
        for name, value in metrics.items():
            if name in RESERVED_NAMES:
                raise ValueError(f"loss_fn returned a metric named {name!r}, which the step result already uses "
                                 f"for its own value; rename the metric")
            log[name] = masked_sum(value.detach().double(), mask)
        return s_w, log

    # -- the end-of-step reduction --------------------------------------------------------------
    def reduce(self, logs: Sequence[Log], counts: MiniBatchCounts, nonfinite: Any = None) -> StepTotals:
        """L_M, the any-rank non-finite flag and metric token means: one all-reduce over the count group
        (plus, with pipeline stages, one broadcast from the last stage, which alone has losses)."""
        dev = self.collective_device
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        names = sorted({k for d in logs for k in d if k != "loss"})
        loss = sum((d["loss"].to(dev) for d in logs), zero)
        bad = (~torch.isfinite(loss)).double()
        if nonfinite is not None:
            bad = bad + torch.as_tensor(nonfinite).to(dev).double()
        vec = [loss, bad] + [sum((d[n].to(dev) for d in logs if n in d), zero) for n in names]
        stats = torch.stack([v.reshape(()) for v in vec])
        if self.view.count_group_size > 1:
            dist.all_reduce(stats, group=self.view.count_group)
        payload = [names, stats.cpu().tolist()]
        pipe = self.view.pipeline
        if pipe is not None and pipe.size > 1:
            dist.broadcast_object_list(payload, src=pipe.last_stage_global_rank, group=pipe.group)
        names, values = payload
        n = counts.tokens
        return StepTotals(
            loss=values[0],
            skipped_nonfinite=values[1] > 0 or not math.isfinite(values[0]),
            metrics={name: (values[2 + i] / n if n else 0.0) for i, name in enumerate(names)},
        )

    # -- the step -------------------------------------------------------------------------------
    def run_step(self, micro_batches: Sequence[MicroBatch], *fns: Callable[..., Any]) -> StepResult:
        """One optimizer step: count, fill, forward/backward (backend), reduce, update (backend), record."""
        inputs = self.prepare_step(micro_batches)
        logs, nonfinite = self._forward_backward(inputs, *fns)
        totals = self.reduce(logs, inputs.counts, nonfinite)
        update = self._update(totals.skipped_nonfinite, inputs.counts)
        if update.applied:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        grad_norm = update.grad_norm.item() if torch.is_tensor(update.grad_norm) else update.grad_norm
        counts = inputs.counts
        return StepResult(
            loss=totals.loss, tokens=counts.tokens, sequences=counts.sequences, samples=counts.samples,
            micro_batches=counts.max_micro_batches, filler_micro_batches=inputs.n_fillers,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=update.lr,
            step_applied=update.applied, skipped_nonfinite=totals.skipped_nonfinite,
            optimizer_step=self.optimizer_steps, metrics=totals.metrics, extra=dict(update.extra),
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The schedule and the step counters (the model/optimizer state is the framework's)."""
        return {
            "schedule": self.schedule.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "loss_agg": self.loss_agg,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the schedule lands on the saved position exactly."""
        self.schedule.load_state_dict(state["schedule"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
