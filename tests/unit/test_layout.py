"""ARCHITECTURE §4's dependency rules, checked on the source: no import circle among dsrl's modules
(lazy, function-level imports included), and the DeepSpeed and Megatron adapters never import each other."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dsrl"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """dsrl modules ``path`` imports anywhere in its body (``from dsrl import x`` counts as dsrl.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dsrl":
            subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
            out |= subs or {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dsrl"}
    return out & mods.keys()


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


def test_no_import_circle_even_through_lazy_imports():
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_engine_and_megatron_never_import_each_other():
    mods = _modules()
    megatron = {m for m in mods if m.startswith("dsrl.backends.megatron")}
    assert not _imports(mods["dsrl.backends.deepspeed.engine"], mods) & megatron
    assert all("dsrl.backends.deepspeed.engine" not in _imports(mods[m], mods) for m in megatron)
