"""What a running job needs around the loop: stop requests and signals (:mod:`.stop`), bounded phases
that name a missing rank (:mod:`.watchdog`), the metrics writer (:mod:`.metrics`), each rollout's phase
timings and peak memory (:mod:`.phases`) and plots (:mod:`.plot`).

May import: :mod:`dsrl.core`, :mod:`dsrl.config`.
"""
