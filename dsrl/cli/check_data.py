"""The data of ``dsrl.check`` (:mod:`dsrl.cli.check`, on either engine): the mini-batch's sequences, their
collation, the split patterns over ranks and micro-batches, the float64 reference gradient from the definitions,
and the run file of one case. Shared by the DeepSpeed check and the Megatron engine's
(:mod:`dsrl.cli.check_engine_megatron`), and by the unit tests' references."""

from __future__ import annotations

import copy
from typing import Any

import torch

from dsrl.cli.check_moe import MoESettings, collate_routes, moe_layout, reference_aux, reference_routing
from dsrl.cli.check_objectives import MAX_LEN, VOCAB, reference_correction, reference_per_token_loss
from dsrl.cli.check_trajectories import trajectory_sequences
from dsrl.cli.reference import mini_batch_loss
from dsrl.core.logprobs import LOGPROB_MASK

MASK_KEYS = ("loss_mask", "reference_mask", "planted_mask")
SPLITS = ("even", "uneven", "pad_rank", "empty")
# Accepted by --splits but not run by default: token-budget micro-batches from dsrl.core.partition.
EXTRA_SPLITS = ("token_budget",)
TOKEN_BUDGET = MAX_LEN  # tight budget: several uneven micro-batches per rank

def make_sequences(n: int, seed: int, empty: bool = False, multiturn: bool = False) -> list[dict[str, torch.Tensor]]:
    """n variable-length sequences with random loss masks; some fully masked (overlong-filtered). ``multiturn``:
    multi-turn trajectories instead (:mod:`dsrl.cli.check_trajectories`: observation spans, empty model turns, a
    trajectory without model tokens), each with its ``reference_mask`` from the definition."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    if multiturn:
        seqs = trajectory_sequences(n, seed, VOCAB)
        for s in seqs:
            if empty:
                for key in MASK_KEYS:
                    s[key] = torch.zeros_like(s[key])
            s["advantages"] = torch.randn((), generator=g) * 2
    for i in range(0 if multiturn else n):
        length = int(torch.randint(2, MAX_LEN + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        targets = torch.randint(0, VOCAB, (length,), generator=g)
        start = int(torch.randint(0, length, (1,), generator=g))  # prompt part is masked
        mask = torch.zeros(length, dtype=torch.long)
        mask[start:] = 1
        if empty or i % 5 == 3:
            mask.zero_()
        adv = torch.randn((), generator=g) * 2
        seqs.append({"input_ids": ids, "targets": targets, "loss_mask": mask, "advantages": adv})
    # Per-token data of the gspo/value objectives, from a second stream (the first one's draws stay as they were).
    g2 = torch.Generator().manual_seed(seed + 7919)
    for s in seqs:
        n = s["input_ids"].shape[0]
        # log pi_old ~ the tiny model's log-probs (about -log VOCAB) with noise: sequence ratios on both sides
        # of the clip range
        s["old_logprobs"] = -torch.log(torch.tensor(float(VOCAB))) + 0.3 * torch.randn(n, generator=g2)
        s["old_values"] = torch.randn(n, generator=g2) * 0.3
        s["returns"] = 1.0 + 0.5 * torch.randn(n, generator=g2)  # returns near a reward of 1: no cancellation
    # Behavior log-probs of the correction objectives, from a third stream: log w = log pi_old - log mu with a
    # spread that puts token weights and sequence weights on both sides of the cap and of [1/cap, cap].
    g3 = torch.Generator().manual_seed(seed + 104729)
    for s in seqs:
        s["behavior_logprobs"] = s["old_logprobs"] + 0.6 * torch.randn(s["input_ids"].shape[0], generator=g3)
        if multiturn:  # as a trajectory's sample carries them: 0.0 at observation tokens (mu is undefined there)
            observation = (s["planted_mask"] > 0) & (s["reference_mask"] == 0)
            s["behavior_logprobs"] = torch.where(observation, torch.zeros_like(s["old_logprobs"]),
                                                 s["behavior_logprobs"])
    return seqs


def collate(seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence of this micro-batch."""
    t = max(s["input_ids"].shape[0] for s in seqs)
    longs = ("input_ids", "targets", "loss_mask", *(k for k in ("reference_mask",) if all(k in s for s in seqs)))
    out = {k: torch.zeros(len(seqs), t, dtype=torch.long) for k in longs}
    out.update({k: torch.zeros(len(seqs), t) for k in FLOAT_KEYS if all(k in s for s in seqs)})
    for i, s in enumerate(seqs):
        n = s["input_ids"].shape[0]
        for k in out:
            out[k][i, :n] = s[k]
    out["advantages"] = torch.stack([s["advantages"] for s in seqs])
    out[LOGPROB_MASK] = out["loss_mask"] > 0  # the positions the fused head computes (host), as the trainer's collate
    if all("routes" in s for s in seqs):  # MoE routes (dsrl.cli.check_moe), FREE at padding
        out["routes"] = collate_routes(seqs, t)
    return out


FLOAT_KEYS = ("old_logprobs", "old_values", "returns", "behavior_logprobs", "is_weights")


def _rank_bounds(n: int, world: int, how: str) -> list[int]:
    if how in ("even", "empty"):
        per = n // world
        return [r * per for r in range(world)] + [n]
    weights = [r + 1 for r in range(world)]
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + max(1, round(n * w / sum(weights))))
    bounds[-1] = n
    return bounds


def prepare_split(seqs: list[dict], world: int, how: str) -> list[dict]:
    """The global mini-batch for a split pattern: for ``pad_rank`` the sequences that land on the
    last rank are fully masked (that rank holds only padding); the reference sees the same data."""
    if how != "pad_rank" or world == 1:
        return seqs
    start = _rank_bounds(len(seqs), world, how)[world - 1]
    return seqs[:start] + [{**s, **{k: torch.zeros_like(s[k]) for k in MASK_KEYS if k in s}} for s in seqs[start:]]


def split_for_rank(seqs: list[dict], world: int, rank: int, how: str) -> list[list[dict]]:
    """This rank's micro-batches (lists of sequences) under a split pattern.

    even: B/world sequences per rank, micro-batches of 2. uneven: rank r gets a share that grows
    with r, cut into micro-batches of sizes 1, 3, 2, 1, ... so micro-batch counts differ per rank.
    pad_rank: like uneven; :func:`prepare_split` masks the last rank's sequences.
    empty: every sequence fully masked (a zero-token mini-batch).
    token_budget: :func:`dsrl.core.partition.token_budget_micro_batches` with a budget of
    ``TOKEN_BUDGET`` padded tokens (rank-balanced, varying sequences per micro-batch).
    """
    if how == "token_budget":
        from dsrl.core.partition import token_budget_micro_batches

        lengths = [s["input_ids"].shape[0] for s in seqs]
        part = token_budget_micro_batches(range(len(seqs)), lengths, world, TOKEN_BUDGET)
        return [[seqs[i] for i in mb] for mb in part[rank] if mb]
    bounds = _rank_bounds(len(seqs), world, how)
    mine = seqs[bounds[rank]:bounds[rank + 1]]
    if how in ("even", "empty"):
        return [mine[i:i + 2] for i in range(0, len(mine), 2)]
    sizes, out, i, k = (1, 3, 2, 1), [], 0, 0
    while i < len(mine):
        out.append(mine[i:i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return out


def reference_gradient(model: torch.nn.Module, seqs: list[dict], loss_agg: str,
                       loss_agg_norm_length: int, objective: str = "policy",
                       moe: MoESettings | None = None) -> dict[str, torch.Tensor]:
    """float64 gradient of the mini-batch loss by parameter name, each mode computed from its definition
    (:func:`dsrl.cli.reference.mini_batch_loss`); with ``moe`` active, MoE blocks computed from theirs with the
    forced routes, plus the load-balancing term."""
    ref = copy.deepcopy(model).double()
    batch = collate(seqs)
    if "reference_mask" in batch:  # multi-turn data: the mask from the definition, not dsrl's
        batch["loss_mask"] = batch.pop("reference_mask")
    _, mask = reference_correction(batch, objective)
    if moe is not None and moe.active:
        with reference_routing(ref, batch, forced=moe.replay) as probs:
            lt = reference_per_token_loss(ref, batch, objective)
        if moe.aux_coef > 0:
            _, experts, top_k = moe_layout(ref)
            lt = lt + moe.aux_coef * reference_aux(probs, batch, mask, experts, top_k)
    else:
        lt = reference_per_token_loss(ref, batch, objective)
    loss = mini_batch_loss([lt], [mask], loss_agg, mini_batch_size=len(seqs), norm_length=loss_agg_norm_length)
    loss.backward()
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in ref.named_parameters()}


def check_run_file(ds_config: dict, stage: int, loss_agg: str, batch: int, lora: Any = None) -> dict:
    """The run file of one case: the user's ds_config minus optimizer/schedule/logging, plain SGD."""
    cfg = copy.deepcopy(ds_config)
    for k in ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "tensorboard", "csv_monitor", "wandb", "comet"):  # no logging here
        cfg.pop(k, None)
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    cfg["zero_allow_untested_optimizer"] = True
    cfg["gradient_clipping"] = 0.0
    cfg["dsrl"] = {
        "batch": {"prompts_per_rollout": batch // 2, "samples_per_prompt": 2, "mini_batch_size": batch,
                  "max_tokens_per_micro_batch": 4 * MAX_LEN, "allow_oversize": True, "loss_agg": loss_agg,
                  "loss_agg_norm_length": MAX_LEN},
        "run": {"rollouts": 1},
        "data": {"max_prompt_tokens": 1},
        "rollout": {"max_new_tokens": MAX_LEN},
    }
    if lora is not None:  # validated like a run's (AutoTP/AutoEP refused)
        cfg["dsrl"]["model"] = {"lora": lora.model_dump()}
    return cfg


