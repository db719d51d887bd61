"""Per-token log-probs and entropy of a causal LM's logits, without a float32 copy of all the logits.

Used wherever log-probs are taken (old/reference log-probs, the training step, the behavior log-probs
of the rollout backends, the supervised warm-up): one computation, so that values agree bit for bit
between the paths (the first step's importance ratios are exactly 1).
"""

from __future__ import annotations

from typing import Any

import torch

# fp32 working set of one chunk in the no-autograd log-prob / entropy paths (old/ref log-probs, the
# entropy metric): rows are processed in chunks of at most this many bytes of fp32 logits.
LOGIT_CHUNK_BYTES = 1 << 28


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    x = x.float()
    return x / temperature if temperature != 1.0 else x


def _rows_per_chunk(vocab: int) -> int:
    """Rows of ``vocab`` logits whose float32 copy fits in ``LOGIT_CHUNK_BYTES`` (at least one)."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab))


def _per_row_chunked(logits: torch.Tensor, fn, *extra: torch.Tensor) -> torch.Tensor:
    """``fn(logit_rows, *extra_rows) -> [rows]`` over row chunks of ``logits`` ``[..., V]``: a float32
    ``[...]`` result without ever holding a float32 copy of all of ``logits`` (no autograd)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    flat_extra = [e.reshape(-1) for e in extra]
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = _rows_per_chunk(vocab)
    with torch.no_grad():
        for i in range(0, flat.shape[0], step):
            out[i:i + step] = fn(flat[i:i + step], *(e[i:i + step] for e in flat_extra))
    return out.reshape(logits.shape[:-1])


def _target_logprob(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunked_target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(target) per row chunk, no autograd: the one computation behind both paths of
    :func:`token_logprobs` (so their values agree bit for bit)."""
    return _per_row_chunked(logits, lambda x, t: _target_logprob(_scaled(x, temperature), t), targets)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """log pi(target) with autograd, never holding a float32 ``[b, t, V]``: the forward runs the no-autograd
    path's per-chunk log-softmax (so its values are those of :func:`_per_row_chunked`, bit for bit) and
    saves only the logits it was given; the backward recomputes each chunk's softmax and writes
    d logp / d logits = (onehot(target) - softmax(x / T)) / T, chunk by chunk, in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        return _chunked_target_logprobs(logits, targets, temperature)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets = ctx.saved_tensors
        vocab, temperature = logits.shape[-1], ctx.temperature
        flat, flat_t, flat_g = logits.reshape(-1, vocab), targets.reshape(-1), grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        step = _rows_per_chunk(vocab)
        for i in range(0, flat.shape[0], step):
            g = flat_g[i:i + step, None]
            d = torch.softmax(_scaled(flat[i:i + step], temperature), dim=-1).mul_(-g)
            d.scatter_add_(-1, flat_t[i:i + step, None], g)
            grad[i:i + step] = d.div_(temperature) if temperature != 1.0 else d
        return grad.reshape(logits.shape), None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target_t | prefix) for every position, ``[b, t]``, in float32 (a log-softmax per row).

    The rows go through in chunks of ``LOGIT_CHUNK_BYTES`` of float32, so no float32 copy of all the
    logits exists, with autograd too (:class:`_ChunkedTargetLogprob`: the gradient is recomputed per
    chunk instead of being kept as a float32 ``[b, t, V]`` log-softmax). The values with and without
    autograd are the same per-row operations, bit for bit (tests/unit/test_logprob_chunks.py), so the
    first step's importance ratios are exactly 1.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _ChunkedTargetLogprob.apply(logits, targets, temperature)
    return _chunked_target_logprobs(logits, targets, temperature)


def _entropy(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the policy at every position, ``[b, t]`` (float32); without autograd (the entropy
    metric) in row chunks, as :func:`token_logprobs`."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _entropy(_scaled(logits, temperature))
    return _per_row_chunked(logits, lambda x: _entropy(_scaled(x, temperature)))


