"""Small collectives for decisions every rank must share (rank 0 decides, or all ranks agree).

Invariant: each function is called by every rank at the same point and returns the same value on
every rank (or raises the same error on every rank); without an initialised process group (one plain
process) it is a local call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dsrl.config import ConfigError
from dsrl.core.errors import RunError

T = TypeVar("T")
_local = threading.local()


def initialized() -> bool:
    """Whether collectives run: a process group exists and this thread is not inside :func:`alone`."""
    return dist.is_available() and dist.is_initialized() and not getattr(_local, "alone", False)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside the block this process acts as a job of one (rank 0, world 1): what runs on one rank only
    (e.g. under :func:`on_rank0`) never enters a collective the other ranks do not."""
    before = getattr(_local, "alone", False)
    _local.alone = True
    try:
        yield
    finally:
        _local.alone = before


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> int:
    return dist.get_world_size() if initialized() else 1


def barrier() -> None:
    if initialized():
        dist.barrier()


def device() -> torch.device:
    """Where tensors of the default group's collectives live: the accelerator for NCCL-like backends."""
    if not initialized() or dist.get_backend() == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (one all-reduce of one number)."""
    if world() == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def max_floats(values: list[float]) -> list[float]:
    """The element-wise maximum over ranks of a short list of floats."""
    if world() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world() == 1:
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_SHARED_ERRORS: dict[str, type[Exception]] = {"config": ConfigError, "run": RunError}


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 only (as a job of one: :func:`alone`); its result, or its ConfigError /
    RunError / OSError, on every rank.

    The other ranks wait in one broadcast; an OSError becomes a RunError naming it.
    """
    outcome: tuple[str, Any] = ("ok", None)
    if rank() == 0:
        try:
            with alone():
                outcome = ("ok", fn())
        except ConfigError as e:
            outcome = ("config", str(e))
        except RunError as e:
            outcome = ("run", str(e))
        except OSError as e:
            outcome = ("run", f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
    kind, value = broadcast(outcome)
    if kind == "ok":
        return value
    err = _SHARED_ERRORS[kind](value)
    err.agreed = True  # type: ignore[attr-defined]
    raise err


def outcome(error: BaseException | None) -> tuple[str, str] | None:
    """What a rank's checks ended with, as it travels to the other ranks: ``None`` (all well), or the kind
    (``"config"`` or ``"run"``) and the sentence of a ConfigError / RunError."""
    if error is None:
        return None
    return ("config" if isinstance(error, ConfigError) else "run", str(error))


def shared_error(outcomes: list[tuple[str, str] | None]) -> Exception | None:
    """The one error every rank raises for the ranks' :func:`outcome` values (in rank order), marked ``agreed``
    (printed once, by rank 0): a ConfigError if any rank had one (exit status 2), else a RunError; each distinct
    sentence once, in rank order (several: "N problems:" and a list, like a run file's own errors)."""
    found = [o for o in outcomes if o is not None]
    if not found:
        return None
    kind = "config" if any(k == "config" for k, _ in found) else "run"
    texts = list(dict.fromkeys(text for k, text in found if k == kind))
    message = texts[0] if len(texts) == 1 else f"{len(texts)} problems:\n" + "\n".join(f"  - {t}" for t in texts)
    err = _SHARED_ERRORS[kind](message)
    err.agreed = True  # type: ignore[attr-defined]
    return err


def agree(error: BaseException | None) -> None:
    """The checks every rank ran before its first collective work, agreed on (one all-gather): if any rank's
    ended in a ConfigError or RunError, every rank raises :func:`shared_error` of them. ``error`` is this rank's
    (None: its checks passed). Alone: ``error`` itself is raised."""
    if world() == 1:
        if error is not None:
            raise error
        return
    err = shared_error(all_gather(outcome(error)))
    if err is not None:
        raise err


def all_reduce_floats(values: list[float], op: Any = None, device: Any = "cpu") -> list[float]:
    """Sum (or ``op``) a short list of floats over all ranks of the default group (in float64, on ``device``);
    a no-op on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()
