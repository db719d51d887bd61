"""What crosses the groups between trainer ranks and generator ranks (:mod:`dsrl.rl.disagg.roles`), and how.

Three kinds of message, each on its own channel so that every pair of ranks sees its messages in order:

- **control** (sync group, broadcast from trainer 0): one JSON document, sent once at start-up: where the
  run (re)starts, the prompt sampler's state, the staleness bound, which trainer rank is each replica's
  source, and the weights' layout (:class:`WeightLayout`);
- **weights** (sync group, broadcast from trainer 0): a header ``[version, stop, evaluate]`` (int64), then, unless
  ``stop``, the policy's ``state_dict`` in the layout's order as a byte stream cut into buckets of at most
  ``dsrl.memory.weight_sync_bucket_mib`` (:mod:`dsrl.core.buckets`), each one broadcast, so neither side holds
  a second whole copy of the model: trainer 0 packs a bucket while the one before travels, the generator unpacks
  a bucket into its model while the next arrives. The generator posts the receive of the next header before
  it generates; trainer 0's send completes once the generators take the buckets (with k >= 1 after the
  generation in progress, which the trainers wait for anyway: its samples come first) (:class:`WeightSender`,
  :class:`WeightReceiver`); ``evaluate``: the generators evaluate this version (``dsrl.eval``) before generating on;
- **samples** (bridge, point to point, generator -> a replica's source trainer): a header
  ``[rollout, replica, version, bytes, generation microseconds, idle microseconds]`` (int64), then the
  completions encoded with :mod:`dsrl.rl.data.codec` (exact, bit for bit). An evaluation's completions travel the
  same way under tags of their own (:data:`EVAL_TAGS`; ``rollout`` = the version evaluated), so they never mix
  with a rollout's.

Invariant: the layout is the trainer's ``state_dict`` order and both sides derive the buffers from it, so a
weight lands in the generator's tensor of the same name, bit for bit (dtype conversions included).
"""

from __future__ import annotations

import functools
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

from dsrl.core.buckets import Segment, bucket_size, byte_buckets
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
    """Each tensor's name, dtype and shape in ``state_dict`` order, and their cut into buckets of at most
    ``bucket_bytes`` (:func:`dsrl.core.buckets.byte_buckets`): both sides derive the same cut from the layout."""

    entries: list[tuple[str, str, list[int]]]
    bucket_bytes: int = 512 * 2**20

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], bucket_bytes: int = 512 * 2**20) -> WeightLayout:
        return cls([(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()],
                   bucket_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries], "bucket_bytes": self.bucket_bytes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WeightLayout:
        return cls([(str(n), str(d), [int(x) for x in s]) for n, d, s in doc["entries"]], int(doc["bucket_bytes"]))

    def _dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, d) for _, d, _ in self.entries]

    @functools.cached_property
    def buckets(self) -> list[list[Segment]]:
        sizes = [(int(np.prod(shape, dtype=np.int64)), torch.empty(0, dtype=dt).element_size())
                 for (_, _, shape), dt in zip(self.entries, self._dtypes())]
        return byte_buckets(sizes, self.bucket_bytes)

    def bucket_sizes(self) -> list[int]:
        itemsizes = [torch.empty(0, dtype=dt).element_size() for dt in self._dtypes()]
        return [bucket_size(b, itemsizes) for b in self.buckets]

    def staging(self) -> list[torch.Tensor]:
        """Two byte buffers of the largest bucket's size: a sync packs (or unpacks) one while the other travels."""
        largest = max(self.bucket_sizes(), default=0)
        return [torch.zeros(largest, dtype=torch.uint8) for _ in range(2)]

    def _slot(self, buffer: torch.Tensor, seg: Segment, dtype: torch.dtype) -> torch.Tensor:
        n = seg.count * torch.empty(0, dtype=dtype).element_size()
        return buffer[seg.offset:seg.offset + n].view(dtype)

    def pack(self, state: Mapping[str, torch.Tensor], bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        """Copy bucket ``bucket`` of ``state`` (any device) into ``buffer``; returns the filled prefix."""
        dtypes = self._dtypes()
        for seg in self.buckets[bucket]:
            name = self.entries[seg.index][0]
            flat = state[name].detach().reshape(-1)[seg.start:seg.start + seg.count]
            self._slot(buffer, seg, dtypes[seg.index]).copy_(flat)
        return buffer[:self.bucket_sizes()[bucket]]

    def unpack(self, buffer: torch.Tensor, bucket: int, state: Mapping[str, torch.Tensor]) -> None:
        """Copy bucket ``bucket`` from ``buffer`` into the tensors of ``state`` (a module's state_dict: written in
        place, dtype and device converted)."""
        missing = [name for name, _, _ in self.entries if name not in state]
        if missing:
            raise RuntimeError(f"the generator's model has no tensor {missing[0]!r} of the trainer's policy: the two "
                               "sides built different models (dsrl.model must be the same on every rank)")
        dtypes = self._dtypes()
        for seg in self.buckets[bucket]:
            target = state[self.entries[seg.index][0]]
            flat = target.view(-1) if target.is_contiguous() else None
            part = self._slot(buffer, seg, dtypes[seg.index]).to(target.device, target.dtype)
            if flat is None:
                raise RuntimeError(f"the generator's tensor {self.entries[seg.index][0]!r} is not contiguous")
            flat[seg.start:seg.start + seg.count].copy_(part)


class WeightSender:
    """Trainer 0's side: each version's header, then its buckets, packed into two staging buffers in turn (a
    bucket is packed while the one before travels). Packing bucket i waits until bucket i - 2 has been taken, so
    a send completes once the generators are receiving; the last two buckets' sends complete in the background
    (:meth:`drain` waits for them)."""

    def __init__(self, group: Any, layout: WeightLayout):
        self.group, self.layout = group, layout
        self.staging = layout.staging()
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
        """Send version ``version`` (``state`` None: the stop message; ``evaluate``: the generators evaluate it);
        returns the seconds spent waiting for the generators to take earlier buckets (TimeoutError past
        ``deadline``, RuntimeError if one is gone)."""
        waited = self.drain(deadline)
        self._header.copy_(torch.tensor([version, int(state is None), int(evaluate)]))
        self.pending.append(_broadcast(self.group, self._header))
        if state is None:
            return waited
        in_flight: list[Any] = [None, None]
        for i in range(len(self.layout.buckets)):
            slot = i % 2
            if in_flight[slot] is not None:
                t0 = time.perf_counter()
                if not wait(in_flight[slot], deadline):
                    raise TimeoutError("a generator did not take a bucket of the weights")
                waited += time.perf_counter() - t0
            in_flight[slot] = _broadcast(self.group, self.layout.pack(state, i, self.staging[slot]))
        self.pending += [w for w in in_flight if w is not None]
        return waited

    def bytes_per_version(self) -> int:
        return sum(self.layout.bucket_sizes())


class WeightReceiver:
    """A generator's side: the next version's header always posted ahead (:meth:`post`); once it arrived,
    :meth:`receive_into` takes the buckets into two staging buffers in turn (one is unpacked into the model while the
    next arrives): the generator never holds a second whole copy of the weights."""

    def __init__(self, group: Any, layout: WeightLayout):
        self.group, self.layout = group, layout
        self.staging = layout.staging()
        self.header = torch.zeros(3, dtype=torch.int64)
        self.work: Any = None

    def post(self) -> None:
        self.work = _broadcast(self.group, self.header)

    def take(self, deadline: float | None = None) -> Received | None:
        """The posted header once it arrived (:class:`Received`; the buckets follow, :meth:`receive_into`); None if
        ``deadline`` passed first."""
        if not wait(self.work, deadline):
            return None
        version, stop, evaluate = (int(x) for x in self.header.tolist())
        return Received(version, bool(stop), bool(evaluate) and not stop)

    def receive_into(self, state: Mapping[str, torch.Tensor] | None, deadline: float | None = None) -> bool:
        """The buckets of the version whose header :meth:`take` returned, unpacked into ``state`` in place (None:
        received and dropped, so that the next header lines up); False if ``deadline`` passed first."""
        sizes = self.layout.bucket_sizes()
        n = len(sizes)
        works = [_broadcast(self.group, self.staging[i][:sizes[i]]) for i in range(min(2, n))]
        for i in range(n):
            if not wait(works[i], deadline):
                return False
            if state is not None:
                self.layout.unpack(self.staging[i % 2], i, state)
            if i + 2 < n:
                works.append(_broadcast(self.group, self.staging[i % 2][:sizes[i + 2]]))
        return True


@dataclass(frozen=True)
class Received:
    """A weights header as the generator took it: the version, whether it is the stop message, whether to evaluate
    the version (``dsrl.eval``)."""

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
