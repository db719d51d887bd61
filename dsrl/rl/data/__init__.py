"""The rollout's data: where a dataset's rows come from (:mod:`.sources`: files, dataset directories, hub names,
offline), the rows as checked prompt records (:mod:`.records`), prompts, their encoding and their sampler
(:mod:`.prompts`), the held-out evaluation's prompts (:mod:`.evalset`), samples and their collation into
micro-batches (:mod:`.batching`), the rollout data path between ranks (:mod:`.replica`: who generates, keeps and
trains on which sample) and the compact sample codec it and the wire share (:mod:`.codec`).

May import: config, core, tasks; no other room of :mod:`dsrl.rl`.
"""
