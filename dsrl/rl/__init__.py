"""The RL application: the trainer loop and everything it composes, in rooms by concern.

Owns, at this level: the loop (:mod:`.trainer`), one rollout's experience (:mod:`.experience`), the critic
(:mod:`.critic`: a value model, or its null object), the supervised warm-up (:mod:`.sft`), the guard against
rollouts that train on nothing (:mod:`.empty_rollouts`) and the run's device memory between phases
(:mod:`.memory`: training state offloaded while generating). Rooms, each a package of its own:

- :mod:`.policy` -- the policy model (a checkpoint or the tiny built-in one), its LoRA adapters, its tokenizer, and
  the one builder of the rollout side (tokenizer, model, backend) that every placement uses;
- :mod:`.data` -- prompts and their sampler, samples and their collation into micro-batches, the rollout data
  path between ranks and the compact sample codec;
- :mod:`.rewards` -- the reward-function contract, loading the run's reward and accuracy functions, the learned
  reward model;
- :mod:`.episodes` -- multi-turn rollouts: the environment contract, trajectories, the turn-by-turn driver;
- :mod:`.disagg` -- asynchronous (disaggregated) RL: trainer and generator roles, the wire formats, the remote
  rollout backend of the trainer ranks and the generator worker (ARCHITECTURE §8).

May import: every package below it (config, core, backends, checkpoint, rollout, algos, tasks, runtime);
never :mod:`dsrl.cli`. A room never imports the modules at this level (trainer, experience, critic, sft,
empty_rollouts); between rooms imports point one way: ``data`` and ``policy`` import no other room,
``rewards`` may import ``data`` and ``policy``, ``episodes`` may import ``data`` and ``rewards``, ``disagg`` may
import ``data`` and ``policy`` (tests/unit/test_layout.py checks it).
"""
