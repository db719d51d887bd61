"""The engine seam (dsrl.core.engine): DeepSpeed's RLEngine is a TrainEngine, and a loss given in the seam's two
parts (a forward, then a per-token loss of its output) trains exactly like the same loss given whole.

- every member of the TrainEngine protocol (and of FrozenPasses) exists on the DeepSpeed classes with the
  protocol's parameters; a class that lacks one, or takes other parameters, is named by the check;
- RLEngine's own step (its ``_forward_backward`` and ``_update``, over a stand-in for DeepSpeed's engine that
  backpropagates exactly what ``engine.backward`` is given) gives bit for bit the same gradient and result with
  ``train_mini_batch(micros, forward_fn, token_loss_fn)`` as with ``train_mini_batch(micros, loss_fn)``, and that
  gradient is the float64 reference's within 1e-6 over an uneven split;
- the policy's, the critic's and the warm-up's losses are split so (their ``forward`` / ``token_loss``).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch

from dsrl.backends.deepspeed.engine import RLEngine
from dsrl.backends.deepspeed.frozen import FrozenModel
from dsrl.cli.check import MAX_LEN, collate, make_sequences, reference_gradient
from dsrl.cli.check import relative_error as _rel
from dsrl.cli.check_models import TinyCausalModel
from dsrl.cli.check_objectives import per_token_loss
from dsrl.core.engine import FrozenPasses, TrainEngine, micro_batch_loss
from dsrl.core.parallel import ParallelView


def protocol_gaps(cls: type, protocol: type) -> list[str]:
    """Each member of ``protocol`` that ``cls`` lacks, or whose parameters differ from the protocol's (by name, in
    order, ``self`` aside)."""
    gaps = []
    members = {n for base in protocol.__mro__ if base.__module__.startswith("dsrl")
               for n in vars(base) if not n.startswith("_")}
    members |= {n for base in protocol.__mro__ if base.__module__.startswith("dsrl")
                for n in getattr(base, "__annotations__", {})}
    for name in sorted(members):
        want = inspect.getattr_static(protocol, name, None)
        have = inspect.getattr_static(cls, name, None)
        if have is None and name not in _instance_attributes(cls):
            gaps.append(f"{cls.__name__} lacks {name}")
            continue
        if inspect.isfunction(want) and inspect.isfunction(have):
            p_want = list(inspect.signature(want).parameters)[1:]
            p_have = list(inspect.signature(have).parameters)[1:]
            if p_have[:len(p_want)] != p_want:
                gaps.append(f"{cls.__name__}.{name}{tuple(p_have)} takes other parameters than the protocol's "
                            f"{tuple(p_want)}")
    return gaps


def _instance_attributes(cls: type) -> set[str]:
    """Names ``__init__`` (of ``cls`` and its bases) assigns on ``self``."""
    import ast
    import textwrap

    names: set[str] = set()
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def test_the_deepspeed_engine_is_a_train_engine():
    assert protocol_gaps(RLEngine, TrainEngine) == []
    assert protocol_gaps(FrozenModel, FrozenPasses) == []


def test_the_megatron_engine_is_a_train_engine():
    from dsrl.backends.megatron.engine import MegatronEngine, ReplicatedFrozen

    assert protocol_gaps(MegatronEngine, TrainEngine) == []
    assert protocol_gaps(ReplicatedFrozen, FrozenPasses) == []


def test_the_conformance_check_names_what_a_class_lacks():
    class NoFrozen(RLEngine):
        frozen = None  # type: ignore[assignment]

    class OtherParameters(RLEngine):
        def train_mini_batch(self, micro_batches: Any, loss_fn: Any) -> Any:  # no token_loss_fn
            return None

    assert protocol_gaps(type("Bare", (), {}), TrainEngine)[:1] == ["Bare lacks device"]
    assert "NoFrozen lacks frozen" in protocol_gaps(NoFrozen, TrainEngine)
    assert any(g.startswith("OtherParameters.train_mini_batch") for g in protocol_gaps(OtherParameters, TrainEngine))


class _Schedule:
    """An LR schedule that only counts its steps."""

    def __init__(self) -> None:
        self.steps = 0

    def current_lr(self) -> float:
        return 0.1

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


class _DeepSpeedStandIn:
    """What RLEngine calls of a DeepSpeedEngine, over a plain module: ``backward`` backpropagates exactly what it is
    given (one rank: no averaging), ``step`` keeps the gradient and applies nothing."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.device, self.training, self.grads = module, torch.device("cpu"), True, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_optimization_stage(self) -> int:
        return 1

    def gradient_clipping(self) -> float:
        return 0.0

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        assert scale_wrt_gas is False
        loss.backward()

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.module.parameters()]
        self.module.zero_grad()

    def was_step_applied(self) -> bool:
        return True

    def get_global_grad_norm(self) -> float:
        return 1.0


def _rl_engine(module: torch.nn.Module, mode: str, n: int) -> RLEngine:
    plan = types.SimpleNamespace(loss_agg=mode, mini_batch_size=n, loss_agg_norm_length=MAX_LEN)  # what it reads
    view = ParallelView(count_group=None, grad_scale=1.0, data_parallel_size=1, data_parallel_rank=0)
    return RLEngine(_DeepSpeedStandIn(module), plan, _Schedule(), view)


def _logprobs_forward(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """The forward half of :func:`per_token_loss`: its log pi(next token) ``[b, t]``."""
    return -per_token_loss(model, {**micro, "advantages": torch.ones_like(micro["advantages"])})


def _advantage_loss(logp: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-token half of :func:`per_token_loss`: -A_seq * log pi."""
    return -micro["advantages"].unsqueeze(-1).to(logp.dtype) * logp


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_a_loss_in_two_parts_trains_bit_for_bit_like_the_whole(mode):
    seqs = make_sequences(7, seed=5)
    micros = [collate(seqs[:1]), collate(seqs[1:4]), collate(seqs[4:])]  # uneven
    torch.manual_seed(0)
    model = TinyCausalModel()
    ref = reference_gradient(model, seqs, mode, MAX_LEN)
    whole = _rl_engine(model, mode, len(seqs))
    res_whole = whole.train_mini_batch(micros, per_token_loss)
    split = _rl_engine(model, mode, len(seqs))
    res_split = split.train_mini_batch(micros, _logprobs_forward, _advantage_loss)
    assert all(torch.equal(a, b) for a, b in zip(whole.engine.grads, split.engine.grads))
    assert res_whole.to_dict() == res_split.to_dict()
    assert _rel(split.engine.grads, ref) < 1e-6
    assert split.optimizer_steps == 1 and split.scheduler.steps == 1
    # the check can fail: a per-token loss that forgets the advantage is another gradient
    wrong = _rl_engine(model, mode, len(seqs))
    wrong.train_mini_batch(micros, _logprobs_forward, lambda logp, micro: -logp)
    assert _rel(wrong.engine.grads, ref) > 1e-2


def test_micro_batch_loss_composes_the_two_parts():
    calls: list[str] = []

    def forward(model: Any, micro: Any) -> str:
        calls.append("forward")
        return f"out({model},{micro})"

    def token_loss(out: str, micro: Any) -> str:
        calls.append("loss")
        return f"loss({out},{micro})"

    assert micro_batch_loss("m", "x", forward, token_loss) == "loss(out(m,x),x)"
    assert micro_batch_loss("m", "x", forward, None) == "out(m,x)"
    assert calls == ["forward", "loss", "forward"]


def test_the_applications_losses_come_in_two_parts():
    from dsrl.rl.critic import Critic
    from dsrl.rl.policy.loss import PolicyLoss
    from dsrl.rl.sft import SupervisedWarmup

    for cls in (PolicyLoss, Critic, SupervisedWarmup):
        assert callable(getattr(cls, "token_loss", None)), cls
    assert callable(PolicyLoss.forward) and callable(SupervisedWarmup.forward)
    assert list(inspect.signature(PolicyLoss.token_loss).parameters)[1:3] == ["out", "micro"]
