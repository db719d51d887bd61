"""The docs harness: what README.md and docs/ tell a user to copy is checked against the code.

For every fenced block of a doc:

- ``json``: a run file, validated as ``dsrl plan`` validates one (the run file, its DeepSpeed half, the plan); a
  block preceded by ``<!-- fragment of FILE -->`` replaces those sections of the shipped run file FILE first (a
  fragment may be a list of ``"section": {...}`` entries of the ``"dsrl"`` section), and one preceded by
  ``<!-- excerpt of FILE -->`` must equal FILE wherever it says something. ``jsonl`` blocks are data rows (each
  line parses);
- shell blocks: every command's flags are accepted by its own parser -- ``dsrl ...``, ``deepspeed ...
  launch/train.py`` and ``--module`` entries, ``python -m dsrl.*``, ``torchrun -m ...``, ``python bench/*.py`` --
  with dotted ``--dsrl.*`` overrides checked against the config's keys; every pytest line selects at least one
  test of the tier it names; install lines install extras that exist, from the checkout.

For every doc: each link and each repository path it names resolves; no doc names an internal file, issue number,
machine path, or the tool (and its machine kinds) the developers' GPUs were lent through; a default a sentence
states (`` `section.key` (default V) ``, `` defaults to ``) is the config's.
Each check returns problems as sentences (empty: fine); tests/unit/test_docs.py runs them and plants defects.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import runpy
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_DIRS = ("configs", "bench", "docs", "launch", "tests", "dsrl")
SHELL = ("bash", "sh", "shell", "console", "")
FORBIDDEN = [
    (re.compile(r"ARCHITECTURE"), "names the developers' design document (users have no ARCHITECTURE.md)"),
    (re.compile(r"\b[Ii]ssues? \d+\b"), "names an internal issue number"),
    (re.compile(r"/work/|/root/|/tmp/bash_jobs"), "names a path of the developers' machines"),
    (re.compile(r"device tool", re.I), "names the developers' tool a GPU was lent through (name the card)"),
    (re.compile(r"\bnvidia-[a-z]\d+(?:-x\d+)?\b"), "names a machine kind of the developers' tool (name the card)"),
]
WORLD_SIZES = {"gsm8k_qwen2.5_1.5b_8gpu.json": 8, "tiny_grpo_async_cpu.json": 3}


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    marker: str | None  # the HTML comment on the line before the fence

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(text: str, doc: Path) -> list[Block]:
    out = []
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        line = text[:m.start()].count("\n") + 1
        before = text[:m.start()].rstrip("\n").splitlines()
        marker = before[-1].strip() if before and before[-1].strip().startswith("<!--") else None
        out.append(Block(doc, line, m.group(1).lower(), m.group(2), marker))
    return out


def prose(text: str) -> str:
    """The doc without its fenced blocks (for the checks of sentences)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


# --------------------------------------------------------------------------------------------- run files
def _parse_json_block(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads("{" + text.strip().rstrip(",") + "}")  # a list of "section": {...} entries


def _marked_file(marker: str | None, kind: str) -> Path | None:
    m = re.match(rf"<!--\s*{kind} of\s+(\S+)\s*-->", marker or "")
    return REPO / m.group(1) if m else None


def check_run_file(raw: dict, world_size: int = 2) -> list[str]:
    """Validate a run file as ``dsrl plan`` does (the config, the DeepSpeed half, the plan)."""
    from dsrl.cli.main import build_plan_report
    from dsrl.config import ConfigError, load_config

    try:
        cfg = load_config(raw)
        build_plan_report(cfg, world_size, 1024)
    except ConfigError as e:
        return [f"is not a run file dsrl accepts: {e}"]
    return []


def _excerpt_differs(part: Any, whole: Any, path: str = "") -> list[str]:
    if isinstance(part, dict):
        if not isinstance(whole, dict):
            return [f"{path or 'the file'} is not an object in the file"]
        return [p for k, v in part.items()
                for p in _excerpt_differs(v, whole.get(k, _MISSING), f"{path}.{k}".strip("."))]
    return [] if part == whole else [f"{path} = {part!r} here, {whole!r} in the file"]


_MISSING = object()


def check_json_block(b: Block) -> list[str]:
    if b.lang == "jsonl":
        bad = [i + 1 for i, line in enumerate(b.text.splitlines()) if line.strip() and not _loads_ok(line)]
        return [f"{b.where()}: line {i} of the data rows is not JSON" for i in bad]
    try:
        raw = _parse_json_block(b.text)
    except json.JSONDecodeError as e:
        return [f"{b.where()}: not JSON ({e})"]
    if b.marker and "row" in b.marker:  # <!-- a metrics.jsonl row --> and the like: JSON, not a run file
        return []
    excerpt, fragment = _marked_file(b.marker, "excerpt"), _marked_file(b.marker, "fragment")
    for f in (excerpt, fragment):
        if f is not None and not f.is_file():
            return [f"{b.where()}: the marker names {f.relative_to(REPO)}, which does not exist"]
    if excerpt is not None:
        return [f"{b.where()}: the excerpt of {excerpt.relative_to(REPO)} differs: {p}"
                for p in _excerpt_differs(raw, json.loads(excerpt.read_text()))]
    if fragment is not None:  # the fragment's sections replace the file's (as a user's run file would hold them)
        whole = json.loads(fragment.read_text())
        part = raw if "dsrl" in raw else {"dsrl": raw}
        raw = {**whole, **{k: v for k, v in part.items() if k != "dsrl"}, "dsrl": {**whole["dsrl"], **part["dsrl"]}}
        size = WORLD_SIZES.get(fragment.name, 2)
    else:
        size = 2
    return [f"{b.where()}: {p}" for p in check_run_file(raw, size)]


def _loads_ok(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


# --------------------------------------------------------------------------------------------- commands
def commands(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell block as argv (continuations joined; ``&&``, ``;``, ``|`` split; comments,
    prompts and leading ``VAR=value`` assignments, ``time`` and ``timeout N`` dropped)."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", ";", "|", "&"):
                while cmd and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]) or cmd[0] in ("time", "sudo", "exec")):
                    cmd = cmd[1:]
                if cmd and cmd[0] == "timeout" and len(cmd) > 2:
                    cmd = cmd[2:]
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(w)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, known: bool):
        self.parser, self.known = parser, known


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    real_args, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self, False)

    def parse_known_args(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self, True)

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real_args  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_known_args = real_known  # type: ignore[method-assign]


def parser_of(run: Callable[[], Any]) -> tuple[argparse.ArgumentParser, bool] | None:
    """The argparse parser ``run()`` builds first (and whether it parses known args only), without running it."""
    with _capturing():
        try:
            run()
        except _Captured as c:
            return c.parser, c.known
        except SystemExit:
            return None
    return None


def _parse(parser: argparse.ArgumentParser, known: bool, args: list[str]) -> tuple[Any, list[str]] | str:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if known:
                return parser.parse_known_args(args)
            return parser.parse_args(args), []
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "rejected"


def _check_overrides(rest: list[str], ds_config: str | None) -> list[str]:
    """Dotted ``--dsrl.a.b V`` overrides name keys of the config (validated with the run file when it exists)."""
    from dsrl.config import ConfigError, load_config, parse_override_args

    # a script's own arguments ("$@") pass through; a shell variable stands for some value
    rest = ["value" if a.startswith("$") else a for a in rest if a not in ("$@", "$*")]
    stray = [a for a in rest if a.startswith("-") and not a.startswith("--dsrl.")]
    if stray:
        return [f"unknown flag(s) {', '.join(stray)}"]
    try:
        overrides = parse_override_args(rest)
    except ConfigError as e:
        return [str(e)]
    if not overrides:
        return []
    path = REPO / ds_config if ds_config else None
    if path is not None and path.is_file():
        try:
            load_config(str(path), overrides)
        except ConfigError as e:
            return [f"with {ds_config}: {e}"]
        return []
    return [f"{k} is not a key of the \"dsrl\" section" for k in overrides if not _is_key(k)]


def _is_key(dotted: str) -> bool:
    from dsrl.config import DsrlConfig

    model: Any = DsrlConfig
    for part in dotted.removeprefix("dsrl.").split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return fields is None  # below a free-form dict (e.g. model.tiny) anything goes
        ann = fields[part].annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), None)
        if model is None:
            return True
    return True


def _check_entry(what: str, run: Callable[[], Any], args: list[str], overrides_ok: bool = False) -> list[str]:
    found = parser_of(run)
    if found is None:
        return [f"{what}: no argument parser found"]
    parser, known = found
    parsed = _parse(parser, known, args)
    if isinstance(parsed, str):
        return [f"{what} {' '.join(args)}: {parsed}"]
    ns, rest = parsed
    if rest and not overrides_ok:
        return [f"{what}: unknown flag(s) {' '.join(rest)}"]
    return _check_overrides(rest, getattr(ns, "ds_config", None)) if rest else []


def _module_main(name: str) -> Callable[[list[str]], Any]:
    import importlib

    mod = importlib.import_module(name)
    if hasattr(mod, "main"):
        return mod.main
    return lambda argv: runpy.run_module(name, run_name="__main__")


def _script(path: str, args: list[str]) -> Callable[[], Any]:
    def run() -> Any:
        old, old_path = sys.argv, list(sys.path)
        sys.argv = [path, *args]
        sys.path.insert(0, str((REPO / path).parent))  # as python SCRIPT puts the script's folder first
        try:
            return runpy.run_path(str(REPO / path), run_name="__main__")
        finally:
            sys.argv, sys.path[:] = old, old_path
    return run


def check_command(argv: list[str]) -> list[str]:
    """Problems of one documented command (empty: its flags are accepted)."""
    head, args = Path(argv[0]).name, argv[1:]
    if head == "dsrl":
        from dsrl.cli.main import main

        return _check_entry(f"dsrl {args[0] if args else ''}".strip(), lambda: main(args), args[1:],
                            overrides_ok=True) if args and not args[0].startswith("-") else []
    if head == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parse_args(args)
        except SystemExit:
            return [f"deepspeed {' '.join(args)}: {err.getvalue().strip().splitlines()[-1:]}"]
        if ns.module:
            return _check_target(["-m", ns.user_script, *ns.user_args])
        return _check_target([ns.user_script, *ns.user_args])
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = _parse(get_args_parser(), False, args)
        if isinstance(parsed, str):
            return [f"torchrun {' '.join(args)}: {parsed}"]
        ns, _ = parsed
        target = ["-m", ns.training_script, *ns.training_script_args] if ns.module else [ns.training_script,
                                                                                           *ns.training_script_args]
        return _check_target(target)
    if head.startswith("python"):
        return _check_target(args)
    if head == "pytest":
        return check_pytest(args)
    if head == "pip":
        return check_pip(args)
    return []


def _check_target(args: list[str]) -> list[str]:
    """``-m module args`` or ``script.py args`` as a Python entry point runs them."""
    if not args:
        return []
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            return check_pytest(rest)
        if module == "dsrl.cli":  # the package's __main__: the dsrl command
            return check_command(["dsrl", *rest])
        if module.startswith("dsrl"):
            main = _module_main("dsrl.cli.check" if module == "dsrl.check" else module)
            return _check_entry(f"python -m {module}", lambda: main(rest), rest, overrides_ok=True)
        return []
    if args[0] == "-c" or not args[0].endswith(".py"):
        return []
    script, rest = args[0], args[1:]
    if not (REPO / script).is_file():
        return [f"{script}: no such file"]
    if script in ("launch/train.py", "bench/gpu/measure.py") or script.startswith("bench/"):
        return _check_entry(script, _script(script, rest), rest, overrides_ok=script == "launch/train.py")
    return []


def extras() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require" and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set()


def check_inline_installs(text: str, doc: Path) -> list[str]:
    """The ``pip install`` lines a sentence quotes (`` `pip install ...` `` outside the fenced blocks), held to
    :func:`check_pip` as the blocks' are."""
    problems = []
    for m in re.finditer(r"`((?:python -m )?pip install [^`]+)`", prose(text)):
        try:
            args = shlex.split(m.group(1))
        except ValueError:
            problems.append(f"{doc.relative_to(REPO)}: `{m.group(1)}` does not parse as a shell line")
            continue
        problems += [f"{doc.relative_to(REPO)}: {p}" for p in check_pip(args[args.index("pip") + 1:])]
    return problems


def check_pip(args: list[str]) -> list[str]:
    """``pip install`` lines install dsrl from the checkout (the package index's ``dsrl`` is another project), with
    extras setup.py declares."""
    if "install" not in args:
        return []
    problems = []
    for a in args:
        m = re.match(r"^(\.|dsrl)?\[([\w,\- ]+)\]$", a)
        if a.startswith("dsrl") and not a.startswith("dsrl-"):
            problems.append(f"pip install {a}: installs the package index's unrelated 'dsrl'; install from the "
                            "checkout (pip install -e \".[...]\")")
        if m:
            unknown = {e.strip() for e in m.group(2).split(",")} - extras()
            if unknown:
                problems.append(f"pip install {a}: no extra {', '.join(sorted(unknown))} in setup.py")
    return problems


# --------------------------------------------------------------------------------------------- pytest lines
def _test_functions(path: Path) -> list[tuple[str, bool]]:
    """(name, in the extended tier) of each test of a test file."""
    tree = ast.parse(path.read_text())
    module_extended = any(any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and "extended" in ast.unparse(n.value).lower()
                          for n in tree.body if isinstance(n, ast.Assign))
    out = []

    def visit(body: list[ast.stmt], prefix: str, extended: bool) -> None:
        for n in body:
            if isinstance(n, ast.ClassDef) and n.name.startswith("Test"):
                marked = extended or any("extended" in ast.unparse(d).lower() for d in n.decorator_list)
                visit(n.body, f"{prefix}{n.name}::", marked)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"):
                marked = extended or any("extended" in ast.unparse(d).lower() for d in n.decorator_list)
                out.append((prefix + n.name, marked))

    visit(tree.body, "", module_extended)
    return out


def _keyword_match(expr: str, name: str) -> bool:
    code = re.sub(r"[A-Za-z_][A-Za-z0-9_\-\[\]]*",
                  lambda m: m.group(0) if m.group(0) in ("and", "or", "not") else repr(m.group(0).lower() in name),
                  expr)
    return bool(eval(code))  # noqa: S307 - only booleans and and/or/not remain


def check_pytest(args: list[str]) -> list[str]:
    """A documented pytest line selects at least one test of the tier it names (static: test functions, the
    ``extended`` marker, ``-k``)."""
    tier, k, paths, skip = "suite", None, [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--tier":
            tier, skip = args[i + 1], True
        elif a.startswith("--tier="):
            tier = a.split("=", 1)[1]
        elif a == "-k":
            k, skip = args[i + 1], True
        elif a in ("-m", "--durations", "-p", "--maxfail"):
            skip = True
        elif not a.startswith("-"):
            paths.append(a)
    if not paths:
        return []
    selected = 0
    for p in paths:
        file_part, _, only = p.partition("::")
        target = REPO / file_part
        if not target.exists():
            return [f"pytest {' '.join(args)}: {file_part} does not exist"]
        files = [target] if target.is_file() else sorted(target.rglob("test_*.py"))
        for f in files:
            for name, extended in _test_functions(f):
                if only and not name.startswith(only.split("[")[0]):
                    continue
                if tier != "all" and extended != (tier == "extended"):
                    continue
                if k and not _keyword_match(k, f"{f.stem}::{name}".lower()):
                    continue
                selected += 1
    return [] if selected else [f"pytest {' '.join(args)}: selects no test (tier {tier})"]


# --------------------------------------------------------------------------------------------- paths, words, defaults
def check_links(text: str, doc: Path) -> list[str]:
    problems = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose(text)):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            problems.append(f"{doc.relative_to(REPO)}: the link {target} does not resolve")
    return problems


def repo_paths(text: str) -> set[str]:
    """Repository paths a doc names in code (spans and blocks): ``configs/...``, ``bench/...``, ``docs/...`` ..."""
    code = " ".join(re.findall(r"^```.*?^```", text, re.M | re.S) + re.findall(r"`[^`\n]+`", prose(text)))
    pattern = r"(?<![\w./$-])((?:{})/[\w./*<>{{}}-]*[\w*>}}])".format("|".join(REPO_DIRS))
    return {m.group(1) for m in re.finditer(pattern, code + " ")
            if not re.search(r"[*<>{}]", m.group(1)) and not re.match(r"/?\.\.\.", code[m.end(1):])}


def check_paths(text: str, doc: Path) -> list[str]:
    missing = sorted(p for p in repo_paths(text) if not (REPO / p).exists() and not (REPO / p.split("::")[0]).exists())
    return [f"{doc.relative_to(REPO)}: {p} does not exist in the repository" for p in missing]


def check_words(text: str, doc: Path) -> list[str]:
    problems = []
    for i, line in enumerate(text.splitlines(), 1):
        for pattern, why in FORBIDDEN:
            if pattern.search(line):
                problems.append(f"{doc.relative_to(REPO)}:{i} {why}: {line.strip()[:90]}")
    return problems


_DEFAULT = re.compile(
    r"`(?:dsrl\.)?(?P<key>[a-z_]+\.[a-z_]+)`\**\s*(?:\((?:default:?\s+(?P<a>[^)]+?)|(?P<b>[^)]+?) by default)\)"
    r"|defaults to\s+(?P<c>`[^`]+`|[\w.\-]+))")


def _normal(text: str) -> Any:
    v = text.strip().strip("`").strip("'\"").split(";")[0].split(",")[0].strip().strip("`")
    v = re.sub(r"\s*(s|seconds|MiB|GiB|tokens)$", "", v)
    low = v.lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    if low in ("null", "none"):
        return None
    try:
        return float(v)
    except ValueError:
        return v if re.fullmatch(r"[\w.\-]+", v) else _MISSING


def config_default(dotted: str) -> Any:
    """The default of ``section.key`` in the config models (``_MISSING`` when there is none)."""
    from pydantic_core import PydanticUndefined

    from dsrl.config import DsrlConfig

    section, key = dotted.split(".", 1)
    field = DsrlConfig.model_fields.get(section)
    model = next((a for a in getattr(field.annotation, "__args__", (field.annotation,)) if hasattr(a, "model_fields")),
                 None) if field else None
    if model is None or key not in model.model_fields:
        return _MISSING
    f = model.model_fields[key]
    if f.default is PydanticUndefined:
        return f.default_factory() if f.default_factory else _MISSING
    return f.default


def check_defaults(text: str, doc: Path) -> list[str]:
    problems = []
    for m in _DEFAULT.finditer(prose(text)):
        stated = _normal(m.group("a") or m.group("b") or m.group("c"))
        actual = config_default(m.group("key"))
        if stated is _MISSING or actual is _MISSING or actual is None:  # None: a bound computed where it is used
            continue
        same = (stated == actual or (isinstance(actual, (int, float)) and not isinstance(actual, bool)
                                     and isinstance(stated, float) and float(actual) == stated)
                or (isinstance(actual, str) and str(stated) == actual))
        if not same:
            problems.append(f"{doc.relative_to(REPO)}: says {m.group('key')} defaults to {stated!r}; the config's "
                            f"default is {actual!r}")
    return problems


def check_doc(doc: Path, text: str | None = None) -> list[str]:
    text = doc.read_text() if text is None else text
    problems = (check_links(text, doc) + check_paths(text, doc) + check_words(text, doc) + check_defaults(text, doc)
                + check_inline_installs(text, doc))
    for b in blocks(text, doc):
        if b.lang in ("json", "jsonl"):
            problems += check_json_block(b)
        elif b.lang in SHELL:
            for argv in commands(b.text):
                problems += [f"{b.where()}: {p}" for p in check_command(argv)]
    return problems
