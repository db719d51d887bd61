"""The rollout's data: prompts and their sampler (:mod:`.prompts`), samples and their collation into micro-batches
(:mod:`.batching`), the rollout data path between ranks (:mod:`.replica`: who generates, keeps and trains on
which sample) and the compact sample codec it and the wire share (:mod:`.codec`).

May import: config, core, tasks; no other room of :mod:`dsrl.rl`.
"""
