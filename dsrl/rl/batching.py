"""Rollout samples and their collation into micro-batches.

A :class:`Sample` is one generated sequence (prompt + completion) with everything the policy loss
needs, kept as plain Python lists so a rollout can be all-gathered across ranks cheaply and
re-partitioned every epoch. :func:`collate` turns samples into a right-padded micro-batch:

- ``input_ids[i, t] = tokens[t]`` and ``targets[i, t] = tokens[t + 1]`` for t < len(tokens) - 1;
- ``loss_mask[i, t] = 1`` exactly where ``targets[i, t]`` is a completion token of an active sample
  whose ``completion_mask`` is 1 (a sample masked by a filter contributes no token to any count; a
  ``completion_mask`` 0 marks an environment token of a multi-turn trajectory, or a token the masked
  importance sampling removed);
- ``is_weights[b, t]``: the off-policy correction's truncated weight of each completion token
  (:mod:`dsrl.algos.correction`), present when some sample carries one (1 elsewhere);
- ``old_logprobs`` / ``ref_logprobs`` are aligned with ``targets``; ``advantages`` is ``[b]`` (one per
  sequence), or ``[b, t]`` aligned with ``targets`` when the samples carry per-token advantages (GAE);
- with a critic, ``old_values`` (the critic's values at rollout time) and ``returns`` (its GAE
  targets) are ``[b, t]`` aligned with ``targets``.

Per-token data (log-probs, values, returns, advantages) is a field of the :class:`Sample`, so it
travels with the sample whichever way a rollout is exchanged between ranks.

Right padding never changes a causal model's outputs at earlier positions, so a sample's losses do
not depend on which micro-batch it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One sequence of a rollout (see the module docstring for the alignment rules)."""

    tokens: list[int]  # prompt + completion, unpadded
    prompt_len: int
    group: int  # global prompt-group id within the rollout
    reward: float
    advantage: float = 0.0
    active: bool = True  # False: fully masked (overlong-filtered, non-finite reward)
    finished: bool = True  # the completion ended with eos
    accuracy: float | None = None
    old_logprobs: list[float] = field(default_factory=list)  # one per completion token
    ref_logprobs: list[float] | None = None
    # With a critic (ppo): one per completion token, from the rollout's values and GAE.
    values: list[float] | None = None
    returns: list[float] | None = None
    token_advantages: list[float] | None = None
    # The rollout side (ARCHITECTURE §8), one per completion token: log mu of the behavior policy (the backend that
    # sampled the token), whether the loss counts the token (None = all of them), the correction's weight.
    behavior_logprobs: list[float] | None = None
    completion_mask: list[int] | None = None
    is_weights: list[float] | None = None
    version: int = 0  # the policy version (weight syncs) the sample was generated with

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def length(self) -> int:
        """Positions a forward over this sample costs (inputs are tokens[:-1])."""
        return max(len(self.tokens) - 1, 1)


def collate(samples: list[Sample], pad_id: int, device: torch.device | str = "cpu",
            with_logprobs: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded micro-batch tensors for ``samples`` (padded to their own longest)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    b, width = len(samples), max(s.length for s in samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    targets = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.long)
    old = torch.zeros((b, width), dtype=torch.float32)
    ref = torch.zeros((b, width), dtype=torch.float32)
    per_token = {key: torch.full((b, width), _FILL.get(key, 0.0), dtype=torch.float32)
                 for key, attr in _PER_TOKEN.items() if with_logprobs and any(getattr(s, attr) for s in samples)}
    for i, s in enumerate(samples):
        n = len(s.tokens) - 1
        toks = torch.tensor(s.tokens, dtype=torch.long)
        input_ids[i, :n] = toks[:-1]
        targets[i, :n] = toks[1:]
        attention_mask[i, :n] = 1
        start = s.prompt_len - 1  # position whose target is the first completion token
        if s.active and n > start:
            loss_mask[i, start:n] = 1
            if s.completion_mask is not None:
                loss_mask[i, start:n] = torch.tensor(s.completion_mask[: n - start], dtype=torch.long)
        if with_logprobs and s.old_logprobs:
            old[i, start:start + len(s.old_logprobs)] = torch.tensor(s.old_logprobs)
        if with_logprobs and s.ref_logprobs:
            ref[i, start:start + len(s.ref_logprobs)] = torch.tensor(s.ref_logprobs)
        for key, out_t in per_token.items():
            values = getattr(s, _PER_TOKEN[key])
            if values:
                out_t[i, start:start + len(values)] = torch.tensor(values)
    out = {
        "input_ids": input_ids,
        "targets": targets,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(width).unsqueeze(0).expand(b, width).contiguous(),
        "loss_mask": loss_mask,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        **per_token,
    }
    return {k: v.to(device) for k, v in out.items()}


def collate_packed(samples: list[Sample], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One padding-free row holding all ``samples`` back to back (``[1, sum of lengths]``).

    ``position_ids`` restart at 0 for every sample and there is no ``attention_mask``: transformers
    then builds a block-diagonal causal mask (sdpa/eager) or uses varlen kernels (flash attention),
    so no token attends across samples -- provided the forward runs without a KV cache
    (``use_cache=False``; with a cache transformers does not look for packed rows). Per-token
    ``seq_valid_tokens`` and ``num_sequences`` keep the loss weights and counts of :mod:`dsrl.core.weights`
    identical to the padded layout.
    """
    rows = [collate([s], pad_id, "cpu") for s in samples]
    keys = ("input_ids", "targets", "loss_mask", "old_logprobs", "ref_logprobs", "old_values", "returns", "is_weights")
    token_keys = [k for k in keys if k in rows[0]]
    cat = {k: torch.cat([r[k][:, : s.length] for r, s in zip(rows, samples)], dim=1) for k in token_keys}
    cat["position_ids"] = torch.cat([torch.arange(s.length) for s in samples]).unsqueeze(0)
    cat["advantages"] = torch.cat([r["advantages"][:, : s.length] if r["advantages"].dim() == 2
                                   else torch.full((1, s.length), float(r["advantages"][0]))
                                   for r, s in zip(rows, samples)], dim=1)
    n_s = [int(r["loss_mask"].sum()) for r in rows]
    cat["seq_valid_tokens"] = torch.cat([torch.full((s.length,), n) for s, n in zip(samples, n_s)]).unsqueeze(0)
    cat["num_sequences"] = torch.tensor([sum(1 for n in n_s if n > 0)])
    return {k: v.to(device) for k, v in cat.items()}


# Collated [b, t] tensor -> the per-completion-token Sample field it is filled from.
_PER_TOKEN = {"old_values": "values", "returns": "returns", "advantages": "token_advantages",
              "is_weights": "is_weights"}
_FILL = {"is_weights": 1.0}  # the value of positions (and samples) without one


def completion_positions(samples: list[Sample]) -> list[slice]:
    """For each sample, the positions of a collated batch whose targets are its completion tokens."""
    return [slice(s.prompt_len - 1, len(s.tokens) - 1) for s in samples]


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
