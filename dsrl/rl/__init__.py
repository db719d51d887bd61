"""The RL application: the trainer loop and everything it composes.

Owns: the loop (:mod:`.trainer`), one rollout's experience (:mod:`.experience`), the critic and the
reward model (:mod:`.critic`, :mod:`.reward_model`), the reward-function contract
(:mod:`.reward_contract`), the supervised warm-up (:mod:`.sft`), samples and their collation
(:mod:`.batching`), the rollout data path between ranks (:mod:`.replica_data`, :mod:`.sample_codec`),
models, tokenizer and prompt data (:mod:`.models`, :mod:`.tokenizer`, :mod:`.data`).

May import: every package below it (config, core, backends, checkpoint, rollout, algos, tasks, runtime);
never :mod:`dsrl.cli`.
"""
