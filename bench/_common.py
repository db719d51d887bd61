"""Shared helpers of the benchmarks: RL-shaped length distributions, a small causal LM, markdown
tables, the machine description and appending a dated section to docs/benchmarks.md.

No benchmark asserts on absolute time: each prints ratios measured side by side in one run."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "docs" / "benchmarks.md"


# -- lengths --------------------------------------------------------------------------------------


def rl_lengths(n: int, max_len: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Sequence lengths (prompt + completion) shaped like an RL rollout, capped at ``max_len``.

    lognormal: prompts of 2-12 % of max_len, completions log-normal (median max_len/8, sigma 1);
    bimodal: 55 % short answers (median max_len/16), 30 % long reasoning (median max_len/2) and
    15 % truncated exactly at max_len (the tail of overlong completions).
    """
    prompt = rng.integers(max(8, max_len // 50), max(9, max_len // 8), n)
    if kind == "lognormal":
        completion = np.exp(rng.normal(np.log(max_len / 8), 1.0, n))
    elif kind == "bimodal":
        u = rng.random(n)
        short = np.exp(rng.normal(np.log(max_len / 16), 0.6, n))
        long = np.exp(rng.normal(np.log(max_len / 2), 0.3, n))
        completion = np.where(u < 0.55, short, np.where(u < 0.85, long, max_len))
    else:
        raise ValueError(f"unknown length distribution {kind!r} (lognormal | bimodal)")
    return np.clip(prompt + completion, 16, max_len).astype(np.int64)


# -- model ------------------------------------------------------------------------------------------

MODEL_SIZES: dict[str, dict[str, Any]] = {
    # CPU-sized shapes; "0.5b" is Qwen2.5-0.5B's shape (random weights, bf16 on GPU).
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
}


def build_lm(size: str, max_len: int, dtype: Any, seed: int = 0) -> Any:
    """A randomly initialised transformers Qwen2 causal LM of a named shape (identical on every rank)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**MODEL_SIZES[size], max_position_embeddings=max(max_len, 128), tie_word_embeddings=True,
                      attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype)


PAD, BOS, EOS = 0, 1, 2  # dsrl's tiny tokenizer
# Shapes of the generation benchmarks (bench/rollout.py, bench/e2e.py): Qwen2 with an untied head.
SHAPES = {
    # dsrl's built-in tiny model (dsrl.rl.policy.model.TINY_DEFAULTS) with a 512-token vocabulary
    "tiny": {"vocab": 512, "tiny": {}},
    # the same with head size 32 (2 heads, 1 key/value head), which vLLM's CPU attention kernels serve
    "tiny32": {"vocab": 512, "tiny": dict(num_attention_heads=2, num_key_value_heads=1)},
    # between the two (4.2 M parameters): where short completions stop favouring hf (bench/auto_grid.py)
    "mid": {"vocab": 2048, "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)},
    # a scaled-up Qwen2 shape that still decodes 128 sequences on 2 CPU cores in seconds (~17 M parameters)
    "scaled": {"vocab": 8192, "tiny": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)},
    # Qwen2.5-0.5B's shape (random weights, untied head): for a GPU
    "0.5b": {"vocab": 151936, "tiny": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                           num_attention_heads=14, num_key_value_heads=2,
                                           max_position_embeddings=32768)},
}


def long_tailed_model(shape: str, mean_len: float, device: str = "cpu", dtype: str = "float32",
                      attn: str | None = None, gradient_checkpointing: bool = False) -> Any:
    """A random-weight Qwen2 whose next-token distribution is ~uniform except eos at probability 1/mean_len (in
    eval mode; with ``gradient_checkpointing``, transformers' non-reentrant checkpointing, as dsrl's
    ``model.gradient_checkpointing`` enables it, active whenever a trainer puts the model in train mode)."""
    import torch

    from dsrl.config import ModelConfig
    from dsrl.rl.policy.model import build_model

    spec = SHAPES[shape]
    vocab = spec["vocab"]
    cfg = ModelConfig(arch="qwen2", dtype=dtype, attn_implementation=attn,
                      gradient_checkpointing=gradient_checkpointing,
                      tiny={**spec["tiny"], "tie_word_embeddings": False})
    model = build_model(cfg, vocab, PAD, BOS, EOS, on_gpu=device != "cpu", seed=0)
    hidden = model.config.hidden_size
    head = torch.nn.Linear(hidden, vocab, bias=True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head.weight.normal_(0.0, 0.02 / math.sqrt(hidden))  # logits ~0: uniform over the non-eos tokens
        head.bias.zero_()
        q = 1.0 / mean_len  # p(eos) = e^b / (e^b + V - 1)
        head.bias[EOS] = math.log(q * (vocab - 1) / (1 - q))
        head.bias[PAD] = head.bias[BOS] = -1e4
    model.lm_head = head.to(next(model.parameters()).dtype)
    return model.to(device).eval()


def serve_biased_head(model: Any) -> None:
    """Make dsrl's vLLM backend sample from :func:`long_tailed_model`'s distribution (benchmarks only).

    vLLM's Qwen2 has no output-head bias, so the head's bias is sent as vLLM's per-request ``logit_bias``
    instead (the same logits: W h + b) and left out of the weights ``sync_weights`` reloads. Patches
    :class:`dsrl.rollout.vllm.VLLMRolloutBackend` for this process."""
    import torch

    from dsrl.rollout import vllm as dsrl_vllm

    bias = model.lm_head.bias.detach().float().cpu()
    logit_bias = {EOS: float(bias[EOS]), PAD: -100.0, BOS: -100.0}  # vLLM keeps biases within [-100, 100]
    cls = dsrl_vllm.VLLMRolloutBackend

    def sampling_params(self: Any, samples_per_prompt: int, seed: int) -> Any:
        cfg = self.cfg
        return self._vllm.SamplingParams(
            n=samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_new_tokens, seed=seed,
            stop_token_ids=list(self.eos), logprobs=0, detokenize=False, logit_bias=logit_bias)

    def sync_weights(self: Any) -> None:
        with torch.no_grad(), dsrl_vllm.gathered_for_generation(self.module, self.policy):
            weights = [(n, t.detach()) for n, t in self.module.state_dict().items() if n != "lm_head.bias"]
            with dsrl_vllm.preserved_process_state():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.synced = True

    cls._sampling_params, cls.sync_weights = sampling_params, sync_weights


def per_token_nll(engine: Any, micro: dict) -> Any:
    """Per-token ``-A * log pi(target)`` ``[b, t]`` of a right-padded micro-batch (no attention mask is
    needed: with causal attention and right padding no valid position attends to a pad)."""
    import torch

    logits = engine(input_ids=micro["input_ids"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, micro["targets"].unsqueeze(-1)).squeeze(-1)
    return -micro["advantages"].unsqueeze(-1) * logp


def make_micro(lengths: list[int], pad_to: int | None, vocab: int, seed: int, device: Any) -> dict:
    """A right-padded micro-batch of random tokens for the given sequence lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = pad_to or max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=g)
    targets = torch.randint(0, vocab, (len(lengths), t), generator=g)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask[:, :1] = 0  # the first token has no prediction
    adv = torch.randn(len(lengths), generator=g)
    return {"input_ids": ids.to(device), "targets": targets.to(device), "loss_mask": mask.to(device),
            "advantages": adv.to(device)}


# -- reporting --------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (also readable in a terminal)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, width)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in width) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def machine() -> str:
    """One line describing where the numbers were taken."""
    parts = [platform.platform(), f"{os.cpu_count()} logical CPUs", f"python {platform.python_version()}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(f"GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
        else:
            parts.append("no GPU")
    except ImportError:
        pass
    try:
        import deepspeed

        parts.append(f"deepspeed {deepspeed.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def record(title: str, command: str, body: str, path: Path = RESULTS) -> None:
    """Print ``body`` and append it to docs/benchmarks.md as a dated section."""
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = f"\n### {title} ({stamp})\n\nCommand: `{command}`  \nMachine: {machine()}\n\n{body.rstrip()}\n"
    print(section, flush=True)
    if not path.exists():
        path.write_text("# Benchmarks\n\n## Recorded results\n", encoding="utf-8")
    with open(path, "a", encoding="utf-8") as f:
        f.write(section)
    print(f"(appended to {path.relative_to(REPO)})", flush=True)


def command_line() -> str:
    """The command that ran this benchmark, as the user would type it."""
    script = os.path.relpath(sys.argv[0], REPO)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
        env = "DS_ACCELERATOR=cpu " if os.environ.get("DS_ACCELERATOR") == "cpu" else ""
        return f"{env}deepspeed --num_gpus {os.environ['WORLD_SIZE']} {script} {' '.join(args)}".strip()
    return f"python {script} {' '.join(sys.argv[1:])}".strip()


# bench/gpu/measure.py: where report() also writes {"title", "command", "body"} as JSON
BENCH_OUT_ENV = "DSRL_BENCH_OUT"


def report(title: str, body: str, dry_run: bool = False) -> None:
    """Print ``body`` (``--no-record``) or append it to docs/benchmarks.md with the command that ran; also
    write it as JSON to ``$DSRL_BENCH_OUT`` when set (how bench/gpu/measure.py collects its parts)."""
    out = os.environ.get(BENCH_OUT_ENV)
    if out:
        import json

        with open(out, "w", encoding="utf-8") as f:
            json.dump({"title": title, "command": command_line(), "body": body}, f)
    if dry_run:
        print(body)
    else:
        record(title, command_line(), body)


def free_port() -> int:
    """A TCP port free on this host now (for a spawned job's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- launching a benchmark's processes: run_process (a fresh process) and spawn_ranks (a gloo job of functions) ------


@dataclass
class Finished:
    """How a benchmark process ended: ``ok``, ``failed`` (``output`` holds the end of what it printed) or ``timeout``
    (stopped past its bound, with its whole process group)."""

    status: str
    returncode: int | None
    output: str
    seconds: float


def bench_env(device: str, *, one_rank: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a benchmark process: this checkout's dsrl first on ``PYTHONPATH``, on the CPU DeepSpeed's
    CPU accelerator and one intra-op thread per process (every side alike), no tokenizer threads; ``one_rank``: a
    world of one rank (a dsrl Trainer run without a launcher)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **extra}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    if one_rank:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return env


def run_process(argv: list[str], *, env: dict[str, str], timeout: float | None = None, log: Path | None = None,
                cwd: Path = REPO) -> Finished:
    """Run ``argv`` from ``cwd`` in a process group of its own for at most ``timeout`` seconds (then the whole group:
    SIGTERM, and SIGKILL 10 s later), its output to ``log`` or kept (the end of it, for a failure's message)."""
    import signal
    import subprocess
    import tempfile
    import time

    t0 = time.perf_counter()
    with (open(log, "w") if log is not None else tempfile.TemporaryFile("w+")) as f:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=None if timeout is None else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        output = ""
        if log is None:
            f.seek(0)
            output = f.read()[-6000:]
    status = "timeout" if rc is None else "ok" if rc == 0 else "failed"
    return Finished(status, rc, output, time.perf_counter() - t0)


def rollout_rows(run_dir: str | Path, event: str = "rollout") -> list[dict[str, Any]]:
    """The ``rollout`` rows (or another ``event``'s: ``step``, ``eval``) of a dsrl run's metrics.jsonl (a line cut by a
    stopped process is skipped): the figures a benchmark reads from dsrl's own metrics."""
    import json

    path = Path(run_dir, "metrics.jsonl")
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("event") == event:
                rows.append(row)
    return rows


def spawn_ranks(fn: Any, world: int, *args: Any) -> None:
    """``fn(rank, world, master_port, *args)`` on ``world`` local processes (a gloo job of this benchmark); each ends
    through :func:`end_rank`."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def end_rank(path: str | Path, result: dict) -> None:
    """A spawned bench rank's last act: write its result, wait for its peers, then end without interpreter
    finalization (a gloo worker thread can abort it there: dsrl/runtime/process_exit.py)."""
    import json

    import torch.distributed as dist

    from dsrl.runtime.process_exit import leave

    Path(path).write_text(json.dumps(result))
    dist.barrier()
    leave(0)


def init_ranks() -> tuple[int, int, bool, Any]:
    """Initialise torch.distributed through dsrl; (rank, world size, on a GPU, training dtype)."""
    import torch
    import torch.distributed as dist

    from dsrl.backends.deepspeed.engine import ensure_distributed, on_gpu

    ensure_distributed()
    gpu = on_gpu()
    return dist.get_rank(), dist.get_world_size(), gpu, torch.bfloat16 if gpu else torch.float32
