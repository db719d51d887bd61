"""dsrl inside Megatron training loops: exact normalisation under TP, PP, CP and variable micro-batch counts.

megatron-core is imported lazily (``pip install -e '.[megatron]' (in the dsrl checkout)``); importing this package needs
only torch. Public names:

- :class:`MegatronRLStep` -- one exact optimizer step per mini-batch (one ``forward_backward_func``
  call), for ``calculate_per_token_loss=True`` (``convention="per_token"``) or Megatron's default
  averaging DDP (``convention="average"``); the step itself is :mod:`dsrl.core.step`'s, shared with
  the DeepSpeed backend;
- :func:`build_param_scheduler` / :class:`SchedulerDriver` -- ``OptimizerParamScheduler`` owned by dsrl,
  in ``"optimizer_steps"`` or ``"samples"``;
- :func:`shard_for_context_parallel` -- Megatron's load-balanced CP cut carrying whole-sequence n_s;
- :func:`megatron_view` -- the :class:`dsrl.core.parallel.ParallelView` of a Megatron layout: the
  token-owning group and the DDP's real gradient factor, validated;
- :func:`fused_output_layer` -- per-token log-probs (and entropy) of a ``GPTModel`` from its vocabulary-parallel
  output layer fused into dsrl's tiled log-softmax, without logits (under sequence parallelism too);
- :func:`sequence_parallel_spec` -- megatron-core's local layer spec with norms that take sequence parallelism
  (their gradients summed over the tensor group), for a ``GPTModel`` without Transformer Engine;
- :mod:`.hf_weights` -- a ``GPTModel`` shaped like a Hugging Face Llama / Qwen2 / Qwen3, its weights loaded from the
  HF ``state_dict`` per tensor-parallel shard and pipeline stage, and gathered back under HF names;
- :mod:`.engine` -- :class:`~dsrl.backends.megatron.engine.MegatronEngine`, megatron-core as dsrl's
  :class:`dsrl.core.engine.TrainEngine` (the application's forwards and steps, weights by HF name for a rollout
  model, dist-checkpointing), built from a Hugging Face model by ``build_engine`` (imported on its own: it needs
  megatron-core).

See docs/megatron.md.

May import: :mod:`dsrl.core`, :mod:`dsrl.config`, megatron-core; never :mod:`dsrl.backends.deepspeed`.
"""

from dsrl.backends.megatron.cp import cp_chunk_index, shard_for_context_parallel, unshard_from_context_parallel
from dsrl.backends.megatron.deps import require_megatron
from dsrl.backends.megatron.logprobs import fused_output_layer
from dsrl.backends.megatron.schedule import OPTIMIZER_STEPS, SAMPLES, SchedulerDriver, build_param_scheduler
from dsrl.backends.megatron.sequence_parallel import sequence_parallel_spec
from dsrl.backends.megatron.step import AVERAGE, CONVENTIONS, PER_TOKEN, FinalizeOnce, MegatronRLStep
from dsrl.backends.megatron.view import ddp_grad_factor, megatron_view, validate_count_group

__all__ = [
    "AVERAGE",
    "CONVENTIONS",
    "OPTIMIZER_STEPS",
    "PER_TOKEN",
    "SAMPLES",
    "FinalizeOnce",
    "MegatronRLStep",
    "SchedulerDriver",
    "build_param_scheduler",
    "cp_chunk_index",
    "ddp_grad_factor",
    "fused_output_layer",
    "megatron_view",
    "require_megatron",
    "sequence_parallel_spec",
    "shard_for_context_parallel",
    "unshard_from_context_parallel",
    "validate_count_group",
]
