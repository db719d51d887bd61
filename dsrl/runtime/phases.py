"""Seconds, tokens and peak memory of each phase of a rollout, on this rank: the phase fields of the ``rollout``
row of metrics.jsonl.

The phases (:data:`PHASES`): ``generate`` (the rollout backend's generation; multi-turn: the model's turns;
disaggregated trainers: waiting for the generators' samples), ``reward`` (reward model and rule rewards),
``old_logprobs`` (the policy's no-grad pass), ``ref_logprobs`` (the KL reference's, when there is one),
``critic_values`` (the critic's no-grad pass, PPO) and ``train`` (every optimizer step of the rollout, the
critic's included). Whatever lies between them (weight sync, off-policy correction, advantages, the data
exchange, the phase-end barriers) belongs to no phase.

Invariants kept by :class:`PhaseClock`:

- **no device synchronization inside or at the end of a phase.** On an accelerator that runs asynchronously
  (DeepSpeed's ``is_synchronized_device()`` is False: CUDA) a phase is timed with two timing events recorded on
  the current stream at its start and at its end, as DeepSpeed's own timers do; the events are read once per
  rollout, by :meth:`PhaseClock.take`, after the rollout's last optimizer step. A phase's seconds are then the
  device timeline between its two markers: work it launched that the device finishes after the host has left
  the phase is counted in it, work of the previous phase still running when it began is not. On a synchronized
  device (the CPU) the host's wall clock;
- **peak memory per phase**: the accelerator's peak counter is reset when a phase starts and read when it ends
  (CUDA: ``max_memory_allocated``, the caching allocator's host-side counter: no synchronization). On the CPU,
  DeepSpeed's accelerator only samples the resident set when asked (its ``max_memory_allocated`` is the larger
  of the RSS at the reset and at the read, not a peak), so the clock reads the kernel's high-water mark instead:
  ``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` at each phase start, after the C heap
  returned what earlier phases freed (glibc's ``malloc_trim``: otherwise the allocator keeps it resident and the
  next phase's peak starts at the last one's). That is the
  whole process's resident memory (interpreter, libraries, weights), not only tensors; None where ``/proc``
  does not allow it (not Linux). So every CPU row also carries ``host_baseline_mib``, the process's resident memory
  before the model was built (interpreter, libraries, tokenizer, prompts: the largest over ranks): a phase's peak
  less it is what the run allocated, the quantity ``dsrl plan``'s memory per phase predicts (docs/memory.md);
- phases never nest (a phase started inside another is a programming error, raised at once); a phase that
  runs several times in one rollout (dynamic sampling rounds, the turns of multi-turn episodes) adds up its
  seconds and keeps its largest peak;
- listeners (:class:`PhaseListener`, e.g. a profiler) hear each phase start before its timing starts and
  each end after its timing stopped, so what they do there is not counted.

:meth:`PhaseTotals.reduced` combines the ranks' totals like :meth:`dsrl.rl.rollout_stats.RolloutStats.summed`:
seconds and token counts are summed (the row divides seconds by the world size: the mean over ranks, like
``rollout_s``), peaks maximised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from dsrl.core.collectives import all_reduce_floats

PHASES = ("generate", "reward", "old_logprobs", "ref_logprobs", "critic_values", "train")
MIB = 2**20


class PhaseListener(Protocol):
    """Told when each phase starts and ends (``rollout``: the rollout index, counted from 0)."""

    def phase_started(self, name: str, rollout: int) -> None: ...

    def phase_ended(self, name: str, rollout: int) -> None: ...


# -- timers -----------------------------------------------------------------------------------------------------


class _HostTimer:
    """Wall-clock seconds (a synchronized device: what the host waited for is what the device did)."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, name: str, started: float, seconds: dict[str, float]) -> None:
        seconds[name] += time.perf_counter() - started

    def settle(self, seconds: dict[str, float]) -> None:
        pass


class _EventTimer:
    """Device timing events recorded at a phase's start and end; read (waited for) only in :meth:`settle`."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.pending: list[tuple[str, Any, Any]] = []

    def _event(self) -> Any:
        event = self.accelerator.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> Any:
        return self._event()

    def stop(self, name: str, started: Any, seconds: dict[str, float]) -> None:
        self.pending.append((name, started, self._event()))

    def settle(self, seconds: dict[str, float]) -> None:
        for name, start, end in self.pending:
            end.synchronize()
            seconds[name] += start.elapsed_time(end) / 1e3
        self.pending = []


# -- memory probes ----------------------------------------------------------------------------------------------


class _NoMemory:
    def reset(self) -> None:
        pass

    def read(self) -> float | None:
        return None


class _DeviceMemory:
    """The accelerator's allocator peak (MiB) since the last reset."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def reset(self) -> None:
        self.accelerator.reset_peak_memory_stats()

    def read(self) -> float | None:
        return self.accelerator.max_memory_allocated() / MIB


class _ResidentPeak:
    """The process's resident high-water mark (MiB) since the last reset (Linux: VmHWM, clear_refs 5)."""

    STATUS = Path("/proc/self/status")
    CLEAR = Path("/proc/self/clear_refs")

    @classmethod
    def available(cls) -> bool:
        try:
            cls.CLEAR.write_text("5")
            return cls.status_kib("VmHWM") is not None
        except OSError:
            return False

    @classmethod
    def status_kib(cls, field: str) -> int | None:
        """A memory field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in KiB; None if absent."""
        for line in cls.STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        return None

    def reset(self) -> None:
        trim_heap()
        self.CLEAR.write_text("5")

    def read(self) -> float | None:
        kib = self.status_kib("VmHWM")
        return None if kib is None else kib / 1024


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc ``malloc_trim``), so that a phase's resident peak holds
    what the phase and the run keep, not what an earlier phase freed and the allocator kept (without it the
    generation after a training step reads the training step's peak). No-op without glibc."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def resident_mib() -> float | None:
    """The process's resident memory now (MiB, Linux ``VmRSS``); None elsewhere."""
    try:
        kib = _ResidentPeak.status_kib("VmRSS")
    except OSError:
        return None
    return None if kib is None else kib / 1024


def _memory_probe(accelerator: Any) -> Any:
    if accelerator is None:
        return _NoMemory()
    if accelerator.device_name() == "cpu":
        return _ResidentPeak() if _ResidentPeak.available() else _NoMemory()
    return _DeviceMemory(accelerator)


# -- totals -----------------------------------------------------------------------------------------------------


def _zeros() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


@dataclass
class PhaseTotals:
    """One rollout's phase figures: this rank's (from :meth:`PhaseClock.take`) or every rank's
    (:meth:`reduced`). ``peak_mib`` holds None for a phase whose memory is unknown or that never ran."""

    seconds: dict[str, float] = field(default_factory=_zeros)
    runs: dict[str, float] = field(default_factory=_zeros)  # how often each phase ran
    peak_mib: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(PHASES))
    generated_tokens: float = 0.0  # completion tokens of the rollout's samples (counted once per replica)
    trained_tokens: float = 0.0  # prompt + completion tokens trained on, times the epochs per rollout
    baseline_mib: float | None = None  # CPU: the process's resident memory before the model was built

    def reduced(self, device: Any = "cpu") -> PhaseTotals:
        """Seconds, runs and tokens summed over every rank of the default group (one all-reduce), peaks maximised
        (a second one); a no-op on one process."""
        sums = [self.seconds[p] for p in PHASES] + [self.runs[p] for p in PHASES]
        sums += [self.generated_tokens, self.trained_tokens]
        total = all_reduce_floats(sums, device=device)
        peaks = all_reduce_floats([-1.0 if v is None else v for v in
                                   [*(self.peak_mib[p] for p in PHASES), self.baseline_mib]],
                                  dist.ReduceOp.MAX, device=device)
        n = len(PHASES)
        return PhaseTotals(seconds=dict(zip(PHASES, total[:n])), runs=dict(zip(PHASES, total[n:2 * n])),
                           peak_mib={p: (None if v < 0 else v) for p, v in zip(PHASES, peaks)},
                           generated_tokens=total[2 * n], trained_tokens=total[2 * n + 1],
                           baseline_mib=None if peaks[n] < 0 else peaks[n])


def phase_record(totals: PhaseTotals, world: int) -> dict[str, Any]:
    """The phase fields of a ``rollout`` row from :meth:`PhaseTotals.reduced` totals over ``world`` ranks, for
    the phases that ran on some rank: ``phase_<name>_s`` (mean over ranks), ``peak_<name>_mib`` (max over ranks;
    None when unknown), ``peak_mib`` (the largest of them), ``generate_tokens_per_s`` (completion tokens over the
    mean generation seconds) and ``train_sequence_tokens_per_s`` (prompt + completion tokens trained on, every
    epoch, over the mean training seconds)."""
    ran = [p for p in PHASES if totals.runs[p] > 0]
    out: dict[str, Any] = {f"phase_{p}_s": totals.seconds[p] / world for p in ran}
    out.update({f"peak_{p}_mib": totals.peak_mib[p] for p in ran})
    known = [totals.peak_mib[p] for p in ran if totals.peak_mib[p] is not None]
    out["peak_mib"] = max(known) if known else None
    if totals.baseline_mib is not None:
        out["host_baseline_mib"] = totals.baseline_mib
    if "generate" in ran:
        out["generate_tokens_per_s"] = _rate(totals.generated_tokens, totals.seconds["generate"] / world)
    if "train" in ran:
        out["train_sequence_tokens_per_s"] = _rate(totals.trained_tokens, totals.seconds["train"] / world)
    return out


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


# -- the clock --------------------------------------------------------------------------------------------------


class PhaseClock:
    """Times the phases of each rollout on this rank (module docstring). ``accelerator``: DeepSpeed's accelerator
    (``deepspeed.accelerator.get_accelerator()``) or an object with its interface; None times with the host clock
    and reads no memory."""

    def __init__(self, accelerator: Any = None, baseline_mib: float | None = None):
        self.baseline_mib = baseline_mib  # CPU: resident memory before the model (every row carries it)
        synchronized = accelerator is None or accelerator.is_synchronized_device()
        self._timer = _HostTimer() if synchronized else _EventTimer(accelerator)
        self._memory = _memory_probe(accelerator)
        self._listeners: list[PhaseListener] = []
        self._open: str | None = None
        self.rollout = 0
        self._totals = PhaseTotals(baseline_mib=self.baseline_mib if self.reads_memory else None)

    @property
    def reads_memory(self) -> bool:
        return not isinstance(self._memory, _NoMemory)

    def add_listener(self, listener: PhaseListener) -> None:
        self._listeners.append(listener)

    def start_rollout(self, rollout: int) -> None:
        """Begin rollout ``rollout`` (0-based): what an unfinished earlier one left is dropped."""
        self.rollout = rollout
        self._totals = PhaseTotals(baseline_mib=self.baseline_mib if self.reads_memory else None)
        if isinstance(self._timer, _EventTimer):
            self._timer.pending = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run the block as phase ``name`` of the current rollout."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")
        if self._open is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._open!r}; phases do not nest")
        for listener in self._listeners:
            listener.phase_started(name, self.rollout)
        self._open = name
        self._memory.reset()
        started = self._timer.start()
        try:
            yield
        finally:
            self._timer.stop(name, started, self._totals.seconds)
            peak = self._memory.read()
            totals = self._totals
            totals.runs[name] += 1
            if peak is not None:
                before = totals.peak_mib[name]
                totals.peak_mib[name] = peak if before is None else max(before, peak)
            self._open = None
            for listener in self._listeners:
                listener.phase_ended(name, self.rollout)

    def count_tokens(self, generated: int | float, trained: int | float) -> None:
        """Add the rollout's completion tokens and the prompt + completion tokens its steps train on (count each
        replica's samples once: tensor-parallel peers pass 0)."""
        self._totals.generated_tokens += generated
        self._totals.trained_tokens += trained

    def take(self) -> PhaseTotals:
        """This rank's totals of the current rollout (waits for its timing events: call it after the rollout's
        last step); the clock starts the next rollout empty."""
        totals = self._totals
        self._timer.settle(totals.seconds)
        self.start_rollout(self.rollout + 1)
        return totals
