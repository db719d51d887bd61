"""One build of the rollout side for every placement: the tokenizer, the policy model with its LoRA structure, and
the generation backend with its arguments.

Colocated ranks, the trainer ranks and the generator ranks of a disaggregated job (ARCHITECTURE §8) all build
their side here, so the three cannot drift apart. Invariants of :class:`RolloutSide`:

- every rank that builds it from the same ``dsrl`` section gets the same tokenizer and a bit-identical model
  (:func:`dsrl.rl.policy.model.build_model`: seeded, offline), LoRA adapters included: a generator holds the same
  PEFT structure as the trainers, so the weights the trainers publish (their module's ``state_dict``, adapters
  and all) land in tensors of the same names, and a backend with its own copy of the weights (vLLM) takes the
  merged ones from it (:func:`dsrl.rollout.policy.generation_weights`);
- the model is built in the same state on every role, parameter flags included: a generator never trains, yet its
  trainable parameters keep ``requires_grad`` like the trainer's. ATen multiplies the last position's hidden
  state (a non-contiguous ``[b, 1, h]`` slice) by the output head through another kernel when the weight requires
  grad, so a generator with frozen weights sampled from logits about 1e-7 away from the colocated replica's and
  its behavior log-probs broke the bitwise equality of k = 0 with a correction (``tis``) that uses them;
- :meth:`RolloutSide.check` refuses, before any work, what the rank that generates cannot serve (vLLM missing, a
  head size or architecture vLLM lacks), with the colocated path's sentence on every placement;
- the backend's arguments (vLLM's ``max_model_len``, G and seed; continuous batching's bounds of the run's largest
  call, which ``rollout.backend = "auto"`` also decides from) are computed once, here
  (:meth:`RolloutSide.backend_kwargs`), for colocated and generator ranks alike, and for ``dsrl plan``
  (:meth:`RolloutSide.planned_workload`: what ``auto`` will decide from, out of the run file and the model's
  config alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrl.algos.defaults import resolve_algorithm
from dsrl.config import ConfigError, DsrlConfig, MemoryConfig, ModelConfig, RolloutConfig
from dsrl.config.names import VLLM_BACKEND
from dsrl.core.forwards import PolicyForwards
from dsrl.core.routes import MoELayout
from dsrl.rollout import RolloutBackend, make_backend
from dsrl.rollout.policy import unwrap

if TYPE_CHECKING:
    from dsrl.rollout.auto import GenerationWorkload
    from dsrl.rollout.cb import CallBounds


@dataclass(frozen=True)
class RolloutSideSettings:
    """What of the run file the rollout side reads: its sections ``model``, ``rollout`` and ``memory`` (vLLM's sleep
    level, the weight-sync buckets), G (``batch.samples_per_prompt``), the run's seed, the longest sequence
    generation makes (``DsrlConfig.max_generation_tokens``) and the longest an evaluation's makes
    (``DsrlConfig.max_eval_generation_tokens``: a vLLM engine is sized for both), and the shape of a rollout's calls
    that continuous batching's bounds and ``auto`` read (new tokens per call, calls per rollout)."""

    model: ModelConfig
    rollout: RolloutConfig
    memory: MemoryConfig
    samples_per_prompt: int
    seed: int
    max_generation_tokens: int
    new_tokens_per_call: int  # rollout.max_new_tokens; with an environment per model turn, within the trajectory
    calls_per_rollout: int  # generate calls per rollout at most: model turns (max_turns) x dynamic-sampling rounds
    max_eval_generation_tokens: int = 0

    @classmethod
    def of(cls, d: DsrlConfig) -> RolloutSideSettings:
        r, a = d.rollout, resolve_algorithm(d.algorithm)
        new_tokens = min(r.max_new_tokens, r.max_trajectory_tokens) if d.multi_turn else r.max_new_tokens
        calls = (r.max_turns if d.multi_turn else 1) * (a.max_sampling_rounds if a.dynamic_sampling else 1)
        return cls(d.model, d.rollout, d.memory, d.batch.samples_per_prompt, d.run.seed, d.max_generation_tokens,
                   new_tokens, calls, d.max_eval_generation_tokens)


class RolloutSide:
    """What a rank needs to generate with (or to publish weights for) the run's policy (module docstring).

    ``RolloutSide(settings, on_gpu)`` loads the tokenizer; :meth:`build_model` builds the policy (once);
    :meth:`check` runs the generating rank's refusals; :meth:`backend` builds the run's backend on a policy (the
    trainer's engine when colocated, this side's own model on a generator)."""

    def __init__(self, settings: RolloutSideSettings, on_gpu: bool):
        from dsrl.rl.policy.tokenizer import load_tokenizer

        self.settings, self.on_gpu = settings, on_gpu
        self.tokenizer = load_tokenizer(settings.model)
        self._model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("RolloutSide.build_model() must run first")
        return self._model

    def build_model(self) -> torch.nn.Module:
        """The policy (a transformers model, a PEFT model with ``dsrl.model.lora``), in train mode on the CPU, its
        parameters' ``requires_grad`` as training wants them; built once, the same on every rank."""
        if self._model is None:
            from dsrl.rl.policy.model import build_model

            tok = self.tokenizer
            self._model = build_model(self.settings.model, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      on_gpu=self.on_gpu, seed=self.settings.seed)
        return self._model

    def weights(self) -> torch.nn.Module:
        """The module whose ``state_dict`` crosses from the trainers to a generator: the transformers model (a
        PEFT model's inner one, whose layers carry the adapters), the same module the local backends generate
        with."""
        return unwrap(self.model)[0]

    def check(self) -> None:
        """Refuse, before any work, a backend this rank cannot build: ``vllm`` without vLLM (the install hint) or a
        model vLLM cannot serve (vLLM under AutoTP is refused with the run file: dsrl.config.support). Call it on the
        ranks that generate locally (colocated ranks, generator ranks), after :meth:`build_model`."""
        if self.settings.rollout.backend != VLLM_BACKEND:
            return
        from dsrl.rollout.vllm import check_servable

        try:
            check_servable(self.weights().config, on_cpu=not self.on_gpu)
        except ImportError as e:
            raise ConfigError(str(e)) from None

    def check_moe(self) -> MoELayout | None:
        """The mixture-of-experts refusals that need the model or this machine
        (:func:`dsrl.rl.policy.moe.check_moe_run`: replay or a load-balancing loss with a dense or unroutable model,
        replay with a backend that cannot return routes here); every rank of every role runs them. Returns the
        policy's routing layout (None when dense)."""
        from dsrl.rl.policy.moe import check_moe_run

        return check_moe_run(self.settings.model, self.settings.rollout, self.on_gpu)

    def backend_kwargs(self, prompts_per_call: int) -> dict[str, Any]:
        """What a backend needs beyond the rollout settings: a vLLM engine its sizes and seed; continuous batching
        (``cb``, ``auto``) the run's largest call (:meth:`call_bounds`), so one manager serves every rollout."""
        st = self.settings
        if st.rollout.backend != VLLM_BACKEND:  # with the offload, cb's cache leaves the device after generation too
            return {"bounds": self.call_bounds(prompts_per_call), "release_between_calls": st.memory.offload_states}
        from dsrl.core.buckets import bucket_bytes

        return {"max_model_len": max(st.max_generation_tokens, st.max_eval_generation_tokens),
                "samples_per_prompt": st.samples_per_prompt, "seed": st.seed, "sleep_level": st.memory.vllm_sleep_level,
                "bucket_bytes": bucket_bytes(st.memory.weight_sync_bucket_mib)}

    def call_bounds(self, prompts_per_call: int) -> CallBounds:
        """The run's largest call (:class:`dsrl.rollout.cb.CallBounds`): ``prompts_per_call`` prompts of G samples,
        each sequence at most ``max_generation_tokens``, at most ``new_tokens_per_call`` new tokens per call and
        ``calls_per_rollout`` calls per rollout (:class:`RolloutSideSettings`)."""
        from dsrl.rollout.cb import CallBounds

        st = self.settings
        return CallBounds.of_run(prompts_per_call, st.samples_per_prompt, st.rollout.generation_batch_size,
                                 st.max_generation_tokens, new_tokens=st.new_tokens_per_call,
                                 calls_per_rollout=st.calls_per_rollout)

    def planned_workload(self, prompts_per_call: int, tensor_parallel: int = 1,
                         expert_parallel: int = 1) -> GenerationWorkload:
        """The generation workload ``rollout.backend = "auto"`` will decide from
        (:class:`dsrl.rollout.auto.GenerationWorkload`), built as the backend builds it at run time but without
        the model's weights: its parameters are counted on the meta device (a checkpoint's config.json is read,
        nothing else; LoRA adapters are left out of the count). Raises what reading the model's config raises."""
        from dsrl.rl.policy.model import resolve_dtype
        from dsrl.rollout.auto import generation_workload

        st = self.settings
        parameters, attn = self._model_facts()
        device = torch.device("cuda" if self.on_gpu else "cpu")
        return generation_workload(device, resolve_dtype(st.model.dtype, self.on_gpu), attn, parameters, st.rollout,
                                   self.call_bounds(prompts_per_call), tensor_parallel, expert_parallel)

    def model_config(self) -> Any:
        """The policy's transformers config, read without its weights: ``model.path``'s config.json, or the tiny
        model's."""
        from transformers import AutoConfig

        from dsrl.rl.policy.model import tiny_config

        m, tok = self.settings.model, self.tokenizer
        if m.path:
            return AutoConfig.from_pretrained(m.path, local_files_only=True)
        return tiny_config(m.arch, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, m.tiny)

    def check_context_length(self) -> None:
        """Refuse, before the model is built, a run whose longest sequence -- ``data.max_prompt_tokens`` plus the
        completion (``rollout.max_new_tokens``, with an environment the trajectory bound and one more turn), in
        training or in an evaluation (``eval.max_new_tokens``) -- does not fit the model's positions
        (``max_position_embeddings``): past them the model has no trained position, so the run would train on
        nonsense or fail mid-way."""
        config = self.model_config()
        limit = getattr(config, "max_position_embeddings", None)
        st = self.settings
        longest = max(st.max_generation_tokens, st.max_eval_generation_tokens)
        if not isinstance(limit, int) or longest <= limit:
            return
        where = f"{st.model.path}/config.json" if st.model.path else "the tiny model's config (dsrl.model.tiny)"
        evaluation = st.max_eval_generation_tokens > st.max_generation_tokens
        new = "dsrl.eval.max_new_tokens" if evaluation else "dsrl.rollout.max_new_tokens"
        raise ConfigError(
            f"dsrl.data.max_prompt_tokens plus {new} (and any multi-turn budget) make sequences of up to {longest} "
            f"tokens, more than the model's max_position_embeddings = {limit} ({where}): positions past it were never "
            f"trained. Fix: lower dsrl.data.max_prompt_tokens or {new} so that they fit {limit} tokens.")

    def _model_facts(self) -> tuple[int, str | None]:
        """(parameters, attention implementation) of the policy as :meth:`build_model` would build it, counted on
        the meta device (no weights read or allocated)."""
        from transformers import AutoModelForCausalLM

        from dsrl.rollout.cb import num_parameters

        m = self.settings.model
        config = self.model_config()
        attn = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, **attn)
        except ImportError:  # e.g. flash-attn named but not installed on this machine: the run would refuse it
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            return num_parameters(model), m.attn_implementation
        return num_parameters(model), model.config._attn_implementation

    def backend(self, policy: PolicyForwards | torch.nn.Module, prompts_per_call: int) -> RolloutBackend:
        """The run's ``rollout.backend`` generating with ``policy`` (an RLEngine, or this side's model), whose
        calls have at most ``prompts_per_call`` prompts (a replica's share of a rollout, P / D)."""
        return make_backend(self.settings.rollout, policy, self.tokenizer, **self.backend_kwargs(prompts_per_call))

    def on_generator_device(self) -> torch.nn.Module:
        """A generator's model on this rank's device (``LOCAL_RANK`` on an accelerator) in the policy dtype, every
        tensor (PEFT keeps adapters in float32; DeepSpeed casts the trainers' whole module to bf16/fp16 the same
        way). No flag is touched (module docstring). Trainers leave this to DeepSpeed."""
        from dsrl.rl.policy.model import resolve_dtype

        model = self.model
        if self.on_gpu:
            import os

            model = model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        self._model = model.to(resolve_dtype(self.settings.model.dtype, self.on_gpu))
        return self._model
