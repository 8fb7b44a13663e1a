"""The one config schema every entry point uses: dataclasses validated at load, from YAML plus ``key=value``
overrides; every error a :class:`ConfigError` naming the dotted key and where it came from.

- :mod:`.schema`    :class:`Config` and its ``model`` (``lev``), ``data``, ``optim``, ``logging`` sections;
                    ``load_config``
- :mod:`.parallel`  the ``parallel`` section (:class:`ParallelConfig`) and the batch arithmetic
- :mod:`.run`       the ``train`` and ``checkpoint`` sections (:class:`TrainConfig`, :class:`CheckpointConfig`)
- :mod:`.loader`    the generic machinery: YAML with ``base:``, dotted overrides, types, "did you mean"

The names below are the package's API (``from leviathan_pretrain.config import load_config``). Torch-free.
"""

from leviathan_pretrain.config.loader import ConfigError, to_dict
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.config.run import CheckpointConfig, TrainConfig
from leviathan_pretrain.config.schema import (
    VARIANTS,
    Config,
    DataConfig,
    LEVConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    config_arguments,
    load_config,
    load_config_or_report,
    split_weights,
)

__all__ = [
    "VARIANTS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LEVConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_arguments",
    "load_config",
    "load_config_or_report",
    "split_weights",
    "to_dict",
]
