"""Where metrics go: stdout (one line per rollout), ``metrics.jsonl``, DeepSpeed's monitor.

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per line: ``{"event": "step", ...}``
after every optimizer step (``optimizer_step`` is the applied-step count, ``call`` the mini-batch
index), ``{"event": "rollout", ...}`` after every rollout (its phase timings and peak memory come from
:mod:`dsrl.runtime.phases`) and ``{"event": "eval", ...}`` after each held-out evaluation (``dsrl.eval``).
The ds_config ``tensorboard`` / ``csv_monitor`` / ``wandb`` sections are honoured through the engine's
``monitor`` (DeepSpeed's MonitorMaster), with the optimizer step as the x-axis (``dsrl/<event>/<key>``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

DROPPED = "metrics.dropped.jsonl"  # rows past a resume point, kept rather than deleted
ROLLOUT_LINE_KEYS = (
    ("reward_mean", "reward {:.3f}"),
    ("accuracy", "acc {:.3f}"),
    ("response_len", "len {:.1f}"),
    ("turns_per_trajectory", "turns {:.2f}"),
    ("tool_calls_per_trajectory", "calls {:.2f}"),
    ("loss", "loss {:+.4f}"),
    ("value_loss", "vloss {:.4f}"),
    ("kl", "kl {:.4f}"),
    ("clip_frac", "clip {:.3f}"),
    ("rollout_logprob_abs_diff", "|dlogp| {:.1e}"),
    ("router_mismatch_frac", "routes {:.3f}"),
    ("logprob_abs_diff_own_routes", "|dlogp| own {:.1e}"),
    ("logprob_abs_diff_replayed_routes", "replayed {:.1e}"),
    ("is_weight_max", "w_max {:.2f}"),
    ("staleness_max", "stale {:.0f}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("lr", "lr {:.2e}"),
    ("tokens_per_s", "{:.0f} tok/s"),
)

SHOWN_WHEN_NONZERO = {"staleness_max"}  # colocated runs are never stale: no column for it


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None reads as "not available"
    return value


class MetricsWriter:
    """Append-only metrics sink; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, rank: int, monitor: Any = None, resume_at: tuple[int, int] | None = None):
        """``resume_at = (rollout, optimizer_step)`` of the checkpoint a run resumed from: rows written
        after it (by the attempt that crashed or stopped) move to metrics.dropped.jsonl, so the file reads
        as one run. Without ``resume_at`` the file is started anew (dsrl.checkpoint.run_dir refuses that when it holds
        a run, unless run.overwrite)."""
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
        """Keep the rows up to the resume point; the others go to ``metrics.dropped.jsonl`` (appended), so
        no row is ever lost."""
        keep, dropped = [], []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line if line.endswith("\n") else line + "\n"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    dropped.append(line)  # a line cut by the crash
                    continue
                ok = isinstance(row, dict) and (row.get("rollout") or 0) <= rollout and (
                    row.get("optimizer_step") or 0) <= step  # (a `dsrl eval` row appended here holds nulls)
                (keep if ok else dropped).append(line)
        if not dropped:
            return
        with open(os.path.join(os.path.dirname(self.path), DROPPED), "a", encoding="utf-8") as f:
            f.writelines(dropped)
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
            if isinstance(v, (int, float)) and math.isfinite(v) and not (key in SHOWN_WHEN_NONZERO and v == 0):
                parts.append(fmt.format(v))
        parts.append(f"gen {record['rollout_s']:.1f}s train {record['train_s']:.1f}s")
        peak = record.get("peak_mib")  # the largest phase peak (dsrl.runtime.phases)
        if isinstance(peak, (int, float)) and math.isfinite(peak):
            parts.append(f"peak {peak:,.0f} MiB")
        return " | ".join(parts)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _token_mean(results: list[dict[str, Any]], key: str) -> float:
    """The token-weighted mean of a per-step metric over a rollout's steps (NaN when absent)."""
    vals = [(r[key], r["tokens"]) for r in results if key in r]
    w = sum(t for _, t in vals)
    return sum(v * t for v, t in vals) / w if w else float("nan")


def rollout_record(stats: Any, results: list[dict[str, Any]], *, world: int, rollout: int, optimizer_step: int,
                   rollout_size: int, prompt_epochs: float, sampling_rounds: int,
                   local_train_s: float, elapsed_s: float = 0.0) -> dict[str, Any]:
    """The ``rollout`` row of metrics.jsonl from the rollout's summed :class:`dsrl.rl.rollout_stats.RolloutStats`
    (already reduced over ranks) and its optimizer steps' results."""
    n = stats.finite_rewards
    mean = stats.reward_sum / n if n else float("nan")
    std = math.sqrt(max(stats.reward_sq_sum / n - mean * mean, 0.0)) if n else float("nan")
    tokens = sum(r["tokens"] for r in results)
    applied = [r for r in results if r["step_applied"]]
    samples = stats.samples
    clip_low, clip_high = _token_mean(results, "clip_low_frac"), _token_mean(results, "clip_high_frac")
    return {
        "rollout": rollout,
        "optimizer_step": optimizer_step,
        "episodes": rollout * rollout_size,
        "prompt_epochs": prompt_epochs,
        "reward_mean": mean,
        "reward_std": std,
        "accuracy": stats.accuracy_sum / stats.scored_accuracy if stats.scored_accuracy else None,
        "response_len": stats.completion_tokens / samples if samples else 0.0,
        "masked_samples": stats.masked_samples,
        "reward_timeouts": stats.reward_timeouts,
        "prompts_truncated": stats.prompts_truncated,
        "truncated_frac": stats.truncated_samples / samples if samples else 0.0,
        "zero_variance_groups": stats.groups_zero_variance / stats.groups_generated if stats.groups_generated else 0.0,
        "sampling_rounds": float(sampling_rounds),
        "reward_model_fillers": stats.reward_model_fillers,
        "loss": sum(r["loss"] for r in results) / len(results) if results else float("nan"),
        "kl": _token_mean(results, "kl"),
        "entropy": _token_mean(results, "entropy"),
        "clip_low_frac": clip_low,
        "clip_high_frac": clip_high,
        "clip_frac": clip_low + clip_high,
        "grad_norm": sum(r["grad_norm"] for r in applied) / len(applied) if applied else float("nan"),
        "lr": results[-1]["lr"] if results else float("nan"),
        "skipped_steps": len(results) - len(applied),
        "train_tokens": tokens,
        "tokens_per_s": tokens / local_train_s if local_train_s > 0 else 0.0,
        "rollout_s": stats.rollout_s / world,
        "train_s": stats.train_s / world,
        "elapsed_s": elapsed_s,  # wall time since this invocation's loop started (rank 0)
        # the behavior policy's mismatch over the counted model tokens (ARCHITECTURE §8, dsrl.algos.correction)
        "rollout_logprob_abs_diff": _per(stats.logprob_abs_diff_sum, stats.mismatch_tokens),
        "rollout_kl": _per(stats.rollout_kl_sum, stats.mismatch_tokens),
        "is_weight_max": stats.is_weight_max if stats.mismatch_tokens else None,
        "is_truncated_frac": _per(stats.is_truncated, stats.mismatch_tokens),
        "is_masked_frac": _per(stats.is_masked, stats.mismatch_tokens),
        "staleness_mean": _per(stats.staleness_sum, samples),
        "staleness_max": stats.staleness_max,
        # disaggregated generation (docs/async.md); 0 when colocated
        "trainer_wait_s": stats.wait_s / world,
        "publish_s": stats.publish_s / world,
        "generator_s": stats.generator_s,
        "generator_idle_frac": _per(stats.generator_idle_s, stats.generator_idle_s + stats.generator_s) or 0.0,
        # weight sync to a generating engine with weights of its own (docs/memory.md); 0 when the weights are shared
        "weight_sync_s": stats.weight_sync_s / world,
        "weight_sync_bytes": stats.weight_sync_bytes,
        "weight_sync_buckets": stats.weight_sync_buckets,
        "vllm_sleep_s": stats.vllm_sleep_s / world,
        "vllm_wake_s": stats.vllm_wake_s / world,
        **_trajectory_record(stats, world),
        **_route_record(stats, results),
    }


def _route_record(stats: Any, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The mixture-of-experts columns (dsrl.rl.policy.moe), present for an MoE policy: the fraction of (position,
    layer) pairs whose experts differ between the rollout's routers and the trainer's own, |log pi - log mu| over
    the counted tokens with the trainer's own routes and with the rollout's replayed (None without rollout
    routes), and the load-balancing term's token mean when it is trained."""
    if not getattr(stats, "moe_policy", 0.0):
        return {}
    out = {
        "router_mismatch_frac": _per(stats.route_differing, stats.route_pairs),
        "logprob_abs_diff_own_routes": _per(stats.own_routes_abs_diff_sum, stats.route_tokens),
        "logprob_abs_diff_replayed_routes": _per(stats.replayed_routes_abs_diff_sum, stats.replayed_tokens),
    }
    if any("router_aux_loss" in r for r in results):
        out["router_aux_loss"] = _token_mean(results, "router_aux_loss")
    return out


def _trajectory_record(stats: Any, world: int) -> dict[str, Any]:
    """The multi-turn columns (dsrl.rl.episodes.driver), present when the rollout's samples are trajectories:
    per-trajectory means of model turns, tool calls (observations appended) and observation tokens; the seconds
    spent in the environment (averaged over ranks, like rollout_s); how many trajectories an environment call
    past data.environment_timeout_s masked, and how many were cut by an observation that did not fit, by
    rollout.max_turns and by rollout.max_trajectory_tokens. ``response_len`` counts model tokens only."""
    n = getattr(stats, "trajectories", 0.0)
    if not n:
        return {}
    return {
        "turns_per_trajectory": stats.turns / n,
        "tool_calls_per_trajectory": stats.tool_calls / n,
        "observation_tokens_per_trajectory": stats.observation_tokens / n,
        "environment_s": stats.environment_s / world,
        "environment_timeouts": stats.environment_timeouts,
        "observation_overflows": stats.observation_overflows,
        "turn_limit_frac": stats.turn_limit_cuts / n,
        "token_limit_frac": stats.token_limit_cuts / n,
    }


def _per(total: float, count: float) -> float | None:
    """A mean, or None (not available) when there is nothing to average."""
    return total / count if count else None


# The critic's per-step values written to each "step" row as critic_<name> (dsrl.critic).
CRITIC_STEP_METRICS = ("loss", "grad_norm", "lr", "vf_clip_frac", "value", "return", "step_applied")


def critic_record(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The critic's part of a ``rollout`` row from its optimizer steps' results (empty without steps)."""
    if not results:
        return {}
    applied = [r for r in results if r["step_applied"]]
    return {
        "value_loss": sum(r["loss"] for r in results) / len(results),
        "vf_clip_frac": _token_mean(results, "vf_clip_frac"),
        "value_mean": _token_mean(results, "value"),
        "return_mean": _token_mean(results, "return"),
        "critic_grad_norm": sum(r["grad_norm"] for r in applied) / len(applied) if applied else float("nan"),
        "critic_lr": results[-1]["lr"],
        "critic_optimizer_step": results[-1]["optimizer_step"],
    }
