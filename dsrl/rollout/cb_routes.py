"""The routes of a mixture-of-experts policy's experts under continuous batching (:mod:`dsrl.rollout.cb`).

Continuous batching packs the rows of many requests, prefill chunks and decode steps alike, into each forward.
The routers' recording (:mod:`dsrl.rollout.routes`) holds one ``[rows, layers, top_k]`` entry per forward;
:class:`PackedRoutes` notes which request and position each row was, and gives every completion its
``[positions, layers, top_k]`` routes in the order of its tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from dsrl.core.routes import FREE, ROUTE_DTYPE


class PackedRoutes:
    """The routes of continuous batching's packed forwards, per request (:mod:`dsrl.rollout.cb`'s docstring).

    :meth:`note_layout` (a pre-forward hook on the model, in the generation thread) notes each forward's rows:
    request ids by the batch's query lengths, positions from ``position_ids``; :meth:`assemble` pairs them with
    the routers' recording (one entry per forward, same order); :meth:`of` gives one completion's routes."""

    def __init__(self, manager: Any):
        self.manager = manager
        self.layouts: list[tuple[list[str], torch.Tensor]] = []  # per forward: request id per row, position per row
        self.per_request: dict[str, dict[int, torch.Tensor]] = {}

    def _host_io(self) -> Any:
        io = self.manager.batch_processor.inputs_and_outputs
        if hasattr(io, "io_pairs"):
            raise RuntimeError("continuous batching runs with asynchronous batching (CUDA graphs): its packed rows "
                               "cannot be matched to requests for the routes of an MoE policy. Fix: use "
                               "rollout.backend = 'hf' for routing replay on this machine.")
        return io

    def note_layout(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        host = self._host_io()
        rows = [fs.state.request_id for fs in host.requests_in_batch for _ in range(fs.query_length)]
        positions = kwargs["position_ids"].reshape(-1)[: len(rows)].to("cpu", copy=True)  # a reused buffer
        self.layouts.append((rows, positions))

    def assemble(self, log: Any) -> None:
        if log.forwards != len(self.layouts):
            raise RuntimeError(f"continuous batching ran {log.forwards} routed forwards for {len(self.layouts)} batch "
                               "layouts; its forward path changed")
        for i, (rows, positions) in enumerate(self.layouts):
            routes = log.call(i)
            for row, (rid, pos) in enumerate(zip(rows, positions.tolist())):
                self.per_request.setdefault(rid, {})[int(pos)] = routes[row]

    def of(self, request_id: str, prompt: int, positions: int) -> torch.Tensor:
        """``[positions, layers, top_k]`` routes of one completion (prompt positions missing from its own forwards
        taken from a sibling sample of the same prompt; FREE where none computed them)."""
        own = self.per_request.get(request_id, {})
        siblings = [r for rid, r in self.per_request.items() if rid.split("/")[0] == str(prompt)]
        first = next(iter(own.values()), None) if own else next(iter(siblings[0].values()))
        out = torch.full((positions, *first.shape), FREE, dtype=ROUTE_DTYPE)
        for p in range(positions):
            row = own.get(p)
            if row is None:
                row = next((r[p] for r in siblings if p in r), None)
            if row is not None:
                out[p] = row
        return out
