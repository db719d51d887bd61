"""Where metrics go: stdout (one line per rollout), ``metrics.jsonl``, DeepSpeed's monitor.

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per line: ``{"event": "step", ...}``
after every optimizer step (``optimizer_step`` is the applied-step count, ``call`` the mini-batch
index) and ``{"event": "rollout", ...}`` after every rollout. The ds_config ``tensorboard`` /
``csv_monitor`` / ``wandb`` sections are honoured through the engine's ``monitor`` (DeepSpeed's
MonitorMaster), with the optimizer step as the x-axis.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

ROLLOUT_LINE_KEYS = (
    ("reward_mean", "reward {:.3f}"),
    ("accuracy", "acc {:.3f}"),
    ("response_len", "len {:.1f}"),
    ("loss", "loss {:+.4f}"),
    ("kl", "kl {:.4f}"),
    ("clip_frac", "clip {:.3f}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("lr", "lr {:.2e}"),
    ("tokens_per_s", "{:.0f} tok/s"),
)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None reads as "not available"
    return value


class MetricsWriter:
    """Append-only metrics sink; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, rank: int, monitor: Any = None, resume_at: tuple[int, int] | None = None):
        """``resume_at = (rollout, optimizer_step)`` of the checkpoint a run resumed from: rows written
        after it (by the attempt that crashed or stopped) are dropped, so the file reads as one run."""
        self.rank = rank
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = None
        if rank == 0:
            os.makedirs(output_dir, exist_ok=True)
            if resume_at is not None and os.path.isfile(self.path):
                self._truncate(*resume_at)
            self._file = open(self.path, "a" if resume_at is not None else "w", encoding="utf-8")  # noqa: SIM115

    def _truncate(self, rollout: int, step: int) -> None:
        keep = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the crash
                if row.get("rollout", 0) <= rollout and row.get("optimizer_step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)

    def write(self, event: str, record: dict[str, Any], step: int) -> None:
        if self._file is None:
            return
        row = {"event": event, **{k: _clean(v) for k, v in record.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.monitor is not None:
            events = [(f"dsrl/{event}/{k}", float(v), step) for k, v in record.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
            self.monitor.write_events(events)

    def rollout_line(self, record: dict[str, Any], total_rollouts: int) -> str:
        parts = [f"rollout {record['rollout']}/{total_rollouts}", f"step {record['optimizer_step']}"]
        for key, fmt in ROLLOUT_LINE_KEYS:
            v = record.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                parts.append(fmt.format(v))
        parts.append(f"gen {record['rollout_s']:.1f}s train {record['train_s']:.1f}s")
        return " | ".join(parts)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
