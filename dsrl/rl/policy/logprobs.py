"""The policy's per-token log-probs (and entropy) from one forward, without full-vocabulary logits.

:func:`forward_logprobs` ``(model, micro)`` is the one entry point every pass uses (old and reference
log-probs, the training loss, the supervised warm-up): it runs the model once on a collated micro-batch
and returns :class:`TokenLogprobs`, the statistics of :mod:`dsrl.core.logprobs` (log pi(target), entropy,
target gap) at the selected positions.

How. The model runs as usual, but for that call its output head's ``forward`` is replaced by one that
takes the hidden states, keeps the selected rows and returns their statistics ``[n, STATS]``
(:func:`dsrl.core.logprobs.head_stats`: the head fused into a tiled log-softmax) instead of logits
``[b, t, V]``. The head *module* is still called, only its body differs, so whatever hooks the module
keeps working: ZeRO-3 gathers the head's weight for its forward and, through the statistics (the
module's output), again for its backward; a tied embedding is the same parameter; PEFT and AutoTP
wrappers dispatch to it. Supported heads: a plain ``torch.nn.Linear`` (also AutoTP's replicated head and
a ZeRO-3-partitioned or tied one), the linear layers a PEFT ``ModulesToSaveWrapper`` dispatches to, and
AutoTP's column-parallel head that gathers its output (an untied head under AutoTP: the vocabulary-parallel
variant over the tensor group, :func:`dsrl.backends.deepspeed.autotp.vocab_shard_of`).

Invariants, checked on every call: the head runs exactly once, on hidden states ``[b, t, H]`` of the
micro-batch, and the model returns the head's output unchanged as its logits (a model that post-processes
its logits, e.g. soft-capping or scaling them, is refused with its name). A model whose head is of
another kind, or whose config says it post-processes logits, takes the logits path instead (the model's
own full logits, then :func:`dsrl.core.logprobs.logit_stats` over the selected rows), with a warning that
names the reason, once per process. No other thread may run the model during a call (generation and the
log-prob passes never overlap on one rank).

The selection: ``micro[LOGPROB_MASK]`` (``"logprob_mask"``, ``[b, t]`` bool, kept on the host by
:func:`dsrl.rl.data.batching.collate`: the positions whose target is a completion token, observation
tokens of a trajectory included), or every position when the micro-batch has none. A host mask becomes
the index without a device synchronization (a device mask costs one). A micro-batch with prompt-shared rows
(:mod:`dsrl.rl.data.prefix`) runs those rows and takes the same selection, in the same order, from their positions
(``micro[PREFIX_INDEX]``); the statistics come back in the padded layout all the same.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.core.logprobs import (
    ENTROPY,
    LOGPROB,
    LOGPROB_MASK,
    TARGET_GAP,
    VocabShard,
    declared_vocab_shard,
    head_stats,
    logit_stats,
)
from dsrl.rl.data.prefix import PREFIX_ATTENTION_MASK, PREFIX_INDEX, PREFIX_INPUT_IDS, PREFIX_POSITION_IDS

# transformers config fields of models that change the head's output before returning it as logits
POSTPROCESSING_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
log = logging.getLogger("dsrl.rl.policy.logprobs")
_warned: set[str] = set()


@dataclass(frozen=True)
class TokenLogprobs:
    """One micro-batch's statistics at its selected positions, and how to lay them out as ``[b, t]``.

    ``stats`` ``[n, STATS]`` float32, in row-major order of the selected positions (``index``: their flat
    positions in ``[b * t]``; None = every position); it carries autograd when the model's parameters do.
    The ``[b, t]`` views hold zeros outside the selection (weight 0 in every loss)."""

    stats: torch.Tensor
    index: torch.Tensor | None
    shape: tuple[int, int]
    entropy_grad: bool = False

    def dense(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[n]`` scattered to ``[b, t]`` (zeros elsewhere; differentiable)."""
        if self.index is None:
            return values.reshape(self.shape)
        b, t = self.shape
        out = torch.zeros(b * t, dtype=values.dtype, device=values.device)
        return out.index_copy(0, self.index, values).view(b, t)

    @property
    def selected_logprobs(self) -> torch.Tensor:
        """log pi(target) at the selected positions, ``[n]``."""
        return self.stats[:, LOGPROB]

    @property
    def logprobs(self) -> torch.Tensor:
        """log pi(target) ``[b, t]``."""
        return self.dense(self.stats[:, LOGPROB])

    @property
    def entropy(self) -> torch.Tensor:
        """The entropy ``[b, t]`` (0 unless asked for; detached unless ``entropy_grad``)."""
        ent = self.stats[:, ENTROPY]
        return self.dense(ent if self.entropy_grad else ent.detach())

    @property
    def target_is_top(self) -> torch.Tensor:
        """1.0 where the target has the largest logit (ties count), ``[b, t]``, no gradient."""
        return self.dense((self.stats[:, TARGET_GAP].detach() == 0).float())


def run_causal_lm(model: Any, micro: dict[str, Any]) -> Any:
    """The forward of a Hugging Face causal LM on a collated micro-batch (padded or packed rows, or the prompt-shared
    rows of :mod:`dsrl.rl.data.prefix` when the micro-batch holds them).

    Packed rows have no attention_mask: transformers derives the block-diagonal mask from ``position_ids``,
    which it only does without a KV cache (``use_cache=False``). Shared rows carry a 4-D mask, which transformers
    uses as given."""
    if PREFIX_INPUT_IDS in micro:
        return model(input_ids=micro[PREFIX_INPUT_IDS], attention_mask=micro[PREFIX_ATTENTION_MASK],
                     position_ids=micro[PREFIX_POSITION_IDS], use_cache=False)
    return model(input_ids=micro["input_ids"], attention_mask=micro.get("attention_mask"),
                 position_ids=micro["position_ids"], use_cache=False)


def forward_logprobs(model: Any, micro: dict[str, Any], *, temperature: float = 1.0, entropy: bool = False,
                     entropy_grad: bool = False,
                     run: Callable[[Any, dict[str, Any]], Any] = run_causal_lm) -> TokenLogprobs:
    """Run ``model`` (a DeepSpeed engine, or the module itself) once on ``micro`` and return the statistics of
    its selected positions (module docstring); ``run(model, micro)`` is the forward (default: a causal LM's).

    ``temperature`` divides the logits, as sampling does; ``entropy`` computes the entropy from the same
    chunks, ``entropy_grad`` lets a gradient flow from it. Autograd follows grad mode.
    """
    targets = micro["targets"]
    b, t = targets.shape
    index = _selection(micro, targets.device)
    chosen = targets.reshape(-1) if index is None else targets.reshape(-1).index_select(0, index)
    # the positions the forward's rows give them at: the same, or those of the prompt-shared rows
    shared = PREFIX_INDEX in micro
    rows_index = micro[PREFIX_INDEX] if shared else index
    rows_shape = tuple(micro[PREFIX_INPUT_IDS].shape) if shared else (b, t)
    options = {"temperature": temperature, "entropy": entropy, "entropy_grad": entropy_grad}
    fused = fused_head(_module_of(model))
    if isinstance(fused, str):
        _warn_once(fused)
        logits = _logits_of(run(model, micro))
        rows = logits.reshape(-1, logits.shape[-1])
        rows = rows if rows_index is None else rows.index_select(0, rows_index)
        return TokenLogprobs(logit_stats(rows, chosen, **options), index, (b, t), entropy_grad)
    linears, shard = fused
    calls: list[torch.Tensor] = []
    compute = functools.partial(_stats_forward, index=rows_index, targets=chosen, shard=shard, calls=calls,
                                shape=rows_shape, options=options)
    with _replaced_forward(linears, compute):
        out = run(model, micro)
    logits = _logits_of(out)
    stats = calls[0]
    if logits.shape != stats.shape or logits.untyped_storage().data_ptr() != stats.untyped_storage().data_ptr():
        raise RuntimeError(
            f"{type(_module_of(model)).__name__} changes its output head's result before returning it as logits "
            "(e.g. logit soft-capping or scaling), which dsrl's fused log-probs (dsrl.rl.policy.logprobs) cannot "
            f"reproduce. Fix: add the config field that does it to {__name__}.POSTPROCESSING_FIELDS (the logits "
            "path then handles the model), or use a model whose logits are its output head's.")
    return TokenLogprobs(logits, index, (b, t), entropy_grad)


def fused_head(module: torch.nn.Module) -> tuple[list[torch.nn.Module], VocabShard | None] | str:
    """(the linear layers whose forward :func:`forward_logprobs` replaces, the vocabulary shard they hold or None)
    for ``module``'s output head, or the reason (a sentence) why the logits path must be taken."""
    config = getattr(module, "config", None)  # a transformers model's; custom models may have none
    for name in POSTPROCESSING_FIELDS:
        value = getattr(config, name, None)
        if value not in (None, 0, 1, 1.0):
            return (f"{type(module).__name__} post-processes its logits (config.{name} = {value!r}), so its "
                    "output head cannot be fused into the log-softmax")
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return (f"{type(module).__name__} exposes no output head (get_output_embeddings), so its log-probs come "
                "from its full logits")
    if _is_plain_linear(head):
        return [head], None
    shard = declared_vocab_shard(head)  # the engine that sharded the head declared it (dsrl.core.logprobs)
    if shard is not None:
        return [head], shard
    wrapped = _modules_to_save(head)
    if wrapped is not None and all(_is_plain_linear(m) for m in wrapped):
        return wrapped, None
    return (f"the output head of {type(module).__name__} is a {type(head).__module__}.{type(head).__qualname__}, "
            "not a plain linear layer (e.g. LoRA adapters on lm_head), so it cannot be fused into the log-softmax")


def _is_plain_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _modules_to_save(head: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The modules a PEFT ``ModulesToSaveWrapper`` dispatches to (its original and every adapter's copy)."""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return None
    if not isinstance(head, ModulesToSaveWrapper):
        return None
    return [head.original_module, *head.modules_to_save.values()]


def _module_of(model: Any) -> torch.nn.Module:
    """The module a DeepSpeed engine wraps, or ``model`` itself."""
    from deepspeed import DeepSpeedEngine

    return model.module if isinstance(model, DeepSpeedEngine) else model


def _logits_of(out: Any) -> torch.Tensor:
    """A model's logits: its output if a tensor (a custom model), else the output's ``logits`` (transformers)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def _selection(micro: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The flat positions of ``micro[LOGPROB_MASK]`` on ``device`` (None: no mask, every position)."""
    mask = micro.get(LOGPROB_MASK)
    if mask is None:
        return None
    index = torch.nonzero(mask.reshape(-1)).squeeze(1)
    return index.to(device, non_blocking=True)


def _stats_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *, index: torch.Tensor | None,
                   targets: torch.Tensor, shard: VocabShard | None, calls: list[torch.Tensor],
                   shape: tuple[int, int], options: dict[str, Any]) -> torch.Tensor:
    """The replaced forward of an output head: the statistics of the selected rows of ``hidden_states``."""
    if calls:
        raise RuntimeError(f"the output head ran {len(calls) + 1} times in one forward; dsrl's fused log-probs "
                           "(dsrl.rl.policy.logprobs) need exactly one call on the whole sequence")
    if tuple(hidden_states.shape[:-1]) != shape:
        raise RuntimeError(f"the output head was called on hidden states {tuple(hidden_states.shape)}, not on every "
                           f"position of the micro-batch {shape}; dsrl's fused log-probs need all of them")
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    rows = rows if index is None else rows.index_select(0, index)
    stats = head_stats(rows, module.weight, targets, module.bias, shard=shard, **options)
    calls.append(stats)
    return stats


@contextlib.contextmanager
def _replaced_forward(modules: list[torch.nn.Module], compute: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Each module's forward is ``compute(module, x)`` inside the block; its own (class or instance) forward after."""
    saved = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = functools.partial(compute, m)
    try:
        yield
    finally:
        for m, own in zip(modules, saved):
            if own is None:
                del m.forward
            else:
                m.forward = own


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("dsrl log-probs take the logits path (full-vocabulary logits, then a chunked log-softmax): %s",
                    reason)
