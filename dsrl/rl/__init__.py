"""The RL application: the trainer loop and everything it composes, in rooms by concern.

Owns, at this level: the loop (:mod:`.trainer`, top to bottom, one call per stage), one rollout's experience
(:mod:`.experience`), the critic (:mod:`.critic`: a value model, or its null object), the supervised warm-up
(:mod:`.sft`), a rollout's statistics (:mod:`.rollout_stats`), the guard against rollouts that train on nothing
(:mod:`.empty_rollouts`) and the held-out evaluation (:mod:`.evaluation`, ``dsrl.eval``); the run's parts
(:mod:`.run`: built by one function, the run state and its checkpointer, the stop policy), which only the trainer
imports. Rooms, each a package of its own:

- :mod:`.policy` -- the policy model (a checkpoint or the tiny built-in one), its LoRA adapters, its tokenizer, the
  one builder of the rollout side (tokenizer, model, backend) that every placement uses, and the actor (its engine,
  KL reference, MoE routing duties and loss behind two verbs), the twin of the critic;
- :mod:`.data` -- prompts and their sampler, samples and their collation into micro-batches, the rollout data
  path between ranks and the compact sample codec;
- :mod:`.rewards` -- the reward-function contract, loading the run's reward and accuracy functions, the learned
  reward model, and scoring: the one reward formula of single- and multi-turn rollouts;
- :mod:`.episodes` -- multi-turn rollouts: the environment contract, trajectories, the turn-by-turn driver;
- :mod:`.disagg` -- asynchronous (disaggregated) RL: trainer and generator roles, the wire formats, the remote
  rollout backend of the trainer ranks and the generator worker (ARCHITECTURE §8).

May import: every package below it (config, core, checkpoint, rollout, algos, tasks, runtime), and the backends only
in :mod:`.run` (:mod:`.run.engines` chooses the training engine; everything else works on
:class:`dsrl.core.engine.TrainEngine`); never :mod:`dsrl.cli`. A room never imports the modules at this level
(trainer, experience, critic, sft, empty_rollouts) nor :mod:`.run`; between rooms imports point one way: ``data``
imports no other room, ``policy`` only ``data``, ``rewards`` may import ``data`` and ``policy``, ``episodes`` may
import ``data`` and ``rewards``, ``disagg`` may import ``data`` and ``policy`` (tests/unit/test_layout.py checks it).
"""
