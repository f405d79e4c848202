"""The configuration tree: one ``Config`` describes a whole run, built once, validated once, then only read.

``schema`` holds the section dataclasses, ``Config`` and each section's checks; ``loading`` builds a Config from
TOML and ``--set`` overrides; ``units`` parses durations and step ranges; ``reference`` writes docs/config.md.
"""

from kiln.config.loading import all_keys, from_dict, load_config, parse_set, sections, tomllib, validate
from kiln.config.reference import config_reference, field_docs
from kiln.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DebugConfig,
    EvalConfig,
    GRPOConfig,
    GuardConfig,
    LoraConfig,
    ModelConfig,
    ObserveConfig,
    ParallelConfig,
    PreferenceConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
)
from kiln.config.units import parse_duration, parse_step_range

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "EvalConfig",
    "GuardConfig",
    "LoraConfig",
    "GRPOConfig",
    "PreferenceConfig",
    "ModelConfig",
    "ObserveConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "config_reference",
    "field_docs",
    "from_dict",
    "load_config",
    "parse_duration",
    "parse_set",
    "parse_step_range",
    "sections",
    "tomllib",
    "validate",
]
