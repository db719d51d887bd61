"""The cb rollout backend (transformers continuous batching): greedy completions equal the hf backend's
(``generate``), sampled first tokens follow the policy's tempered/filtered distribution (a chi-square
check that rejects a wrong temperature), results are reproducible from the seed without touching the
caller's RNG, and every call restores the model (mode, attention, hooks) and leaves no thread or cache
behind, also when generation fails. ``rollout.backend = "auto"`` follows its documented rule."""

from __future__ import annotations

import gc
import math
import threading
import types

import pytest
import torch

from dsrl.config import ModelConfig, RolloutConfig
from dsrl.rl.policy.model import build_model
from dsrl.rollout import make_backend
from dsrl.rollout.auto import CPU_SMALL_MODEL_MAX_CB_CONCURRENCY, CPU_SMALL_MODEL_PARAMETERS, AutoRolloutBackend
from dsrl.rollout.cb import DENSE_MASK_BUDGET_BYTES, CallBounds, ContinuousBatchingBackend, cache_geometry
from dsrl.rollout.hf import HFRolloutBackend

PAD, BOS, EOS = 0, 1, 2
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
PROMPTS = [[BOS, 5, 6, 7, 3, 4], [BOS, 4], [BOS, 3, 5, 3], [BOS], [BOS, 7, 7, 6, 5, 4, 3, 6, 5]]


def tiny(arch: str = "qwen2", vocab: int = 32, seed: int = 0, **kwargs) -> torch.nn.Module:
    return build_model(ModelConfig(arch=arch, **kwargs), vocab, PAD, BOS, EOS, on_gpu=False, seed=seed)


def rollout(**kw) -> RolloutConfig:
    # Greedy (temperature 0) is not a valid run-file setting; the backends still support it for tests.
    return RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=10).model_dump(), **kw})


def as_tuples(cs) -> list[tuple]:
    return [(c.prompt_index, tuple(c.completion_ids), c.finished) for c in cs]


@pytest.mark.parametrize("arch,eos_at", [("llama", 5), ("qwen2", 7)])
def test_greedy_completions_equal_generate(arch, eos_at):
    """Several prompt lengths, G = 3, fewer concurrent sequences than requests (refills), on a model whose
    eos logit is boosted so greedy decoding ends some completions: with max_new_tokens 10 completions end
    at an eos inside the limit or are truncated; with max_new_tokens = eos_at one ends with eos exactly at
    the limit. Tokens, finished flags and log-probs (greedy: raw logits) equal the hf backend's."""
    model = tiny(arch, tiny={"tie_word_embeddings": False})
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 8.0
    for max_new in (10, eos_at):
        cfg = rollout(temperature=0.0, max_new_tokens=max_new, generation_batch_size=2)
        expect = HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=0)
        got = ContinuousBatchingBackend(model, TOK, cfg).generate(PROMPTS, 3, seed=5)
        assert as_tuples(got) == as_tuples(expect) and model.training
        ends = {(c.finished, len(c.completion_ids) == max_new) for c in got}
        assert (False, True) in ends  # truncated at the limit
        assert ((True, False) if max_new == 10 else (True, True)) in ends  # eos inside / exactly at the limit
        for a, b in zip(got, expect):
            torch.testing.assert_close(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs),
                                       atol=1e-5, rtol=0)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The next-token distribution the policy defines: logits / T, then top-k, then top-p (smallest set of
    most likely tokens whose mass reaches top_p), renormalised. Float64, written from the definitions."""
    z = logits.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k > 0:
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1.0:
        p = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
        order = torch.argsort(p, descending=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        nucleus = torch.zeros_like(keep)
        nucleus[order[mass_before < top_p]] = True
        keep &= nucleus
    return torch.softmax(z.masked_fill(~keep, -math.inf), -1)


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> bool:
    """Pearson's test of observed counts against probabilities at level alpha (cells with an expected count
    under 5 pooled; a draw outside the support rejects outright). Critical value: Wilson-Hilferty."""
    n = counts.sum().item()
    if counts[probs == 0].sum() > 0:
        return True
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big & (probs > 0)].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = len(exp) - 1
    z = {1e-3: 3.0902}[alpha]
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8)])
def test_sampled_first_tokens_follow_the_policy(temperature, top_k, top_p):
    """N = 3000 first tokens of one prompt, from each backend: their counts pass a chi-square test against
    the policy's distribution at alpha = 1e-3 (df = support cells - 1: 4-15 here), while the same counts fail it
    against the distribution with a 1.5x too high temperature (the check has the power to catch a
    sampler that ignores or misapplies the temperature)."""
    model = tiny("qwen2", vocab=16, tiny={"tie_word_embeddings": False})
    with torch.no_grad():  # spread the logits to a std of 1.5 (random init: ~0.1) so the settings matter
        ids = torch.tensor([PROMPTS[0]])
        model.lm_head.weight.mul_(1.5 / model.eval()(input_ids=ids).logits[0, -1].std())
        logits = model(input_ids=ids).logits[0, -1]
    model.train()
    policy = reference_probs(logits, temperature, top_k, top_p)
    wrong = reference_probs(logits, 1.5 * temperature, top_k, top_p)
    cfg = rollout(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    for backend in (ContinuousBatchingBackend(model, TOK, cfg), HFRolloutBackend(model, TOK, cfg)):
        first = [c.completion_ids[0] for c in backend.generate([PROMPTS[0]], 3000, seed=11)]
        counts = torch.bincount(torch.tensor(first), minlength=16)
        assert not chi_square_rejects(counts, policy), (type(backend).__name__, counts, policy * 3000)
        assert chi_square_rejects(counts, wrong), type(backend).__name__


def test_reproducible_rng_untouched_state_restored_nothing_leaked():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    model = tiny("llama", attn_implementation="eager")  # continuous batching runs it as paged|eager
    be = ContinuousBatchingBackend(model, TOK, rollout(generation_batch_size=2))
    threads, hooks = threading.active_count(), len(model._forward_pre_hooks)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = be.generate(PROMPTS, 3, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is untouched
    assert model.training and model.config._attn_implementation == "eager"
    assert as_tuples(be.generate(PROMPTS, 3, seed=7)) == as_tuples(first)
    assert as_tuples(be.generate(PROMPTS, 3, seed=8)) != as_tuples(first)
    model.eval()
    model.generation_config.top_k = 1  # the model's own sampling defaults are ignored
    model.generation_config.repetition_penalty = 50.0
    for _ in range(5):
        assert as_tuples(be.generate(PROMPTS, 3, seed=7)) == as_tuples(first)
    assert not model.training
    assert threading.active_count() == threads and len(model._forward_pre_hooks) == hooks
    kept = lambda: [o for o in gc.get_objects() if isinstance(o, (ContinuousBatchProcessor, PagedAttentionCache))]  # noqa: E731
    gc.collect()
    assert len(kept()) == 2 and (be.calls, be.managers_built) == (8, 1)  # one manager served every call
    assert not hasattr(model, "_cached_continuous_batching_manager")  # kept by the backend, not on the model
    be.close()  # its cache and batch processor go with it
    gc.collect()
    assert not kept()
    assert be.generate([], 3, seed=0) == []
    with pytest.raises(ValueError, match="empty"):
        be.generate([[]], 1, seed=0)


def test_failure_inside_generation_raises_and_cleans_up():
    model = tiny()
    be = ContinuousBatchingBackend(model, TOK, rollout())
    threads = threading.active_count()

    def boom(module, args, output):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("injected failure")

    handle = model.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        be.generate(PROMPTS, 2, seed=0)
    handle.remove()
    assert threading.active_count() == threads and model.training and not model._forward_pre_hooks
    assert len(be.generate(PROMPTS, 2, seed=0)) == 2 * len(PROMPTS)  # the next call works


def test_cache_geometry_bounds():
    # default: every request fits at full length, one sequence per request per forward
    g = cache_geometry([5, 9, 3], 4, 100, generation_batch_size=64, dense_mask=True)
    assert g.max_requests_per_batch == 12 and g.num_blocks * g.page_size >= 12 * (9 + 100) and g.page_size == 32
    # fewer concurrent prompts: C = generation_batch_size * G
    assert cache_geometry([5] * 10, 8, 50, generation_batch_size=2, dense_mask=True).max_requests_per_batch == 16
    # dense mask under budget even with thousands of long sequences; flash: no mask, 256-token pages
    big = cache_geometry([200] * 64, 16, 4096, generation_batch_size=64, dense_mask=True)
    cached = big.num_blocks * big.page_size
    assert big.max_batch_tokens * (cached + big.max_batch_tokens) * 4 <= DENSE_MASK_BUDGET_BYTES
    assert big.max_batch_tokens >= big.max_requests_per_batch >= 1 and cached >= big.max_requests_per_batch * 4296
    flash = cache_geometry([200] * 64, 16, 4096, generation_batch_size=64, dense_mask=False)
    assert flash.page_size == 256 and flash.max_requests_per_batch == 1024


def test_make_backend_cb_and_auto():
    """make_backend builds cb and auto; auto runs the backend its rule picks for the call (the rule itself:
    tests/unit/test_auto_backend.py), cb's completions when it picks cb, and hf where continuous batching is
    unavailable."""
    model = tiny()
    assert isinstance(make_backend(RolloutConfig(backend="cb"), model, TOK), ContinuousBatchingBackend)
    cfg = rollout(backend="auto", generation_batch_size=16, max_new_tokens=64)
    auto = make_backend(cfg, model, TOK)
    assert isinstance(auto, AutoRolloutBackend) and auto.num_params < CPU_SMALL_MODEL_PARAMETERS
    assert auto.choose(40, 16) is auto.cb and auto.decision(40, 16).backend == "cb"
    dense = make_backend(rollout(backend="auto", generation_batch_size=16, cb_attention="model", max_new_tokens=64),
                         model, TOK)
    limit = CPU_SMALL_MODEL_MAX_CB_CONCURRENCY  # the dense mask on a small model above this C: hf
    assert dense.choose(40, limit // 16) is dense.cb and dense.choose(40, limit // 16 + 1) is dense.hf
    short = make_backend(rollout(backend="auto", generation_batch_size=16, max_new_tokens=8), model, TOK)
    assert short.choose(40, 16) is short.hf  # a short call on a tiny model
    bounds = CallBounds(sequences=256, sequence_tokens=80)  # the run's largest call decides for every call
    bounded = make_backend(cfg, model, TOK, bounds=bounds)
    assert bounded.choose(len(PROMPTS), 2) is bounded.cb
    assert as_tuples(bounded.generate(PROMPTS, 2, seed=3)) == as_tuples(
        ContinuousBatchingBackend(model, TOK, cfg, bounds=bounds).generate(PROMPTS, 2, seed=3))
    not_hf = AutoRolloutBackend(torch.nn.Linear(2, 2), TOK, cfg)  # no continuous batching: always hf
    assert not_hf.cb is None and not_hf.choose(1, 1) is not_hf.hf


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.3, 5, 0.9)])
def test_cb_behavior_logprobs_are_the_sampling_distributions(temperature, top_k, top_p):
    """Continuous batching's behavior log-probs are the sampler's: log of each token's probability after
    temperature, top-k and top-p, equal to an unpadded forward's (the same definition as the hf backend's)."""
    from test_models_rollout import processed_logprobs

    model = tiny("qwen2")
    cs = ContinuousBatchingBackend(model, TOK, rollout(temperature=temperature, top_k=top_k, top_p=top_p)
                                   ).generate(PROMPTS, 3, seed=2)
    model.eval()
    for c in cs:
        assert len(c.behavior_logprobs) == len(c.completion_ids)
        want = processed_logprobs(model, c, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(c.behavior_logprobs), want, atol=1e-4, rtol=0)


def test_a_transformers_without_the_config_cb_sets_is_refused_by_name(monkeypatch):
    """transformers 5.16-5.18 (ContinuousBatchingConfig without page_size or auto_switch_to_flash, and another
    paged-cache interface): cb refuses at construction naming the version it needs; auto falls back to hf."""
    import sys

    class Config518:  # transformers 5.18's arguments that dsrl sets: no auto_switch_to_flash
        def __init__(self, page_size=256, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None,
                     return_logprobs=False, seed=None, scheduler_type="fifo", disable_nccl_graph_mixing=True):
            pass

    model = tiny()  # first: building a model may put a fresh transformers module into sys.modules
    monkeypatch.setattr(sys.modules["transformers"], "ContinuousBatchingConfig", Config518, raising=False)
    with pytest.raises(ImportError, match=r"transformers >= 5\.19.*has no auto_switch_to_flash"):
        ContinuousBatchingBackend(model, TOK, rollout())
    auto = make_backend(rollout(backend="auto"), model, TOK)
    assert auto.cb is None and auto.choose(len(PROMPTS), 2) is auto.hf


@pytest.mark.parametrize("planted", [None, "no_prefix_reset"])
def test_a_kept_manager_sees_every_optimizer_step(planted, monkeypatch):
    """One manager (paged cache, batch processor; on a GPU its CUDA graphs) serves every call of a run: greedy
    completions equal ``generate``'s after each of several optimizer steps, with prompts longer than a cache page,
    so a prefix cached under earlier weights would be reused if the kept cache were not emptied at each call (the
    planted case keeps it and must fail). With :class:`CallBounds` every call has one geometry, whatever its
    number of prompts or their lengths."""
    model = tiny("qwen2", tiny={"tie_word_embeddings": False})
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4.0
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    long_prompts = [[BOS] + [3 + (7 * i + j) % 29 for j in range(40 + 3 * i)] for i in range(3)]
    cfg = rollout(temperature=0.0, max_new_tokens=6, generation_batch_size=4, cb_attention="model")
    cb = ContinuousBatchingBackend(model, TOK, cfg, bounds=CallBounds(sequences=8, sequence_tokens=64))
    hf = HFRolloutBackend(model, TOK, cfg)
    if planted == "no_prefix_reset":
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        monkeypatch.setattr(PagedAttentionCache, "reset", lambda self: self.free_all_requests())
    differs = []
    for step in range(4):
        prompts = long_prompts[: 1 + step % 3]
        differs.append(as_tuples(cb.generate(prompts, 2, seed=step)) != as_tuples(hf.generate(prompts, 2, seed=0)))
        batch = torch.tensor([long_prompts[step % 3]])  # an optimizer step that changes every next greedy token
        loss = -torch.log_softmax(model(input_ids=batch).logits[0, -1], -1)[(step * 5) % 32]
        opt.zero_grad()
        loss.backward()
        opt.step()
    cb.close()
    assert (cb.calls, cb.managers_built) == (4, 1)
    assert any(differs) if planted else not any(differs), differs


def test_with_the_offload_cb_releases_its_cache_after_each_rollout_and_samples_alike():
    """memory.offload_states: sleep() after a rollout's generation destroys the kept manager (its paged cache and
    graphs leave the device through training); the next call builds a new one and samples exactly what a kept
    manager samples with the same seed. Without the setting sleep() keeps it (the planted counterpart)."""
    model = tiny()
    bounds = CallBounds(8, 32)
    released = ContinuousBatchingBackend(model, TOK, rollout(temperature=1.0), bounds=bounds,
                                         release_between_calls=True)
    kept = ContinuousBatchingBackend(model, TOK, rollout(temperature=1.0), bounds=bounds)
    try:
        for seed in (3, 4):
            a = released.generate(PROMPTS[:3], 2, seed=seed)
            b = kept.generate(PROMPTS[:3], 2, seed=seed)
            assert as_tuples(a) == as_tuples(b)
            released.sleep()
            kept.sleep()
            assert released._session is None and kept._session is not None
        assert (released.calls, released.managers_built) == (2, 2) and (kept.calls, kept.managers_built) == (2, 1)
        auto = make_backend(rollout(backend="auto"), model, TOK, bounds=bounds, release_between_calls=True)
        assert auto.cb is not None and auto.cb.release_between_calls
    finally:
        released.close()
        kept.close()
