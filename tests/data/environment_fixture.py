"""Environment factories imported by path in tests/distributed/test_multiturn.py (data.environment)."""

from __future__ import annotations

import os
import time

from dsrl.tasks.calculator import Calculator

_slow: list[bool] = []


class HangOnRank1(Calculator):
    """The calculator; on rank 1 its first step never returns (with no environment timeout, the collective bound
    must end the job, and rank 0 must say meanwhile what rank 1 is doing)."""

    def step(self, turn):
        if os.environ.get("RANK") == "1":
            time.sleep(3600)
        return super().step(turn)


class RankDependent:
    """Rank 0's episodes take three model turns (observation '=ok\\n' after the first two), rank 1's one, so the
    ranks' trajectories take different numbers of turns; rank 1's first step takes 60 s (data.environment_timeout_s
    must cut it). Rewards vary with the text."""

    def __init__(self, prompt: str, answer: object):
        self.prompt = prompt

    def step(self, turn):
        if os.environ.get("RANK") == "1":
            if not _slow:
                _slow.append(True)
                time.sleep(60)
            return {"reward": float(len(turn.text) % 3), "done": True}
        if turn.index < 2:
            return {"observation": "=ok\n", "reward": 0.1}
        return {"reward": len(turn.text) / 10, "done": True}
