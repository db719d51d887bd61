"""Prompt-shared micro-batches (``dsrl.model.share_prompts``): one forward over each prompt for all the samples of
the micro-batch that continue it.

GRPO-family rollouts hold G completions of every prompt, and a prompt is often longer than its completions, so a
padded micro-batch spends most of its forward and backward on G copies of the same prompt. :func:`prefix_inputs`
lays a micro-batch out as one row per distinct prompt: the prompt's tokens once, then each of its samples'
completion tokens (all but the last, which is only a target), back to back::

    row = [p_0 .. p_{L-1} | c1_0 .. c1_{n1-2} | c2_0 .. c2_{n2-2} | ...]

with ``position_ids`` that restart at ``L`` for every completion and a 4-D boolean attention mask
``[rows, 1, W, W]`` (True = attend) in which the prompt is causal, each completion attends to the prompt and
causally to itself, and nothing attends across completions. Every token thus sees exactly the context, at exactly
the positions, it has in its own padded row, so the model computes the same function (the kernels reduce in
another order: equal to float rounding, not bit for bit). Padding positions attend to themselves only (a row with
nothing to attend to would be NaN under sdpa) and are never selected.

:data:`PREFIX_INDEX` maps the micro-batch's selected positions (its ``logprob_mask``, in the padded layout's
row-major order: sample by sample, position by position) to flat positions of the shared layout: the first
completion token of every sample is predicted at its prompt's last position (one position, selected once per
sample: its gradient is the sum over them, as autograd's index_select gives), the others at the sample's own
segment. The loss side keeps the padded layout's tensors (``loss_mask``, ``old_logprobs``, ``advantages``, ...):
:func:`dsrl.rl.policy.logprobs.forward_logprobs` runs the shared rows and returns the statistics in the padded
layout, so weights, counts and every loss are unchanged (ARCHITECTURE §2).

Two samples share a row exactly when their prompt token ids are equal (not by their group id), so any micro-batch
is valid; sharing pays when the micro-batch holds many samples of few prompts
(:func:`dsrl.core.partition.prompt_micro_batches` keeps a prompt's samples together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PREFIX_INPUT_IDS = "prefix_input_ids"
PREFIX_POSITION_IDS = "prefix_position_ids"
PREFIX_ATTENTION_MASK = "prefix_attention_mask"
PREFIX_INDEX = "prefix_index"
PREFIX_KEYS = (PREFIX_INPUT_IDS, PREFIX_POSITION_IDS, PREFIX_ATTENTION_MASK, PREFIX_INDEX)


def shared_rows(tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[int]]:
    """The samples of each shared row, in order of first appearance: samples whose first ``prompt_len`` tokens are
    equal share one."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, (toks, p) in enumerate(zip(tokens, prompt_lens)):
        rows.setdefault(tuple(toks[:p]), []).append(i)
    return list(rows.values())


def row_length(prompt_len: int, lengths: Sequence[int]) -> int:
    """Positions a shared row costs: the prompt once, then each sample's forward length (``len(tokens) - 1``) past
    the prompt."""
    return prompt_len + sum(max(n - prompt_len, 0) for n in lengths)


def prefix_inputs(tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """The shared layout of a micro-batch whose sample ``i`` is ``tokens[i]`` with a prompt of ``prompt_lens[i]``
    tokens (module docstring): ``{PREFIX_INPUT_IDS, PREFIX_POSITION_IDS: [rows, W] long, PREFIX_ATTENTION_MASK:
    [rows, 1, W, W] bool, PREFIX_INDEX: [n] long}``, ``n`` the number of selected positions of the padded layout."""
    groups = shared_rows(tokens, prompt_lens)
    layouts, index_parts = [], [None] * len(tokens)
    for r, members in enumerate(groups):
        p = prompt_lens[members[0]]
        ids, pos, segments = list(tokens[members[0]][:p]), list(range(p)), []
        for i in members:
            tail = list(tokens[i][p:len(tokens[i]) - 1])  # completion inputs: every completion token but the last
            segments.append((len(ids), len(tail)))
            index_parts[i] = (r, p, len(ids), len(tokens[i]) - 1)
            ids += tail
            pos += range(p, p + len(tail))
        layouts.append((p, ids, pos, segments))
    width = max(len(ids) for _, ids, _, _ in layouts)
    rows = len(layouts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, 1, width, width), dtype=torch.bool)
    for r, (p, ids, pos, segments) in enumerate(layouts):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids, dtype=torch.long)
        position_ids[r, :n] = torch.tensor(pos, dtype=torch.long)
        m = mask[r, 0]
        m[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril_()
        for start, length in segments:
            m[start:start + length, :p] = True
            m[start:start + length, start:start + length] = torch.ones(length, length, dtype=torch.bool).tril_()
        pad = torch.arange(n, width)
        m[pad, pad] = True
    index = []
    for r, p, start, n in index_parts:  # padded positions p - 1 .. n - 1 of each sample, in order
        if n >= p:
            index.append(r * width + p - 1)
            index.extend(r * width + start + j for j in range(n - p))
    return {PREFIX_INPUT_IDS: input_ids, PREFIX_POSITION_IDS: position_ids, PREFIX_ATTENTION_MASK: mask,
            PREFIX_INDEX: torch.tensor(index, dtype=torch.long)}
