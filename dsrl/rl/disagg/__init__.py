"""Disaggregated (asynchronous) RL, ARCHITECTURE §8: trainer ranks and generator ranks under one launcher
(:mod:`.roles`), what crosses between them (:mod:`.wire`), the trainer side's rollout backend whose completions
come from the generators (:mod:`.remote`) and the generator rank's loop (:mod:`.generator`).

May import: config, core (the trainers' engine as :class:`dsrl.core.engine.TrainEngine`), rollout, runtime, and the
rooms :mod:`dsrl.rl.data` and :mod:`dsrl.rl.policy`.
"""
