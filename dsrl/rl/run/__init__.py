"""The run: its parts built by one function, its state, its checkpoints and its stop policy.

- :mod:`.parts` -- :func:`.parts.build_run`, the composition root: every check before any work (agreed by every
  rank), then the components from their own sections (the policy actor, the critic, the rollout backend, the
  experience maker, the checkpointer), handed to each other through constructors, in a typed :class:`RunParts`;
- :mod:`.state` -- :class:`.state.RunState`, what continues the run exactly besides the engines (rollouts and
  mini-batches done, the prompt stream, the count of empty rollouts), with ``state_dict`` / ``load_state_dict``;
- :mod:`.checkpointer` -- save, resume, the mid-rollout boundary and the final export;
- :mod:`.stopping` -- the pure stop policy ("save now?", "end now?" after each rollout) and what a stop says;
- :mod:`.engines` -- the one place of :mod:`dsrl.rl` that chooses the training engine (today DeepSpeed's): the
  policy's, the critic's, and what a generator rank is told of the trainers'.

The trainer (:mod:`dsrl.rl.trainer`) runs the loop on these parts and is the only module of :mod:`dsrl.rl`'s own
level that imports this package; nothing here imports the trainer.

May import: what :mod:`dsrl.rl` may import and the backends, every room of it, and its own modules below the trainer
(experience, critic, sft, rollout statistics, empty rollouts).
"""
