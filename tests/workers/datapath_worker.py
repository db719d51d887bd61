"""``launch/train.py`` with the rollout data path chosen by ``--datapath``: ``all-to-all`` (dsrl's,
dsrl.rl.data.replica.RolloutIndex) or ``all-gather`` (the path before issue 11: bench/datapath.py's
AllGatherRollout stands in for RolloutIndex in the trainer). For tests/distributed/test_datapath_ranks.py."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "launch")]


def main() -> int:
    argv = sys.argv[1:]
    at = argv.index("--datapath")
    path = argv[at + 1]
    del argv[at:at + 2]
    if path == "all-gather":
        from datapath import AllGatherRollout

        import dsrl.rl.trainer

        dsrl.rl.trainer.RolloutIndex = AllGatherRollout
    elif path != "all-to-all":
        raise SystemExit(f"--datapath {path!r}: all-to-all | all-gather")
    import train

    return train.main(argv)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    leave(main())  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
