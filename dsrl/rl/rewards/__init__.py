"""Rewards: the contract every rule reward is held to (:mod:`.contract`: numbers, one per completion, bounded
calls), loading the run's reward and accuracy functions (:mod:`.functions`), the learned reward model
(:mod:`.model`), and scoring (:mod:`.scoring`): the one reward formula of single completions and multi-turn
trajectories alike.

May import: config, core (the policy's engine as :class:`dsrl.core.engine.TrainEngine`), rollout, runtime, tasks, and
the rooms :mod:`dsrl.rl.data` and :mod:`dsrl.rl.policy`.
"""
