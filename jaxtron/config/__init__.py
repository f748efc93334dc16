"""The one typed configuration tree: model, parallel, optim, data, train, checkpoint, logging.

Parsing and merging (YAML presets plus dotted command-line overrides such as ``parallel.tensor=8``) is done
by OmegaConf against the dataclass schema (:mod:`jaxtron.config.schema`), so unknown keys and wrong types are
rejected with the full dotted name of the field (:mod:`jaxtron.config.loading`). Cross-field checks live in
:func:`validate` (:mod:`jaxtron.config.validation`) and raise :class:`ConfigError`, whose message starts with
the field it is about. This package imports nothing else of jaxtron: the checks against the model and the
mesh are :mod:`jaxtron.preflight`'s.

    cfg = jaxtron.config.load("configs/llama3_8b.yaml", ["parallel.tensor=8", "train.steps=100"])
"""

from jaxtron.config.schema import (CONFIG_DIR, DEFAULT_PRESET, CheckpointConfig, Config, ConfigError, DataConfig,
                                   DistributedConfig, LoggingConfig, OptimConfig, ParallelConfig, TrainConfig,
                                   checkpoint_dir, require)
from jaxtron.config.model_schema import ModelConfig, RopeScalingConfig, compute_dtype, gmm_impl, head_dim
from jaxtron.config.loading import (fields_help, from_dict, inference_parallel, load, load_config, preset_path,
                                    reference_markdown, to_dict, to_yaml)
from jaxtron.config.validation import (ATTENTION_IMPLS, DTYPES, KERNEL_IMPLS, REMAT_POLICIES, SCHEDULES,
                                       validate)

__all__ = [
    "CONFIG_DIR", "DEFAULT_PRESET", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistributedConfig",
    "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RopeScalingConfig", "TrainConfig",
    "checkpoint_dir", "compute_dtype", "gmm_impl", "head_dim", "require", "fields_help", "from_dict",
    "inference_parallel", "load", "load_config",
    "preset_path", "reference_markdown", "to_dict", "to_yaml", "ATTENTION_IMPLS", "DTYPES", "KERNEL_IMPLS",
    "REMAT_POLICIES", "SCHEDULES", "validate",
]
