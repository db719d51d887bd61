"""The ``"dsrl"`` section of a run file: typed models, errors, names, loading, generated docs.

Owns: every rule that needs neither the world size, the data nor a framework (:mod:`.models` and the
section modules), the one :class:`ConfigError` (import it from here: ``from dsrl.config import
ConfigError``), the names of algorithms, loss modes and backends (:mod:`.names`, declared once),
reading a run file with dotted overrides (:mod:`.load`) and docs/configuration.md (:mod:`.docs`).

May import: pydantic and the standard library; no other dsrl package.
"""

from dsrl.config.errors import ConfigError
from dsrl.config.load import (
    DS_BATCH_KEYS,
    Config,
    apply_overrides,
    load_config,
    parse_override_args,
    parse_override_value,
)
from dsrl.config.models import (
    AlgorithmConfig,
    BatchConfig,
    CriticConfig,
    DataConfig,
    DsrlConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    Section,
    SftConfig,
)

__all__ = [
    "DS_BATCH_KEYS", "AlgorithmConfig", "BatchConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DsrlConfig", "ModelConfig", "RolloutConfig", "RunConfig", "SchedulerConfig", "Section", "SftConfig",
    "apply_overrides", "load_config", "parse_override_args", "parse_override_value",
]
