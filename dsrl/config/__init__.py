"""The ``"dsrl"`` section of a run file: typed models, errors, names, loading, generated docs.

Owns: every rule that needs neither the world size, the data nor a framework (one module per
section group: :mod:`.batch`, :mod:`.run`, :mod:`.model`, :mod:`.data`, :mod:`.rollout`,
:mod:`.algorithm`, :mod:`.memory`, :mod:`.evaluation`, and :mod:`.root` for the rules across sections), the one
:class:`ConfigError`
(import it from here: ``from dsrl.config import ConfigError``), the names of algorithms, loss modes
and backends (:mod:`.names`, declared once), reading a run file with dotted overrides (:mod:`.load`),
docs/configuration.md (:mod:`.docs`), the combinations of settings that are refused (:mod:`.support`,
checked on every run file) and the support matrix with docs/support.md (:mod:`.matrix`).

May import: pydantic and the standard library; no other dsrl package.
"""

from dsrl.config.algorithm import AlgorithmConfig, CriticConfig, RolloutCorrectionConfig, SftConfig
from dsrl.config.batch import BatchConfig
from dsrl.config.data import DataConfig
from dsrl.config.errors import ConfigError
from dsrl.config.evaluation import EvalConfig
from dsrl.config.load import (
    DS_BATCH_KEYS,
    Config,
    apply_overrides,
    load_config,
    parse_override_args,
    parse_override_value,
)
from dsrl.config.memory import MemoryConfig
from dsrl.config.model import LoraConfig, ModelConfig
from dsrl.config.rollout import RolloutConfig
from dsrl.config.root import DsrlConfig
from dsrl.config.run import RunConfig, SchedulerConfig
from dsrl.config.section import Section

__all__ = [
    "DS_BATCH_KEYS", "AlgorithmConfig", "BatchConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DsrlConfig", "EvalConfig", "LoraConfig", "MemoryConfig", "ModelConfig", "RolloutConfig", "RolloutCorrectionConfig",
    "RunConfig",
    "SchedulerConfig", "Section", "SftConfig",
    "apply_overrides", "load_config", "parse_override_args", "parse_override_value",
]
