"""dsrl's packed attention for continuous batching (``rollout.cb_attention = "varlen"``).

The padded reference equals causal attention computed one sequence at a time in float64 (grouped query
heads, queries that are the tail of their keys, padding rows past the last sequence); on a GPU the
PyTorch flash path equals the reference; greedy continuous batching under it gives exactly
``generate``'s tokens; the setting resolves as documented and the model's attention is restored after
every call, also when generation fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_rollout_cb import EOS, PROMPTS, TOK, as_tuples, rollout, tiny

from dsrl.rollout.cb import (
    CPU_VARLEN_MIN_CONCURRENCY,
    CPU_VARLEN_MIN_PARAMETERS,
    ContinuousBatchingBackend,
    cb_attention_implementation,
)
from dsrl.rollout.hf import HFRolloutBackend
from dsrl.rollout.varlen_attention import VARLEN_ATTENTION, cuda_flash_available, varlen_attention_forward

CUDA_FLASH = pytest.mark.skipif(not cuda_flash_available(), reason="needs a CUDA GPU of compute capability >= 8")


def packed_case(q_lens: list[int], k_lens: list[int], heads: int, kv_heads: int, dim: int, pad_rows: int,
                dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens) + pad_rows, sum(k_lens)
    q = torch.randn(1, heads, tq, dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, tk, dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, tk, dim, generator=g).to(device, dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)  # noqa: E731
    kwargs = dict(cu_seq_lens_q=cu(q_lens), cu_seq_lens_k=cu(k_lens), max_length_q=max(q_lens),
                  max_length_k=max(k_lens))
    return q, k, v, kwargs


def per_sequence_reference(q, k, v, q_lens, k_lens, scale, window=None) -> torch.Tensor:
    """Causal attention of each sequence on its own, float64: query i attends keys 0..(k_len - q_len + i),
    and with a sliding window W only the last W of those."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[2], heads, v.shape[-1], dtype=torch.float64)
    oq = ok = 0
    for lq, lk in zip(q_lens, k_lens):
        qs = q[0, :, oq:oq + lq].double().cpu()
        ks = k[0, :, ok:ok + lk].double().cpu().repeat_interleave(heads // kv_heads, 0)
        vs = v[0, :, ok:ok + lk].double().cpu().repeat_interleave(heads // kv_heads, 0)
        scores = qs @ ks.transpose(-1, -2) * scale
        pos = (lk - lq + torch.arange(lq))[:, None]
        allowed = torch.arange(lk)[None, :] <= pos
        if window is not None:
            allowed &= torch.arange(lk)[None, :] > pos - window
        out[oq:oq + lq] = (scores.masked_fill(~allowed, -math.inf).softmax(-1) @ vs).transpose(0, 1)
        oq, ok = oq + lq, ok + lk
    return out


CASES = [  # (q lengths, k lengths, heads, kv heads): decode, prefill, chunked prefill mixed with decode
    ([1, 1, 1, 1], [5, 17, 1, 9], 4, 4),
    ([6, 3, 11], [6, 3, 11], 8, 2),
    ([1, 4, 1, 7, 2], [30, 4, 2, 19, 2], 6, 3),
]


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("q_lens,k_lens,heads,kv_heads", CASES)
def test_padded_reference_is_causal_attention_per_sequence(q_lens, k_lens, heads, kv_heads, window):
    q, k, v, kw = packed_case(q_lens, k_lens, heads, kv_heads, 16, pad_rows=3, dtype=torch.float32)
    scale = 16 ** -0.5
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=scale, sliding_window=window, **kw)
    expect = per_sequence_reference(q, k, v, q_lens, k_lens, scale, window)
    assert out.shape == (1, q.shape[2], heads, 16)
    err = (out[0].double() - expect).norm() / expect.norm()
    assert err < 1e-6, err
    assert torch.all(out[0, sum(q_lens):] == 0)  # padding rows
    # a wrong alignment (causal from the top-left) or attention across sequences would be far off
    shifted = per_sequence_reference(q, k, v, q_lens, [lq for lq in q_lens], scale) if q_lens != k_lens else None
    if shifted is not None:
        assert (out[0].double() - shifted).norm() / shifted.norm() > 1e-2
    if window is not None:  # the window matters in these cases
        full = per_sequence_reference(q, k, v, q_lens, k_lens, scale)
        assert (out[0].double() - full).norm() / full.norm() > 1e-2


def test_refuses_padded_forwards():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="packed"):
        varlen_attention_forward(None, q, q, q, None)


def test_setting_resolution_and_model_attention_restored():
    """auto on the CPU: packed from 1 M parameters or 128 concurrent sequences, else the model's (the dense
    mask measured faster on the 0.1 M tiny model at C = 8-32); the settings model/varlen as named; a flash
    model kept. The backend computes C = min(prompts, generation_batch_size) * G."""
    cpu, f32 = torch.device("cpu"), torch.float32
    resolve = lambda setting, attn, params, c: cb_attention_implementation(setting, attn, cpu, f32, params, c)  # noqa: E731
    assert resolve("auto", "sdpa", CPU_VARLEN_MIN_PARAMETERS - 1, CPU_VARLEN_MIN_CONCURRENCY - 1) == "sdpa"
    assert resolve("auto", "sdpa", CPU_VARLEN_MIN_PARAMETERS - 1, CPU_VARLEN_MIN_CONCURRENCY) == VARLEN_ATTENTION
    assert resolve("auto", "eager", CPU_VARLEN_MIN_PARAMETERS, 1) == VARLEN_ATTENTION
    assert resolve("model", "sdpa", 10**9, 512) == "sdpa"
    assert resolve("varlen", "eager", 10, 1) == VARLEN_ATTENTION
    assert resolve("varlen", "flash_attention_2", 10, 1) == "flash_attention_2"
    model = tiny()
    be = ContinuousBatchingBackend(model, TOK, rollout(cb_attention="auto", generation_batch_size=16))
    assert be.attention(15, 8) == "sdpa" and be.attention(16, 8) == be.attention(40, 8) == VARLEN_ATTENTION
    be = ContinuousBatchingBackend(model, TOK, rollout(cb_attention="varlen"))
    assert be.attention(1, 1) == VARLEN_ATTENTION
    be.generate(PROMPTS, 2, seed=0)
    assert model.config._attn_implementation == "sdpa" and model.training

    def boom(module, args, output):
        raise RuntimeError("injected failure")

    handle = model.model.layers[0].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        be.generate(PROMPTS, 2, seed=0)
    handle.remove()
    assert model.config._attn_implementation == "sdpa"


SLIDING = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}  # layer 1: a 3-token window


@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("llama", {}), ("qwen2", SLIDING)])
def test_greedy_completions_equal_generate(arch, extra):
    """As tests/unit/test_rollout_cb.py, under the packed attention: tokens and finished flags equal the
    hf backend's, log-probs to 1e-5, with refills (C = 6 < 15 requests); also with a sliding-window layer
    (the window changes these completions: checked)."""
    model = tiny(arch, tiny={"tie_word_embeddings": False, **extra})
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 8.0
    cfg = rollout(temperature=0.0, max_new_tokens=10, generation_batch_size=2, cb_attention="varlen")
    expect = HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=0)
    got = ContinuousBatchingBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=5)
    assert as_tuples(got) == as_tuples(expect)
    assert {c.finished for c in got} == {True, False}
    if extra:
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
        windowless = tiny(arch, tiny={"tie_word_embeddings": False})
        with torch.no_grad():
            windowless.lm_head.weight[EOS] *= 8.0
        assert as_tuples(HFRolloutBackend(windowless, TOK, cfg).generate(PROMPTS, 3, seed=0)) != as_tuples(expect)
    for a, b in zip(got, expect):
        torch.testing.assert_close(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs),
                                   atol=1e-5, rtol=0)


@CUDA_FLASH
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("q_lens,k_lens,heads,kv_heads", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_flash_path_equals_the_reference(q_lens, k_lens, heads, kv_heads, dtype, window):
    q, k, v, kw = packed_case(q_lens, k_lens, heads, kv_heads, 64, pad_rows=0, dtype=dtype, device="cuda")
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.125, sliding_window=window, **kw)
    expect = per_sequence_reference(q, k, v, q_lens, k_lens, 0.125, window)
    err = (out[0].double().cpu() - expect).norm() / expect.norm()
    assert err < 1e-2, err  # bf16/fp16 inputs and output


@CUDA_FLASH
def test_cuda_greedy_under_graphs():
    """On a GPU continuous batching captures the packed attention in CUDA graphs: in float32 (the reference
    path, graph-safe) greedy tokens equal generate's; in bfloat16 (PyTorch's flash kernel) at least 90% of
    the completions are identical (different kernels round differently, so near-ties may flip)."""
    for dtype, least in ((torch.float32, 1.0), (torch.bfloat16, 0.9)):
        model = tiny("qwen2", tiny={"tie_word_embeddings": False}).to("cuda", dtype)
        with torch.no_grad():
            model.lm_head.weight[EOS] *= 8.0
        cfg = rollout(temperature=0.0, max_new_tokens=10, generation_batch_size=2, cb_attention="varlen")
        expect = as_tuples(HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=0))
        got = as_tuples(ContinuousBatchingBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=5))
        same = sum(a == b for a, b in zip(got, expect)) / len(got)
        assert same >= least, (dtype, same)


def test_flash_self_check_catches_a_misaligned_kernel(monkeypatch):
    """The once-per-process check before the first GPU call: a kernel with the causal mask aligned top-left
    (a real difference between flash-attn versions) is refused with the fix named; the right one passes."""
    import dsrl.rollout.varlen_attention as va

    monkeypatch.setattr(va, "uses_flash_kernel", lambda device, dtype, sliding_window=None: True)
    monkeypatch.setattr(va, "_CHECKED", set())

    def top_left(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # query i sees keys 0..i of its sequence
        first = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(cu_k[:-1], cu_q[1:] - cu_q[:-1])])
        return va._padded_reference(q, k[first], v[first], cu_q, cu_q, max_q, max_q, scale)

    monkeypatch.setattr(va, "flash_kernel", top_left)
    with pytest.raises(RuntimeError, match="rollout.cb_attention = 'model'"):
        va.check_flash_kernel(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(va, "flash_kernel", va._padded_reference)
    va.check_flash_kernel(torch.device("cpu"), torch.float32)
    assert ("cpu", torch.float32) in va._CHECKED
