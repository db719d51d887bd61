"""token_logprobs / token_entropy (dsrl.core.logprobs.logit_stats, the logits path): the chunked no-autograd path
gives the autograd path's values bit for bit, and both match a float64 log-softmax (the fused head:
tests/unit/test_head_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from dsrl.core import logprobs as loss


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", [8 * 50, 8 * 50 * 5, 1 << 28])  # one row, 5 rows (uneven), all
def test_chunked_equals_autograd_path_bitwise(batch, monkeypatch, temperature, chunk_bytes):
    logits, targets = batch
    monkeypatch.setattr(loss, "LOGIT_CHUNK_BYTES", chunk_bytes)
    with_grad = logits.clone().requires_grad_(True)
    want_lp = loss.token_logprobs(with_grad, targets, temperature)
    want_ent = loss.token_entropy(with_grad, temperature)
    assert want_lp.requires_grad and want_ent.requires_grad
    with torch.no_grad():
        got_lp = loss.token_logprobs(logits, targets, temperature)
        got_ent = loss.token_entropy(logits, temperature)
    assert got_lp.dtype == got_ent.dtype == torch.float32 and got_lp.shape == targets.shape
    assert torch.equal(got_lp, want_lp.detach()) and torch.equal(got_ent, want_ent.detach())

    ref = torch.log_softmax(logits.double() / temperature, dim=-1)
    ref_lp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert torch.allclose(got_lp.double(), ref_lp, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_ent.double(), ref_ent, rtol=1e-6, atol=1e-6)


def test_the_gradient_is_the_log_softmax_gradient(batch):
    logits, targets = batch
    x = logits.float().requires_grad_(True)
    loss.token_logprobs(x, targets).sum().backward()
    y = logits.double().requires_grad_(True)
    torch.log_softmax(y, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    assert torch.allclose(x.grad.double(), y.grad, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", [8 * 50, 8 * 50 * 5, 1 << 28])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_backward_equals_the_float64_gradient(batch, monkeypatch, temperature, chunk_bytes, dtype):
    """The autograd path recomputes the softmax per chunk in its backward: its gradient (any upstream
    weights, a temperature, uneven chunks) equals float64 autograd through log_softmax, in the logits'
    dtype; through a module the parameters get the same gradient as through the plain formula."""
    logits, targets = batch
    monkeypatch.setattr(loss, "LOGIT_CHUNK_BYTES", chunk_bytes)
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    x = logits.detach().to(dtype).clone().requires_grad_(True)
    (loss.token_logprobs(x, targets, temperature) * weights).sum().backward()
    y = logits.double().requires_grad_(True)
    ref = torch.log_softmax(y / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * weights.double()).sum().backward()
    assert x.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (x.grad.double() - y.grad).norm() / y.grad.norm() < tol

    head = torch.nn.Linear(8, 50).double()
    h = torch.randn(3, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (loss.token_logprobs(head(h), targets, temperature) * weights).sum().backward()
    got = head.weight.grad.clone()
    head.weight.grad = None
    out = torch.log_softmax(head(h) / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (out * weights.double()).sum().backward()
    assert (got - head.weight.grad).norm() / head.weight.grad.norm() < 1e-6  # token_logprobs computes in fp32
