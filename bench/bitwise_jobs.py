"""Before-and-after evidence for a refactor: the six reference jobs' training rows, bit for bit.

A change that claims "no behaviour change" (the engine seam, the application's redesign) runs this on the tree
before and on the tree after, then compares:

    python bench/bitwise_jobs.py run --tree /path/to/old/checkout --out runs/bitwise/before
    python bench/bitwise_jobs.py run --tree . --out runs/bitwise/after
    python bench/bitwise_jobs.py compare runs/bitwise/before runs/bitwise/after

Each job is a shipped CPU run file (default GRPO, PPO with a critic, tools, LoRA, MoE, async with one generator
rank at k = 0) for 6 rollouts after 20 supervised warm-up steps, launched by DeepSpeed's runner on the CPU
accelerator with the tree first on ``PYTHONPATH``. ``compare`` reads every ``metrics.jsonl`` row with its
timings, throughputs and memory readings removed (they differ run to run) and prints each job's rows and the
number that differ; it exits 1 when any differs. This is not a benchmark: it prints no ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: name -> (run file, ranks)
JOBS: dict[str, tuple[str, int]] = {
    "default": ("configs/tiny_grpo_cpu.json", 2),
    "ppo": ("configs/tiny_ppo_cpu.json", 2),
    "tool": ("configs/tiny_tool_cpu.json", 2),
    "lora": ("configs/tiny_grpo_lora_cpu.json", 2),
    "moe": ("configs/tiny_moe_cpu.json", 2),
    "async": ("configs/tiny_grpo_async_cpu.json", 3),
}
#: keys of a metrics row that are measurements of the machine, not of the training
VOLATILE = re.compile(r"(_s|_sec|_seconds|per_s|_per_sec|_mib|_mb|_gib|time|timestamp|wall|elapsed|peak|idle"
                      r"|rss|memory|throughput|tok_s|samples_s)($|_)|^phase_|^t$|^date$")


def run(tree: Path, out: Path, jobs: list[str], port: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for i, name in enumerate(jobs):
        run_file, ranks = JOBS[name]
        job_dir = out / name
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
               "--master_port", str(port + i), str(tree / "launch/train.py"), "--ds_config", str(tree / run_file),
               "--dsrl.run.rollouts", "6", "--dsrl.sft.steps", "20", "--dsrl.run.output_dir", str(job_dir)]
        print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"[{name}] exit {rc} (log: {out / f'{name}.log'})", flush=True)
        if rc != 0:
            raise SystemExit(f"job {name} failed with exit status {rc}; see {out / f'{name}.log'}")


def stable_rows(path: Path) -> list[dict]:
    """A job's metrics rows without the keys that measure the machine."""
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not VOLATILE.search(k)})
    return rows


def compare(before: Path, after: Path, jobs: list[str]) -> int:
    differing = 0
    for name in jobs:
        a, b = stable_rows(before / name / "metrics.jsonl"), stable_rows(after / name / "metrics.jsonl")
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        diff += list(range(min(len(a), len(b)), max(len(a), len(b))))
        keys = sorted({k for r in a for k in r})
        print(f"{name}: {len(a)} rows before, {len(b)} after, {len(diff)} differ ({len(keys)} compared keys)")
        for i in diff[:3]:
            x, y = (a[i] if i < len(a) else {}), (b[i] if i < len(b) else {})
            changed = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
            print(f"  row {i}: {changed}")
        differing += len(diff)
    print(f"total: {differing} differing rows")
    return 1 if differing else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the jobs on one tree")
    r.add_argument("--tree", type=Path, default=REPO)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    r.add_argument("--port", type=int, default=29650)
    c = sub.add_parser("compare", help="compare two runs' rows")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    args = p.parse_args()
    if args.cmd == "run":
        run(args.tree.resolve(), args.out.resolve(), args.jobs, args.port)
    else:
        raise SystemExit(compare(args.before, args.after, args.jobs))


if __name__ == "__main__":
    main()
