"""dsrl: numerically exact, fast RL post-training of LLMs on DeepSpeed and Megatron.

Public names (architecture §5): :class:`BatchPlan`, :func:`initialize`, :class:`RLEngine`,
plus :func:`load_config` and :class:`ConfigError` for reading run files.
"""

from dsrl.config import ConfigError, load_config
from dsrl.core.plan import BatchPlan

__version__ = "0.1.0"
__all__ = ["BatchPlan", "ConfigError", "RLEngine", "initialize", "load_config", "__version__"]


def __getattr__(name: str):
    # The engine imports torch.distributed and DeepSpeed; keep `import dsrl` (and `dsrl plan`) light.
    if name in ("RLEngine", "initialize"):
        from dsrl.backends.deepspeed import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dsrl' has no attribute {name!r}")
