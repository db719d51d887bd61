"""Rewards: the contract every rule reward is held to (:mod:`.contract`: numbers, one per completion, bounded
calls), loading the run's reward and accuracy functions (:mod:`.functions`) and the learned reward model
(:mod:`.model`).

May import: config, core, backends.deepspeed, runtime, tasks, and the rooms :mod:`dsrl.rl.data` and
:mod:`dsrl.rl.policy`.
"""
