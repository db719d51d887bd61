"""What works with what: the refusals of combinations of settings, declared once.

One source for three readers, so they cannot disagree:

- the configuration's validation: :class:`dsrl.config.load.Config` calls :func:`check` on every run file it
  builds, so ``launch/train.py``, ``dsrl plan``, ``dsrl.initialize`` and ``dsrl.check`` refuse a combination
  before any work, with every broken rule of the file in one :class:`ConfigError`;
- docs/support.md (``python -m dsrl.config.matrix docs/support.md``): the rules and the support matrix;
- the support-matrix tests (tests/unit/test_support_matrix.py, tests/distributed/test_support_matrix.py,
  tests/vllm_tier/test_vllm_matrix.py), which run every cell the rules allow and check every refusal.

A :class:`Setup` is what the rules look at: the features of a run file (placement and staleness bound k, ZeRO
stage, rollout backend, LoRA, multi-turn, off-policy correction, AutoTP, AutoEP, dynamic sampling), read from the
run file by :meth:`Setup.of`. A :class:`Rule` is a name, a condition and one sentence. The condition is data (a
feature and the values it refuses, per feature), so the docs render the very predicate the validation
evaluates; the sentence names the settings of its condition and the fix, and is formatted with the run file's
values. Rules that need more than the run file (the world size, the model's shape, installed packages) live
where that is known (:mod:`dsrl.core.plan`, :mod:`dsrl.rollout.vllm`, :mod:`dsrl.backends.deepspeed.validation`).

May import: the standard library and :mod:`dsrl.config`'s own modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsrl.config.engine import DEEPSPEED_ENGINE, MEGATRON_ENGINE
from dsrl.config.errors import problems_error
from dsrl.config.names import (
    ALGORITHM_DEFAULTS,
    CB_BACKEND,
    COLOCATED,
    CORRECTION_NONE,
    CRITIC_ALGORITHMS,
    DISAGGREGATED,
    HF_BACKEND,
    REPLAY_OFF,
    REPLAY_ROLLOUT,
    VLLM_BACKEND,
)

if TYPE_CHECKING:
    from dsrl.config.root import DsrlConfig

__all__ = ["RULES", "AtLeast", "Is", "OneOf", "Rule", "Setup", "check", "refusals"]


def _feature(default: Any, setting: str) -> Any:
    return field(default=default, metadata={"setting": setting})


@dataclass(frozen=True)
class Setup:
    """The features of a run the rules look at; each names the setting it is read from (:meth:`of`)."""

    placement: str = _feature(COLOCATED, "rollout.placement")
    max_staleness: int = _feature(0, "algorithm.max_staleness")  # k, resolved (1 when disaggregated and unset)
    zero_stage: int = _feature(0, "zero_optimization.stage")
    backend: str = _feature(HF_BACKEND, "rollout.backend")
    lora: bool = _feature(False, "model.lora")
    multi_turn: bool = _feature(False, "data.environment")
    correction: str = _feature(CORRECTION_NONE, "algorithm.rollout_correction.mode")
    autotp_size: int = _feature(1, "tensor_parallel.autotp_size")
    sequence_parallel_size: int = _feature(1, "sequence_parallel_size")  # Ulysses
    expert_parallel: bool = _feature(False, "expert_parallel")
    algorithm: str = _feature("grpo", "algorithm.name")
    dynamic_sampling: bool = _feature(False, "algorithm.dynamic_sampling")  # resolved: dapo's default is on
    routing_replay: str = _feature(REPLAY_OFF, "model.routing_replay")  # a mixture-of-experts policy's routes (R3)
    router_aux_loss: bool = _feature(False, "model.router_aux_loss_coef")  # > 0: the load-balancing term is trained
    offload_states: bool = _feature(False, "memory.offload_states")  # training state off the device between phases
    share_prompts: bool = _feature(False, "model.share_prompts")  # prompt-shared forwards (dsrl.rl.data.prefix)
    engine: str = _feature(DEEPSPEED_ENGINE, "engine.kind")  # the training engine (dsrl.config.engine)

    @classmethod
    def of(cls, dsrl: DsrlConfig, ds_config: dict[str, Any]) -> Setup:
        """The features of a run file: its validated "dsrl" section and the rest (the user's ds_config).

        The ds_config is read leniently: a malformed ``zero_optimization`` or ``tensor_parallel`` counts as
        unset here and is named by the layout checks that own it (:mod:`dsrl.backends.deepspeed.autotp`,
        DeepSpeed's own config classes)."""
        algorithm = dsrl.algorithm
        dynamic = algorithm.dynamic_sampling
        if dynamic is None:
            dynamic = ALGORITHM_DEFAULTS[algorithm.name]["dynamic_sampling"]
        experts = ds_config.get("expert_parallel")
        return cls(placement=dsrl.rollout.placement, max_staleness=dsrl.max_staleness,
                   zero_stage=_integer(ds_config, "zero_optimization.stage", 0), backend=dsrl.rollout.backend,
                   lora=dsrl.model.lora is not None, multi_turn=dsrl.multi_turn,
                   correction=algorithm.rollout_correction.mode,
                   autotp_size=max(_integer(ds_config, "tensor_parallel.autotp_size", 1), 1),
                   sequence_parallel_size=max(_integer(ds_config, "sequence_parallel_size", 1), 1),
                   expert_parallel=isinstance(experts, dict) and bool(experts.get("enabled", False)),
                   algorithm=algorithm.name, dynamic_sampling=bool(dynamic),
                   routing_replay=dsrl.model.routing_replay, router_aux_loss=dsrl.model.router_aux_loss_coef > 0,
                   offload_states=dsrl.memory.offload_states, share_prompts=dsrl.model.share_prompts,
                   engine=dsrl.engine.kind)

    def replace(self, **features: Any) -> Setup:
        return dataclasses.replace(self, **features)

    @staticmethod
    def setting(feature: str) -> str:
        """The run-file setting a feature is read from (``rollout.placement``)."""
        return {f.name: f.metadata["setting"] for f in dataclasses.fields(Setup)}[feature]


def _integer(ds_config: dict[str, Any], dotted: str, default: int) -> int:
    """The integer at a dotted path of the ds_config, else ``default`` (absent or malformed)."""
    value: Any = ds_config
    for key in dotted.split("."):
        value = value.get(key, default) if isinstance(value, dict) else default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# ---------------------------------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Is:
    """The feature equals ``value``."""

    value: Any

    def holds(self, value: Any) -> bool:
        return value == self.value

    def witness(self) -> Any:
        return self.value

    def describe(self, setting: str) -> str:
        if self.value is True:
            return f"`{setting}` set"
        if self.value is False:
            return f"`{setting}` unset"
        return f"`{setting}` = {self.value!r}"


@dataclass(frozen=True)
class AtLeast:
    """The feature is an integer >= ``bound``."""

    bound: int

    def holds(self, value: Any) -> bool:
        return value >= self.bound

    def witness(self) -> Any:
        return self.bound

    def describe(self, setting: str) -> str:
        return f"`{setting}` >= {self.bound}"


@dataclass(frozen=True)
class OneOf:
    """The feature is one of ``values``."""

    values: tuple[Any, ...]

    def holds(self, value: Any) -> bool:
        return value in self.values

    def witness(self) -> Any:
        return self.values[0]

    def describe(self, setting: str) -> str:
        if len(self.values) == 1:
            return f"`{setting}` = {self.values[0]!r}"
        return f"`{setting}` one of {', '.join(repr(v) for v in self.values)}"


Condition = Is | AtLeast | OneOf


@dataclass(frozen=True)
class Rule:
    """A refused combination: every feature of ``when`` meets its condition. ``sentence`` names those settings
    and the fix in one sentence; it is formatted with the run's :class:`Setup` (``{autotp_size}``)."""

    name: str
    when: dict[str, Condition]
    sentence: str

    def __hash__(self) -> int:  # rules are told apart by name (unique in RULES, checked by the unit tests)
        return hash(self.name)

    def applies(self, setup: Setup) -> bool:
        return all(condition.holds(getattr(setup, feature)) for feature, condition in self.when.items())

    def message(self, setup: Setup) -> str:
        return self.sentence.format(**dataclasses.asdict(setup))

    def condition(self) -> str:
        """The condition in words, rendered from ``when`` itself: '`rollout.placement` = 'disaggregated' and ...'."""
        return " and ".join(c.describe(Setup.setting(f)) for f, c in self.when.items())

    def example(self) -> Setup:
        """The smallest run this rule refuses: the default features with each condition's least value."""
        return Setup().replace(**{f: c.witness() for f, c in self.when.items()})


# -------------------------------------------------------------------------------------------------------- rules
_DISAGG = Is(DISAGGREGATED)
_AUTOTP = AtLeast(2)
_MEGATRON = Is(MEGATRON_ENGINE)

RULES: tuple[Rule, ...] = (
    Rule("multi-turn-disaggregated", {"placement": _DISAGG, "multi_turn": Is(True)},
         "dsrl.data.environment (multi-turn rollouts) with rollout.placement 'disaggregated': the generator ranks "
         "produce single completions; turn-by-turn generation runs where the environment runs. Fix: use placement "
         "'colocated' for multi-turn runs."),
    Rule("dynamic-sampling-disaggregated", {"placement": _DISAGG, "dynamic_sampling": Is(True)},
         "dsrl.algorithm.dynamic_sampling is on (dapo's default) with rollout.placement 'disaggregated': refilling "
         "zero-variance groups needs generation rounds inside a rollout, which generator ranks running ahead do not "
         "provide. Fix: set dsrl.algorithm.dynamic_sampling to false, or use placement 'colocated'."),
    Rule("staleness-colocated", {"placement": Is(COLOCATED), "max_staleness": AtLeast(1)},
         "dsrl.algorithm.max_staleness = {max_staleness} with rollout.placement 'colocated', where every rollout is "
         "generated with the current weights. Fix: set dsrl.rollout.placement to 'disaggregated' (with "
         "rollout.generator_ranks), or max_staleness to 0."),
    Rule("autotp-disaggregated", {"placement": _DISAGG, "autotp_size": _AUTOTP},
         "dsrl.rollout.placement = 'disaggregated' with tensor_parallel.autotp_size = {autotp_size}: the generators "
         "need whole weights and AutoTP shards them. Fix: use ZeRO-3 without AutoTP for the trainers, or placement "
         "'colocated'."),
    Rule("autotp-vllm", {"backend": Is(VLLM_BACKEND), "autotp_size": _AUTOTP},
         "rollout.backend = 'vllm' with tensor_parallel.autotp_size = {autotp_size}: the vLLM engine takes whole "
         "weights, which AutoTP shards. Fix: use rollout.backend = 'hf' (or 'auto', which picks hf) under AutoTP, "
         "or set autotp_size to 1 (ZeRO-3 shards the training state instead)."),
    Rule("autotp-cb", {"backend": OneOf((CB_BACKEND,)), "autotp_size": _AUTOTP},
         "rollout.backend = {backend!r} with tensor_parallel.autotp_size = {autotp_size}: continuous batching sizes "
         "its paged KV cache from the model's config while AutoTP leaves each rank a share of the attention heads, "
         "and it does not keep tensor peers in lockstep as hf does. Fix: use rollout.backend = 'hf' or 'auto' (which "
         "picks hf under AutoTP), or set autotp_size to 1."),
    Rule("autotp-lora", {"lora": Is(True), "autotp_size": _AUTOTP},
         "dsrl.model.lora with tensor_parallel.autotp_size = {autotp_size}: AutoTP replaces the linear layers the "
         "LoRA adapters wrap with its own sharded layers. Fix: set autotp_size to 1 and let ZeRO-3 shard the frozen "
         "base weights, or remove dsrl.model.lora."),
    Rule("critic-autotp", {"algorithm": OneOf(CRITIC_ALGORITHMS), "autotp_size": _AUTOTP},
         "dsrl.algorithm.name = {algorithm!r} with tensor_parallel.autotp_size = {autotp_size}: the critic does not "
         "run under AutoTP yet. Fix: use a data-parallel layout (ZeRO 0-3, autotp_size 1), or a critic-free "
         "algorithm."),
    Rule("critic-sequence-parallel", {"algorithm": OneOf(CRITIC_ALGORITHMS), "sequence_parallel_size": AtLeast(2)},
         "dsrl.algorithm.name = {algorithm!r} with sequence_parallel_size = {sequence_parallel_size}: the critic does "
         "not run under Ulysses sequence parallelism yet. Fix: use a data-parallel layout (ZeRO 0-3, "
         "sequence_parallel_size 1), or a critic-free algorithm."),
    Rule("autoep-lora", {"lora": Is(True), "expert_parallel": Is(True)},
         "dsrl.model.lora with an expert_parallel section: AutoEP replaces the expert layers the LoRA adapters would "
         "wrap. Fix: remove expert_parallel (ZeRO-3 shards the frozen experts), or remove dsrl.model.lora."),
    # mixture-of-experts policies (docs/moe.md); the rules that need the model or the installed vLLM live in
    # dsrl.rl.policy.moe.check_moe_run
    Rule("autoep-cb", {"backend": Is(CB_BACKEND), "expert_parallel": Is(True)},
         "rollout.backend = 'cb' with an expert_parallel section: every forward of an AutoEP model is an all-to-all "
         "of the expert-parallel group, and continuous batching runs a different number of forwards on each rank. "
         "Fix: use rollout.backend = 'hf' or 'auto' (which picks hf under AutoEP)."),
    Rule("autoep-vllm", {"backend": Is(VLLM_BACKEND), "expert_parallel": Is(True)},
         "rollout.backend = 'vllm' with an expert_parallel section: the vLLM engine takes whole weights, which AutoEP "
         "splits over ranks. Fix: use rollout.backend = 'hf' or 'auto' under AutoEP, or remove expert_parallel."),
    Rule("autoep-disaggregated", {"placement": _DISAGG, "expert_parallel": Is(True)},
         "dsrl.rollout.placement = 'disaggregated' with an expert_parallel section: the generator ranks would need "
         "the trainers' expert-parallel groups. Fix: use placement 'colocated' with AutoEP, or remove "
         "expert_parallel."),
    Rule("replay-autotp", {"routing_replay": Is(REPLAY_ROLLOUT), "autotp_size": _AUTOTP},
         "dsrl.model.routing_replay = 'rollout' with tensor_parallel.autotp_size = {autotp_size}: dsrl's routes "
         "describe whole routers, which AutoTP may shard. Fix: set autotp_size to 1 (ZeRO-3 or expert_parallel "
         "instead), or routing_replay to 'off'."),
    Rule("replay-sequence-parallel", {"routing_replay": Is(REPLAY_ROLLOUT), "sequence_parallel_size": AtLeast(2)},
         "dsrl.model.routing_replay = 'rollout' with sequence_parallel_size = {sequence_parallel_size}: each rank "
         "holds a shard of every sequence's positions, which dsrl's routes do not describe. Fix: set "
         "sequence_parallel_size to 1, or routing_replay to 'off'."),
    Rule("router-aux-autotp", {"router_aux_loss": Is(True), "autotp_size": _AUTOTP},
         "dsrl.model.router_aux_loss_coef > 0 with tensor_parallel.autotp_size = {autotp_size}: the load-balancing "
         "term reads whole routers, which AutoTP may shard. Fix: set autotp_size to 1, or router_aux_loss_coef to "
         "0."),
    Rule("router-aux-sequence-parallel", {"router_aux_loss": Is(True), "sequence_parallel_size": AtLeast(2)},
         "dsrl.model.router_aux_loss_coef > 0 with sequence_parallel_size = {sequence_parallel_size}: the "
         "load-balancing term counts routes per position, which each rank holds a shard of. Fix: set "
         "sequence_parallel_size to 1, or router_aux_loss_coef to 0."),
    # prompt-shared forwards (docs/rollout.md); flash attention, packing and MoE routes: dsrl.config.model
    Rule("share-prompts-sequence-parallel", {"share_prompts": Is(True), "sequence_parallel_size": AtLeast(2)},
         "dsrl.model.share_prompts with sequence_parallel_size = {sequence_parallel_size}: Ulysses splits each row's "
         "positions over ranks, and a shared row's attention mask spans the whole row. Fix: set share_prompts to "
         "false, or sequence_parallel_size to 1."),
    Rule("share-prompts-autotp", {"share_prompts": Is(True), "autotp_size": _AUTOTP},
         "dsrl.model.share_prompts with tensor_parallel.autotp_size = {autotp_size}: shared rows are not tested under "
         "AutoTP yet. Fix: set share_prompts to false, or autotp_size to 1 (ZeRO-3 shards the model instead)."),
    # device memory between phases (docs/memory.md); the ZeRO-3 optimizer condition needs the resolved optimizer
    # and lives in dsrl.backends.deepspeed.validation
    Rule("offload-zero0", {"offload_states": Is(True), "zero_stage": Is(0), "engine": Is(DEEPSPEED_ENGINE)},
         "dsrl.memory.offload_states with zero_optimization.stage 0 (dsrl.engine.kind {engine!r}): DeepSpeed's "
         "engine.offload_states moves the buffers of its ZeRO optimizer, and ZeRO-0 has none (DeepSpeed 0.19.8 "
         "offers it for ZeRO 1-3 only; under stage 0 the call fails with \"'AdamW' object has no attribute "
         "'offload_states'\"). Fix: set zero_optimization.stage to 1, 2 or 3, or memory.offload_states to false."),
    # megatron-core's engine (docs/megatron.md): what is DeepSpeed's alone, and what is not built on it yet
    Rule("megatron-zero", {"engine": _MEGATRON, "zero_stage": AtLeast(1)},
         "dsrl.engine.kind = 'megatron' with zero_optimization.stage = {zero_stage}: ZeRO is DeepSpeed's engine; "
         "megatron-core shards the optimizer state with its distributed optimizer (on GPUs). Fix: set "
         "zero_optimization.stage to 0 (or remove the section), or use dsrl.engine.kind 'deepspeed'."),
    Rule("megatron-autotp", {"engine": _MEGATRON, "autotp_size": _AUTOTP},
         "dsrl.engine.kind = 'megatron' with tensor_parallel.autotp_size = {autotp_size}: AutoTP is DeepSpeed's "
         "tensor parallelism. Fix: remove the tensor_parallel section and set "
         "dsrl.engine.tensor_model_parallel_size instead."),
    Rule("megatron-autoep", {"engine": _MEGATRON, "expert_parallel": Is(True)},
         "dsrl.engine.kind = 'megatron' with an expert_parallel section: AutoEP is DeepSpeed's, and dsrl's HF weight "
         "map for megatron-core is for dense models. Fix: remove expert_parallel, or use dsrl.engine.kind "
         "'deepspeed'."),
    Rule("megatron-ulysses", {"engine": _MEGATRON, "sequence_parallel_size": AtLeast(2)},
         "dsrl.engine.kind = 'megatron' with sequence_parallel_size = {sequence_parallel_size}: Ulysses is "
         "DeepSpeed's sequence parallelism. Fix: remove sequence_parallel_size."),
    Rule("megatron-lora", {"engine": _MEGATRON, "lora": Is(True)},
         "dsrl.model.lora with dsrl.engine.kind = 'megatron': dsrl's LoRA wraps the HF model's linear layers through "
         "PEFT, which megatron-core's layers are not. Fix: remove dsrl.model.lora, or use dsrl.engine.kind "
         "'deepspeed'."),
    Rule("megatron-offload", {"engine": _MEGATRON, "offload_states": Is(True)},
         "dsrl.memory.offload_states with dsrl.engine.kind = 'megatron': the offload moves DeepSpeed's optimizer "
         "buffers (engine.offload_states). Fix: set memory.offload_states to false."),
    Rule("megatron-share-prompts", {"engine": _MEGATRON, "share_prompts": Is(True)},
         "dsrl.model.share_prompts with dsrl.engine.kind = 'megatron': shared rows need a 4-D attention mask, and "
         "megatron-core's rotary positions are each row's own. Fix: set share_prompts to false."),
    Rule("megatron-disaggregated", {"engine": _MEGATRON, "placement": _DISAGG},
         "dsrl.rollout.placement = 'disaggregated' with dsrl.engine.kind = 'megatron': megatron-core 0.16's parallel "
         "state spans every rank of the job, so the generator ranks would join the trainers' data-parallel groups; "
         "the trainers' engine over a sub-world is not built yet. Fix: use placement 'colocated'."),
)


def refusals(setup: Setup, rules: tuple[Rule, ...] = RULES) -> list[Rule]:
    """The rules that refuse ``setup``, in declaration order."""
    return [rule for rule in rules if rule.applies(setup)]


def check(dsrl: DsrlConfig, ds_config: dict[str, Any]) -> None:
    """Raise one ConfigError naming every rule the run file breaks (none: return)."""
    setup = Setup.of(dsrl, ds_config)
    messages = _generator_ranks_problems(dsrl) + [rule.message(setup) for rule in refusals(setup)]
    if messages:
        raise problems_error(messages)


def _generator_ranks_problems(dsrl: DsrlConfig) -> list[str]:
    """`rollout.generator_ranks` is at least 1 with `rollout.placement` "disaggregated" and 0 with "colocated" (not a
    combination rule: the placement is one setting in two keys), reported with the combination rules, so that a
    run file switched between placements hears of every key to change at once."""
    r = dsrl.rollout
    if r.placement == DISAGGREGATED and r.generator_ranks < 1:
        return ["dsrl.rollout.placement = 'disaggregated' needs dsrl.rollout.generator_ranks >= 1 (the ranks that "
                "only generate). Fix: set generator_ranks, e.g. 1."]
    if r.placement == COLOCATED and r.generator_ranks:
        return [f"dsrl.rollout.generator_ranks = {r.generator_ranks} with placement 'colocated', where every rank "
                "generates. Fix: set dsrl.rollout.placement to 'disaggregated', or generator_ranks to 0."]
    return []
