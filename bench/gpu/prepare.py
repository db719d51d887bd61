"""Build, on a CPU machine with a package index, the wheels a lent GPU machine lacks, into one ignored folder
(``.whl/``), and print the exact device-tool call that carries them and runs bench/gpu/measure.py.

    python bench/gpu/prepare.py            # .whl/ for the GPU image's Python 3.12 (x86-64 Linux)
    python bench/gpu/prepare.py --check    # also check that every wheel installs for that Python

What it carries (pinned to the versions dsrl's suite passes with):
- DeepSpeed as a pure-Python wheel built from its source (``DS_BUILD_OPS=0``: no kernel is compiled here; on the
  GPU DeepSpeed builds the few it uses on first use with the image's nvcc and ninja);
- TRL (bench/e2e.py's comparison), transformers (dsrl's continuous batching needs >= 5.19; the image's may be
  older), megatron-core (the Megatron benchmarks);
- every requirement of those, followed recursively, that the GPU image does not ship (``IMAGE``: the lent image's
  package list; the image's torch, accelerate, pyarrow, ... are used as they are): e.g. pydantic and
  pydantic-core, datasets with dill and multiprocess, hjson.

A dependency takes the version installed on this machine when that satisfies the requirement (the combination
the suite runs), else the newest that does. Nothing is installed here; ``--check`` resolves the install for the
target Python into a throw-away folder. The folder is ignored by git (.gitignore: /.whl/ and *.whl).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINNED = {"deepspeed": "0.19.8", "trl": "1.16.0", "transformers": "5.24.0", "megatron-core": "0.16.1"}
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
CARRY_LIMIT_MIB = 64  # the device tool's working-tree limit, wheels and repository together
# The lent GPU image ('cuda', nvidia-h100-x1 / nvidia-h200: /work/.library/device/KINDS.md, read 2026-11-17).
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
MARKER_ENV = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           ".whl/*.whl")
RUN = "PYTHONUNBUFFERED=1 python3 bench/gpu/measure.py --window 530 --resume --out $OUT"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def download(spec: str, dest: Path) -> None:
    """One binary wheel for the GPU image's Python (a pure-Python wheel fits any platform)."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
        *plats, "-d", str(dest), spec)


def build_deepspeed(version: str, dest: Path) -> None:
    """DeepSpeed from its source distribution as a py3-none-any wheel (no ops built here)."""
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", f"deepspeed=={version}", "-w", str(dest), env=env)


def wheel_name(path: Path) -> str:
    return norm(path.name.split("-")[0])


def requirements(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel that apply on the GPU image (no extras), as requirement strings."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
            continue
        out.append(str(req))
    return out


def choose(req_text: str) -> str:
    """``name==version`` installed here when it satisfies the requirement, else the requirement itself."""
    from packaging.requirements import Requirement

    req = Requirement(req_text)
    try:
        here = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        here = None
    if here is not None and req.specifier.contains(here, prereleases=True):
        return f"{req.name}=={here}"
    return f"{req.name}{req.specifier}"


def prepare(dest: Path, extra: list[str]) -> list[Path]:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    build_deepspeed(PINNED["deepspeed"], dest)
    for name, version in PINNED.items():
        if name != "deepspeed":
            download(f"{name}=={version}", dest)
    for spec in extra:
        download(spec, dest)
    carried = {wheel_name(w) for w in dest.glob("*.whl")}
    queue = sorted(dest.glob("*.whl"))
    while queue:
        wheel = queue.pop(0)
        for req in requirements(wheel):
            name = norm(re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0])
            if name in IMAGE or name in carried:
                continue
            before = set(dest.glob("*.whl"))
            download(choose(req), dest)
            carried.add(name)
            queue += sorted(set(dest.glob("*.whl")) - before)
    return sorted(dest.glob("*.whl"))


def check(dest: Path) -> None:
    """Resolve an install of every wheel for the GPU image's Python into a throw-away folder."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    with tempfile.TemporaryDirectory(prefix="whl_check_") as tmp:
        pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:", "--python-version",
            PYTHON, "--implementation", "cp", *plats, "--target", tmp, *map(str, sorted(dest.glob("*.whl"))))
        found = sorted(p.name for p in Path(tmp).iterdir() if p.is_dir() and not p.name.endswith(".dist-info"))
    print(f"check: every wheel installs for Python {PYTHON} ({len(found)} top-level packages)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=str(REPO / ".whl"), help="the folder (default: .whl in the repository)")
    ap.add_argument("--also", nargs="*", default=[], help="more NAME==VERSION to carry (their requirements follow)")
    ap.add_argument("--check", action="store_true", help="also resolve an install for the GPU image's Python")
    args = ap.parse_args()
    dest = Path(args.dest).resolve()
    wheels = prepare(dest, args.also)
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"\n{len(wheels)} wheels, {total:.1f} MiB in {dest}:")
    for w in wheels:
        print(f"  {w.name} ({w.stat().st_size / 2**20:.1f} MiB)")
    if args.check:
        check(dest)
    if total > CARRY_LIMIT_MIB / 2:
        print(f"warning: {total:.0f} MiB of wheels leaves little of the device call's {CARRY_LIMIT_MIB} MiB for "
              "the repository")
    rel = os.path.relpath(dest, REPO)
    print(f"""
Device tool (run), from the repository root: the first call installs and runs the verdict (bench/gpu/measure.py's e2e
part, <= 8 minutes) and whatever else its window allows; the same call again, on the still-warm machine, goes on
where the last stopped (rollout-128 next); the section comes back as $OUT/section.md:
  carry: ["{rel}"]
  command: [ -d /tmp/site/deepspeed ] || {INSTALL.replace('.whl/', rel + '/')}; export PYTHONPATH=/tmp/site; {RUN}
  timeout_s: 600
Then here: python bench/gpu/measure.py --append <files_at>/section.md""")


if __name__ == "__main__":
    main()
