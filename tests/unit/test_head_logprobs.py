"""dsrl.core.logprobs.head_stats: the output head fused into a tiled log-softmax, against float64.

- values (log-prob, entropy, target gap) and gradients with respect to the hidden states, the weight and the
  bias, with a temperature, for every chunking (one row, uneven chunks, one chunk), float32 and bfloat16;
- the no-grad path gives the autograd path's values bit for bit; the logits path (logit_stats) gives the same
  values as the fused head on the same logits' rows;
- the vocabulary-parallel variant on 2 gloo ranks (uneven shards) equals the unsharded float64 reference,
  forward and backward;
- planted bugs fail the same assertions: an off-by-one chunk boundary, the entropy taken from the wrong logits,
  a missing all-reduce (of the sums, of the hidden states' gradient).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.core import logprobs as lp

N, H, V = 13, 8, 50
TOL = 1e-6


def _data(seed: int = 0, bias: bool = True, n: int = N, vocab: int = V):
    """Inputs exactly representable in float32 (the reference sees what the float32 path sees)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).double()
    weight = torch.randn(vocab, H, generator=g).double()
    b = torch.randn(vocab, generator=g).double() if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_logp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, g_logp, g_ent


def _reference(hidden, weight, bias, targets, temperature):
    """float64: (log-prob, entropy, gap) from the definition."""
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    x = logits / temperature
    logp = torch.log_softmax(x, -1)
    lp_t = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    gap = x.max(-1).values - x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp_t, ent, gap


def _leaves(*ts, dtype=torch.float32):
    return [None if t is None else t.detach().to(dtype).clone().requires_grad_(True) for t in ts]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30)) if b.numel() else 0.0


def _check_against_reference(chunk_bytes, temperature, dtype, monkeypatch, bias=True):
    monkeypatch.setattr(lp, "LOGIT_CHUNK_BYTES", chunk_bytes)
    hidden, weight, b, targets, g_logp, g_ent = _data(bias=bias)
    h, w, bb = _leaves(hidden, weight, b, dtype=dtype)
    stats = lp.head_stats(h, w, targets, bb, temperature=temperature, entropy_grad=True)
    assert stats.dtype == torch.float32 and stats.shape == (N, lp.STATS)
    loss = (stats[:, lp.LOGPROB] * g_logp.float()).sum() + (stats[:, lp.ENTROPY] * g_ent.float()).sum()
    loss.backward()
    rh, rw, rb = _leaves(hidden, weight, b, dtype=torch.float64)
    ref_lp, ref_ent, ref_gap = _reference(rh, rw, rb, targets, temperature)
    ((ref_lp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    errors = {"logp": _rel(stats[:, lp.LOGPROB], ref_lp), "entropy": _rel(stats[:, lp.ENTROPY], ref_ent),
              "gap": _rel(stats[:, lp.TARGET_GAP], ref_gap),
              "grad_hidden": _rel(h.grad, rh.grad), "grad_weight": _rel(w.grad, rw.grad)}
    if bias:
        errors["grad_bias"] = _rel(bb.grad, rb.grad)
    assert h.grad.dtype == w.grad.dtype == dtype
    return errors, stats


CHUNKINGS = [8 * V, 8 * V * 5, 1 << 28]  # one row (one column in the backward), 5 rows (uneven: 13 = 5+5+3), all


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", CHUNKINGS)
def test_values_and_gradients_equal_float64(monkeypatch, chunk_bytes, temperature):
    errors, stats = _check_against_reference(chunk_bytes, temperature, torch.float32, monkeypatch)
    assert max(errors.values()) <= TOL, errors
    assert (stats[:, lp.TARGET_GAP] >= 0).all()


def test_without_bias_and_in_bfloat16(monkeypatch):
    errors, _ = _check_against_reference(8 * V * 5, 0.7, torch.float32, monkeypatch, bias=False)
    assert max(errors.values()) <= TOL, errors
    errors, _ = _check_against_reference(8 * V * 5, 0.7, torch.bfloat16, monkeypatch)
    assert max(errors.values()) <= 3e-2, errors  # the head's matmul runs in bfloat16, as the model's would


@pytest.mark.parametrize("chunk_bytes", CHUNKINGS)
def test_no_grad_path_is_the_autograd_path_bitwise(monkeypatch, chunk_bytes):
    monkeypatch.setattr(lp, "LOGIT_CHUNK_BYTES", chunk_bytes)
    hidden, weight, b, targets, *_ = _data()
    for dtype in (torch.float32, torch.bfloat16):
        h, w, bb = _leaves(hidden, weight, b, dtype=dtype)
        with_grad = lp.head_stats(h, w, targets, bb, temperature=0.7, entropy=True)
        assert with_grad.requires_grad
        with torch.no_grad():
            plain = lp.head_stats(h, w, targets, bb, temperature=0.7, entropy=True)
        assert torch.equal(plain, with_grad.detach())
        # without the entropy, the log-probs are the same bits too (same chunking, same operations)
        lean = lp.head_stats(h.detach(), w.detach(), targets, bb.detach(), temperature=0.7)
        assert torch.equal(lean[:, lp.LOGPROB], plain[:, lp.LOGPROB]) and not lean[:, lp.ENTROPY].any()


def test_entropy_without_entropy_grad_carries_no_gradient():
    hidden, weight, b, targets, *_ = _data()
    h, w, bb = _leaves(hidden, weight, b)
    lp.head_stats(h, w, targets, bb, entropy=True)[:, lp.ENTROPY].sum().backward()
    assert not h.grad.any() and not w.grad.any()  # only the log-prob column is differentiated


def test_logit_stats_and_token_functions_agree_with_the_fused_head(monkeypatch):
    monkeypatch.setattr(lp, "LOGIT_CHUNK_BYTES", 8 * V * 5)
    hidden, weight, b, targets, g_logp, g_ent = _data()
    h, w = hidden.float(), weight.float()
    logits = torch.nn.functional.linear(h, w, b.float())
    fused = lp.head_stats(h, w, targets, b.float(), temperature=0.7, entropy=True)
    from_logits = lp.logit_stats(logits, targets, 0.7, entropy=True)
    # the same per-chunk operations; the head's matmul on 5-row chunks may round differently from one on 13 rows
    assert _rel(fused, from_logits) <= TOL
    assert torch.equal(lp.token_logprobs(logits, targets, 0.7), from_logits[:, lp.LOGPROB])
    assert torch.equal(lp.token_entropy(logits, 0.7), from_logits[:, lp.ENTROPY])
    x = logits.detach().clone().requires_grad_(True)
    out = lp.logit_stats(x, targets, 0.7, entropy_grad=True)
    ((out[:, lp.LOGPROB] * g_logp.float()).sum() + (out[:, lp.ENTROPY] * g_ent.float()).sum()).backward()
    y = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(y / 0.7, -1)
    ref_lp, ref_ent = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((ref_lp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    assert _rel(x.grad, y.grad) <= TOL
    assert torch.equal(out.detach(), from_logits)  # the autograd path: the same bits


def test_empty_selection_gives_zero_gradients():
    _, weight, b, _, _, _ = _data()
    h = torch.zeros(0, H, requires_grad=True)
    w, bb = _leaves(weight, b)
    out = lp.head_stats(h, w, torch.zeros(0, dtype=torch.long), bb, entropy_grad=True)
    assert out.shape == (0, lp.STATS)
    out.sum().backward()
    assert w.grad is not None and not w.grad.any() and not bb.grad.any()


# -- planted bugs: the same assertions fail ------------------------------------------------------------------
def _off_by_one_chunks(monkeypatch):
    """Chunk i covers rows [i*step, i*step + step - 1): one row per chunk is never computed."""
    real = lp._head_forward

    def buggy(hidden, weight, bias, targets, temperature, entropy, shard):
        out, m, s = real(hidden, weight, bias, targets, temperature, entropy, shard)
        step = lp._rows_per_chunk(weight.shape[0])
        for i in range(step - 1, hidden.shape[0], step):
            out[i] = 0.0
        return out, m, s

    monkeypatch.setattr(lp, "_head_forward", buggy)


def _entropy_of_wrong_logits(monkeypatch):
    """Each row's entropy taken from its neighbour's logits (sum p log p of the wrong row)."""
    real = lp._chunk_stats

    def buggy(x, local, owned, entropy, group):
        m, t, s, ez = real(x, local, owned, entropy, group)
        return m, t, s, (ez.roll(1, 0) * s.roll(-1, 0).roll(1, 0) / s.roll(1, 0) if ez is not None else None)

    monkeypatch.setattr(lp, "_chunk_stats", buggy)


@pytest.mark.parametrize("plant", [_off_by_one_chunks, _entropy_of_wrong_logits])
def test_planted_bugs_fail(monkeypatch, plant):
    plant(monkeypatch)
    errors, _ = _check_against_reference(8 * V * 5, 0.7, torch.float32, monkeypatch)
    assert max(errors.values()) > 1e-3, errors


# -- vocabulary-parallel, 2 gloo ranks -----------------------------------------------------------------------
SHARDS = (27, 23)  # uneven: rank 0 holds ids 0..26, rank 1 ids 27..49


def _vocab_parallel_case(rank: int, plant: str | None) -> dict:
    """One case on this rank: the errors against float64 with ``plant`` (a missing all-reduce) in place."""
    real = dist.all_reduce

    def planted(t, op=dist.ReduceOp.SUM, group=None):
        sums = op == dist.ReduceOp.SUM and t.dim() == 2 and t.shape[1] != H  # [2 or 3, rows]: the chunk's sums
        grad = op == dist.ReduceOp.SUM and t.dim() == 2 and t.shape[1] == H  # [n, H]: the hidden states' gradient
        if (plant == "no_sum_all_reduce" and sums) or (plant == "no_grad_all_reduce" and grad):
            return None
        return real(t, op=op, group=group)

    lp.dist.all_reduce = planted
    try:
        hidden, weight, b, targets, g_logp, g_ent = _data(seed=3)
        start = sum(SHARDS[:rank])
        mine = slice(start, start + SHARDS[rank])
        h, w, bb = _leaves(hidden, weight[mine], b[mine])
        shard = lp.VocabShard(dist.group.WORLD, start, max(SHARDS))
        stats = lp.head_stats(h, w, targets, bb, temperature=0.7, entropy_grad=True, shard=shard)
        ((stats[:, lp.LOGPROB] * g_logp.float()).sum() + (stats[:, lp.ENTROPY] * g_ent.float()).sum()).backward()
        with torch.no_grad():
            plain = lp.head_stats(h, w, targets, bb, temperature=0.7, entropy=True, shard=shard)
    finally:
        lp.dist.all_reduce = real
    rh, rw, rb = _leaves(hidden, weight, b, dtype=torch.float64)
    ref_lp, ref_ent, ref_gap = _reference(rh, rw, rb, targets, 0.7)
    ((ref_lp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    return {"logp": _rel(stats[:, lp.LOGPROB], ref_lp), "entropy": _rel(stats[:, lp.ENTROPY], ref_ent),
            "gap": _rel(stats[:, lp.TARGET_GAP], ref_gap), "grad_hidden": _rel(h.grad, rh.grad),
            "grad_weight": _rel(w.grad, rw.grad[mine]), "grad_bias": _rel(bb.grad, rb.grad[mine]),
            "bitwise": bool(torch.equal(plain, stats.detach()))}


PLANTS = (None, "no_sum_all_reduce", "no_grad_all_reduce")


def _vocab_parallel_worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    lp.LOGIT_CHUNK_BYTES = 8 * max(SHARDS) * 4  # 4 rows per forward chunk: 13 = 4+4+4+1
    try:
        out[rank] = {str(plant): _vocab_parallel_case(rank, plant) for plant in PLANTS}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def vocab_parallel() -> dict:
    """Every case on 2 forked gloo ranks (one start: starting processes is the slow part; forked, they need not
    import torch again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("fork").Manager().dict()
    mp.start_processes(_vocab_parallel_worker, args=(port, out), nprocs=2, join=True, start_method="fork")
    return dict(out)


def test_vocab_parallel_on_two_ranks_equals_float64(vocab_parallel):
    for rank in (0, 1):
        r = dict(vocab_parallel[rank]["None"])
        assert r.pop("bitwise"), r
        assert max(r.values()) <= TOL, (rank, r)


@pytest.mark.parametrize("plant,broken", [("no_sum_all_reduce", "logp"), ("no_grad_all_reduce", "grad_hidden")])
def test_vocab_parallel_missing_all_reduce_fails(vocab_parallel, plant, broken):
    assert all(vocab_parallel[rank][plant][broken] > 1e-2 for rank in (0, 1)), vocab_parallel
