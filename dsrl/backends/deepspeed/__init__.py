"""DeepSpeed: :class:`RLEngine` and :func:`initialize` (``dsrl.initialize``).

Owns: the exact step on a DeepSpeedEngine (:mod:`.engine`), the ds_config DeepSpeed sees (:mod:`.config`)
and its validation by DeepSpeed's own classes (:mod:`.validation`, :mod:`.probe`,
:mod:`.optimizer_check`), the LR schedule dsrl steps (:mod:`.schedule`), the engine's parallel view
(:mod:`.view`), AutoTP and AutoEP (:mod:`.autotp`, :mod:`.autoep`), apex's FusedAdam (:mod:`.apex`),
frozen engines for the reference and reward models (:mod:`.frozen`), training state and frozen models off the
device between phases (:mod:`.offload`, ``dsrl.memory.offload_states``) and the CPU shared-memory release
(:mod:`.cpu_shm`).

May import: :mod:`dsrl.core`, :mod:`dsrl.config`, DeepSpeed; never :mod:`dsrl.backends.megatron`.
"""

from dsrl.backends.deepspeed.engine import EngineSpec, RLEngine, ensure_distributed, initialize, on_gpu, prepare

__all__ = ["EngineSpec", "RLEngine", "ensure_distributed", "initialize", "on_gpu", "prepare"]
