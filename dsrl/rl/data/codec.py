"""One rollout sample (any dataclass, e.g. :class:`dsrl.rl.data.batching.Sample`) <-> a compact byte string.

The data path (:mod:`dsrl.rl.data.replica`) moves samples between ranks as bytes; this codec decides
the bytes. It is generic over the dataclass's fields, so a field added to ``Sample`` travels without
any change here, and it is exact: ``decode_sample(encode_sample(s))`` equals ``s`` field by field,
bit for bit.

- a list of Python ints becomes an int32 array (int64 if a value needs it);
- a list of Python floats becomes a float32 array when every value survives the round trip
  float64 -> float32 -> float64 bit for bit (log-probs computed in float32 do), else float64;
- a ``torch.Tensor`` travels as its raw bytes, dtype and shape (any dtype, bfloat16 included) and
  arrives on the CPU; a numpy array likewise;
- everything else (scalars, None, strings, empty or mixed lists) is pickled in a small header,
  together with the dataclass itself.

Layout: ``uint32 header length | pickled header | the arrays' raw bytes, in header order``. A
``Sample`` costs 4 bytes per token plus 12 per completion token (old, reference and behavior
log-probs; 4 more with off-policy weights or a completion mask) plus ~0.3 kB of header, against
~4 + 27 for a pickled one (3- or 5-byte ints, 9-byte floats): measured in bench/datapath.py.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from dsrl.rl.data.batching import Sample

_LEN = struct.Struct("<I")
_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)


def _list_array(values: list) -> np.ndarray | None:
    """The exact array form of a list of ints or floats, or None (the list is pickled as it is)."""
    if not values:
        return None
    if all(type(v) is int for v in values):  # bools are not ints here: they stay bools
        lo, hi = min(values), max(values)
        if _INT32.min <= lo and hi <= _INT32.max:
            return np.asarray(values, dtype=np.int32)
        if _INT64.min <= lo and hi <= _INT64.max:
            return np.asarray(values, dtype=np.int64)
        return None
    if all(type(v) is float for v in values):
        wide = np.asarray(values, dtype=np.float64)
        narrow = wide.astype(np.float32)
        same = np.array_equal(narrow.astype(np.float64).view(np.int64), wide.view(np.int64))
        return narrow if same else wide
    return None


def encode_sample(sample: Sample) -> bytes:
    """``sample`` (a dataclass instance) as bytes; see the module docstring for the layout."""
    if not dataclasses.is_dataclass(sample) or isinstance(sample, type):
        raise TypeError(f"encode_sample needs a dataclass instance, got {type(sample).__name__}")
    plain: dict[str, Any] = {}
    specs: list[tuple[str, str, str, tuple[int, ...], int]] = []
    chunks: list[bytes] = []
    for f in dataclasses.fields(sample):
        value = getattr(sample, f.name)
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            specs.append((f.name, "tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), len(raw)))
            chunks.append(raw)
            continue
        if isinstance(value, np.ndarray) and value.dtype != object:
            raw = np.ascontiguousarray(value).tobytes()
            specs.append((f.name, "ndarray", value.dtype.str, tuple(value.shape), len(raw)))
            chunks.append(raw)
            continue
        arr = _list_array(value) if type(value) is list else None
        if arr is None:
            plain[f.name] = value
            continue
        raw = arr.tobytes()
        specs.append((f.name, "list", arr.dtype.str, (arr.size,), len(raw)))
        chunks.append(raw)
    header = pickle.dumps((type(sample), plain, specs), protocol=pickle.HIGHEST_PROTOCOL)
    return b"".join([_LEN.pack(len(header)), header, *chunks])


def decode_sample(data: bytes | bytearray | memoryview | np.ndarray) -> Sample:
    """The dataclass instance :func:`encode_sample` turned into ``data``."""
    view = memoryview(data).cast("B")
    (n,) = _LEN.unpack_from(view, 0)
    cls, values, specs = pickle.loads(view[_LEN.size:_LEN.size + n])
    pos = _LEN.size + n
    for name, kind, dtype, shape, nbytes in specs:
        raw = view[pos:pos + nbytes]
        pos += nbytes
        if kind == "tensor":
            tdtype = getattr(torch, dtype)
            values[name] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdtype).reshape(shape)
                            if nbytes else torch.empty(shape, dtype=tdtype))
        elif kind == "ndarray":
            values[name] = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        else:
            values[name] = np.frombuffer(raw, dtype=np.dtype(dtype)).tolist()
    if pos != len(view):
        raise ValueError(f"a sample encoding of {len(view)} bytes holds {pos}: the buffer is cut or misaligned")
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in values.items() if k in init})
    for k, v in values.items():
        if k not in init:
            object.__setattr__(obj, k, v)
    return obj
