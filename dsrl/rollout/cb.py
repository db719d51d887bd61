"""Generation with transformers' continuous batching (paged attention) on the policy itself.

The engine behind ``model.generate_batch`` (transformers 5.x): a scheduler admits sequences into a
paged KV cache and packs the active ones into one forward per step, so a finished sequence frees its
slot at once instead of riding along as padding until the longest one of a static batch ends. Same
contract as the ``hf`` backend (:mod:`dsrl.rollout.base`, :mod:`dsrl.rollout.hf`):

- calls drive one manager through transformers' manager API, the steps ``generate_batch`` takes
  (``init_continuous_batching`` -> ``warmup`` -> ``add_request`` ... -> ``start`` -> ``get_result`` ->
  ``stop``), with one difference that makes sampling reproducible: every request is queued *before* the
  generation thread starts, so the first scheduling step sees all of them whatever the thread timing
  (``generate_batch`` starts the thread first and then queues). The thread is joined before ``generate``
  returns, on every path. The manager is kept between calls with its paged cache and CUDA graphs
  (:mod:`dsrl.rollout.cb_session`: one capture per shape for the whole run, replays see the weights the
  optimizer updated in place; storage that moved, e.g. a ZeRO-3 gather, means a new manager) and the prefix
  cache emptied at every call (no key/value computed under earlier weights is reused); with
  :class:`CallBounds` (the trainer gives them) every call of a run has the same geometry. ``close()``
  destroys it, and a call that fails drops it;
- G samples of a prompt are G independent requests, each sampled on its own; completions come back
  grouped per prompt in prompt order, cut at the first eos (kept);
- reproducible from ``seed``: the cache geometry is a function of the workload (or the run's bounds) and the
  settings only (:func:`cache_geometry`, never of free memory) and the sampler's generator is seeded with
  ``seed`` at the start of every call, after any warm-up (transformers adds the data-parallel rank to its seed;
  the backend subtracts it so the result does not depend on the rank), so a call on a kept manager samples
  exactly as the first call of a resumed run on a new one. The batched sampler draws one multinomial over all
  sequences of a step, so samples differ from the ``hf`` backend's for the same seed, while greedy decoding gives
  the same tokens (up to floating-point ties; tested). The torch RNG is forked: the caller's stream is untouched;
- sampling sees only ``dsrl.rollout`` (temperature, top_p, top_k, max_new_tokens): a neutral
  ``GenerationConfig``, and the call refuses to run if transformers would apply any other logits
  processor or drop one of these (continuous batching drops processors it cannot run);
- eval mode during generation; the train/eval mode, the attention implementation (eager runs as
  ``paged|eager``) and the module's hooks are restored after. The generation thread uses the caller's
  ``torch.get_num_threads()`` (OpenMP thread counts are per thread);
- a mixture-of-experts policy's completions carry their routes (:mod:`dsrl.rollout.routes`), recorded token by
  token from the routers in continuous batching's own packed forwards: a pre-forward hook notes which request
  each packed row belongs to (the batch's requests and query lengths, in row order) and its position
  (``position_ids``); prompt positions a request took from a shared cache page (prefix sharing) get the routes
  of the request that computed that page (same prompt, same position). A manager that replays CUDA graphs (a GPU)
  runs no Python forward, so no hook: a routed call is refused there, as is asynchronous batching (rows could not
  be matched to requests);
- ZeRO-3: exactly as ``hf`` (:func:`dsrl.rollout.policy.gathered_for_generation`): one parameter gather per
  call on every rank with DeepSpeed's hooks suspended, no copy of the weights, so nothing to sync. A
  rank with no prompts still enters the gather and returns ``[]``. Under every stage DeepSpeed's engine hooks
  are out of the module for the call, so no decode step (in particular none inside a CUDA-graph capture)
  synchronizes the device.

Attention (``rollout.cb_attention``, :func:`cb_attention_implementation`): a flash implementation of the
model is kept (transformers runs it on varlen kernels with CUDA graphs and asynchronous batching);
otherwise either the model's own sdpa/eager, which transformers packs under a dense block-diagonal
``[batch tokens, cached tokens]`` mask whose size :func:`cache_geometry` bounds, or dsrl's packed
attention (:mod:`dsrl.rollout.varlen_attention`: PyTorch's own flash kernel on a GPU), set on the config
while the backend generates (restored between calls). The backend never lets transformers switch to a flash
kernel by itself (one could be fetched at run time).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import RolloutConfig
from dsrl.core.seeds import forked_torch_rng
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend, cut_at_eos
from dsrl.rollout.cb_routes import PackedRoutes
from dsrl.rollout.cb_session import Session, capture_hint, warmup_or_raise
from dsrl.rollout.hf import HFRolloutBackend
from dsrl.rollout.policy import gathered_for_generation, neutral_generation_config
from dsrl.rollout.varlen_attention import VARLEN_ATTENTION, check_flash_kernel, uses_flash_kernel
from dsrl.rollout.varlen_attention import register as register_varlen_attention

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FLASH_PAGE_SIZE = 256  # transformers' default; flash-attn's paged kernels want multiples of 256
DENSE_MASK_PAGE_SIZE = 32  # sdpa/eager: the mask grows with the cache tokens, so keep pages tight
DENSE_MASK_BUDGET_BYTES = 256 * 2**20  # at most this much for the sdpa/eager attention mask
MAX_PREFILL_TOKENS = 4096  # tokens per forward beyond one per sequence (longer prefills are chunked)
RESULT_POLL_S = 1.0  # how often the waiting thread checks that the generation thread is alive
INSTALL_HINT = ("rollout.backend = 'cb' needs transformers >= 5.19 (continuous batching's ContinuousBatchingConfig "
                "with page_size and auto_switch_to_flash; tested with 5.19.0 and 5.24.0): "
                "pip install -U 'transformers>=5.19', or use rollout.backend = 'hf'")
# every ContinuousBatchingConfig argument continuous_batching_config passes (5.16-5.17 call page_size block_size,
# 5.18 has no auto_switch_to_flash, and before 5.19 the paged cache has another interface)
CB_CONFIG_ARGUMENTS = frozenset({"page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
                                 "return_logprobs", "seed", "scheduler_type", "auto_switch_to_flash",
                                 "disable_nccl_graph_mixing"})


def is_flash(attn_implementation: str | None) -> bool:
    """Whether transformers runs this attention implementation without a dense mask (varlen kernels)."""
    return "flash" in str(attn_implementation or "")


CPU_VARLEN_MIN_PARAMETERS = 1_000_000  # cb_attention "auto" on the CPU: packed attention from this model size
CPU_VARLEN_MIN_CONCURRENCY = 128  # ... or from this many concurrent sequences


def concurrency(num_prompts: int, samples_per_prompt: int, generation_batch_size: int) -> int:
    """C: the sequences a call with this many prompts decodes at once (at most ``generation_batch_size``
    prompts' samples; :func:`cache_geometry`'s bound), at least one prompt's worth."""
    return max(1, min(num_prompts, generation_batch_size)) * samples_per_prompt


def num_parameters(module: torch.nn.Module) -> int:
    """Parameters of the full model (a ZeRO-3 partition knows its full size as ``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def cb_attention_implementation(setting: str, model_attn: str | None, device: torch.device, dtype: torch.dtype,
                                parameters: int, concurrency: int) -> str | None:
    """The attention implementation continuous batching runs under for ``rollout.cb_attention``.

    A flash implementation of the model is kept whatever the setting (transformers already packs it).
    Otherwise ``"model"`` keeps the model's own (sdpa/eager: the dense mask), ``"varlen"`` gives
    :data:`dsrl.rollout.varlen_attention.VARLEN_ATTENTION`, and ``"auto"`` gives it
    - on the CPU, for a model of at least ``CPU_VARLEN_MIN_PARAMETERS`` or at least
      ``CPU_VARLEN_MIN_CONCURRENCY`` concurrent sequences (measured faster there, docs/rollout.md; below
      both, per-step overhead dominates and the dense mask was faster);
    - on a GPU that runs PyTorch's flash kernel in this dtype (not measured: chosen because the dense mask
      was measured slower than ``generate`` there, and checked for correctness once per process);
    and keeps the model's own elsewhere. A function of the settings, model and workload only.
    """
    if is_flash(model_attn) or setting == "model":
        return model_attn
    if setting == "varlen":
        return VARLEN_ATTENTION
    if device.type == "cpu":
        big = parameters >= CPU_VARLEN_MIN_PARAMETERS or concurrency >= CPU_VARLEN_MIN_CONCURRENCY
        return VARLEN_ATTENTION if big else model_attn
    return VARLEN_ATTENTION if uses_flash_kernel(device, dtype) else model_attn


@dataclass(frozen=True)
class CacheGeometry:
    """The paged cache of one call (fields of transformers' ``ContinuousBatchingConfig``)."""

    page_size: int  # tokens per page
    num_blocks: int  # pages per layer the cache holds
    max_batch_tokens: int  # tokens per forward
    max_requests_per_batch: int  # sequences per forward: the concurrency


def cache_geometry(prompt_lengths: list[int], samples_per_prompt: int, max_new_tokens: int,
                   generation_batch_size: int, dense_mask: bool, mask_itemsize: int = 4) -> CacheGeometry:
    """The cache of one call, a function of the workload and the settings only (so scheduling, and hence
    the sampled tokens, never depend on free memory).

    Concurrency C = ``generation_batch_size * samples_per_prompt`` sequences per forward (capped by the
    number of requests), the KV memory the ``hf`` backend uses for one chunk: the cache holds C sequences
    of the longest possible length, so when one call's requests fit in C (the default
    ``generation_batch_size`` >= prompts per rank) no sequence is ever preempted. With a dense mask
    (sdpa/eager) the mask ``[batch tokens, cached tokens + batch tokens]`` is kept under
    ``DENSE_MASK_BUDGET_BYTES``: first by fewer prefill tokens per forward, then by a lower C.
    """
    requests = len(prompt_lengths) * samples_per_prompt
    longest = max(prompt_lengths) + max_new_tokens
    page = DENSE_MASK_PAGE_SIZE if dense_mask else FLASH_PAGE_SIZE
    per_seq = math.ceil(longest / page) * page  # cache tokens one sequence may need
    c = max(1, min(requests, generation_batch_size * samples_per_prompt))
    m = max(c, min(sum(prompt_lengths) * samples_per_prompt, MAX_PREFILL_TOKENS))
    if dense_mask:
        budget = DENSE_MASK_BUDGET_BYTES // mask_itemsize  # mask elements
        c = max(1, min(c, math.isqrt(budget // (per_seq + 1))))  # a decode step of C sequences: C x (C*per_seq + C)
        n = c * per_seq
        m_fit = (math.isqrt(n * n + 4 * budget) - n) // 2  # largest M with M * (n + M) <= budget
        m = max(c, min(m, m_fit))
    return CacheGeometry(page_size=page, num_blocks=c * per_seq // page, max_batch_tokens=m, max_requests_per_batch=c)


def _same_threads_hook(threads: int) -> Any:
    """A forward pre-hook that gives the generation thread the caller's intra-op thread count (OpenMP's
    count is per thread: the new thread would otherwise use the OpenMP default, e.g. all cores)."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    return hook


@contextlib.contextmanager
def _collect_only_new_objects() -> Iterator[None]:
    """Full garbage collections inside the block scan only objects created inside it.

    transformers' manager runs ``gc.collect()`` twice per generation (when it stops and when its batch
    processor is freed), meant for the cache and CUDA graphs it just created; in a training process the
    long-lived heap (torch, DeepSpeed, data) makes each ~0.3-0.5 s. ``gc.freeze`` parks the existing
    objects in the permanent generation for the block (O(1)) and ``gc.unfreeze`` returns them to the oldest
    generation after, so nothing escapes collection for longer than the call. Skipped when the process has
    frozen objects itself (unfreezing would undo that).
    """
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class CallBounds:
    """The largest call a run makes (given by the trainer from its plan and settings): at most ``sequences``
    sequences decoding at once (min(prompts per rank, ``generation_batch_size``) * G), and every sequence (prompt
    and completion; every turn of a trajectory) at most ``sequence_tokens`` tokens. With bounds, every call of the
    run has one cache geometry and one attention, so one manager (its paged cache and CUDA graphs) serves every
    rollout and every turn; a call with more sequences queues them. ``new_tokens`` (the most tokens one call adds to
    a sequence; None: ``rollout.max_new_tokens``) and ``calls_per_rollout`` (generate calls per rollout at most)
    complete the workload ``rollout.backend = "auto"`` decides from (:mod:`dsrl.rollout.auto`)."""

    sequences: int
    sequence_tokens: int
    new_tokens: int | None = None
    calls_per_rollout: int = 1

    @classmethod
    def of_run(cls, prompts_per_rank: int, samples_per_prompt: int, generation_batch_size: int,
               sequence_tokens: int, new_tokens: int | None = None, calls_per_rollout: int = 1) -> CallBounds:
        return cls(concurrency(prompts_per_rank, samples_per_prompt, generation_batch_size), sequence_tokens,
                   new_tokens, calls_per_rollout)

    def for_sampling(self, was: RolloutConfig, now: RolloutConfig) -> CallBounds:
        """These bounds for calls made with ``now``'s settings instead of ``was``'s: as many sequences, each longer by
        the change in ``max_new_tokens``."""
        return CallBounds(self.sequences, self.sequence_tokens - was.max_new_tokens + now.max_new_tokens)


class ContinuousBatchingBackend(RolloutBackend):
    """transformers continuous batching on the policy (a :class:`dsrl.RLEngine` or a plain module).

    Same constructor arguments and contract as :class:`dsrl.rollout.hf.HFRolloutBackend` (whose
    unwrapping, eos/pad resolution and generation config it reuses); ``rollout.generation_batch_size``
    bounds the prompts whose samples decode at once (:func:`cache_geometry`). ``release_between_calls``
    (``dsrl.memory.offload_states``): :meth:`sleep` destroys the kept manager after each rollout's generation, so its
    paged cache does not stay on the device through training (the next call builds a new one, CUDA graphs
    captured again).
    """

    def __init__(self, engine_or_module: GenerationPolicy, tokenizer: PreTrainedTokenizerBase,
                 rollout_cfg: RolloutConfig, bounds: CallBounds | None = None, release_between_calls: bool = False):
        try:
            import transformers
            from transformers import ContinuousBatchingConfig
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        missing = sorted(CB_CONFIG_ARGUMENTS - set(inspect.signature(ContinuousBatchingConfig).parameters))
        if missing:
            raise ImportError(f"{INSTALL_HINT} (transformers {transformers.__version__}'s ContinuousBatchingConfig "
                              f"has no {', '.join(missing)})")
        self._hf = HFRolloutBackend(engine_or_module, tokenizer, rollout_cfg)
        self.module, self.policy, self.cfg, self.eos = self._hf.module, self._hf.policy, rollout_cfg, self._hf.eos
        self.bounds, self.release_between_calls = bounds, release_between_calls
        self._num_params: int | None = None
        self._session: Session | None = None
        self._attn: str | None = self.module.config._attn_implementation if hasattr(self.module, "config") else None
        self.calls = 0  # generate calls that ran requests
        self.managers_built = 0  # of which started a new manager (a new cache, new CUDA graphs)
        if not hasattr(self.module, "init_continuous_batching"):
            raise TypeError(f"{type(self.module).__name__} is not a transformers model with continuous batching; "
                            "use rollout.backend = 'hf'")
        self.routing = self._hf.routing  # None for a dense policy

    def returns_routes(self) -> bool:
        return self.routing is not None

    def model_attention(self) -> str | None:
        """The model's own attention implementation (not the packed one a call sets while it runs)."""
        return self._attn if self._session is not None else self.module.config._attn_implementation

    def attention(self, num_prompts: int, samples_per_prompt: int) -> str | None:
        """The attention implementation a call runs under (:func:`cb_attention_implementation`), for the largest
        call of the run when the backend has :class:`CallBounds` (so every call runs under the same one)."""
        if self._num_params is None:
            self._num_params = num_parameters(self.module)
        c = concurrency(num_prompts, samples_per_prompt, self.cfg.generation_batch_size)
        if self.bounds is not None:
            c = self.bounds.sequences
        model_attn = self.model_attention()
        return cb_attention_implementation(
            self.cfg.cb_attention, model_attn, self._hf.device,
            next(self.module.parameters()).dtype, self._num_params, c)

    def continuous_batching_config(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int,
                                   attention: str | None = None) -> Any:
        """transformers' ``ContinuousBatchingConfig`` of one call (geometry from :func:`cache_geometry`, of the
        run's largest call when the backend has :class:`CallBounds`) run under ``attention`` (default:
        :meth:`attention` of the call)."""
        from transformers import ContinuousBatchingConfig

        if attention is None:
            attention = self.attention(len(prompt_ids), samples_per_prompt)
        dense_mask = not is_flash(attention)
        itemsize = next(self.module.parameters()).element_size()
        if self.bounds is None:
            geometry = cache_geometry([len(p) for p in prompt_ids], samples_per_prompt, self.cfg.max_new_tokens,
                                      self.cfg.generation_batch_size, dense_mask=dense_mask, mask_itemsize=itemsize)
        else:  # the run's largest call, as that many single-sample requests: one geometry for every call
            n, prompt = self.bounds.sequences, self.bounds.sequence_tokens - self.cfg.max_new_tokens
            geometry = cache_geometry([prompt] * n, 1, self.cfg.max_new_tokens, n, dense_mask=dense_mask,
                                      mask_itemsize=itemsize)
        return ContinuousBatchingConfig(
            **vars(geometry), return_logprobs=True, seed=seed % 2**63, scheduler_type="fifo",
            auto_switch_to_flash=False,  # the model's own attention, nothing fetched at run time
            disable_nccl_graph_mixing=False,  # a tensor-parallel option; leaves the process environment alone
        )

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """Sample ``samples_per_prompt`` completions per prompt; see :mod:`dsrl.rollout.base`. The behavior
        log-probs are the sampler's own: log of the probability of each token after temperature, top-k and
        top-p, as continuous batching computed it."""
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. bos)")
        self._check_bounds(prompt_ids)
        device = self._hf.device
        was_training = self.module.training
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(gathered_for_generation(self.module, self.policy))
            if not prompt_ids:  # the gather above is collective: entered even with nothing to generate
                return []
            stack.enter_context(neutral_generation_config(self.module))
            stack.enter_context(forked_torch_rng(device))
            stack.enter_context(_collect_only_new_objects())
            try:
                results, routes = self._run(prompt_ids, samples_per_prompt, seed)
            finally:
                self.module.train(was_training)
        eos = set(self.eos)
        out = []
        for i, p in enumerate(prompt_ids):
            for j in range(samples_per_prompt):
                r = results[f"{i}/{j}"]
                tokens, finished = cut_at_eos(list(r.generated_tokens), eos)
                out.append(Completion(prompt_index=i, prompt_ids=list(p), completion_ids=tokens, finished=finished,
                                      behavior_logprobs=[float(x) for x in r.logprobs[: len(tokens)]],
                                      routes=routes.of(f"{i}/{j}", i, len(p) + len(tokens) - 1) if routes else None))
        return out

    def close(self) -> None:
        """Destroy the kept manager (its paged cache, CUDA graphs and memory pool)."""
        self._drop_session()

    def sleep(self) -> None:
        """With ``release_between_calls``: the kept manager destroyed until the next call (class docstring)."""
        if self.release_between_calls:
            self._drop_session()

    def with_sampling(self, rollout_cfg: RolloutConfig) -> ContinuousBatchingBackend:
        """A new continuous-batching backend on the same policy (its own manager, released by its ``close``), bounded
        like this one: as many sequences at once, each longer by the change in ``max_new_tokens``
        (:meth:`dsrl.rollout.base.RolloutBackend.with_sampling`)."""
        return ContinuousBatchingBackend(self._hf.source, self._hf.tokenizer, rollout_cfg,
                                         bounds=self.bounds and self.bounds.for_sampling(self.cfg, rollout_cfg))

    def _check_bounds(self, prompt_ids: list[list[int]]) -> None:
        if self.bounds is None:
            return
        longest = max((len(p) for p in prompt_ids), default=0) + self.cfg.max_new_tokens
        if longest > self.bounds.sequence_tokens:
            raise ValueError(f"a prompt of {longest - self.cfg.max_new_tokens} tokens plus rollout.max_new_tokens = "
                             f"{self.cfg.max_new_tokens} exceeds the {self.bounds.sequence_tokens} tokens per sequence "
                             "the continuous-batching cache was sized for (the run's longest sequence)")

    def _session_for(self, prompt_ids: list[list[int]], g: int, seed: int) -> tuple[Session, bool]:
        """The manager this call runs on, and whether it is new: the kept one when its geometry and attention are
        this call's and (with CUDA graphs) every parameter still lives where its graphs read it; else a new one."""
        attention = self.attention(len(prompt_ids), g)
        cb_cfg = self.continuous_batching_config(prompt_ids, g, seed, attention=attention)
        key = (attention, cb_cfg.page_size, cb_cfg.num_blocks, cb_cfg.max_batch_tokens, cb_cfg.max_requests_per_batch)
        kept = self._session
        if kept is not None and kept.key == key and not kept.weights_moved(self.module):
            return kept, False
        self._drop_session()
        self._use_attention(attention)
        gen_cfg = self._hf.generation_config(sampling_in_config=True)
        manager = self.module.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        session = Session(key, attention, manager, self._attn)
        self._session = session  # dropped (destroyed) on any failure below
        self._check_processors(manager)
        # transformers seeds its sampler with seed + data-parallel rank when it builds the batch processor; dsrl
        # reseeds every call (below), so the offset only needs to cancel here
        manager.continuous_batching_config.seed = cb_cfg.seed - manager.distributed_helper.dp_rank
        warmup_or_raise(manager)  # builds the cache and captures the CUDA graphs in this thread
        session.remember_weights(self.module)
        return session, True

    def _use_attention(self, attention: str | None) -> None:
        """Run the module under ``attention`` (dsrl's packed attention is set on the config, not through
        set_attn_implementation: transformers would try to import flash-attn for a name containing "flash")."""
        if attention == VARLEN_ATTENTION and self.module.config._attn_implementation != attention:
            register_varlen_attention()
            check_flash_kernel(self._hf.device, next(self.module.parameters()).dtype)
            self.module.config._attn_implementation = attention

    def _restore_attention(self) -> None:
        if self.module.config._attn_implementation == VARLEN_ATTENTION != self._attn:
            self.module.config._attn_implementation = self._attn
        elif self.module.config._attn_implementation != self._attn:
            self.module.set_attn_implementation(self._attn)

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        session.manager.batch_processor = None  # the paged cache, the batch buffers and the CUDA graphs
        session.manager.destroy()
        self._restore_attention()

    def _run(self, prompt_ids: list[list[int]], g: int, seed: int) -> tuple[dict[str, Any], PackedRoutes | None]:
        """Every request through the kept manager (:meth:`_session_for`): request id ``"<prompt>/<sample>"`` ->
        GenerationOutput, and (an MoE policy) the routes of the call's packed forwards. The manager stops after
        the call with its cache and graphs kept for the next one."""
        self._attn = self.module.config._attn_implementation
        pin = self.module.register_forward_pre_hook(_same_threads_hook(torch.get_num_threads()))
        session, started, done = None, False, False
        routes, layout_hook, recording = None, None, contextlib.nullcontext()
        try:
            session, new = self._session_for(prompt_ids, g, seed)
            manager = session.manager
            if not new:
                self._use_attention(session.attention)
                manager.switch_to_cb_friendly_attn(self.module, auto_switch_to_flash=False)  # undone by stop()
                # No prefix of this call may reuse keys and values computed under earlier weights.
                manager.batch_processor.cache.reset()
                manager.background_thread_status.clear()  # the last call's stop; start() would clear it after queueing
            torch.manual_seed(seed % 2**63)  # this call's seed, after any warm-up (what transformers seeds at build)
            self.calls += 1
            self.managers_built += int(new)
            expected = [f"{i}/{j}" for i in range(len(prompt_ids)) for j in range(g)]
            for rid in expected:
                manager.add_request(list(prompt_ids[int(rid.split("/")[0])]), request_id=rid,
                                    max_new_tokens=self.cfg.max_new_tokens, eos_token_id=list(self.eos))
            if self.routing is not None:  # after any warm-up: its forwards belong to no request
                if session.uses_graphs():
                    raise RuntimeError("continuous batching replays CUDA graphs here, which run no Python forward, so "
                                       "the routes of an MoE policy cannot be recorded. Fix: use rollout.backend = "
                                       "'hf' for routing replay on this machine.")
                routes = PackedRoutes(manager)
                layout_hook = self.module.register_forward_pre_hook(routes.note_layout, with_kwargs=True)
                recording = self.routing.recording()
            with recording as log:
                manager.start()
                started = True
                results = self._collect(manager, expected)
            if routes is not None:
                routes.assemble(log)
            done = True
            return results, routes
        finally:
            if layout_hook is not None:
                layout_hook.remove()
            if started:  # joins the thread; keeps the batch processor (cache, graphs) unless something failed
                session.manager.stop(block=True, hard_stop=not done, keep_for_next_session=done)
                if hasattr(self.module, "_cached_continuous_batching_manager"):
                    del self.module._cached_continuous_batching_manager  # dsrl keeps it, not the model
            if not done:
                self._drop_session()
            pin.remove()
            self._restore_attention()

    def _collect(self, manager: Any, expected: list[str]) -> dict[str, Any]:
        """Every expected request's finished output from the running generation thread."""
        # Flush-and-stop right away: the thread drains the queue on its first step, so it finishes every
        # request and then exits by itself (no idle polling before the join).
        status = manager.background_thread_status
        status.request_stop(type(status).FLUSH_AND_STOP, manager.distributed_helper.global_rank)
        results: dict[str, Any] = {}
        while len(results) < len(expected):
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is not None:
                if result.is_finished():
                    results[result.request_id] = result
            elif not manager.is_running():
                fatal = manager.background_thread_status.fatal_error
                raise RuntimeError(f"continuous batching stopped after {len(results)} of {len(expected)} "
                                   f"requests: {fatal!r}{capture_hint(fatal)}") from fatal
        failed = {k: r.error for k, r in results.items() if r.error is not None}
        if failed:
            rid, error = next(iter(failed.items()))
            raise RuntimeError(f"continuous batching failed {len(failed)} requests, e.g. {rid}: {error}"
                               f"{capture_hint(error)}")
        return results

    def _check_processors(self, manager: Any) -> None:
        """The manager applies exactly dsrl's temperature/top-k/top-p warpers, nothing else and nothing less."""
        cfg = self.cfg
        expected: set[str] = set()
        if cfg.temperature > 0:
            expected |= {"TemperatureLogitsWarper"} if cfg.temperature != 1.0 else set()
            expected |= {"TopKLogitsWarper"} if cfg.top_k > 0 else set()
            expected |= {"TopPLogitsWarper"} if cfg.top_p < 1.0 else set()
        got = {type(p).__name__.replace("ContinuousBatching", "") for p in manager.logit_processor.logits_processor}
        if got != expected:
            raise RuntimeError(f"continuous batching would apply the logits processors {sorted(got)} instead of "
                               f"dsrl.rollout's {sorted(expected)}; use rollout.backend = 'hf'")
