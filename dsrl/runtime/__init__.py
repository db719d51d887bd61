"""What a running job needs around the loop: stop requests and signals (:mod:`.stop`), bounded phases
that name a missing rank (:mod:`.watchdog`), the metrics writer (:mod:`.metrics`) and plots (:mod:`.plot`).

May import: :mod:`dsrl.core`, :mod:`dsrl.config`.
"""
