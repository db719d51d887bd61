"""The exactness check's multi-turn data (``dsrl.check --data multiturn``): sequences whose completions interleave
model turns and environment observations, built through dsrl's own trajectory path, with a reference mask
written from the definition.

Each sequence is a synthetic trajectory: a prompt, then model turns and observation spans. The data covers
several observation spans per sequence, empty model turns (two observation spans in a row), a trajectory with no
model token at all, and trajectories that end on an observation. dsrl's side goes through
:class:`dsrl.rl.episodes.trajectory.Trajectory` (``add_model_turn`` / ``add_observation``), its ``Sample`` and
:func:`dsrl.rl.data.batching.collate`, exactly as a rollout's trajectories do; the reference mask is computed from the
segment list alone: input position p counts iff its target (token p + 1) is a model token. The planted bug of
``--method count_observations`` trains on the sample with every completion token counted (observations
included), which the comparison must catch.
"""

from __future__ import annotations

import torch

MODEL, OBSERVATION = "model", "observation"


def _segments(g: torch.Generator, i: int, vocab: int) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """(prompt, [(kind, tokens), ...]) of synthetic trajectory ``i``: at most 12 input positions."""

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompt = draw(1, 2)
    if i % 6 == 4:  # no model token at all: two observation spans
        return prompt, [(OBSERVATION, draw(1, 3)), (OBSERVATION, draw(1, 3))]
    segments: list[tuple[str, list[int]]] = []
    for turn in range(int(torch.randint(2, 4, (1,), generator=g))):
        segments.append((MODEL, [] if (i + turn) % 5 == 2 else draw(1, 2)))  # some model turns are empty
        segments.append((OBSERVATION, draw(1, 2)))
    if i % 3 != 1:  # most end on a model turn, some on an observation
        segments.append((MODEL, draw(1, 2)))
    return prompt, segments


def trajectory_sequences(n: int, seed: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``n`` multi-turn sequences (module docstring) as the check's sequence dicts: ``input_ids``, ``targets``,
    ``loss_mask`` (dsrl's, from the collated sample), ``reference_mask`` (from the definition) and
    ``planted_mask`` (the planted bug's: every completion token counted)."""
    import dataclasses

    from dsrl.rl.data.batching import collate
    from dsrl.rl.episodes.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed + 15485863)
    out = []
    for i in range(n):
        prompt, segments = _segments(g, i, vocab)
        t = Trajectory(0, prompt)
        for kind, tokens in segments:
            if kind == MODEL:
                t.add_model_turn(tokens, [0.0] * len(tokens))
            else:
                t.add_observation(tokens)
        sample = t.sample(group=i, reward=0.0)
        mine = collate([sample], pad_id=0)
        planted = collate([dataclasses.replace(sample, completion_mask=None)], pad_id=0)["loss_mask"][0]
        # The definition: the completion is the segments in order; input position p predicts token p + 1.
        kinds = ["prompt"] * len(prompt) + [k for k, tokens in segments for _ in tokens]
        reference = torch.tensor([int(kinds[p + 1] == MODEL) for p in range(len(kinds) - 1)] or [0])
        out.append({"input_ids": mine["input_ids"][0], "targets": mine["targets"][0],
                    "loss_mask": mine["loss_mask"][0], "reference_mask": reference, "planted_mask": planted})
    return out
