"""Training state and frozen models off the device between the phases that need them (``dsrl.memory.offload_states``).

- :class:`EngineStates`: a training engine's optimizer states, fp32 master weights and gradient buffers
  (DeepSpeed's ``OffloadStateTypeEnum`` optim_states, hp_params, lp_grads, contiguous_grad_buffer) go to pinned
  host memory through DeepSpeed's own ``engine.offload_states(include, pin_memory=True, non_blocking=True)`` and
  come back with ``engine.reload_states(non_blocking=True)``. Under ZeRO-3 dsrl moves the fp32 master partitions and
  the optimizer's state tensors itself, the way DeepSpeed's stage-3 offload does (a pinned host buffer per tensor,
  reused, takes its ``.data``), because that offload asserts DeepSpeed's FusedAdam: the run's optimizer must be
  the one it has with the offload off (on the CPU torch's AdamW; before, the offload switched a ZeRO-3 run to
  DeepSpeed's FusedAdam, whose update differs in the last bits, so the first step after an update differed).
  DeepSpeed's ZeRO buffers are flat (one per parameter group), so each state moves in a few coalesced copies. The
  low-precision weights (lp_params) stay: generation and the no-grad passes compute with them. The values do not
  change in transit, so training is bitwise the same with the offload on or off; :func:`require_resident` refuses
  a step while any state is still off the device;
- :class:`FrozenWeights`: a frozen model beside the policy (the KL reference, a reward model) leaves the device
  after each of its passes and comes back before the next. Its tensors are packed, per dtype, into one pinned host
  buffer, written once (the weights are frozen), and back into one device buffer per dtype on reload, each tensor
  a view at a 64-byte-aligned offset (as aligned as a fresh allocation, so kernels compute the same bits). Under
  ZeRO-3 (an optimizer-less DeepSpeed engine) the tensors are each parameter's shard (``ds_tensor``) and the
  full tensors of the parameters ZeRO keeps gathered (persistent ones), after the engine's partition cache is
  emptied.

Where DeepSpeed 0.19.8 cannot offload (:func:`offload_refusal`): ZeRO-0 (no ZeRO optimizer; a rule of
:mod:`dsrl.config.support`), ZeRO-1 with bf16 and fp32 gradient accumulation (DeepSpeed runs it with its
BF16_Optimizer, which has no ``offload_states``), ZeRO-3 with parameter offload ("Moving states across devices is
not supported for offloaded parameters"). With ``offload_optimizer`` DeepSpeed already keeps the optimizer states
and master weights on the host and moves the rest.

Bytes are measured, not estimated (:mod:`dsrl.core.traffic`): on an accelerator the drop (offload) or rise
(reload) of its allocator's allocated bytes; on the CPU accelerator (one memory) the bytes of the state tensors whose
storage left (a fresh host buffer, or freed), and for a reload those that came back into fresh storage. DeepSpeed's
full garbage collections inside ``offload_states`` are made to scan nothing (:func:`heap_frozen`).

:class:`StateOffload` is the run's one component over them, called by the loop at two points whatever engines the
run has: :meth:`StateOffload.release` before a rollout's generation (every training engine's optimizer states,
fp32 master weights and gradient buffers to pinned host memory), :meth:`StateOffload.reload` before its training
phase and before a checkpoint is saved; :meth:`StateOffload.frozen` gives a frozen model (the KL reference, a reward
model) an offloader that keeps it off the device except during its own passes; :meth:`StateOffload.record` is the
rollout's ``offload_s``, ``reload_s``, ``offload_bytes`` and ``reload_bytes`` (zeros with the setting off, so every
run's rows have the same columns). The values never change in transit, so training is bitwise the same with the
setting on or off.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from dsrl.config import MemoryConfig
from dsrl.core.traffic import Moved, TrafficMeter, traffic_record

TRAINING_STATES = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")
ZERO3_DEEPSPEED_STATES = ("lp_grads", "contiguous_grad_buffer")  # ZeRO-3: dsrl moves hp_params, optim_states
ALIGN_BYTES = 64


def offload_refusal(ds_config: dict[str, Any]) -> str | None:
    """Why DeepSpeed cannot offload this run's training state (one sentence with the fix), or None when it can.
    ``ds_config`` is the one DeepSpeed will see; ZeRO-0 is refused with the run file (``offload-zero0``)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
    optimizer_device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    bf16 = isinstance(ds_config.get("bf16"), dict) and ds_config["bf16"].get("enabled") is True
    accumulate = str((ds_config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    if zero.get("stage") == 1 and bf16 and accumulate in ("fp32", "float32") and optimizer_device in ("none", ""):
        return ("dsrl.memory.offload_states with ZeRO-1, bf16 and fp32 gradient accumulation (data_types."
                "grad_accum_dtype, dsrl's default for exactness): DeepSpeed 0.19.8 runs that combination with its "
                "BF16_Optimizer, which has no offload_states. Fix: zero_optimization.stage 2 (on one device the same "
                "memory as ZeRO-1), or set memory.offload_states to false.")
    if zero.get("stage") != 3:
        return None
    param_device = str((zero.get("offload_param") or {}).get("device", "none")).lower()
    if param_device not in ("none", ""):
        return (f"dsrl.memory.offload_states with zero_optimization.offload_param.device = {param_device!r}: "
                "DeepSpeed's offload_states refuses engines whose parameters are offloaded (\"Moving states across "
                "devices is not supported for offloaded parameters\"). Fix: remove offload_param, or set "
                "memory.offload_states to false.")
    return None  # any optimizer: dsrl moves ZeRO-3's master weights and optimizer states itself (EngineStates)


def require_resident(engine: Any) -> None:
    """Refuse an optimizer step while DeepSpeed reports any of the engine's states offloaded."""
    away = getattr(getattr(engine, "optimizer", None), "offloaded_states", None)
    if away:
        names = ", ".join(sorted(str(getattr(s, "value", s)) for s in away))
        raise RuntimeError(f"a training step started while the engine's {names} were offloaded to the host "
                           "(dsrl.memory.offload_states): they must be reloaded before every training phase")


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """{storage address: bytes} of the given tensors (each storage once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        out[storage.data_ptr()] = max(out.get(storage.data_ptr(), 0), storage.nbytes())
    return out


def state_tensors(engine: Any, scratch: bool = True) -> list[torch.Tensor]:
    """The tensors of the training states a ZeRO 1-3 engine offloads (DeepSpeed 0.19.8's buffer names: the
    stage-1/2 optimizer's fp32 partitions and averaged gradients, the stage-3 optimizer's fp32 partitions, flat
    gradient buffer and reduce buckets, and the torch optimizer's state tensors). Used to count bytes only.
    ``scratch`` False leaves out the stage-3 reduce buckets, whose contents DeepSpeed does not keep (its reload
    allocates them empty: they are overwritten before use)."""
    opt = getattr(engine, "optimizer", None)
    out: list[torch.Tensor] = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += [t for t in (getattr(opt, name, None) or []) if torch.is_tensor(t)]
    out.append(getattr(opt, "grad_partitions_flat_buffer", None))
    averaged = getattr(opt, "averaged_gradients", None)
    if isinstance(averaged, dict):
        for grads in averaged.values():
            out += [g for g in (grads or []) if torch.is_tensor(g)]
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values() if scratch else ():
        out.append(getattr(bucket, "buffer", None))
    inner = getattr(opt, "optimizer", None)
    for state in (getattr(inner, "state", None) or {}).values():
        out += [v for v in state.values() if torch.is_tensor(v)]
    return [t for t in out if torch.is_tensor(t)]


class EngineStates:
    """A training engine's optimizer states, master weights and gradient buffers, offloaded after its training
    phase and reloaded before the next (module docstring). ``offload``/``reload`` are idempotent; each move is
    recorded in ``meter``."""

    def __init__(self, engine: Any, meter: TrafficMeter):
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        self.engine, self.meter = engine, meter
        self.offloaded = False
        self._away: dict[int, int] = {}
        self._zero3 = isinstance(getattr(engine, "optimizer", None), DeepSpeedZeroOptimizer_Stage3)
        self._pinned: dict[tuple[Any, ...], torch.Tensor] = {}  # ZeRO-3: dsrl's host buffers, reused by each offload
        self._moved: list[tuple[torch.Tensor, torch.device]] = []  # ZeRO-3: on the host now, and where from

    def offload(self) -> None:
        if not self.offloaded:
            self.meter.offloaded(self._offload())

    def reload(self) -> None:
        if self.offloaded:
            self.meter.reloaded(self._reload())

    def _offload(self) -> Moved:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        before = _storages(state_tensors(self.engine))
        allocated = _allocated()
        t0 = time.perf_counter()
        with heap_frozen():
            states = ZERO3_DEEPSPEED_STATES if self._zero3 else TRAINING_STATES
            self.engine.offload_states(include=[OffloadStateTypeEnum(s) for s in states], pin_memory=True,
                                       non_blocking=True)
            if self._zero3:
                self._offload_master()
        seconds = time.perf_counter() - t0
        after = _storages(state_tensors(self.engine))
        self._away = after
        self.offloaded = True
        if allocated is not None:  # an accelerator's allocator: what the device really released
            return Moved(seconds, max(0, allocated - _allocated()))
        return Moved(seconds, sum(n for ptr, n in before.items() if ptr not in after))

    def _reload(self) -> Moved:
        allocated = _allocated()
        t0 = time.perf_counter()
        with heap_frozen():
            self._reload_master()  # queued first: DeepSpeed's non-blocking reload synchronizes at its end
            self.engine.reload_states(non_blocking=True)
        seconds = time.perf_counter() - t0
        after = _storages(state_tensors(self.engine))
        moved = sum(n for ptr, n in after.items() if ptr not in self._away)
        if allocated is not None:
            moved = max(0, _allocated() - allocated)
        self.offloaded, self._away = False, {}
        return Moved(seconds, moved)

    def _master(self) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
        """ZeRO-3's fp32 master partitions (one flat tensor per sub-group, the parameters of the wrapped optimizer)
        and the wrapped optimizer's state tensors of each (0-dim ones, a step count, aside), named by position."""
        opt = self.engine.optimizer
        state = getattr(getattr(opt, "optimizer", None), "state", None) or {}
        for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
            yield ("hp_params", i), flat
            for key, value in (state.get(flat) or {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    yield ("optim_states", i, key), value

    def _offload_master(self) -> None:
        """What DeepSpeed's stage-3 ``offload_states`` does for hp_params and optim_states (a pinned host buffer per
        tensor, kept for the next offload, takes the tensor's ``.data``), for any optimizer: DeepSpeed asserts its own
        FusedAdam there, and dsrl's choice of optimizer must not depend on the offload (module docstring). The
        buffers are dsrl's, never in the optimizer's state (which a checkpoint saves). Tensors already on the host
        (``offload_optimizer``) stay."""
        from deepspeed.accelerator import get_accelerator

        device = torch.device(get_accelerator().current_device_name())
        for name, t in self._master():
            if t.device != device:
                continue
            host = self._pinned.get(name)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._pinned[name] = get_accelerator().pin_memory(torch.empty_like(t, device="cpu"))
            host.copy_(t.data, non_blocking=True)
            t.data = host
            self._moved.append((t, device))

    def _reload_master(self) -> None:
        for t, device in self._moved:
            t.data = t.data.to(device, non_blocking=True)
        self._moved = []


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Python's garbage collector skips every object that exists at entry for the block (``gc.freeze``; undone at
    exit). DeepSpeed's ``offload_states`` runs full ``gc.collect()`` passes (two under ZeRO 1-2) to drop references
    to the moved buffers: in a training process they took 1.5-2 s each on the CPU machine (3.1-4.2 s per offload
    of a tiny model), while the buffers are released by reference counting (DeepSpeed swaps ``.data`` and clears
    the parameters' ``_hp_mapping`` itself). On an accelerator the release is measured (:func:`_allocated`)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _allocated() -> int | None:
    """The accelerator allocator's allocated bytes, or None on the CPU accelerator (device and host are one)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    return int(accelerator.memory_allocated())


def _aligned(numel: int, itemsize: int) -> int:
    step = max(1, ALIGN_BYTES // itemsize)
    return -(-numel // step) * step


class FrozenWeights:
    """A frozen model's tensors off the device between its passes (module docstring). ``model``: a module on the
    device, or a ZeRO-3 engine from :func:`dsrl.backends.deepspeed.frozen.frozen_engine`; each move is recorded in
    ``meter``. The first offload happens at the end of the first pass (:meth:`for_pass`)."""

    def __init__(self, model: Any, meter: TrafficMeter):
        self.model, self.meter = model, meter
        self.resident = True
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._layout: list[tuple[torch.Tensor, torch.dtype, int, torch.Size]] = []
        self._device: torch.device | None = None

    def _tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.data`` moves, each once, in a fixed order."""
        from dsrl.backends.deepspeed.frozen import is_sharded

        seen: set[int] = set()
        out: list[torch.Tensor] = []

        def add(t: Any) -> None:
            if torch.is_tensor(t) and t.numel() > 0 and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

        if is_sharded(self.model):
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            self.model.empty_partition_cache()
            for p in self.model.module.parameters():
                add(getattr(p, "ds_tensor", None))
                if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE:
                    add(p)  # kept gathered (persistent): its full tensor is on the device too
            for b in self.model.module.buffers():
                add(b)
        else:
            for t in (*self.model.parameters(), *self.model.buffers()):
                add(t)
        return out

    @contextlib.contextmanager
    def for_pass(self) -> Iterator[None]:
        """The weights on the device for the block (one pass of the model), off it afterwards."""
        self.reload()
        try:
            yield
        finally:
            self.offload()

    def offload(self) -> None:
        if self.resident:
            self.meter.offloaded(self._offload())

    def reload(self) -> None:
        if not self.resident:
            self.meter.reloaded(self._reload())

    def _offload(self) -> Moved:
        """Release the device copy (the first time, after writing the pinned host copy)."""
        t0 = time.perf_counter()
        tensors = self._tensors()
        if not self._host:
            from deepspeed.accelerator import get_accelerator

            sizes: dict[torch.dtype, int] = {}
            self._layout = []
            for t in tensors:
                offset = sizes.get(t.dtype, 0)
                self._layout.append((t, t.dtype, offset, t.shape))
                sizes[t.dtype] = offset + _aligned(t.numel(), t.element_size())
            self._device = tensors[0].device if tensors else torch.device("cpu")
            self._host = {dt: get_accelerator().pin_memory(torch.empty(n, dtype=dt)) for dt, n in sizes.items()}
            for t, dt, offset, _ in self._layout:
                self._host[dt][offset:offset + t.numel()].copy_(t.data.reshape(-1), non_blocking=True)
        moved = 0
        for t, dt, offset, shape in self._layout:
            moved += t.numel() * t.element_size()
            t.data = self._host[dt][offset:offset + shape.numel()].view(shape)
        self.resident = False
        return Moved(time.perf_counter() - t0, moved)

    def _reload(self) -> Moved:
        """Copy the weights into one fresh device buffer per dtype (views of it take the tensors' places)."""
        t0 = time.perf_counter()
        device = {dt: torch.empty_like(host, device=self._device) for dt, host in self._host.items()}
        for dt, buf in device.items():
            buf.copy_(self._host[dt], non_blocking=True)
        moved = 0
        for t, dt, offset, shape in self._layout:
            t.data = device[dt][offset:offset + shape.numel()].view(shape)
            moved += shape.numel() * t.element_size()
        self.resident = True
        return Moved(time.perf_counter() - t0, moved)


class StateOffload:
    """The run's training engines and frozen models off the device between the phases that need them (module
    docstring). ``engines``: the RLEngines that train (the policy's first)."""

    def __init__(self, config: MemoryConfig, engines: Sequence[Any] = ()):
        self.enabled = config.offload_states
        self.meter = TrafficMeter()
        self.engines: list[EngineStates] = []
        for rl in engines:
            self.add_engine(rl)

    def frozen(self, model: Any) -> FrozenWeights | None:
        """The offloader of a frozen model (a module on the device or a ZeRO-3 engine), already off the device; None
        with the setting off."""
        if not self.enabled:
            return None
        weights = FrozenWeights(model, self.meter)
        weights.offload()
        return weights

    def add_engine(self, rl: Any) -> None:
        """One more training engine (the policy's as soon as it is built, the critic's after the frozen models)."""
        if self.enabled:
            self.engines.append(EngineStates(rl.engine, self.meter))

    def release(self) -> None:
        """Every training engine's states off the device (before generation)."""
        for engine in self.engines:
            engine.offload()

    def reload(self) -> None:
        """Every training engine's states back on the device (before training, before a checkpoint)."""
        for engine in self.engines:
            engine.reload()

    def record(self, device: Any, world: int) -> dict[str, float]:
        """The rollout's traffic fields (one all-reduce over the default group: every rank calls it)."""
        return traffic_record(self.meter.take().reduced(device), world)
