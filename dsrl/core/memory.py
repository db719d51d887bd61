"""What one rank's device holds in each phase of a rollout, predicted from the run file and the model's shape alone
(no weights, no DeepSpeed): ``dsrl plan``'s ``"memory"`` (docs/memory.md).

Three phases, each a dict of parts (bytes) whose sum is the phase's total:

- ``generation``: the policy's weights (under ZeRO-3 the full weights gathered for the call), the training state
  unless ``memory.offload_states`` keeps it on the host, the frozen models unless offloaded, and the generation
  backend's own memory: ``hf``'s KV cache for the C sequences one call decodes, ``cb``'s paged cache of the same
  size (kept for the whole run), or a vLLM engine (on a GPU the ``rollout.vllm_gpu_memory_utilization`` share of
  the device; on the CPU its weights and the KV cache dsrl sizes). Disaggregated: a generator rank (its own
  weights and the backend);
- ``logprobs``: the old and reference log-prob passes (and the critic's values): the no-grad forwards of one
  ``rollout.logprob_micro_batch_size`` micro-batch of the longest sequences, the fused head's logit chunk
  (:data:`dsrl.core.logprobs.LOGIT_CHUNK_BYTES` at most), the reference during its pass;
- ``training``: the full model states by ZeRO stage (:func:`model_states`), the activations of one micro-batch
  (the token budget T, or m sequences of the longest length) with or without gradient checkpointing, the logit
  chunk, ZeRO-0's flat all-reduce bucket of the gradients on more than one rank, and whatever else stays resident
  (frozen models unless offloaded, ``cb``'s cache, a vLLM engine unless asleep). Outside training the training
  state is the optimizer's and the master weights, with the gradients but under ZeRO-0, whose step frees them.

On the Megatron engine (``dsrl.engine.kind = "megatron"``) the model states are this rank's TP x PP shard
(:func:`megatron_states`), and every phase holds the rollout model, a full Hugging Face replica on every rank
(``rollout_replica``), which generates (its KV cache unsharded) and receives the engine's weights at each sync;
frozen models are full replicas too. Its tensor group splits the attention and MLP activations; the hidden-sized ones
(the norms', the residual stream) only under sequence parallelism (``dsrl.engine.sequence_parallel``). Its context
group (``context_parallel_size``) splits every position of the decoder layers' activations, plus on each rank every
position's keys and values per layer (all-gathered); the head's logit chunk runs on every position.

The model states follow DeepSpeed's own accounting (``estimate_zero2_model_states_mem_needs`` /
``estimate_zero3_model_states_mem_needs`` of DeepSpeed 0.19.8, 16-bit weights with Adam: 2 + 18/D bytes per
parameter under ZeRO-2, 18/D plus 4 bytes per parameter of the largest layer under ZeRO-3; tests/unit/test_memory.py
holds them to it), extended the same way to ZeRO 0-1, fp32 weights, LoRA (states of the adapters only),
DeepSpeed's ``offload_optimizer`` (states on the host) and ``offload_param``. Activations are an estimate: per
token and layer the tensors a Llama-like decoder layer keeps for its backward (attention by a fused kernel: no
score matrix), or with checkpointing each layer's input plus one layer recomputed.

:func:`fit` compares each phase with the device: above it is a refusal naming the phase, its largest parts and the
settings that would free the most; above :data:`TIGHT` of it (the CUDA context, the allocator's fragmentation and
the estimate's error live there) a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsrl.config import Config
from dsrl.config.names import AUTO_BACKEND, CB_BACKEND, DISAGGREGATED, VLLM_BACKEND
from dsrl.core.logprobs import LOGIT_CHUNK_BYTES

MIB = 2**20
GIB = 2**30
TIGHT = 0.9  # a phase above this share of the device gets a warning
PHASES = ("generation", "logprobs", "training")
VLLM_CPU_MIN_KV_BYTES = 64 * MIB  # dsrl.rollout.vllm: the CPU engine's KV cache floor
VLLM_MAX_NUM_SEQS = 256
# DeepSpeed 0.19.8's engine.allreduce_gradients: ZeRO-0's gradients go to the all-reduce flattened into buckets of
# this many elements (MEMORY_OPT_ALLREDUCE_SIZE), one copy of them during the training step
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a model: parameter counts (``trainable``: the adapters under LoRA) and the
    decoder's dimensions (``mlp_width``: the MLP's intermediate width one token passes through, top-k experts'
    for a mixture of experts)."""

    params: int
    trainable: int
    largest_layer: int
    layers: int
    hidden: int
    mlp_width: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer, per byte of the cache dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class MemorySetup:
    """The run's settings the memory model reads, resolved (:meth:`of`)."""

    shape: ModelShape
    weight_bytes: int  # 2 (bf16/fp16) or 4 (fp32)
    zero_stage: int
    data_parallel: int  # D: the ranks the ZeRO partitions span
    tensor_parallel: int
    offload_optimizer: bool  # ds_config zero_optimization.offload_optimizer (DeepSpeed keeps states on the host)
    offload_param: bool
    offload_states: bool  # dsrl.memory.offload_states
    gradient_checkpointing: bool
    train_tokens: int  # one training micro-batch
    token_budget: bool  # train_tokens is batch.max_tokens_per_micro_batch (else m sequences of the longest length)
    logprob_tokens: int  # one no-grad log-prob micro-batch
    backend: str
    disaggregated: bool
    generation_sequences: int  # C: sequences one generate call decodes at once
    generation_tokens: int  # the longest sequence a call may hold
    prompt_tokens: int
    vllm_fraction: float
    vllm_sleeps: bool  # memory.vllm_sleep_level > 0 on a GPU
    on_gpu: bool
    reference_copy: bool  # a frozen copy of the policy (kl_coef > 0 without LoRA)
    reward_model: ModelShape | None = None
    critic: ModelShape | None = None
    megatron: bool = False  # dsrl.engine.kind = "megatron" (:func:`megatron_states`, an HF replica for generation)
    pipeline_parallel: int = 1  # the Megatron engine's pipeline stages
    distributed_optimizer: bool = False  # megatron-core's distributed optimizer (on GPUs): states sharded over D
    sequence_parallel: bool = False  # megatron-core's: the tensor group splits the hidden-sized activations too
    context_parallel: int = 1  # the Megatron engine's context group: splits the positions of the trunk's activations

    @property
    def sharded_for_generation(self) -> int:
        """The tensor-parallel factor of what generates: the engine's (AutoTP) on DeepSpeed; 1 on Megatron, whose
        rollout model is a full Hugging Face replica on every rank."""
        return 1 if self.megatron else self.tensor_parallel

    @classmethod
    def of(cls, cfg: Config, plan: Any, shape: ModelShape, *, on_gpu: bool, reward_model: ModelShape | None = None,
           critic: ModelShape | None = None) -> MemorySetup:
        """From the run file, its :class:`dsrl.core.plan.BatchPlan` and the policy's shape (and the reward model's
        and critic's where the run has them)."""
        d, ds = cfg.dsrl, cfg.ds_config
        zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
        stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else 0
        bf16 = isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") in (True, "auto") and on_gpu
        fp16 = isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled") is True
        dtype = d.model.dtype
        weight_bytes = 4 if dtype == "float32" or (dtype == "auto" and not on_gpu) else 2
        if bf16 or fp16:
            weight_bytes = 2
        tp = ds.get("tensor_parallel") if isinstance(ds.get("tensor_parallel"), dict) else {}
        megatron = d.engine.kind == "megatron"
        tp_size = d.engine.tensor_model_parallel_size if megatron else max(1, int(tp.get("autotp_size", 1) or 1))
        max_len = d.data.max_prompt_tokens + d.max_completion_tokens
        b = plan.max_tokens_per_micro_batch
        train_tokens = b if b is not None else plan.micro_batch_size_per_rank * max_len
        # a generate call holds one replica's share of the prompts (a generator rank makes one call per replica)
        sequences = max(1, min(plan.prompts_per_rank, d.rollout.generation_batch_size)) * plan.samples_per_prompt
        return cls(shape=shape, weight_bytes=weight_bytes, zero_stage=stage, data_parallel=plan.data_parallel_size,
                   tensor_parallel=tp_size,
                   offload_optimizer=_device_set(zero.get("offload_optimizer")),
                   offload_param=_device_set(zero.get("offload_param")), offload_states=d.memory.offload_states,
                   gradient_checkpointing=d.model.gradient_checkpointing, train_tokens=train_tokens,
                   token_budget=b is not None,
                   logprob_tokens=d.rollout.logprob_micro_batch_size * max_len, backend=d.rollout.backend,
                   disaggregated=plan.placement == DISAGGREGATED, generation_sequences=sequences,
                   generation_tokens=d.max_generation_tokens, prompt_tokens=d.data.max_prompt_tokens,
                   vllm_fraction=d.rollout.vllm_gpu_memory_utilization,
                   vllm_sleeps=d.memory.vllm_sleep_level > 0 and on_gpu, on_gpu=on_gpu,
                   reference_copy=d.algorithm.kl_coef > 0 and d.model.lora is None, reward_model=reward_model,
                   critic=critic if d.has_critic else None, megatron=megatron,
                   pipeline_parallel=d.engine.pipeline_model_parallel_size if megatron else 1,
                   distributed_optimizer=megatron and on_gpu,
                   sequence_parallel=megatron and d.engine.sequence_parallel,
                   context_parallel=d.engine.context_parallel_size if megatron else 1)


def _device_set(section: Any) -> bool:
    return isinstance(section, dict) and str(section.get("device", "none")).lower() not in ("none", "")


# ------------------------------------------------------------------------------------------------ model states
def model_states(params: int, trainable: int, largest_layer: int, data_parallel: int, stage: int, weight_bytes: int,
                 *, offload_optimizer: bool = False, offload_param: bool = False) -> dict[str, int]:
    """Bytes per rank of a trained model's states under DeepSpeed (module docstring): ``weights`` (16-bit or fp32,
    partitioned under ZeRO-3), ``gradients``, ``master_weights`` (fp32), ``optimizer_states`` (Adam's two fp32
    moments), and under ZeRO-3 ``gathered_layer`` (the largest layer's gathered weights and gradients)."""
    N, T, D = params, trainable, max(1, data_parallel)
    mixed = weight_bytes == 2
    weights = weight_bytes * N // D if stage == 3 else weight_bytes * N
    if offload_param and stage == 3:
        weights = 0
    if mixed:
        grads = {0: 6 * T, 1: 2 * T + 4 * T // D, 2: 6 * T // D, 3: 4 * T // D}[min(stage, 3)]
    else:
        grads = 4 * T if stage < 2 else 4 * T // D
    master = (4 * T if mixed else 0) if stage == 0 else 4 * T // D
    optimizer = 8 * T if stage == 0 else 8 * T // D
    if offload_optimizer and stage > 0:  # DeepSpeed keeps fp32 gradients, master weights and moments on the host
        grads = 2 * T if stage == 1 and mixed else 0
        master = optimizer = 0
    out = {"weights": weights, "gradients": grads, "master_weights": master, "optimizer_states": optimizer}
    if stage == 3:
        out["gathered_layer"] = 2 * weight_bytes * largest_layer
    return out


def megatron_states(params: int, trainable: int, data_parallel: int, model_parallel: int, weight_bytes: int,
                    distributed_optimizer: bool) -> dict[str, int]:
    """Bytes per rank of a model's states on the Megatron engine: this rank's shard of ``model_parallel`` = TP x PP
    (the weights spread evenly over the stages and tensor ranks; the embedding and head make the first and last stages
    somewhat larger; context ranks hold whole replicas), megatron-core DDP's contiguous fp32 gradient buffer (kept
    between steps), Adam's two fp32 moments, and under mixed precision (``weight_bytes`` 2: bf16 weights) the fp32
    main weights; the moments and main weights are sharded over the D replicas by the distributed optimizer (on
    GPUs). In float32 (``weight_bytes`` 4) the weights are the main weights."""
    shard, trained = params // model_parallel, trainable // model_parallel
    spread = max(1, data_parallel) if distributed_optimizer else 1
    main = 4 * trained // spread if weight_bytes < 4 else 0
    return {"weights": weight_bytes * shard, "gradients": 4 * trained, "master_weights": main,
            "optimizer_states": 8 * trained // spread}


TRAINING_STATE = ("gradients", "master_weights", "optimizer_states")


# --------------------------------------------------------------------------------------------------- the phases
#: hidden-sized tensors one token keeps per decoder layer for its backward (the two norms' inputs and outputs)
_HIDDEN_SIZED = 4


def _per_layer_train(s: ModelShape, b: int) -> int:
    """Bytes one token keeps in one decoder layer for its backward (module docstring)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return b * (_HIDDEN_SIZED * s.hidden + 2 * q + 2 * kv + 4 * s.mlp_width) + 8


def _per_layer_nograd(s: ModelShape, b: int) -> int:
    """Bytes one token holds at the peak of one layer's no-grad forward."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return b * (2 * s.hidden + q + 2 * kv + 3 * s.mlp_width)


def _logit_chunk(rows: int, vocab: int) -> int:
    return min(LOGIT_CHUNK_BYTES, 8 * max(rows, 1) * vocab)


@dataclass
class PhaseMemory:
    """One phase: its parts (bytes) and where it runs."""

    parts: dict[str, int] = field(default_factory=dict)
    where: str = "every rank"

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> dict[str, Any]:
        return {"parts": {k: round(v / MIB, 1) for k, v in self.parts.items()}, "total_mib": round(self.total / MIB, 1),
                "where": self.where}


def estimate(m: MemorySetup, device_bytes: int | None) -> dict[str, PhaseMemory]:
    """Every phase's parts (module docstring). ``device_bytes``: the device's memory (sizes a GPU vLLM engine's
    share; None: unknown)."""
    s, wb = m.shape, m.weight_bytes
    tp = m.tensor_parallel
    if m.megatron:  # the engine's shards, and the rollout model: a full HF replica on every rank (all phases)
        model_parallel = tp * m.pipeline_parallel
        states = megatron_states(s.params, s.trainable, m.data_parallel, model_parallel, wb, m.distributed_optimizer)
        states["rollout_replica"] = wb * s.params
    else:
        states = {k: v // tp for k, v in model_states(s.params, s.trainable, s.largest_layer, m.data_parallel,
                                                     m.zero_stage, wb, offload_optimizer=m.offload_optimizer,
                                                     offload_param=m.offload_param).items()}
    resident_states = {k: v for k, v in states.items() if k in ("weights", "gathered_layer", "rollout_replica")}
    # between steps: ZeRO-0's step sets the gradients to None (measured, docs/memory.md); ZeRO 1-3 and megatron-core
    # DDP keep buffers
    kept = [k for k in TRAINING_STATE if not (k == "gradients" and m.zero_stage == 0 and not m.megatron)]
    training_state = sum(states.get(k, 0) for k in kept)
    frozen: dict[str, int] = {}
    frozen_split = 1 if m.megatron else tp  # beside the Megatron engine a frozen model is a full replica
    if m.reference_copy:
        frozen["reference"] = wb * s.params // (m.data_parallel if m.zero_stage == 3 else 1) // frozen_split
    if m.reward_model is not None:
        frozen["reward_model"] = wb * m.reward_model.params // (m.data_parallel if m.zero_stage == 3 else 1)
    critic: dict[str, int] = {}
    if m.critic is not None:
        if m.megatron:
            c = megatron_states(m.critic.params, m.critic.params, m.data_parallel, tp * m.pipeline_parallel, wb,
                                m.distributed_optimizer)
        else:
            c = model_states(m.critic.params, m.critic.params, m.critic.largest_layer, m.data_parallel,
                             m.zero_stage, wb, offload_optimizer=m.offload_optimizer, offload_param=m.offload_param)
        critic = {"critic_weights": c["weights"] + c.get("gathered_layer", 0),
                  "critic_training_state": sum(c[k] for k in TRAINING_STATE)}
    backend = _backend_memory(m, device_bytes)
    kept_backend = {k: v for k, v in backend.items() if k in ("cb_kv_cache", "vllm_engine")}
    if m.vllm_sleeps:
        kept_backend.pop("vllm_engine", None)
    if m.offload_states:  # continuous batching's manager is destroyed after generation (release_between_calls)
        kept_backend.pop("cb_kv_cache", None)
    b = wb  # activations in the weights' dtype

    # generation
    gen = PhaseMemory()
    if m.disaggregated:  # a generator rank: its own copy of the policy and the backend
        gen.where = "a generator rank"
        gen.parts["weights"] = wb * s.params
    else:
        gen.parts.update(resident_states)
        if m.zero_stage == 3:
            gen.parts["gathered_weights"] = wb * s.params // tp
            gen.parts.pop("gathered_layer", None)
        if not m.offload_states:
            gen.parts["training_state"] = training_state
            gen.parts.update(frozen)
            gen.parts.update(critic)
        elif critic:
            gen.parts["critic_weights"] = critic["critic_weights"]
    gen.parts.update(backend)

    # old / reference log-probs (and critic values)
    lp = PhaseMemory(parts=dict(resident_states))
    if not m.offload_states:
        lp.parts["training_state"] = training_state
        lp.parts.update(critic)
        lp.parts.update(frozen)
    else:
        if critic:
            lp.parts["critic_weights"] = critic["critic_weights"]
        if "reference" in frozen:  # on the device during its own pass
            lp.parts["reference"] = frozen["reference"]
    lp.parts.update(kept_backend)
    cp = m.context_parallel
    lp.parts["activations"] = m.logprob_tokens * (_per_layer_nograd(s, b) + 2 * s.hidden * b) // (tp * cp)
    lp.parts["logit_chunk"] = _logit_chunk(m.logprob_tokens, s.vocab // tp)

    # training
    tr = PhaseMemory(parts=dict(states))
    tr.parts.update(critic)
    if not m.offload_states:
        tr.parts.update(frozen)
    tr.parts.update(kept_backend)
    per_layer = _per_layer_train(s, b) // tp
    layer_input = s.hidden * b  # what checkpointing keeps of each layer
    if m.megatron and tp > 1:  # megatron-core's tensor group replicates the hidden-sized activations (the norms'
        # inputs, the residual stream) unless sequence parallelism splits them along the sequence
        if m.sequence_parallel:
            layer_input //= tp
        else:
            per_layer += _HIDDEN_SIZED * s.hidden * b * (tp - 1) // tp
    per_layer //= cp  # the context group splits every position of the trunk, but each rank keeps every position's
    layer_input //= cp  # keys and values (all-gathered for its queries, dsrl.backends.megatron.context_parallel)
    gathered_kv = 2 * s.kv_heads * s.head_dim * b // tp if cp > 1 else 0
    if m.gradient_checkpointing:
        tr.parts["activations"] = m.train_tokens * (s.layers * layer_input + per_layer + gathered_kv)
    else:
        tr.parts["activations"] = m.train_tokens * s.layers * (per_layer + gathered_kv)
    tr.parts["logit_chunk"] = _logit_chunk(m.train_tokens, s.vocab // tp) + 4 * m.train_tokens * s.hidden
    if m.zero_stage == 0 and m.data_parallel > 1 and not m.megatron:  # DeepSpeed all-reduces ZeRO-0's gradients as
        # flat buckets
        tr.parts["allreduce_buffer"] = min(s.trainable, ALLREDUCE_BUCKET_ELEMENTS) * wb // tp
    return {"generation": gen, "logprobs": lp, "training": tr}


def _backend_memory(m: MemorySetup, device_bytes: int | None) -> dict[str, int]:
    """The generation backend's own memory during generation (module docstring)."""
    s, C = m.shape, m.generation_sequences
    kv = C * m.generation_tokens * s.kv_bytes_per_token * m.weight_bytes // m.sharded_for_generation
    if m.backend == VLLM_BACKEND:
        if m.on_gpu:
            return {"vllm_engine": int(m.vllm_fraction * device_bytes) if device_bytes else 0}
        kv_cpu = max(VLLM_CPU_MIN_KV_BYTES, 2 * min(C, VLLM_MAX_NUM_SEQS) * m.generation_tokens
                     * s.kv_bytes_per_token * m.weight_bytes)
        return {"vllm_engine": m.weight_bytes * s.params + kv_cpu}
    out = {"cb_kv_cache" if m.backend in (CB_BACKEND, AUTO_BACKEND) else "kv_cache": kv}
    out["sampling_logits"] = 2 * 4 * C * s.vocab
    out["prefill_activations"] = C * m.prompt_tokens * (_per_layer_nograd(s, m.weight_bytes)
                                                        + 2 * s.hidden * m.weight_bytes) // m.sharded_for_generation
    return out


# ------------------------------------------------------------------------------------------------------ the fit
@dataclass(frozen=True)
class Fit:
    """:func:`fit`'s verdict: one sentence per phase that cannot fit, one per phase that barely does."""

    refusals: list[str]
    warnings: list[str]


_FIXES = {
    "training_state": "dsrl.memory.offload_states = true (keeps it on the host outside training)",
    "reference": "dsrl.memory.offload_states = true (the reference leaves the device between its passes)",
    "reward_model": "dsrl.memory.offload_states = true (the reward model leaves the device between its passes)",
    "critic_training_state": "dsrl.memory.offload_states = true",
    "kv_cache": "a smaller dsrl.rollout.generation_batch_size (fewer sequences decode at once)",
    "cb_kv_cache": "a smaller dsrl.rollout.generation_batch_size (fewer sequences decode at once), or "
                   "rollout.backend 'hf' (its cache lives only while it generates)",
    "prefill_activations": "a smaller dsrl.rollout.generation_batch_size (fewer sequences decode at once)",
    "vllm_engine": "a smaller dsrl.rollout.vllm_gpu_memory_utilization, or dsrl.memory.vllm_sleep_level = 1 "
                   "(asleep outside generation)",
    "gathered_weights": "hf generation gathers the whole ZeRO-3 model: rollout.backend 'vllm' syncs it instead",
    "optimizer_states": "a higher zero_optimization.stage, or zero_optimization.offload_optimizer.device = 'cpu'",
    "master_weights": "a higher zero_optimization.stage, or zero_optimization.offload_optimizer.device = 'cpu'",
    "gradients": "a higher zero_optimization.stage",
    "weights": "zero_optimization.stage 3 (partitions the weights), or dsrl.model.lora",
}


def _fix(phase: str, part: str, m: MemorySetup) -> str | None:
    if part == "activations":
        if phase == "logprobs":
            return "a smaller dsrl.rollout.logprob_micro_batch_size"
        knob = "dsrl.batch.max_tokens_per_micro_batch" if m.token_budget else "dsrl.batch.micro_batch_size_per_rank"
        return (f"a smaller {knob}" if m.gradient_checkpointing else
                f"dsrl.model.gradient_checkpointing = true, or a smaller {knob}")
    if part == "vllm_engine" and phase != "generation":
        return "dsrl.memory.vllm_sleep_level = 1 (the engine sleeps outside generation)"
    if m.megatron and part in ("weights", "gradients", "optimizer_states", "training_state", "critic_weights",
                               "critic_training_state"):
        return ("a larger dsrl.engine.tensor_model_parallel_size or pipeline_model_parallel_size (a rank holds "
                "1 / (TP x PP) of the model states)")
    if m.megatron and part in ("reference", "reward_model", "rollout_replica"):
        return None  # a full replica on every rank beside the Megatron engine; not offloaded there yet
    return _FIXES.get(part)


def fit(phases: dict[str, PhaseMemory], device_bytes: int, m: MemorySetup) -> Fit:
    """Each phase against the device (module docstring)."""
    refusals, warnings = [], []
    for name in PHASES:
        phase = phases[name]
        total = phase.total
        biggest = sorted(phase.parts.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{k} {v / MIB:,.1f}" for k, v in biggest[:4] if v)
        if total > device_bytes:
            fixes: list[str] = []
            for part, _ in biggest:  # each setting named once, in the order of the parts it shrinks
                for f in (_fix(name, part, m) or "").split(", or "):
                    if f and f not in fixes:
                        fixes.append(f)
            refusals.append(f"the {name} phase needs {total / MIB:,.0f} MiB on {phase.where} ({parts} MiB) but the "
                            f"device has {device_bytes / MIB:,.0f} MiB (--device_memory_gib {device_bytes / GIB:g}). "
                            f"Fix: {'; or '.join(fixes[:3]) or 'more devices'}.")
        elif total > TIGHT * device_bytes:
            warnings.append(f"the {name} phase needs {total / MIB:,.0f} MiB of the device's {device_bytes / MIB:,.0f} "
                            f"MiB ({total / device_bytes:.0%}; {parts} MiB): the CUDA context, the allocator's "
                            "fragmentation and this estimate's error may not fit in the rest")
    return Fit(refusals, warnings)
