"""The framework-free core: the batch plan, partitions, loss weights (§2) and the exact step.

Owns: :class:`BatchPlan` (:mod:`.plan`), rollout -> mini-batch -> micro-batch partitions and rank
balancing (:mod:`.partition`, :mod:`.balance`), the aggregation weights (:mod:`.weights`), log-probs
with the output head fused into a tiled log-softmax (:mod:`.logprobs`), the step every backend runs
(:mod:`.step`), the parallel layout a rank sees (:mod:`.parallel`), small collectives and their time
bounds (:mod:`.collectives`, :mod:`.timeouts`), seeds (:mod:`.seeds`), run errors (:mod:`.errors`), and the
start-up: which launcher placed this rank (:mod:`.launchers`: DeepSpeed's and pdsh, torchrun, Slurm, OpenMPI) and
the preflight on the job's TCP store before the process group exists (:mod:`.rendezvous`),
which process a pid names, by its start counted from boot (:mod:`.process_identity`),
the memory model of ``dsrl plan`` (:mod:`.memory`), weight-sync buckets (:mod:`.buckets`) and what a rollout moved
between device and host (:mod:`.traffic`).

May import: :mod:`dsrl.config`, torch (torch.distributed only through a group it is given, or the job's store
that :mod:`.rendezvous` creates); never DeepSpeed or Megatron.
"""
