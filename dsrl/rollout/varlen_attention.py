"""Variable-length (packed) attention for continuous batching, without the flash-attn package.

transformers' continuous batching has two paths. With a *flash* attention implementation it packs the
step's sequences end to end and hands the attention function cumulative lengths (``cu_seq_lens_q/k``),
runs the step under CUDA graphs and overlaps scheduling with compute (asynchronous batching). With
``sdpa``/``eager`` it instead builds a dense ``[step tokens, cached tokens]`` mask, so every query attends
over every cached token of every sequence of the step: the attention work grows with C² at C concurrent
sequences, and there are no graphs. On a GPU without flash-attn (it has no wheel for many torch/CUDA
pairs and must not be fetched at run time) that made continuous batching slower than ``generate``.

PyTorch ships the flash-attention kernels itself (they back ``scaled_dot_product_attention``), and its
variable-length entry point takes exactly what transformers' flash path passes. This module registers
one attention implementation, :data:`VARLEN_ATTENTION`, with transformers' ``AttentionInterface`` and
``AttentionMaskInterface``:

- its name contains ``flash`` (so continuous batching takes the packed, graph-captured path) and no
  version digit (so transformers never treats it as flash-attn 2/3 and never imports ``flash_attn`` or
  the paged-decode kernels; every step goes through the index-based cache update, then here);
- on CUDA in fp16/bf16 it calls ``torch.ops.aten._flash_attention_forward`` on the packed tensors: causal,
  aligned bottom-right (each sequence's queries are its last ``q`` positions of its ``k`` keys), grouped
  query heads read natively, sliding windows as transformers defines them, capturable in a CUDA graph
  (no host synchronisation);
- elsewhere (CPU, fp32) it runs the same arithmetic as ``scaled_dot_product_attention`` on a padded
  ``[sequences, max q, max k]`` batch: work proportional to the sum over sequences of q·k instead of
  (Σq)·(Σk). It is the reference the CUDA path is tested against.

Only the packed form is accepted (``cu_seq_lens_q/k`` present): the implementation is meant to be set for
the duration of a continuous-batching call (:mod:`dsrl.rollout.cb`), never for training forwards.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

VARLEN_ATTENTION = "dsrl_flash_varlen"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def cuda_flash_available() -> bool:
    """Whether PyTorch's own variable-length flash kernel is there (CUDA build, a GPU of compute
    capability >= 8.0)."""
    if not torch.cuda.is_available() or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    return torch.cuda.get_device_capability()[0] >= 8


@functools.cache
def flash_kernel_has_window() -> bool:
    """Whether this torch's flash op takes a sliding window (``window_size_left``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and any(a.name == "window_size_left" for a in op.default._schema.arguments)


def uses_flash_kernel(device: torch.device, dtype: torch.dtype, sliding_window: int | None = None) -> bool:
    """Whether :func:`varlen_attention_forward` runs tensors of this device and dtype through PyTorch's flash
    kernel (else the padded reference: CPU, fp32, or a sliding window this torch's kernel cannot take)."""
    if not (device.type == "cuda" and dtype in _FLASH_DTYPES and cuda_flash_available()):
        return False
    return sliding_window is None or flash_kernel_has_window()


def _padded_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_q: int, max_k: int, scale: float | None, sliding_window: int | None = None) -> torch.Tensor:
    """Packed causal attention through ``scaled_dot_product_attention`` on a padded batch.

    ``q``: [Tq, H, D], ``k``/``v``: [Tk, Hkv, D]; sequence i owns rows ``cu_q[i]:cu_q[i+1]`` of ``q`` and
    ``cu_k[i]:cu_k[i+1]`` of ``k``/``v``; its queries are the last positions of its keys; with a
    ``sliding_window`` W a query at position p sees keys p - W < j <= p (transformers' convention). Returns [Tq, H, D]
    (rows past ``cu_q[-1]``, padding, are zero). Static shapes and no host synchronisation, so a CUDA
    graph can capture it.
    """
    len_q, len_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    ar_q = torch.arange(max_q, device=q.device)
    ar_k = torch.arange(max_k, device=q.device)
    valid_q = ar_q[None, :] < len_q[:, None]  # [n, max_q]
    idx_q = (cu_q[:-1, None].long() + ar_q[None, :]).clamp(max=max(q.shape[0] - 1, 0))
    idx_k = (cu_k[:-1, None].long() + ar_k[None, :]).clamp(max=max(k.shape[0] - 1, 0))
    # query i of a sequence sits at key position (len_k - len_q + i): causal, aligned bottom-right
    last_key = (len_k - len_q)[:, None, None] + ar_q[None, :, None]  # [n, max_q, 1]
    mask = (ar_k[None, None, :] <= last_key) & (ar_k[None, None, :] < len_k[:, None, None])  # [n, max_q, max_k]
    if sliding_window is not None:
        mask &= ar_k[None, None, :] > last_key - sliding_window
    mask |= ~valid_q[:, :, None] & (ar_k[None, None, :] == 0)  # padded query rows see one key: no NaN rows
    out = F.scaled_dot_product_attention(
        q[idx_q].transpose(1, 2), k[idx_k].transpose(1, 2), v[idx_k].transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    ).transpose(1, 2)  # [n, max_q, H, D]
    # back to packed rows: row t belongs to sequence s (cu_q[s] <= t < cu_q[s + 1]) at offset t - cu_q[s]
    t = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_q[1:].long(), t, right=True).clamp(max=cu_q.numel() - 2)
    offset = (t - cu_q[seq].long()).clamp(0, max_q - 1)
    inside = (t < cu_q[-1].long())[:, None, None]
    return torch.where(inside, out[seq, offset], torch.zeros((), dtype=out.dtype, device=out.device))


def flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float | None, sliding_window: int | None = None) -> torch.Tensor:
    """PyTorch's variable-length flash attention, causal; same layout and result as :func:`_padded_reference`
    (rows past ``cu_q[-1]`` are left as the kernel writes them: continuous batching discards them)."""
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
        **window,
    )[0]


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                             cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                             max_length_k: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [1, H, Tq, D], ``key``/``value`` [1, Hkv, Tk, D]
    packed; returns ([1, Tq, H, D], None). Causal within each sequence (and within ``sliding_window``),
    never across sequences."""
    cache = kwargs.get("cache")
    if cache is not None and hasattr(cache, "layer_to_allocator"):
        # transformers 5.19-5.23: the model hands the paged cache to the attention function, which writes
        # this step's keys/values and picks the layer type's ``cu_seq_lens_k``/``max_length_k`` from their dicts
        # (transformers >= 5.24 does both in the attention layer, before calling here)
        step = dict(kwargs, cu_seq_lens_k=cu_seq_lens_k, max_length_k=max_length_k)
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=step)
        cu_seq_lens_k, max_length_k = step["cu_seq_lens_k"], step["max_length_k"]
    if cu_seq_lens_q is None or cu_seq_lens_k is None or max_length_q is None or max_length_k is None:
        raise RuntimeError(f"attn_implementation {VARLEN_ATTENTION!r} only runs packed sequences (continuous "
                           "batching); it is not meant for padded forwards")
    if dropout:
        raise NotImplementedError(f"{VARLEN_ATTENTION!r} is for generation: dropout must be 0")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects a batch of 1, got query of shape {tuple(query.shape)}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    if uses_flash_kernel(q.device, q.dtype, sliding_window):
        out = flash_kernel(q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k), scaling, sliding_window)
    else:
        out = _padded_reference(q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k), scaling, sliding_window)
    return out.unsqueeze(0), None


_CHECKED: set[tuple[str, torch.dtype]] = set()
SELF_CHECK_TOLERANCE = 2e-2  # relative error of bf16/fp16 attention against the float32 reference


def check_flash_kernel(device: torch.device, dtype: torch.dtype) -> None:
    """Once per process, device and dtype: the flash path gives the padded reference's result on a packed case
    with every layout continuous batching produces (decode rows, a chunked prefill whose queries are the tail
    of its keys, grouped query heads). A kernel that aligned the causal mask differently, or mixed sequences,
    would be off by far more than rounding. Raises RuntimeError naming the fix; a few milliseconds."""
    key = (str(device), dtype)
    if key in _CHECKED or not uses_flash_kernel(device, dtype):
        return
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens, heads, kv_heads, dim = [1, 5, 1, 3], [9, 12, 1, 3], 8, 2, 64
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    k, v = (torch.randn(sum(k_lens), kv_heads, dim, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (q_lens, k_lens))
    want = _padded_reference(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), dim**-0.5)
    got = flash_kernel(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), cu_q.to(device),
                       cu_k.to(device), max(q_lens), max(k_lens), dim**-0.5).float().cpu()
    err = float((got - want).norm() / want.norm())
    if not err <= SELF_CHECK_TOLERANCE:
        raise RuntimeError(
            f"PyTorch's flash kernel (torch {torch.__version__}, {dtype}) disagrees with causal packed attention "
            f"(relative error {err:.3g} > {SELF_CHECK_TOLERANCE}); set rollout.cb_attention = 'model' (or "
            "rollout.backend = 'hf') and report this")
    _CHECKED.add(key)


def register() -> str:
    """Registers :data:`VARLEN_ATTENTION` with transformers (idempotent) and returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)
    return VARLEN_ATTENTION
