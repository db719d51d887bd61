"""Where one rollout's time and memory go, cheaply enough to finish inside a bounded benchmark process.

- :class:`PhaseProfiler`: ``torch.profiler`` phase by phase (generate / log-probs / train). The log-prob and
  train phases are traced whole; generation is *sampled*: only decode forwards ``skip + 1 .. skip + window``
  of each generate call are traced (a forward pre-hook on the policy opens and closes the window in the thread
  that runs the forwards, so continuous batching's worker thread is traced too), which keeps the trace of a
  256-step decode to a few thousand events (the 2026-11-24 H100 round's whole-rollout trace did not finish in
  160 s). Per phase: wall seconds traced, device-busy seconds (sum of kernels' self time), the busy fraction,
  and the operators with the most self device time and self CPU time.
- :func:`memory_census`: bytes resident between rollouts by role (weights, gradients, fp32 master weights,
  optimizer moments, the rest of what the allocator holds), by walking the model's parameters and the
  innermost ``torch.optim.Optimizer`` under any wrappers (accelerate, DeepSpeed ZeRO). Counted per storage,
  so a flat buffer that parameters view into counts once.

Neither changes what it measures except by its own overhead; the profiled rollout is left out of the timings.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

PHASES = ("generate", "logprobs", "train")
TOP_OPS = 8


def _self_device_us(evt: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, name, None)
        if value:
            return float(value)
    return 0.0


class PhaseProfiler:
    """Traces one rollout phase by phase (module docstring). ``enter(phase)`` at each phase boundary (main
    thread), ``finish()`` at the end; ``summary()`` is JSON-ready."""

    def __init__(self, model: Any, cuda: bool, skip: int = 8, window: int = 16):
        import torch

        self.torch = torch
        self.cuda = cuda
        self.skip, self.window = skip, window
        self.lock = threading.Lock()
        self.active = False
        self.phase: str | None = None
        self.prof: Any = None
        self.prof_thread: int | None = None
        self.t0 = 0.0
        self.forwards = 0
        self.ops: dict[str, dict[str, dict[str, float]]] = {p: defaultdict(lambda: defaultdict(float)) for p in PHASES}
        self.wall = dict.fromkeys(PHASES, 0.0)  # seconds traced per phase
        self.phase_wall = dict.fromkeys(PHASES, 0.0)  # seconds the phase took (traced or not)
        self.steps = {"traced": 0, "total": 0}  # generate forwards
        self.phase_t0 = 0.0
        model.register_forward_pre_hook(self._hook)

    # -- tracing ----------------------------------------------------------------------------------------------

    def _start(self) -> None:
        acts = [self.torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(self.torch.profiler.ProfilerActivity.CUDA)
        self.prof = self.torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        self.prof_thread = threading.get_ident()
        self.t0 = time.perf_counter()

    def _stop(self, phase: str) -> None:
        if self.prof is None:
            return
        if self.cuda:
            self.torch.cuda.synchronize()
        self.wall[phase] += time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        bucket = self.ops[phase]
        for evt in prof.key_averages():
            row = bucket[evt.key]
            row["count"] += evt.count
            row["self_cpu_us"] += float(evt.self_cpu_time_total)
            row["self_device_us"] += _self_device_us(evt)

    def _hook(self, _module: Any, _args: Any) -> None:
        with self.lock:
            if not self.active or self.phase != "generate":
                return
            self.forwards += 1
            self.steps["total"] += 1
            if self.forwards == self.skip + 1 and self.prof is None:
                self._start()
            elif self.forwards == self.skip + self.window + 1 and self.prof is not None:
                self._stop("generate")
            if self.prof is not None:
                self.steps["traced"] += 1

    # -- phases -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin the profiled rollout (in its train phase: rewards, advantages, updates)."""
        self.active = True
        self.enter("train")

    def enter(self, phase: str) -> None:
        with self.lock:
            if self.phase is not None:
                self.phase_wall[self.phase] += time.perf_counter() - self.phase_t0
            if self.prof is not None:
                self._stop(self.phase or "train")
            self.phase, self.forwards, self.phase_t0 = phase, 0, time.perf_counter()
            if self.active and phase != "generate":
                self._start()

    def finish(self) -> None:
        with self.lock:
            if self.phase is not None:
                self.phase_wall[self.phase] += time.perf_counter() - self.phase_t0
            if self.prof is not None:
                self._stop(self.phase or "train")
            self.active, self.phase = False, None

    # -- results ----------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": dict(self.steps), "window": [self.skip, self.window], "phases": {}}
        for phase in PHASES:
            ops = self.ops[phase]
            busy = sum(r["self_device_us"] for r in ops.values()) / 1e6
            cpu = sum(r["self_cpu_us"] for r in ops.values()) / 1e6
            by_dev = sorted(ops.items(), key=lambda kv: -kv[1]["self_device_us"])[:TOP_OPS]
            by_cpu = sorted(ops.items(), key=lambda kv: -kv[1]["self_cpu_us"])[:TOP_OPS]
            out["phases"][phase] = {
                "wall_s": self.phase_wall[phase], "traced_s": self.wall[phase], "device_busy_s": busy,
                "self_cpu_s": cpu,
                "busy_fraction": busy / self.wall[phase] if self.cuda and self.wall[phase] > 0 else None,
                "top_device": [[k, v["self_device_us"] / 1e3, int(v["count"])] for k, v in by_dev
                               if v["self_device_us"] > 0],
                "top_cpu": [[k, v["self_cpu_us"] / 1e3, int(v["count"])] for k, v in by_cpu],
            }
        return out


def format_profile(side: str, summary: dict[str, Any]) -> str:
    """A plain-text report of :meth:`PhaseProfiler.summary` (what ``--profile_dir`` writes)."""
    lines = [f"{side}: generate traced forwards {summary['steps']['traced']} of {summary['steps']['total']} "
             f"(skip {summary['window'][0]}, window {summary['window'][1]} per generate call)"]
    for phase, p in summary["phases"].items():
        frac = f"{p['busy_fraction']:.0%}" if p["busy_fraction"] is not None else "-"
        lines.append(f"\n[{phase}] phase {p['wall_s']:.3f} s, traced {p['traced_s']:.3f} s, device busy "
                     f"{p['device_busy_s']:.3f} s ({frac}), self CPU {p['self_cpu_s']:.3f} s")
        for title, key in (("self device ms", "top_device"), ("self CPU ms", "top_cpu")):
            if p[key]:
                lines.append(f"  top by {title}:")
                lines += [f"    {ms:10.2f}  x{count:<6d} {name}" for name, ms, count in p[key]]
    return "\n".join(lines) + "\n"


# -- memory ---------------------------------------------------------------------------------------------------


def _innermost_optimizer(optimizer: Any) -> Any:
    import torch

    seen: list[Any] = []
    while optimizer is not None and all(optimizer is not s for s in seen):
        seen.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    torch_opts = [o for o in seen if isinstance(o, torch.optim.Optimizer) and hasattr(o, "state")]
    return torch_opts[-1] if torch_opts else None


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def memory_census(model: Any, optimizer: Any, device: str) -> dict[str, float]:
    """MiB resident by role (module docstring); ``allocated`` and ``other`` on CUDA only."""
    counted: set[int] = set()

    def size(tensors: list[Any]) -> float:
        total = 0
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in counted or storage.nbytes() == 0:
                continue
            counted.add(key)
            total += storage.nbytes()
        return total / 2**20

    params = list(model.parameters())
    out = {"weights": size(params + list(model.buffers())), "gradients": size([p.grad for p in params])}
    inner = _innermost_optimizer(optimizer)
    if inner is not None:
        opt_params = [p for g in inner.param_groups for p in g["params"]]
        out["master weights"] = size(opt_params)
        out["gradients"] += size([p.grad for p in opt_params])
        out["optimizer state"] = size(_tensors(list(inner.state.values())))
    if device.startswith("cuda"):
        import torch

        out["allocated"] = torch.cuda.memory_allocated() / 2**20
        out["other"] = out["allocated"] - sum(v for k, v in out.items() if k != "allocated")
    return out
