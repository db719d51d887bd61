"""``rollout.backend = "auto"`` (the default): ``hf`` (static batches through ``generate``) or ``cb`` (continuous
batching), chosen for the run's whole generation workload by a fixed rule whose constants come from measurements
in the training loop.

The rule (:func:`choose_backend`) is a pure function of a :class:`GenerationWorkload`: everything known before the
run (device, the model's attention and size, the tensor- and expert-parallel layout, the call's concurrency C =
min(prompts per rank, ``generation_batch_size``) * G of the run's largest call (:class:`dsrl.rollout.cb.CallBounds`),
the most new tokens a call adds to a sequence L (``rollout.max_new_tokens``; with an environment per model turn,
within ``max_trajectory_tokens``) and the generate calls a rollout makes (model turns, dynamic-sampling rounds)).
Never a timing: every call of a run, and a resumed run, chooses alike, and a call's result stays a function of
weights, prompts, settings and seed. Both backends gather ZeRO-3 parameters exactly once per call, so ranks that
choose differently would still issue the same collectives. The choice is per call: turns and sampling rounds repeat
calls, each paying ``cb``'s costs and getting its savings, so the calls per rollout are part of the workload
``dsrl plan`` shows but move no bound. ``dsrl plan`` prints the choice and the reason (the workload built from the
run file by :meth:`dsrl.rl.policy.rollout_side.RolloutSide.planned_workload`, as :func:`generation_workload` builds
it at run time).

What decides, in order:

- tensor parallelism (AutoTP): ``hf``, whose stopping criterion keeps tensor peers stepping together
  (:class:`dsrl.rollout.policy.TensorPeersStop`); AutoEP: ``hf``, which runs every rank's forwards in lockstep over
  the expert-parallel group;
- the CPU (sdpa/eager; measured in the training loop, ``bench/auto_grid.py``, table in docs/rollout.md). ``cb``
  spends per-request scheduling in Python at every step and a thread hand-off per call; what it saves is the decode
  work ``hf`` spends on sequences that already ended (a static batch runs to its longest member). A decode step's
  work, C x parameters, is what that saving is a share of, and the share is small in short calls (most sequences
  run to the limit), so ``cb`` only where the step is heavy enough:
  - short calls (L < ``CPU_SHORT_NEW_TOKENS``): C x parameters >= ``CPU_SHORT_CB_MIN_STEP_WORK``. Grid: at 8-16 new
    tokens ``cb`` was slower on the 0.14 M tiny model at every C up to 512 (72 M), on the 4.2 M shape at C = 8
    and 32 (134 M) and on the 26.5 M shape at C = 8 (212 M), and as fast or faster from 538 M (the 4.2 M shape at
    C = 128, the 26.5 M shape from C = 32);
  - longer calls: C x parameters >= ``CPU_CB_MIN_STEP_WORK``. Grid: ``cb`` slower on the tiny model at C = 8
    (1.1 M) at every length, as fast or faster from C = 32 (4.5 M) from 32 new tokens on;
  - and with few sequences (C < ``CPU_FEW_SEQUENCES``) only calls of ``CPU_FEW_SEQUENCES_MIN_NEW_TOKENS`` new
    tokens or more: the 26.5 M shape at C = 8 (212 M) was slower with ``cb`` at 64 new tokens (1.04-1.34x in three
    runs) and faster at 256 (0.71-0.88x in three runs); at C = 32 it was faster from 8 new tokens on;
  - ``hf`` for a model under ``CPU_SMALL_MODEL_PARAMETERS`` at C > ``CPU_SMALL_MODEL_MAX_CB_CONCURRENCY`` when
    ``cb`` would attend through the dense mask (``rollout.cb_attention = "model"``; its ``"auto"`` packs there):
    each step then attends every query to every cached token of the step, a cost that grows with C squared
    (``bench/rollout.py``, 2026-11-23: 0.72x ``hf``'s tokens/s on the tiny model at C = 512);
- an accelerator (not measured in the loop yet; ``bench/gpu/measure.py``'s ``auto-grid`` part measures it): ``cb`` under
  dsrl's packed attention (``rollout.cb_attention`` ``"auto"`` in bf16/fp16 on a GPU with PyTorch's flash kernel)
  from C >= ``GPU_CB_MIN_CONCURRENCY``, or with a flash implementation of the model, else ``hf``. Measured once,
  generation alone (one H200, 2026-11-26, Qwen2.5-0.5B shape, bf16, C = 128, 256 new tokens, ``bench/rollout.py``
  in ``bench/gpu/measure.py``): ``generate`` 725 tokens/s, ``cb`` under the dense mask 975 (1.35x), under the packed
  attention 9,927 (13.7x); one H100 at C = 64 under the dense mask: cb/hf 0.83. Assumed, not measured: C < 128
  (``hf`` kept), short calls (a 13.7x margin is taken to survive them: ``generate`` pays its per-step launch cost
  at every length; the GPU grid's 8-new-token cells check it), flash-attn models (no lent GPU image had flash-attn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrl.config import RolloutConfig
from dsrl.config.names import CB_BACKEND, HF_BACKEND
from dsrl.rollout.base import Completion, GenerationPolicy, RolloutBackend
from dsrl.rollout.cb import (
    CallBounds,
    ContinuousBatchingBackend,
    cb_attention_implementation,
    concurrency,
    is_flash,
    num_parameters,
)
from dsrl.rollout.hf import HFRolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# CPU (bench/auto_grid.py, the training loop; docs/rollout.md): C x parameters of one decode step from which cb pays
CPU_SHORT_NEW_TOKENS = 32  # a call of fewer new tokens per sequence is short: little decode work for cb to save
CPU_SHORT_CB_MIN_STEP_WORK = 400_000_000  # short calls: between 212 M (hf faster) and 538 M (cb as fast or faster)
CPU_CB_MIN_STEP_WORK = 2_000_000  # longer calls: between 1.1 M (hf faster) and 4.5 M (cb faster)
CPU_FEW_SEQUENCES = 32  # below this C ...
CPU_FEW_SEQUENCES_MIN_NEW_TOKENS = 128  # ... cb only for calls this long: between 64 (hf faster) and 256 (cb faster)
CPU_SMALL_MODEL_PARAMETERS = 1_000_000  # the dense-mask rule (bench/rollout.py, 2026-11-23) ...
CPU_SMALL_MODEL_MAX_CB_CONCURRENCY = 256  # ... above this C
# accelerators (one H200 measurement of generation alone at C = 128 and 256 new tokens; the rest assumed)
GPU_CB_MIN_CONCURRENCY = 128


@dataclass(frozen=True)
class GenerationWorkload:
    """Everything ``auto`` decides from, all known before the run (module docstring)."""

    device_type: str  # "cpu", "cuda", ...
    attn_implementation: str | None  # the model's
    cb_attention: str | None  # the attention continuous batching would run under (cb_attention_implementation)
    parameters: int  # the full model's (a ZeRO-3 partition counts its full size)
    concurrency: int  # C: sequences of the run's largest call decoding at once
    new_tokens: int  # L: the most tokens one call adds to a sequence
    calls_per_rollout: int = 1  # generate calls per rollout at most (model turns x dynamic-sampling rounds)
    tensor_parallel: int = 1
    expert_parallel: int = 1

    def describe(self) -> str:
        """The workload in words (what ``dsrl plan`` prints beside the choice)."""
        calls = f", up to {self.calls_per_rollout} calls per rollout" if self.calls_per_rollout > 1 else ""
        attn = self.attn_implementation or "default"
        own = self.cb_attention in (None, self.attn_implementation)
        packed = "" if own else f", cb attending with {self.cb_attention}"
        return (f"{self.device_type}, {attn} attention{packed}, {self.parameters / 1e6:.3g} M parameters, "
                f"C = {self.concurrency} concurrent sequences, up to {self.new_tokens} new tokens per call{calls}")


@dataclass(frozen=True)
class AutoChoice:
    """The backend ``auto`` runs (``"hf"`` or ``"cb"``) and why, in one sentence."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def _m(parameters: int) -> str:
    return f"{parameters / 1e6:.3g} M"


def choose_backend(w: GenerationWorkload) -> AutoChoice:
    """``hf`` or ``cb`` for the workload, with the reason (module docstring: the rule and its measurements)."""
    if w.tensor_parallel > 1:
        return AutoChoice(HF_BACKEND, f"tensor parallelism (autotp_size {w.tensor_parallel}): only hf keeps tensor "
                                      "peers stepping together")
    if w.expert_parallel > 1:
        return AutoChoice(HF_BACKEND, f"AutoEP (expert_parallel_size {w.expert_parallel}): only hf runs every rank's "
                                      "forwards in lockstep over the expert-parallel group")
    C, L, p = w.concurrency, w.new_tokens, w.parameters
    packed = is_flash(w.cb_attention if w.cb_attention is not None else w.attn_implementation)
    if w.device_type == "cpu":
        step = C * p
        if L < CPU_SHORT_NEW_TOKENS and step < CPU_SHORT_CB_MIN_STEP_WORK:
            return AutoChoice(HF_BACKEND, f"short calls (at most {L} new tokens, under {CPU_SHORT_NEW_TOKENS}) with a "
                                          f"decode step of C x parameters = {C} x {_m(p)}, under "
                                          f"{CPU_SHORT_CB_MIN_STEP_WORK / 1e6:g} M: cb's scheduling costs more than "
                                          "the decoding it saves (CPU grid, docs/rollout.md)")
        if step < CPU_CB_MIN_STEP_WORK:
            return AutoChoice(HF_BACKEND, f"a decode step of C x parameters = {C} x {_m(p)}, under "
                                          f"{CPU_CB_MIN_STEP_WORK / 1e6:g} M: cb's scheduling costs more than the "
                                          "decoding it saves (CPU grid, docs/rollout.md)")
        if C < CPU_FEW_SEQUENCES and L < CPU_FEW_SEQUENCES_MIN_NEW_TOKENS:
            return AutoChoice(HF_BACKEND, f"few sequences (C = {C}, under {CPU_FEW_SEQUENCES}) in calls of at most {L} "
                                          f"new tokens (under {CPU_FEW_SEQUENCES_MIN_NEW_TOKENS}): cb's per-call costs "
                                          "outweigh the decoding it saves (CPU grid, docs/rollout.md)")
        if not packed and p < CPU_SMALL_MODEL_PARAMETERS and C > CPU_SMALL_MODEL_MAX_CB_CONCURRENCY:
            return AutoChoice(HF_BACKEND, f"cb would attend through the dense mask (rollout.cb_attention = 'model') "
                                          f"at C = {C} on a {_m(p)} parameter model: a cost growing with C squared "
                                          f"(measured 0.72x hf at C = 512)")
        return AutoChoice(CB_BACKEND, f"a decode step of C x parameters = {C} x {_m(p)} with up to {L} new tokens: "
                                      "continuous batching stops decoding each sequence at its end where hf decodes "
                                      "static batches to their longest member (CPU grid, docs/rollout.md)")
    if is_flash(w.attn_implementation):
        return AutoChoice(CB_BACKEND, f"a flash attention model ({w.attn_implementation}): continuous batching on "
                                      "varlen kernels with CUDA graphs (not measured here: public serving figures "
                                      "put it several times above static batches when lengths vary)")
    if not packed:
        return AutoChoice(HF_BACKEND, f"on {w.device_type} cb would attend through the dense mask (measured slower "
                                      "than generate on a GPU); rollout.cb_attention 'auto' packs in bf16/fp16")
    if C < GPU_CB_MIN_CONCURRENCY:
        return AutoChoice(HF_BACKEND, f"C = {C} concurrent sequences, under {GPU_CB_MIN_CONCURRENCY} (cb measured "
                                      f"13.7x generate at C = 128 on an H200; smaller C not measured)")
    return AutoChoice(CB_BACKEND, f"{C} concurrent sequences under packed attention on {w.device_type} (measured "
                                  "13.7x generate at C = 128 with 256 new tokens on one H200)")


def generation_workload(device: torch.device, dtype: torch.dtype, attn_implementation: str | None, parameters: int,
                        rollout_cfg: RolloutConfig, bounds: CallBounds, tensor_parallel: int = 1,
                        expert_parallel: int = 1) -> GenerationWorkload:
    """The workload of a run from its model facts, ``dsrl.rollout`` settings and :class:`CallBounds` (the one
    build, for the backend at run time and for ``dsrl plan`` before it)."""
    c = bounds.sequences
    cb_attn = cb_attention_implementation(rollout_cfg.cb_attention, attn_implementation, device,
                                          dtype, parameters, c)
    new_tokens = bounds.new_tokens if bounds.new_tokens is not None else rollout_cfg.max_new_tokens
    return GenerationWorkload(device_type=device.type, attn_implementation=attn_implementation,
                              cb_attention=cb_attn, parameters=parameters, concurrency=c, new_tokens=new_tokens,
                              calls_per_rollout=bounds.calls_per_rollout, tensor_parallel=tensor_parallel,
                              expert_parallel=expert_parallel)


class AutoRolloutBackend(RolloutBackend):
    """Dispatches every call to an :class:`HFRolloutBackend` or a :class:`ContinuousBatchingBackend` on the
    same policy (both share the weights; nothing is copied) by :func:`choose_backend` on the run's workload
    (:meth:`decision`); always ``hf`` when continuous batching is unavailable (an older transformers, a policy that
    is not a transformers model)."""

    def __init__(self, engine_or_module: GenerationPolicy, tokenizer: PreTrainedTokenizerBase,
                 rollout_cfg: RolloutConfig, bounds: CallBounds | None = None, release_between_calls: bool = False):
        """``release_between_calls``: continuous batching's manager is destroyed after each rollout's generation
        (:class:`dsrl.rollout.cb.ContinuousBatchingBackend`)."""
        self.hf = HFRolloutBackend(engine_or_module, tokenizer, rollout_cfg)
        try:
            self.cb: ContinuousBatchingBackend | None = ContinuousBatchingBackend(
                engine_or_module, tokenizer, rollout_cfg, bounds=bounds, release_between_calls=release_between_calls)
        except (ImportError, TypeError):
            self.cb = None
        self.cfg, self.bounds = rollout_cfg, bounds
        self.num_params = num_parameters(self.hf.module)
        policy = self.hf.policy
        self.tensor_parallel = policy.view.tensor_parallel_size if policy is not None else 1
        self.expert_parallel = self.hf.routing.expert_parallel_size if self.hf.synced else 1

    def workload(self, num_prompts: int, samples_per_prompt: int) -> GenerationWorkload:
        """The workload a call with this many prompts and samples per prompt belongs to: the run's largest call
        (its :class:`CallBounds`) when the backend has them, else this call alone."""
        bounds = self.bounds or CallBounds(
            concurrency(num_prompts, samples_per_prompt, self.cfg.generation_batch_size), 0)
        module = self.hf.module
        attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if self.cb is not None:
            attn = self.cb.model_attention()  # the model's own, also while a cb call has its packed one set
        dtype = next(module.parameters()).dtype
        return generation_workload(self.hf.device, dtype, attn, self.num_params, self.cfg, bounds,
                                   self.tensor_parallel, self.expert_parallel)

    def decision(self, num_prompts: int, samples_per_prompt: int) -> AutoChoice:
        """What ``auto`` runs for such a call, and why (the same for every call of a run with bounds)."""
        if self.cb is None:
            return AutoChoice(HF_BACKEND, "continuous batching is unavailable here (transformers >= 5.19 and a "
                                          "transformers model are needed)")
        return choose_backend(self.workload(num_prompts, samples_per_prompt))

    def choose(self, num_prompts: int, samples_per_prompt: int) -> RolloutBackend:
        """The backend a call with this many prompts and samples per prompt uses."""
        return self.cb if self.decision(num_prompts, samples_per_prompt).backend == CB_BACKEND else self.hf

    def returns_routes(self) -> bool:
        return self.hf.returns_routes()  # cb records them too, on the same policy

    def close(self) -> None:
        if self.cb is not None:
            self.cb.close()

    def sleep(self) -> None:
        if self.cb is not None:
            self.cb.sleep()

    def with_sampling(self, rollout_cfg: RolloutConfig) -> AutoRolloutBackend:
        """A new dispatcher on the same policy, choosing per call on its own workload and bounds
        (:meth:`dsrl.rollout.base.RolloutBackend.with_sampling`)."""
        return AutoRolloutBackend(self.hf.source, self.hf.tokenizer, rollout_cfg,
                                  bounds=self.bounds and self.bounds.for_sampling(self.cfg, rollout_cfg))

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int, **kwargs: Any
                 ) -> list[Completion]:
        """See :mod:`dsrl.rollout.base`; the chosen backend's ``generate``."""
        return self.choose(len(prompt_ids), samples_per_prompt).generate(prompt_ids, samples_per_prompt, seed,
                                                                          **kwargs)
