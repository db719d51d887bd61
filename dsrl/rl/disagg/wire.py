"""What crosses the groups between trainer ranks and generator ranks (:mod:`dsrl.rl.disagg.roles`), and how.

Three kinds of message, each on its own channel so that every pair of ranks sees its messages in order:

- **control** (sync group, broadcast from trainer 0): one JSON document, sent once at start-up: where the
  run (re)starts, the prompt sampler's state, the staleness bound, which trainer rank is each replica's
  source, and the weights' layout (:class:`WeightLayout`);
- **weights** (sync group, broadcast from trainer 0): a header ``[version, stop, evaluate]`` (int64), then, unless
  ``stop``, one flat buffer per dtype holding every tensor of the policy's ``state_dict`` in the layout's
  order; ``evaluate``: the generators evaluate this version (``dsrl.eval``) before generating on. The generator
  posts the receive of the next version before it generates, so the trainer's send never waits for generation
  (:class:`WeightReceiver`);
- **samples** (bridge, point to point, generator -> a replica's source trainer): a header
  ``[rollout, replica, version, bytes, generation microseconds, idle microseconds]`` (int64), then the
  completions encoded with :mod:`dsrl.rl.data.codec` (exact, bit for bit). An evaluation's completions travel the
  same way under tags of their own (:data:`EVAL_TAGS`; ``rollout`` = the version evaluated), so they never mix
  with a rollout's.

Invariant: the layout is the trainer's ``state_dict`` order and both sides derive the buffers from it, so a
weight lands in the generator's tensor of the same name, bit for bit (dtype conversions included).
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dsrl.rl.data.codec import decode_sample, encode_sample
from dsrl.rollout.base import Completion

SAMPLE_HEADER, SAMPLE_PAYLOAD = 0, 1  # bridge tags
SAMPLE_TAGS, EVAL_TAGS = (SAMPLE_HEADER, SAMPLE_PAYLOAD), (2, 3)  # a rollout's samples; an evaluation's
_LEN = struct.Struct("<I")
POLL_S = 0.05


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def wait(work: Any, deadline: float | None = None, interrupt: Any = None) -> bool:
    """Wait for a posted operation; False if ``deadline`` (monotonic) passed or ``interrupt()`` became true
    first (the operation stays posted). A failed operation (a peer gone) raises.

    gloo's point-to-point operations only complete inside ``wait()`` (``is_completed()`` stays false until
    then), so the wait runs in a helper thread, once per operation, and this thread polls it."""
    _, done, errors = _waiter(work)
    while not done.wait(POLL_S):
        if (deadline is not None and time.monotonic() > deadline) or (interrupt is not None and interrupt()):
            return False
    _WAITERS.pop(id(work), None)
    if errors:
        raise errors[0]
    return True


def finished(work: Any) -> bool:
    """Whether a posted operation completed (without blocking); a failed one raises."""
    _, done, errors = _waiter(work)
    if errors:
        raise errors[0]
    if done.is_set():
        _WAITERS.pop(id(work), None)
        return True
    return False


def _waiter(work: Any) -> tuple[Any, threading.Event, list]:
    waiter = _WAITERS.get(id(work))
    if waiter is None or waiter[0] is not work:
        waiter = (work, threading.Event(), [])
        _WAITERS[id(work)] = waiter

        def run(w: Any = work, done: threading.Event = waiter[1], errors: list = waiter[2]) -> None:
            try:
                w.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name="dsrl-wire-wait", daemon=True).start()
    return waiter


_WAITERS: dict[int, tuple[Any, threading.Event, list]] = {}


# -- control --------------------------------------------------------------------------------------------------


def send_control(group: Any, doc: Mapping[str, Any], deadline: float | None = None) -> None:
    """Broadcast ``doc`` from trainer 0 (the start message, or ``{"abort": status}``); a TimeoutError if the
    generators did not take it by ``deadline``, a RuntimeError if one is gone."""
    data = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
    size, payload = torch.tensor([data.size], dtype=torch.int64), torch.from_numpy(data.copy())
    for work in (_broadcast(group, size), _broadcast(group, payload)):
        if not wait(work, deadline):
            raise TimeoutError("a generator did not take the control message")


def recv_control(group: Any, deadline: float | None = None) -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64)
    if not wait(_broadcast(group, size), deadline):
        raise TimeoutError("no control message from trainer 0")
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    _broadcast(group, data).wait()
    return json.loads(bytes(data.numpy()).decode())


def all_gather_bytes(group: Any, data: bytes, world: int) -> list[bytes]:
    """Every rank's ``data`` in rank order, on every rank of ``group`` (a raw gloo group of ``world`` ranks: the
    bridge), within the group's bound. Two all-gathers: the lengths, then the padded bytes."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    group.allgather([sizes], [size]).wait()
    longest = max(1, max(int(s.item()) for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    group.allgather([out], [mine]).wait()
    return [bytes(t[:int(n.item())].numpy()) for t, n in zip(out, sizes)]


def describe_failure(exc: BaseException) -> str:
    """A peer's failure as a few words for a message: 'its connection closed', 'it did not answer in time', or
    the error's first sentence without the C++ source location gloo puts in front."""
    text = str(exc).strip()
    lowered = text.lower()
    if "connection closed" in lowered or "connection reset" in lowered or "broken pipe" in lowered:
        return "its connection closed"
    if "timed out" in lowered or "timeout" in lowered:
        return "it did not answer in time"
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(exc).__name__)
    return first.split(". ")[0][:160]


# -- weights --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightLayout:
    """Each tensor's name, dtype and shape in ``state_dict`` order, grouped into one flat buffer per dtype."""

    entries: list[tuple[str, str, list[int]]]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> WeightLayout:
        return cls([(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()])

    def to_json(self) -> list:
        return [list(e) for e in self.entries]

    @classmethod
    def from_json(cls, doc: list) -> WeightLayout:
        return cls([(str(n), str(d), [int(x) for x in s]) for n, d, s in doc])

    def dtypes(self) -> list[str]:
        return list(dict.fromkeys(d for _, d, _ in self.entries))

    def buffers(self) -> dict[str, torch.Tensor]:
        """Zeroed flat CPU buffers, one per dtype."""
        sizes: dict[str, int] = {}
        for _, d, shape in self.entries:
            sizes[d] = sizes.get(d, 0) + int(np.prod(shape, dtype=np.int64))
        return {d: torch.zeros(n, dtype=getattr(torch, d)) for d, n in sizes.items()}

    def pack(self, state: Mapping[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (any device) into ``buffers``."""
        offsets = dict.fromkeys(buffers, 0)
        for name, d, _ in self.entries:
            flat = state[name].detach().reshape(-1)
            buffers[d][offsets[d]:offsets[d] + flat.numel()].copy_(flat)
            offsets[d] += flat.numel()

    def unpack(self, buffers: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``buffers`` into the tensors of ``state`` (a module's state_dict: written in place)."""
        offsets = dict.fromkeys(buffers, 0)
        missing = [name for name, _, _ in self.entries if name not in state]
        if missing:
            raise RuntimeError(f"the generator's model has no tensor {missing[0]!r} of the trainer's policy: the two "
                               "sides built different models (dsrl.model must be the same on every rank)")
        for name, d, shape in self.entries:
            n = int(np.prod(shape, dtype=np.int64))
            target = state[name]
            target.copy_(buffers[d][offsets[d]:offsets[d] + n].view(shape).to(target.device, target.dtype))
            offsets[d] += n


class WeightSender:
    """Trainer 0's side: broadcast each version without waiting for the generators (the previous send must
    have completed before the buffers are reused; the time spent waiting for it is returned)."""

    def __init__(self, group: Any, layout: WeightLayout):
        self.group, self.layout = group, layout
        self.buffers = layout.buffers()
        self.pending: list[Any] = []
        self._header = torch.zeros(3, dtype=torch.int64)

    def drain(self, deadline: float | None = None) -> float:
        t0 = time.perf_counter()
        for work in self.pending:
            if not wait(work, deadline):
                raise TimeoutError("a generator did not receive the previous weights")
        self.pending = []
        return time.perf_counter() - t0

    def send(self, version: int, state: Mapping[str, torch.Tensor] | None, deadline: float | None = None,
             evaluate: bool = False) -> float:
        """Post version ``version`` (``state`` None: the stop message; ``evaluate``: the generators evaluate it);
        returns the seconds spent waiting for the previous send."""
        waited = self.drain(deadline)
        self._header.copy_(torch.tensor([version, int(state is None), int(evaluate)]))
        self.pending.append(_broadcast(self.group, self._header))
        if state is not None:
            self.layout.pack(state, self.buffers)
            self.pending += [_broadcast(self.group, self.buffers[d]) for d in self.layout.dtypes()]
        return waited


class WeightReceiver:
    """A generator's side: one version always posted ahead (:meth:`post`), received into staging buffers."""

    def __init__(self, group: Any, layout: WeightLayout):
        self.group, self.layout = group, layout
        self.buffers = layout.buffers()
        self.header = torch.zeros(3, dtype=torch.int64)
        self.works: list[Any] = []

    def post(self) -> None:
        self.works = [_broadcast(self.group, self.header)]
        self.works += [_broadcast(self.group, self.buffers[d]) for d in self.layout.dtypes()]

    def take(self, deadline: float | None = None) -> Received | None:
        """The posted message once it arrived (its buffers then hold the weights); None if ``deadline`` passed
        first."""
        if not wait(self.works[0], deadline):
            return None
        version, stop, evaluate = (int(x) for x in self.header.tolist())
        if stop:
            return Received(version, True, False)
        for work in self.works[1:]:
            if not wait(work, deadline):
                return None
        return Received(version, False, bool(evaluate))


@dataclass(frozen=True)
class Received:
    """A weights message as the generator took it: the version, whether it is the stop message, whether to
    evaluate the version (``dsrl.eval``)."""

    version: int
    stop: bool
    evaluate: bool


# -- samples --------------------------------------------------------------------------------------------------


def encode_completions(completions: list[Completion]) -> bytes:
    parts = [encode_sample(c) for c in completions]
    return b"".join([_LEN.pack(len(parts))] + [_LEN.pack(len(p)) + p for p in parts])


def decode_completions(data: bytes | memoryview) -> list[Completion]:
    view = memoryview(data)
    (n,) = _LEN.unpack_from(view, 0)
    pos, out = _LEN.size, []
    for _ in range(n):
        (size,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        out.append(decode_sample(view[pos:pos + size]))
        pos += size
    return out


@dataclass
class SampleMessage:
    """One replica's completions of one rollout, and what producing them cost the generator."""

    rollout: int
    replica: int
    version: int
    completions: list[Completion]
    generation_s: float = 0.0
    idle_s: float = 0.0


def send_samples(bridge: Any, dst: int, msg: SampleMessage, tags: tuple[int, int] = SAMPLE_TAGS) -> list[Any]:
    """Post the message to global rank ``dst`` (``tags``: :data:`SAMPLE_TAGS`, or :data:`EVAL_TAGS` for an
    evaluation's); returns the operations (keep their tensors alive until done)."""
    payload = torch.from_numpy(np.frombuffer(encode_completions(msg.completions), dtype=np.uint8).copy())
    header = torch.tensor([msg.rollout, msg.replica, msg.version, payload.numel(), int(msg.generation_s * 1e6),
                           int(msg.idle_s * 1e6)], dtype=torch.int64)
    return [(bridge.send([header], dst, tags[0]), header), (bridge.send([payload], dst, tags[1]), payload)]


class SampleReceiver:
    """A source trainer's side: the next message from one generator on ``tags``, with a deadline and an
    interrupt."""

    def __init__(self, bridge: Any, src: int, tags: tuple[int, int] = SAMPLE_TAGS):
        self.bridge, self.src, self.tags = bridge, src, tags
        self.header = torch.zeros(6, dtype=torch.int64)
        self.work = None

    def receive(self, deadline: float | None = None, interrupt: Any = None) -> SampleMessage | None:
        """The message, or None if the deadline passed or the interrupt fired (the receive stays posted)."""
        if self.work is None:
            self.work = self.bridge.recv([self.header], self.src, self.tags[0])
        if not wait(self.work, deadline, interrupt):
            return None
        self.work = None
        rollout, replica, version, size, gen_us, idle_us = (int(x) for x in self.header.tolist())
        payload = torch.zeros(size, dtype=torch.uint8)
        self.bridge.recv([payload], self.src, self.tags[1]).wait()
        return SampleMessage(rollout, replica, version, decode_completions(payload.numpy().tobytes()),
                             gen_us / 1e6, idle_us / 1e6)
