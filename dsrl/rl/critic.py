"""The critic of algorithms with a value model (``ppo``): a second :class:`dsrl.core.engine.TrainEngine`.

The value model is ``transformers.AutoModelForTokenClassification`` with one label: the causal LM's
backbone plus a linear ``score`` head giving one scalar per position (loaded from ``critic.path``, a
causal-LM checkpoint whose head is then new, or built like the policy's tiny model). Dropout in the
head is switched off, so a value forward is a deterministic function of the weights. The value at the
position whose target is completion token t is V(s_t), the estimate before emitting that token, and
lines up with the policy's log-probs (:mod:`dsrl.algos.gae`).

Invariants kept here:

- the critic's run file is the policy's with the ``dsrl.critic`` sections swapped in
  (:func:`critic_config`): the same batch plan and parallel layout, so the critic trains on exactly
  the policy's micro-batches, one optimizer step per mini-batch, with its own optimizer, ZeRO stage
  and LR schedule whose horizon is the critic's own step count (warm-up rollouts included);
- the value loss (:func:`dsrl.algos.losses.clipped_value_loss`) is aggregated ``token-mean`` over the
  mini-batch by the same step core as the policy loss: exact under any split, ZeRO stage or rank count;
- every forward goes through the engine and through :meth:`TrainEngine.forward_no_grad` /
  :meth:`TrainEngine.train_mini_batch`, so every rank runs the same number of forwards and backwards
  (ZeRO-3 gathers parameters in each one).

The seam: the trainer and the experience maker see the critic as one collaborator, a :class:`Critic` or the
:data:`NO_CRITIC` null object (an algorithm without a value model), with the same four duties -- the rollout's
values (:meth:`Critic.add_values`), one step per mini-batch (:meth:`Critic.train_mini_batch`), its engine in the
checkpoint (:meth:`Critic.companions`) and its metrics -- and one attribute, ``present``, for the one decision it
implies elsewhere (advantages by GAE from its values, or group advantages). Whether a run has a critic is decided
once, by :func:`dsrl.rl.run.engines.prepare_critic` (None without one) and :func:`dsrl.rl.run.engines.build_critic`,
where the composition root builds the critic's engine.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dsrl.algos.losses import clipped_value_loss
from dsrl.config import Config, ConfigError, load_config
from dsrl.config.names import TOKEN_MEAN
from dsrl.core.engine import TrainEngine
from dsrl.rl.data.batching import PassBatches
from dsrl.runtime.metrics import CRITIC_STEP_METRICS, critic_record
from dsrl.runtime.phases import PhaseClock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ds_config sections that write files: the critic's engine leaves them to the policy's (dsrl logs the
# critic's metrics through the policy engine's monitor, with a "critic_" prefix).
_MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")


def critic_config(cfg: Config) -> Config:
    """The critic's run file: the policy's, with every set ``dsrl.critic`` section swapped in, ``token-mean``
    aggregation, and a plan whose horizon is the critic's own steps (every rollout, no supervised warm-up)."""
    c = cfg.dsrl.critic
    ds = copy.deepcopy(cfg.ds_config)
    for key in _MONITORS:
        ds.pop(key, None)
    if c.zero_optimization is not None:
        ds["zero_optimization"] = copy.deepcopy(c.zero_optimization)
    if c.optimizer is not None:
        ds["optimizer"] = copy.deepcopy(c.optimizer)
    if c.lr is not None:
        opt = ds.get("optimizer")
        if not isinstance(opt, dict):
            raise ConfigError("dsrl.critic.lr is set but neither dsrl.critic.optimizer nor the ds_config has an "
                              "optimizer section to set it in. Fix: add an \"optimizer\" section.")
        opt.setdefault("params", {})["lr"] = c.lr
    if c.gradient_clipping is not None:
        ds["gradient_clipping"] = c.gradient_clipping
    section = cfg.dsrl.model_dump()
    if c.scheduler is not None:
        ds["scheduler"] = copy.deepcopy(c.scheduler)
        section["scheduler"] = {}  # the critic's own schedule replaces a transformers named one
    section["batch"]["loss_agg"] = TOKEN_MEAN
    section["critic"]["warmup_rollouts"] = 0
    section["sft"]["steps"] = 0  # the supervised warm-up trains the policy only
    return load_config({**ds, "dsrl": section})


def build_value_model(cfg: Config, tokenizer: PreTrainedTokenizerBase, on_gpu: bool, seed: int) -> torch.nn.Module:
    """``AutoModelForTokenClassification(num_labels=1)`` from ``critic.path``, else ``model.path``, else the
    tiny model of ``model.arch``/``model.tiny`` (seeded like the policy); head dropout off, train mode."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from dsrl.rl.policy.model import resolve_dtype, tiny_config

    d = cfg.dsrl
    dtype = resolve_dtype(d.model.dtype, on_gpu)
    attn = {"attn_implementation": d.model.attn_implementation} if d.model.attn_implementation else {}
    path = d.critic.path or d.model.path
    if path:
        where = "dsrl.critic.path" if d.critic.path else "dsrl.model.path"
        if not os.path.isdir(path):
            raise ConfigError(f"{where} = {path!r} is not a directory. Fix: point it at a local Hugging Face model "
                              "directory (config.json + weights).")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        config.num_labels, config.classifier_dropout = 1, 0.0
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, local_files_only=True,
                                                                dtype=dtype, **attn)
    else:
        config = tiny_config(d.model.arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                             tokenizer.eos_token_id, d.model.tiny)
        config.num_labels, config.classifier_dropout = 1, 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForTokenClassification.from_config(config, dtype=dtype, **attn)
    if d.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def forward_values(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(s_t) at every position of a collated micro-batch, ``[b, t]`` float32 (padded or packed rows)."""
    out = model(input_ids=micro["input_ids"], attention_mask=micro.get("attention_mask"),
                position_ids=micro["position_ids"], use_cache=False)
    return out.logits[..., 0].float()


class Critic:
    """The value model's engine and what the trainer and the experience maker ask of it (module docstring): the
    rollout's values, one exact optimizer step per mini-batch (its results kept for the rollout's metrics), its
    engine in the checkpoint (a companion of the policy's)."""

    present = True

    def __init__(self, rl: TrainEngine, value_clip: float | None, phases: PhaseClock | None = None):
        self.rl = rl
        self.value_clip = value_clip
        self.phases = phases or PhaseClock()  # times the values pass as the ``critic_values`` phase
        self.results: list[dict[str, Any]] = []  # this rollout's step results

    def values(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The rollout's values per micro-batch (``[b, t]``, on the device), before any update; every rank runs
        the same number of forwards."""
        return self.rl.forward_no_grad(micro_batches, forward_values)

    def token_loss(self, values: torch.Tensor,
                   micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token clipped value loss of :func:`forward_values`' output and metrics (the new values, the returns,
        the clip indicator): the engine seam's second part (:mod:`dsrl.core.engine`)."""
        loss, m = clipped_value_loss(values, micro["old_values"], micro["returns"], self.value_clip)
        return loss, {"vf_clip_frac": m["vf_clip_frac"], "value": values.detach(), "return": micro["returns"]}

    def add_values(self, batches: PassBatches) -> None:
        """Each sample's ``values``: V(s_t) at its completion tokens, from the no-grad micro-batches the policy's
        log-probs were computed on (:class:`dsrl.rl.data.batching.PassBatches`), once per rollout, before any update,
        timed as the ``critic_values`` phase (one device-to-host copy for the pass)."""
        samples = [s for g in batches.groups for s in g]
        with self.phases.phase("critic_values"):
            for s, values in zip(samples, batches.per_sample(self.values(batches.micros))):
                s.values = values

    def begin_rollout(self) -> None:
        self.results = []

    def train_mini_batch(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One exact optimizer step of the critic over the same micro-batches the policy steps on (timed in
        ``step_s``, kept for :meth:`rollout_metrics`)."""
        t0 = time.perf_counter()
        res = self.rl.train_mini_batch(micro_batches, forward_values, self.token_loss)
        res["step_s"] = time.perf_counter() - t0
        self.results.append(res)
        return res

    def companions(self) -> dict[str, Any]:
        """The engines saved and resumed in the policy's checkpoint commit."""
        return {"critic": self.rl}

    @staticmethod
    def step_metrics(res: Any) -> dict[str, Any]:
        """The critic's part of a step row of metrics.jsonl (``critic_<name>``)."""
        return {f"critic_{k}": res[k] for k in CRITIC_STEP_METRICS if k in res}

    def rollout_metrics(self) -> dict[str, Any]:
        """The critic's part of the rollout row (empty without steps)."""
        return critic_record(self.results)


class NoCritic:
    """The critic of an algorithm without a value model: no values, no steps, nothing saved, no metrics."""

    present = False
    results: tuple[Any, ...] = ()

    def add_values(self, batches: PassBatches) -> None:
        return None

    def begin_rollout(self) -> None:
        return None

    def train_mini_batch(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> None:
        return None

    def companions(self) -> dict[str, Any]:
        return {}

    def step_metrics(self, res: Any) -> dict[str, Any]:
        return {}

    def rollout_metrics(self) -> dict[str, Any]:
        return {}


NO_CRITIC = NoCritic()
