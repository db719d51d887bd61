"""DeepSpeed AutoEP (``"expert_parallel": {"enabled": true, "autoep_size": N}``) as dsrl runs it.

Measured with DeepSpeed 0.19.8 on 2 CPU ranks (gloo): AutoEP replaces each Hugging Face MoE block
(Mixtral, Qwen2/Qwen3-MoE presets) by an ``AutoEPMoELayer`` whose experts are split over an
expert-parallel group (tokens travel by all-to-all); expert gradients are reduced over the
expert-data-parallel group and come out with the same averaging factor as the dense gradients, so
the exact step's single factor D (:func:`dsrl.backends.deepspeed.view.deepspeed_view`) is right for both kinds of
parameters (checked against a float64 reference by ``dsrl.check``).

Two things dsrl has to provide:

- **a compatibility fix.** With transformers >= 5.x (5.23 here), AutoEP's model presets fail while
  the engine is built: ``deepspeed/module_inject/auto_ep_presets/base.py`` line 326 calls
  ``registry.get(registry_key, _MISSING_REGISTRY_ENTRY)`` on ``transformers.utils.output_capturing.
  _CAN_RECORD_REGISTRY``, whose ``_CanRecordRegistry.get(self, model)`` takes one argument
  (``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``). It does not
  depend on the accelerator. :func:`ensure_transformers_compat` gives that ``get`` an optional default
  for string keys (the class names the registry stores), leaving every other call unchanged; dsrl
  applies it only when expert parallelism is enabled;
- **MoE parameter groups.** ZeRO-1/2 assert that an optimizer over a model with AutoEP layers has
  param groups marked ``moe``; an optimizer DeepSpeed builds from the ds_config gets them, a client
  optimizer must be built by a callable that calls ``deepspeed.moe.utils.configure_moe_param_groups``
  (:func:`moe_optimizer`).

:func:`full_parameters` maps the AutoEP layout back to the Hugging Face parameter names (experts
all-gathered over the expert-parallel group), for checks and tests.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from dsrl.config import ConfigError

SECTION = "expert_parallel"
log = logging.getLogger("dsrl")


def expert_parallel_enabled(ds_config: dict[str, Any]) -> bool:
    """Whether the ds_config enables AutoEP."""
    section = ds_config.get(SECTION)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def expert_parallel_size(ds_config: dict[str, Any]) -> int:
    """``expert_parallel.autoep_size`` when AutoEP is enabled, else 1."""
    if not expert_parallel_enabled(ds_config):
        return 1
    size = ds_config[SECTION].get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"ds_config {SECTION}.autoep_size = {size!r} must be a positive integer (the ranks that "
                          "split the experts of one MoE layer). Fix: set it to a divisor of the world size.")
    return size


def check_expert_layout(ds_config: dict[str, Any], world_size: int) -> None:
    """The experts of one layer are split over ``autoep_size * expert_tensor_parallel_size`` ranks, which
    must divide the world (DeepSpeed's ``build_folding_spec`` rule, checked here before any work)."""
    ep = expert_parallel_size(ds_config)
    if ep <= 1:
        return
    etp = ds_config[SECTION].get("expert_tensor_parallel_size", 1)
    if isinstance(etp, int) and not isinstance(etp, bool) and etp >= 1 and world_size % (ep * etp):
        what = f"{SECTION}.autoep_size = {ep}" + (f" x expert_tensor_parallel_size = {etp}" if etp > 1 else "")
        raise ConfigError(f"ds_config {what} does not divide the world size {world_size}: the experts of a layer are "
                          f"split over {ep * etp} ranks. Fix: choose a divisor of {world_size}.")


def ensure_transformers_compat() -> bool:
    """Apply the fix of the module docstring if this transformers needs it; True when it was applied."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    registry_cls = type(getattr(output_capturing, "_CAN_RECORD_REGISTRY", None))
    get = getattr(registry_cls, "get", None)
    if get is None or registry_cls is dict or getattr(get, "_dsrl_compat", False):
        return False
    if len(inspect.signature(get).parameters) != 2:  # (self, model): the version DeepSpeed cannot call
        return False

    def get_with_default(self: dict, key: Any, default: Any = None) -> Any:
        if isinstance(key, str):  # DeepSpeed's AutoEP looks entries up by their stored class-name key
            return dict.get(self, key, default)
        return get(self, key)

    get_with_default._dsrl_compat = True  # type: ignore[attr-defined]
    registry_cls.get = get_with_default
    log.info("dsrl: transformers' output-capture registry given a default argument for DeepSpeed AutoEP "
             "(dsrl.backends.deepspeed.autoep.ensure_transformers_compat)")
    return True


def moe_optimizer(make: Callable[[Any], torch.optim.Optimizer]) -> Callable[[Any], torch.optim.Optimizer]:
    """A client-optimizer callable for ``deepspeed.initialize`` that splits the (AutoEP-replaced)
    parameters into DeepSpeed's dense and MoE param groups before calling ``make(param_groups)``."""

    def build(params: Any) -> torch.optim.Optimizer:
        from deepspeed.moe.utils import configure_moe_param_groups

        return make(configure_moe_param_groups(list(params)))

    return build


# -- the AutoEP layout back in Hugging Face names ------------------------------------------------
_EXPERT_META = "ds_autoep_uc_meta"


def _gather_experts(local: torch.Tensor, meta: dict[str, Any], group: Any) -> torch.Tensor:
    """[num_experts, ...] from this rank's [local_experts, ...], placed by the expert placement table."""
    import torch.distributed as dist

    placement = meta["expert_placement"]
    parts = [torch.empty_like(local) for _ in placement["ranks"]]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = local.new_empty((placement["num_experts"], *local.shape[1:]))
    for entry, part in zip(sorted(placement["ranks"], key=lambda e: e["rank"]), parts):
        full[list(entry["experts"])] = part
    return full


def hf_parameters(named: dict[str, torch.Tensor], metas: dict[str, dict[str, Any]],
                  group_of: Callable[[str], Any]) -> dict[str, torch.Tensor]:
    """Parameters of an AutoEP-replaced model under the Hugging Face names of the fused-expert presets
    (Mixtral, Qwen-MoE): ``router.gate.weight`` -> ``gate.weight``; experts ``w1`` (gate) and ``w3``
    (up) -> ``gate_up_proj`` (concatenated on dim 1, gate first); ``w2`` -> ``down_proj``. The experts named in
    ``metas`` are this rank's and get all-gathered over their expert-parallel group first."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        if name in metas:
            prefix, _, leaf = name.rpartition(".")
            experts.setdefault(prefix, {})[leaf] = _gather_experts(t, metas[name], group_of(name))
        else:
            out[name.replace(".router.gate.", ".gate.")] = t
    return _fuse_experts(out, experts)


def hf_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A consolidated AutoEP checkpoint (DeepSpeed's universal conversion: every expert already whole,
    ``[experts, ...]``) under the Hugging Face names of :func:`hf_parameters`. The conversion also writes each
    router's gate a second time under the MoE block's output-capture alias (``mlp.gate.gate.weight``, equal to
    ``mlp.router.gate.weight``); that copy is dropped."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in full.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("w1", "w2", "w3"):
            experts.setdefault(prefix, {})[leaf] = t
        elif ".gate.gate." in name and name.replace(".gate.gate.", ".router.gate.") in full:
            continue
        else:
            out[name.replace(".router.gate.", ".gate.")] = t
    return _fuse_experts(out, experts)


def _fuse_experts(out: dict[str, torch.Tensor], experts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for prefix, w in experts.items():
        if set(w) != {"w1", "w2", "w3"}:
            raise ValueError(f"AutoEP experts {prefix} hold {sorted(w)}; dsrl maps the fused gate/up layout "
                             "(w1, w2, w3)")
        out[f"{prefix}.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"{prefix}.down_proj"] = w["w2"]
    return out


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Full float64 CPU parameters of an engine (ZeRO-3 gathered, AutoTP shards and AutoEP experts
    reassembled) under the model's Hugging Face names, on every rank. Collective."""
    from dsrl.backends.deepspeed.autotp import full_parameters as tp_full

    full = tp_full(engine)
    metas = {n: getattr(p, _EXPERT_META) for n, p in engine.module.named_parameters() if hasattr(p, _EXPERT_META)}
    if not metas:
        return full
    from deepspeed.utils import groups

    group_names = {n: p.group_name for n, p in engine.module.named_parameters() if n in metas}
    return hf_parameters(full, metas, lambda n: groups._get_expert_parallel_group(group_names[n]))
