"""ARCHITECTURE §4's layout and dependency rules, checked on the source.

- ``dsrl/`` holds at most ``__init__.py``, ``check.py`` (and ``__main__.py``) at top level; every other
  module lives in one of the packages of §4, each with a docstring saying what it owns and may import;
- the dependency direction between packages (function-level imports included): ``config`` imports no
  other dsrl package; ``core`` only ``config``; the two backends ``core``/``config`` and never each
  other; ``checkpoint`` the DeepSpeed backend, never ``rl``; ``rollout`` and ``algos`` never ``rl``,
  ``checkpoint`` or ``cli``; ``rl`` composes everything below it, its rooms (``rl.policy``, ``rl.data``,
  ``rl.rewards``, ``rl.episodes``, ``rl.disagg``) never import its own modules and import each other one way;
  of ``rl`` only the run's parts (``rl.run``) name a backend, the rest works on ``core.engine.TrainEngine``;
  ``cli`` and the top-level entries sit on top; nothing imports ``tests``;
- no import circle among dsrl's modules, and every checker is shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dsrl"

PACKAGES = ("config", "core", "backends.deepspeed", "backends.megatron", "checkpoint", "rollout", "algos", "rl",
            "rl.policy", "rl.data", "rl.rewards", "rl.episodes", "rl.disagg", "rl.run", "tasks", "runtime", "cli")
BELOW_RL = {"config", "core", "backends.deepspeed", "checkpoint", "rollout", "algos", "tasks", "runtime"}
# the engine seam (ARCHITECTURE §4, "(engine)"): of dsrl.rl only the run's parts name a backend; every other module
# and room works on dsrl.core.engine.TrainEngine
BACKENDS = {"backends.deepspeed", "backends.megatron"}
RL_ROOMS = {"rl.policy", "rl.data", "rl.rewards", "rl.episodes", "rl.disagg"}
TOP_LEVEL = {"dsrl", "dsrl.check", "dsrl.__main__"}
# package -> the dsrl packages it may import (besides itself). Anything not listed is forbidden.
MAY_IMPORT: dict[str, set[str]] = {
    "config": set(),
    "core": {"config"},
    "backends": set(),
    "backends.deepspeed": {"config", "core"},
    "backends.megatron": {"config", "core"},
    "algos": {"config", "core"},
    "tasks": {"config"},
    "runtime": {"config", "core"},
    "rollout": {"config", "core", "algos"},
    "checkpoint": {"config", "core"} | BACKENDS,
    # the RL application's own modules (trainer, experience, critic, sft) compose everything below and every room;
    # a room never imports them, and rooms import each other one way only (dsrl/rl/__init__.py); the run's parts
    # (rl.run) compose the application's modules, and only the trainer imports them (ONLY_THE_TRAINER)
    "rl": (BELOW_RL - BACKENDS) | RL_ROOMS | {"rl.run"},
    "rl.run": BELOW_RL | BACKENDS | RL_ROOMS | {"rl"},
    "rl.policy": {"config", "core", "rollout", "algos", "runtime", "rl.data"},
    "rl.data": {"config", "core", "tasks"},
    "rl.rewards": {"config", "core", "rollout", "runtime", "tasks", "rl.data", "rl.policy"},
    "rl.episodes": {"config", "core", "runtime", "rollout", "rl.data", "rl.rewards"},
    "rl.disagg": {"config", "core", "rollout", "runtime", "rl.data", "rl.policy"},
    "cli": {"config", "core", "backends.deepspeed", "backends.megatron", "checkpoint", "rollout", "algos", "tasks",
            "runtime"} | {"rl", "rl.run"} | RL_ROOMS,
}


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    mods = {}
    for path in root.rglob("*.py"):
        if "assets" in path.parts:
            continue
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


@functools.cache
def _import_statements(text: str) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
    """(module of a ``from`` import or None for ``import``, the names) of every import in a module's text: parsed
    once per text, so the planted copies of dsrl/ re-parse only the file a test changed."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            out.append((None, tuple(a.name for a in node.names)))
    return tuple(out)


def _imports(path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """Everything ``path`` imports anywhere in its body that names dsrl or tests (``from dsrl import x``
    counts as dsrl.x when that is a module)."""
    out = set()
    for module, names in _import_statements(path.read_text()):
        if module is not None and module.split(".")[0] in ("dsrl", "tests"):
            subs = {f"{module}.{name}" for name in names} & mods.keys()
            out |= subs or {module}
        elif module is None:
            out |= {name for name in names if name.split(".")[0] in ("dsrl", "tests")}
    return out


def package_of(module: str) -> str | None:
    """The §4 package a dsrl module belongs to (None for the top-level entries)."""
    rest = module.removeprefix("dsrl.")
    for pkg in sorted(PACKAGES, key=len, reverse=True):
        if rest == pkg or rest.startswith(pkg + "."):
            return pkg
    if rest == "backends":
        return "backends"
    return None


ONLY_THE_TRAINER = {"dsrl.rl.trainer"}  # of rl's own modules, the ones that may import the run's parts (rl.run)


def violations(root: pathlib.Path = ROOT) -> list[str]:
    """Every import that breaks the dependency direction, as 'a imports b (package x may import only ...)'."""
    mods = _modules(root)
    found = []
    for mod, path in sorted(mods.items()):
        mine = package_of(mod)
        for target in sorted(_imports(path, mods)):
            if target.split(".")[0] == "tests":
                found.append(f"{mod} imports {target}: nothing in dsrl imports tests")
                continue
            theirs = package_of(target)
            if mine == "rl" and theirs == "rl.run" and mod not in ONLY_THE_TRAINER:
                found.append(f"{mod} imports {target}: of rl's own modules only the trainer imports rl.run")
                continue
            if mine is None or theirs is None or theirs == mine:
                continue
            if theirs not in MAY_IMPORT[mine]:
                allowed = ", ".join(sorted(MAY_IMPORT[mine])) or "no other dsrl package"
                found.append(f"{mod} imports {target}: {mine} may import only {allowed}")
    return found


PACKAGE_ABBREVIATIONS = {"deepspeed": ("ds",), "megatron": ("mcore", "mg"), "checkpoint": ("ckpt",),
                         "config": ("cfg",)}


def repeats_its_package(mod: str) -> bool:
    """``dsrl.backends.deepspeed.ds_validation`` or ``dsrl.config.config_errors``: the prefix stands in for the
    package the module already lives in."""
    parts = mod.split(".")
    first = parts[-1].split("_")[0]
    return any(first == pkg or first in PACKAGE_ABBREVIATIONS.get(pkg, ()) for pkg in parts[1:-1])


def misplaced(root: pathlib.Path = ROOT) -> list[str]:
    """Modules outside the §4 packages, module names that repeat their package, and packages whose __init__ has
    no docstring."""
    out = []
    for mod, path in _modules(root).items():
        if package_of(mod) is None and mod not in TOP_LEVEL:
            out.append(f"{mod}: not in one of the packages of ARCHITECTURE §4")
        if path.name != "__init__.py" and repeats_its_package(mod):
            out.append(f"{mod}: its name repeats its package")
        if path.name == "__init__.py" and ast.get_docstring(ast.parse(path.read_text())) is None:
            out.append(f"{mod}: its __init__.py has no docstring saying what it owns and may import")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def circles(root: pathlib.Path = ROOT) -> list[list[str]]:
    mods = _modules(root)
    return _cycles({m: (_imports(p, mods) & mods.keys()) - {m} for m, p in mods.items()})


def test_every_module_lives_in_a_documented_package():
    assert misplaced() == []
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 3 and set(top) <= {"__init__.py", "check.py", "__main__.py"}, top


def test_dependency_direction_between_packages():
    assert violations() == []


def test_no_import_circle_even_through_lazy_imports():
    assert circles() == []


@pytest.fixture()
def planted(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of dsrl/ to plant violations in."""
    shutil.copytree(ROOT, tmp_path / "dsrl", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    return tmp_path / "dsrl"


def _plant(root: pathlib.Path, module: str, line: str) -> None:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("dsrl.core.plan", "from dsrl.rl import trainer", "dsrl.core.plan imports dsrl.rl.trainer: core may import only"),
    ("dsrl.config.load", "import dsrl.core.plan", "dsrl.config.load imports dsrl.core.plan: config may import only"),
    ("dsrl.backends.deepspeed.engine", "from dsrl.backends.megatron import step",
     "backends.deepspeed may import only config, core"),
    ("dsrl.checkpoint.export", "from dsrl.rl.policy.model import build_model", "checkpoint may import only"),
    ("dsrl.rollout.hf", "from dsrl.checkpoint import commit", "rollout may import only"),
    ("dsrl.algos.gae", "from dsrl.cli import main", "algos may import only"),
    ("dsrl.rl.trainer", "import tests.conftest", "nothing in dsrl imports tests"),
    # the rooms of dsrl.rl: never the application's own modules, and one way between rooms
    ("dsrl.rl.data.batching", "from dsrl.rl import trainer", "rl.data may import only config, core, tasks"),
    ("dsrl.rl.disagg.remote", "from dsrl.rl.experience import ExperienceMaker", "rl.disagg may import only"),
    ("dsrl.rl.data.prompts", "from dsrl.rl.episodes import driver", "rl.data may import only"),
    ("dsrl.rl.policy.model", "from dsrl.rl.disagg.roles import Role", "rl.policy may import only"),
    # the run's parts sit between the application's modules and the trainer
    ("dsrl.rl.experience", "from dsrl.rl.run import parts", "only the trainer imports rl.run"),
    ("dsrl.rl.policy.actor", "from dsrl.rl.run.state import RunState", "rl.policy may import only"),
    ("dsrl.rl.run.state", "from dsrl.cli import main", "rl.run may import only"),
    # the engine seam: only the run's parts choose (and so name) the training engine
    ("dsrl.rl.policy.actor", "from dsrl.backends.deepspeed.engine import initialize", "rl.policy may import only"),
    ("dsrl.rl.critic", "from dsrl.backends.deepspeed.engine import RLEngine", "rl may import only"),
    ("dsrl.rl.disagg.generator", "from dsrl.backends.deepspeed.engine import on_gpu", "rl.disagg may import only"),
    ("dsrl.rl.experience", "from dsrl.backends.megatron import step", "rl may import only"),
])
def test_the_direction_check_fails_on_a_planted_violation(planted, module, line, expected):
    assert violations(planted) == []
    _plant(planted, module, line)
    found = violations(planted)
    assert len(found) == 1 and expected in found[0], found


def test_the_circle_check_fails_on_a_planted_circle(planted):
    _plant(planted, "dsrl.core.weights", "from dsrl.core import step")  # step imports weights
    assert ["dsrl.core.step", "dsrl.core.weights"] in circles(planted)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_placement_check_fails_on_a_planted_module(planted):
    (planted / "helpers.py").write_text('"""A flat module."""\n')
    (planted / "rl" / "__init__.py").write_text("")
    (planted / "backends" / "deepspeed" / "ds_validation.py").write_text('"""A prefixed module."""\n')
    (planted / "config" / "config_errors.py").write_text('"""A prefixed module."""\n')
    assert sorted(misplaced(planted)) == ["dsrl.backends.deepspeed.ds_validation: its name repeats its package",
                                          "dsrl.config.config_errors: its name repeats its package",
                                          "dsrl.helpers: not in one of the packages of ARCHITECTURE §4",
                                          "dsrl.rl: its __init__.py has no docstring saying what it owns and may "
                                          "import"]
