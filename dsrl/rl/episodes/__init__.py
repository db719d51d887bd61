"""Multi-turn rollouts (ARCHITECTURE §8): the environment contract (:mod:`.environment`), trajectories and the
samples they become (:mod:`.trajectory`), and the turn-by-turn driver over any rollout backend (:mod:`.driver`).

May import: config, core, runtime, rollout, and the rooms :mod:`dsrl.rl.data` and :mod:`dsrl.rl.rewards`.
"""
