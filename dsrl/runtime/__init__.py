"""What a running job needs around the loop: stop requests and signals (:mod:`.stop`), bounded phases
that name a missing rank (:mod:`.watchdog`), which ranks of the job still run (:mod:`.peers`: a dead or frozen
rank named by role, rank and host), how a process ends (:mod:`.process_exit`), the metrics writer
(:mod:`.metrics`), each rollout's phase timings and peak memory (:mod:`.phases`) and plots (:mod:`.plot`).

May import: :mod:`dsrl.core`, :mod:`dsrl.config`.
"""
