"""Per-token log-probs and entropy of a causal LM in tiles, without full-vocabulary logits.

One per-chunk computation behind every path, so that on the same input the no-grad pass (old and
reference log-probs) and the autograd pass (the training step) agree bit for bit:

- :func:`head_stats` fuses the output head in: from the hidden states of the selected positions
  ``[n, H]`` and the head's weight ``[V, H]`` (and bias) it makes the logits of at most one chunk of
  rows at a time, turns each chunk into its per-row statistics and drops it. With autograd the
  backward recomputes the logits, one vocabulary block at a time, and returns the gradients of the
  hidden states, the weight and the bias. With a :class:`VocabShard` the weight is this rank's
  vocabulary shard of a vocabulary-parallel head (Megatron's output layer, DeepSpeed AutoTP's
  gathered column head): the row maxima and the sums are combined over the shard's group with two
  all-reduces per chunk, and the hidden states' gradient is all-reduced in the backward;
- :func:`logit_stats` does the same from logits a model already made (a head that is not a plain
  linear layer); :func:`token_logprobs` and :func:`token_entropy` are its two columns.

The statistics of a row, float32, in the columns of the result ``[..., STATS]``:
``LOGPROB`` = log softmax(x / T)[target], ``ENTROPY`` = -sum p log p of softmax(x / T) (0 unless asked),
``TARGET_GAP`` = max(x / T) - x[target] / T (0 exactly when the target has the largest logit; no
gradient). The entropy column carries a gradient only with ``entropy_grad``. Gradients, per row and
logit j, with p = softmax(x / T) and H the entropy: d LOGPROB / d x_j = (onehot_j - p_j) / T and
d ENTROPY / d x_j = -p_j (log p_j + H) / T.

Memory: a chunk's float32 working set (two ``[rows, V]`` buffers, forward and backward alike) stays
within ``LOGIT_CHUNK_BYTES``; the chunking depends only on the shapes, so the no-grad and the autograd
paths run the same operations on the same rows and give the same bits.

Why here and not a library's (DeepSpeed 0.19.8, transformers 5.24, megatron-core 0.16): DeepSpeed's
``TiledFusedLogitsLoss`` returns one scalar loss and runs its backward inside the forward (an RL loss needs
per-token values whose upstream gradient comes later); ``deepspeed.sequence.linear_cross_entropy`` gives
per-token cross entropy with autograd, vocabulary-parallel too, but no entropy from the same chunks and no
temperature, reads a value back to the host on every call, and is DeepSpeed's (this package imports no
DeepSpeed, and Megatron runs need the same function); transformers and megatron-core hold full logits.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The float32 working set of one chunk: rows (forward) or vocabulary columns (backward) are processed in chunks
# whose two float32 [rows, V] buffers fit in this many bytes (at V = 151,936: 55 rows per chunk).
LOGIT_CHUNK_BYTES = 1 << 26
STATS = 3
LOGPROB, ENTROPY, TARGET_GAP = range(STATS)
# The micro-batch key of the positions whose log-probs a pass computes: a [b, t] bool mask, kept on the host
# (dsrl.rl.data.batching.collate: the positions whose target is a completion token; dsrl.rl.policy.logprobs).
LOGPROB_MASK = "logprob_mask"


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary-parallel output head: the weight holds vocabulary ids
    ``[start, start + weight rows)``, the other ranks of ``group`` hold the rest. ``largest`` is the row count
    of the largest shard in the group: every rank chunks by it, so all run the same collectives. The hidden
    states (and targets) must be the same on every rank of the group, as for a column-parallel layer.
    ``group=None`` combines nothing (right only when the shard is the whole vocabulary)."""

    group: Any
    start: int
    largest: int


_DECLARED_SHARDS: weakref.WeakKeyDictionary[torch.nn.Module, VocabShard] = weakref.WeakKeyDictionary()


def declare_vocab_shard(head: torch.nn.Module, shard: VocabShard) -> None:
    """Record that ``head`` (a model's output head) holds only ``shard`` of the vocabulary: the engine that sharded
    it says so once, when it builds the model (DeepSpeed's AutoTP: :func:`dsrl.backends.deepspeed.autotp.
    declare_vocab_shard_of`), so that the log-probs of ``dsrl.rl`` compute vocabulary-parallel without knowing
    which framework sharded the head. Kept as long as the head lives."""
    _DECLARED_SHARDS[head] = shard


def declared_vocab_shard(head: torch.nn.Module) -> VocabShard | None:
    """The shard :func:`declare_vocab_shard` recorded for ``head``; None for a head that holds the whole
    vocabulary (nothing declared)."""
    return _DECLARED_SHARDS.get(head)


def _rows_per_chunk(columns: int) -> int:
    """Rows of ``columns`` logits whose two float32 buffers fit in ``LOGIT_CHUNK_BYTES`` (at least one)."""
    return max(1, LOGIT_CHUNK_BYTES // (8 * max(columns, 1)))


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x`` as a new float32 tensor divided by the temperature (never a view of the caller's tensor)."""
    x = x.to(torch.float32, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_stats(x: torch.Tensor, local: torch.Tensor, owned: torch.Tensor | None, entropy: bool,
                 group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row max m, target logit - m, sum exp(x - m), sum exp(x - m) (x - m) or None) of a float32 chunk
    ``[rows, C]`` of scaled logits, which it overwrites. ``local``: each row's target column; ``owned``: whether
    this shard holds it (None: an unsharded head). With ``group`` the four are over the whole vocabulary."""
    m = x.amax(-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = x.sub_(m.unsqueeze(-1))
    t = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    if owned is not None:
        t = torch.where(owned, t, torch.zeros_like(t))
    if entropy:
        e = torch.exp(z)
        s = e.sum(-1)
        ez = e.mul_(z).sum(-1)
    else:
        s, ez = z.exp_().sum(-1), None
    if group is not None:
        sums = torch.stack([s, t] + ([ez] if entropy else []))
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        s, t, ez = sums[0], sums[1], (sums[2] if entropy else None)
    return m, t, s, ez


def _fill(out: torch.Tensor, t: torch.Tensor, s: torch.Tensor, ez: torch.Tensor | None) -> torch.Tensor:
    """Write a chunk's LOGPROB, ENTROPY and TARGET_GAP columns into ``out`` ``[rows, STATS]``; returns log s."""
    log_s = s.log()
    out[:, LOGPROB] = t - log_s
    out[:, ENTROPY] = log_s - ez / s if ez is not None else 0.0
    out[:, TARGET_GAP] = -t
    return log_s


def _targets(targets: torch.Tensor, columns: int, shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each target's column in this rank's weight, whether this rank holds it; None when unsharded)."""
    if shard is None:
        return targets, None
    local = targets - shard.start
    owned = (local >= 0) & (local < columns)
    return local.clamp(0, columns - 1), owned


def _logit_grad(x: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, entropy: torch.Tensor | None,
                g_logp: torch.Tensor, g_entropy: torch.Tensor | None, column: torch.Tensor, hit: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
    """d loss / d logits of a float32 chunk ``x`` of scaled logits ``[rows, C]`` (overwritten): with logp_j =
    x_j - m - log s and p_j = exp(logp_j), ``(g_logp (onehot_j - p_j) - g_entropy p_j (logp_j + H)) / T``.
    ``column``: each row's target column in this chunk, ``hit``: whether it lies in the chunk (None: always)."""
    logp = x.sub_(m.unsqueeze(-1)).sub_(log_s.unsqueeze(-1))
    if g_entropy is not None:
        p = torch.exp(logp)
        coef = logp.add_(entropy.unsqueeze(-1)).mul_(g_entropy.unsqueeze(-1)).add_(g_logp.unsqueeze(-1))
        grad = p.mul_(coef).neg_()
    else:
        grad = logp.exp_().mul_(-g_logp.unsqueeze(-1))
    onehot = g_logp if hit is None else torch.where(hit, g_logp, torch.zeros_like(g_logp))
    grad.scatter_add_(-1, column.unsqueeze(-1), onehot.unsqueeze(-1))
    return grad.div_(temperature) if temperature != 1.0 else grad


# -- the output head fused in -------------------------------------------------------------------------------
def _head_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float, entropy: bool, shard: VocabShard | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stats ``[n, STATS]``, row maxima, log sums) of ``hidden @ weight.T + bias``, row chunk by row chunk."""
    compute = torch.promote_types(hidden.dtype, weight.dtype)
    hidden, weight = hidden.to(compute), weight.to(compute)
    bias = bias.to(compute) if bias is not None else None
    n, columns = hidden.shape[0], weight.shape[0]
    group = shard.group if shard is not None else None
    local, owned = _targets(targets, columns, shard)
    out = torch.empty(n, STATS, dtype=torch.float32, device=hidden.device)
    maxima, log_sums = torch.empty(n, dtype=torch.float32, device=hidden.device), torch.empty_like(out[:, 0])
    step = _rows_per_chunk(shard.largest if shard is not None else columns)
    for i in range(0, n, step):
        x = F.linear(hidden[i:i + step], weight, bias).float()  # a fresh tensor: scaled in place
        if temperature != 1.0:
            x.div_(temperature)
        m, t, s, ez = _chunk_stats(x, local[i:i + step], None if owned is None else owned[i:i + step], entropy,
                                   group)
        del x
        log_sums[i:i + step] = _fill(out[i:i + step], t, s, ez)
        maxima[i:i + step] = m
    return out, maxima, log_sums


class _HeadStats(torch.autograd.Function):
    """:func:`head_stats` with autograd. The forward is :func:`_head_forward` (so its values are the no-grad
    path's, bit for bit) and saves the hidden states, the weight, the bias and three floats per row; the
    backward recomputes the logits of one block of vocabulary columns at a time, for all rows: each block of
    the weight's gradient is one matmul, and the hidden states' gradient is summed in float32 over blocks
    (all-reduced over a shard's group: each rank saw its shard of the vocabulary only)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, entropy: bool, entropy_grad: bool,
                shard: VocabShard | None) -> torch.Tensor:
        out, maxima, log_sums = _head_forward(hidden, weight, bias, targets, temperature, entropy, shard)
        ctx.save_for_backward(hidden, weight, bias, targets, maxima, log_sums, out[:, ENTROPY].clone())
        ctx.temperature, ctx.entropy_grad, ctx.shard = temperature, entropy_grad, shard
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple[Any, ...]:
        none = (None,) * 8
        if grad_out is None:
            return none
        hidden, weight, bias, targets, maxima, log_sums, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, shard = ctx.temperature, ctx.shard
        g_logp = grad_out[:, LOGPROB].float()
        g_entropy = grad_out[:, ENTROPY].float() if ctx.entropy_grad else None
        n, columns = hidden.shape[0], weight.shape[0]
        local, owned = _targets(targets, columns, shard)
        compute = torch.promote_types(hidden.dtype, weight.dtype)
        h = hidden.to(compute)
        grad_h = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b and bias is not None else None
        width = _rows_per_chunk(n)  # vocabulary columns per block: two float32 [n, width] buffers
        for v in range(0, columns, width):
            w_block = weight[v:v + width].to(compute)
            b_block = bias[v:v + width].to(compute) if bias is not None else None
            x = F.linear(h, w_block, b_block).float()
            if temperature != 1.0:
                x.div_(temperature)
            hit = (local >= v) & (local < v + w_block.shape[0])
            if owned is not None:
                hit &= owned
            column = (local - v).clamp(0, w_block.shape[0] - 1)
            g = _logit_grad(x, maxima, log_sums, entropy, g_logp, g_entropy, column, hit, temperature)
            if grad_b is not None:
                grad_b[v:v + width] = g.sum(0)
            g = g.to(compute)
            if grad_w is not None:  # written in place: no second weight-sized tensor
                if grad_w.dtype == compute:
                    torch.mm(g.t(), h, out=grad_w[v:v + width])
                else:
                    grad_w[v:v + width] = g.t() @ h
            if grad_h is not None:
                if compute == torch.float32:
                    grad_h.addmm_(g, w_block)
                else:
                    grad_h.add_(g @ w_block)
        if grad_h is not None:
            if shard is not None and shard.group is not None:
                dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=shard.group)
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def head_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
               *, temperature: float = 1.0, entropy: bool = False, entropy_grad: bool = False,
               shard: VocabShard | None = None) -> torch.Tensor:
    """Per-row statistics ``[n, STATS]`` (module docstring) of the logits ``hidden @ weight.T + bias`` divided by
    ``temperature``, for the targets ``[n]``, without ever holding more than one chunk of those logits.

    ``hidden`` ``[n, H]`` and ``weight`` ``[V, H]`` (a linear output head's) are multiplied in their promoted
    dtype, as the head would; ``entropy`` fills the ENTROPY column (a second float32 buffer per chunk),
    ``entropy_grad`` lets a gradient flow from it. With autograd (grad mode on and any input requiring grad)
    the gradients reach ``hidden``, ``weight`` and ``bias``; either way the values are the same bits.
    ``shard``: the weight is this rank's part of a vocabulary-parallel head (:class:`VocabShard`).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"head_stats needs hidden [n, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"head_stats needs one target per row of hidden {tuple(hidden.shape)}, got "
                         f"{tuple(targets.shape)}")
    entropy = entropy or entropy_grad
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _HeadStats.apply(hidden, weight, bias, targets, temperature, entropy, entropy_grad, shard)
    with torch.no_grad():
        return _head_forward(hidden, weight, bias, targets, temperature, entropy, shard)[0]


# -- from logits the model made -----------------------------------------------------------------------------
def _logits_forward(flat: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stats ``[n, STATS]``, row maxima, log sums) of logits rows ``[n, V]``, row chunk by row chunk."""
    n = flat.shape[0]
    out = torch.empty(n, STATS, dtype=torch.float32, device=flat.device)
    maxima, log_sums = torch.empty(n, dtype=torch.float32, device=flat.device), torch.empty_like(out[:, 0])
    step = _rows_per_chunk(flat.shape[1])
    for i in range(0, n, step):
        m, t, s, ez = _chunk_stats(_scaled(flat[i:i + step], temperature), targets[i:i + step], None, entropy, None)
        log_sums[i:i + step] = _fill(out[i:i + step], t, s, ez)
        maxima[i:i + step] = m
    return out, maxima, log_sums


class _LogitStats(torch.autograd.Function):
    """:func:`logit_stats` with autograd: the forward is :func:`_logits_forward` and saves only the logits it was
    given (and three floats per row); the backward recomputes each row chunk's softmax and writes the logits'
    gradient chunk by chunk, in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                entropy_grad: bool) -> torch.Tensor:
        out, maxima, log_sums = _logits_forward(flat, targets, temperature, entropy)
        ctx.save_for_backward(flat, targets, maxima, log_sums, out[:, ENTROPY].clone())
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple[Any, ...]:
        if grad_out is None:
            return None, None, None, None, None
        flat, targets, maxima, log_sums, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        g_logp = grad_out[:, LOGPROB].float()
        g_entropy = grad_out[:, ENTROPY].float() if ctx.entropy_grad else None
        grad = torch.empty_like(flat)
        step = _rows_per_chunk(flat.shape[1])
        for i in range(0, flat.shape[0], step):
            r = slice(i, i + step)
            grad[r] = _logit_grad(_scaled(flat[r], temperature), maxima[r], log_sums[r], entropy[r], g_logp[r],
                                  None if g_entropy is None else g_entropy[r], targets[r], None, temperature)
        return grad, None, None, None, None


def logit_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, entropy: bool = False,
                entropy_grad: bool = False) -> torch.Tensor:
    """Per-position statistics ``[..., STATS]`` (module docstring) of logits ``[..., V]`` for ``targets``
    ``[...]``, in row chunks: no float32 copy of all the logits, with autograd too (the backward recomputes each
    chunk's softmax instead of keeping a float32 log-softmax). Same values with and without autograd."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    if targets.shape != shape:
        raise ValueError(f"logit_stats needs one target per row of logits {tuple(logits.shape)}, got "
                         f"{tuple(targets.shape)}")
    flat, flat_t = logits.reshape(-1, vocab), targets.reshape(-1)
    entropy = entropy or entropy_grad
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _LogitStats.apply(flat, flat_t, temperature, entropy, entropy_grad)
    else:
        with torch.no_grad():
            out = _logits_forward(flat, flat_t, temperature, entropy)[0]
    return out.reshape(*shape, STATS)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target_t | prefix) for every position, ``[b, t]``, float32, from logits ``[b, t, V]``
    (:func:`logit_stats`' LOGPROB column; with autograd when the logits require grad)."""
    return logit_stats(logits, targets, temperature)[..., LOGPROB]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the policy at every position, ``[b, t]``, float32, from logits ``[b, t, V]``
    (:func:`logit_stats`' ENTROPY column; with autograd when the logits require grad)."""
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    grad = torch.is_grad_enabled() and logits.requires_grad
    return logit_stats(logits, targets, temperature, entropy=True, entropy_grad=grad)[..., ENTROPY]
