"""``dsrl plot RUN_DIR [--out FILE]``: the curves of a run, as a PNG, from its ``metrics.jsonl``.

Panels: mean reward and exact-match accuracy, the held-out evaluations (``dsrl.eval``: accuracy, pass@k and mean
reward per evaluated rollout, when the run has them), policy entropy, KL to the reference, (with a critic) the
value loss, the behavior policy's mismatch (when measured), and the seconds of each phase with the peak
memory (``dsrl.runtime.phases``), per rollout; the learning rate per optimizer step (policy, and critic when present),
with the supervised warm-up steps (``dsrl.sft``) shaded. matplotlib is optional: it is imported only
here, and a clear message says how to install it when it is missing.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from dsrl.config import ConfigError

DEFAULT_NAME = "curves.png"


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (a line cut by a crash is skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"dsrl plot {run_dir}: no metrics.jsonl there. Fix: pass a run's dsrl.run.output_dir.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in rows if isinstance(r.get(y), (int, float)) and math.isfinite(r[y])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("dsrl plot needs matplotlib, an optional dependency. Fix: pip install matplotlib "
                          "(or pip install -e '.[plot]').") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_KEYS = ("phase_generate_s", "phase_reward_s", "phase_old_logprobs_s", "phase_ref_logprobs_s",
              "phase_critic_values_s", "phase_train_s")


def _phase_panel(ax: Any, rollouts: list[dict[str, Any]], keys: list[str]) -> None:
    """Seconds per rollout of each phase that ran (mean over ranks), and the largest phase peak memory (max over
    ranks) on a second axis."""
    for key in keys:
        x, y = _series(rollouts, "rollout", key)
        ax.plot(x, y, label=key.removeprefix("phase_").removesuffix("_s"))
    ax.set_ylabel("seconds per phase")
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    x, y = _series(rollouts, "rollout", "peak_mib")
    if y:
        mem = ax.twinx()
        mem.plot(x, y, color="0.5", linestyle="--", label="peak memory")
        mem.set_ylabel("peak MiB", fontsize=8)
        mem.legend(loc="upper right", fontsize=7)


def _eval_panel(ax: Any, evals: list[dict[str, Any]]) -> None:
    """Accuracy, pass@k and mean reward of each held-out evaluation, at the rollout it evaluated."""
    k = evals[-1].get("pass_k")
    for key, label in (("accuracy", "held-out accuracy"), ("pass_at_k", f"pass@{k}"), ("reward_mean", "mean reward")):
        if key == "pass_at_k" and k == 1:
            continue  # pass@1 is the accuracy
        x, y = _series(evals, "rollout", key)
        if y:
            ax.plot(x, y, marker="o", markersize=3, label=label)
    last = evals[-1]
    ax.set_ylabel(f"evaluation ({last.get('prompts')} prompts)")
    ax.legend(loc="lower right", fontsize=8)


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write the run's curves to ``out`` (default ``RUN_DIR/curves.png``); returns the path written."""
    rows = read_metrics(run_dir)
    rollouts = [r for r in rows if r.get("event") == "rollout"]
    evals = [r for r in rows if r.get("event") == "eval" and isinstance(r.get("rollout"), int)]
    steps = [r for r in rows if r.get("event") in ("step", "sft")]
    if not rollouts and not steps:
        raise ConfigError(f"dsrl plot {run_dir}: metrics.jsonl holds no rollout or step rows yet.")
    plt = _pyplot()
    has_critic = any("value_loss" in r for r in rollouts)
    has_mismatch = any(isinstance(r.get(k), (int, float)) for r in rollouts
                       for k in ("rollout_logprob_abs_diff", "router_mismatch_frac"))
    phase_keys = [k for k in PHASE_KEYS if any(isinstance(r.get(k), (int, float)) for r in rollouts)]
    panels = ["reward", *(["eval"] if evals else []), "entropy", "kl", *(["value"] if has_critic else []),
              *(["mismatch"] if has_mismatch else []),
              *(["phases"] if phase_keys else []), "lr"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.1 * len(panels)), sharex=False)
    ax = dict(zip(panels, axes))

    x, y = _series(rollouts, "rollout", "reward_mean")
    ax["reward"].plot(x, y, label="mean reward")
    x, y = _series(rollouts, "rollout", "accuracy")
    if y:
        ax["reward"].plot(x, y, label="exact-match accuracy")
    ax["reward"].set_ylabel("reward / accuracy")
    ax["reward"].legend(loc="lower right", fontsize=8)
    if evals:  # the held-out evaluations (dsrl.eval)
        _eval_panel(ax["eval"], evals)
    for name, key, label in (("entropy", "entropy", "entropy (nats/token)"), ("kl", "kl", "KL to reference"),
                             ("value", "value_loss", "value loss")):
        if name not in ax:
            continue
        x, y = _series(rollouts, "rollout", key)
        if y:
            ax[name].plot(x, y)
        else:
            why = " (algorithm.kl_coef = 0)" if key == "kl" else ""
            ax[name].text(0.5, 0.5, f"no {key} in this run{why}", ha="center", va="center",
                          transform=ax[name].transAxes)
        ax[name].set_ylabel(label)
    if has_mismatch:  # the behavior policy against the trainer (ARCHITECTURE §8)
        mm = ax["mismatch"]
        for key, label in (("rollout_logprob_abs_diff", "mean |log pi_old - log mu|"),
                           ("rollout_kl", "KL(mu || pi_old)"), ("is_masked_frac", "masked fraction (mis)"),
                           ("is_truncated_frac", "truncated fraction (tis)"),
                           # a mixture-of-experts policy (docs/moe.md): experts chosen differently, and the
                           # recompute's |log pi - log mu| with the trainer's own routes and with the rollout's
                           ("router_mismatch_frac", "experts differing (token-layer fraction)"),
                           ("logprob_abs_diff_own_routes", "|dlogp|, trainer's own routes"),
                           ("logprob_abs_diff_replayed_routes", "|dlogp|, rollout's routes replayed")):
            x, y = _series(rollouts, "rollout", key)
            if y and any(v > 0 for v in y):
                mm.plot(x, y, label=label)
        mm.set_yscale("symlog", linthresh=1e-8)
        mm.set_ylabel("rollout vs trainer")
        mm.legend(loc="upper right", fontsize=7)
    if phase_keys:
        _phase_panel(ax["phases"], rollouts, phase_keys)
    for a in axes[:-1]:
        a.set_xlabel("rollout")
    lr = ax["lr"]
    # Mini-batches in the order they ran: supervised warm-up steps, then RL steps (critic-only ones included).
    for key, label in (("lr", "policy"), ("critic_lr", "critic")):
        pts = [(i, r[key]) for i, r in enumerate(steps, 1) if isinstance(r.get(key), (int, float))]
        if pts:
            lr.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    n_sft = sum(1 for r in steps if r.get("event") == "sft")
    if n_sft:
        lr.axvspan(0.5, n_sft + 0.5, color="0.9", label="supervised warm-up")
    lr.set_xlabel("mini-batch (optimizer step)")
    lr.set_ylabel("learning rate")
    lr.legend(loc="upper right", fontsize=8)
    last = rollouts[-1] if rollouts else {}
    tail = rollouts[-10:]
    acc = [r["accuracy"] for r in tail if isinstance(r.get("accuracy"), (int, float))]
    title = os.path.basename(os.path.normpath(run_dir))
    if acc:
        title += f": exact match {sum(acc) / len(acc):.1%} over the last {len(acc)} rollouts"
    elif last:
        title += f": mean reward {last.get('reward_mean', float('nan')):.3f} at rollout {last.get('rollout')}"
    if evals and isinstance(evals[-1].get("accuracy"), (int, float)):
        title += f";\nheld-out {evals[-1]['accuracy']:.1%} at rollout {evals[-1]['rollout']}"
    fig.suptitle(title, fontsize=10)  # two lines at most: the figure is narrower than a long run name's title
    fig.tight_layout()
    out = out or os.path.join(run_dir, DEFAULT_NAME)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
