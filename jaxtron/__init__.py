"""jaxtron: Megatron-LM's capabilities rebuilt on JAX/XLA with SPMD sharding.

The public API (everything the command-line tools do goes through it; ``docs/api.md`` has a tour)::

    import jaxtron

    cfg = jaxtron.load_config("tiny", {"train.steps": 30})        # Config (YAML preset/file + overrides)
    trainer = jaxtron.Trainer(cfg)                                 # mesh, sharded state, jitted steps
    result = trainer.train()                                       # the loop of `python -m jaxtron.train`
    metrics = trainer.step(trainer.batch(0))                       # ... or one optimizer step at a time
    out = jaxtron.generate(trainer.model, [[1, 2, 3]], max_new_tokens=16)

Config:       load_config, Config, ConfigError
Training:     Trainer, Callback, TrainResult, TrainingAborted
Model/mesh:   Llama, Layout, create_model
Checkpoints:  Checkpointer, CheckpointError, load_params, load_model
Hugging Face: import_hf, export_hf, load_hf, save_hf
Data:         prepare_data, make_corpus, IndexedDataset, load_tokenizer
Inference:    generate, evaluate

Names are imported on first use, so ``import jaxtron`` does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> (module, attribute); None: the module itself (jaxtron.generate and jaxtron.evaluate are
# callable modules: calling them calls their generate()/evaluate() function)
_EXPORTS = {
    "load_config": ("jaxtron.config", "load_config"),
    "Config": ("jaxtron.config", "Config"),
    "ConfigError": ("jaxtron.config", "ConfigError"),
    "Trainer": ("jaxtron.train.trainer", "Trainer"),
    "Callback": ("jaxtron.train.callbacks", "Callback"),
    "TrainResult": ("jaxtron.train.callbacks", "TrainResult"),
    "TrainingAborted": ("jaxtron.train.callbacks", "TrainingAborted"),
    "Llama": ("jaxtron.model.llama", "Llama"),
    "Layout": ("jaxtron.parallel.layout", "Layout"),
    "create_model": ("jaxtron.train.state", "create_model"),
    "Checkpointer": ("jaxtron.checkpoint", "Checkpointer"),
    "CheckpointError": ("jaxtron.checkpoint", "CheckpointError"),
    "load_params": ("jaxtron.checkpoint", "load_params"),
    "load_model": ("jaxtron.convert.loading", "load_model"),
    "import_hf": ("jaxtron.convert.checkpoint_io", "import_hf"),
    "export_hf": ("jaxtron.convert.checkpoint_io", "export_hf"),
    "load_hf": ("jaxtron.convert.hf", "load"),
    "save_hf": ("jaxtron.convert.hf", "save"),
    "prepare_data": ("jaxtron.data.prepare", "prepare"),
    "make_corpus": ("jaxtron.data.corpus", "make_corpus"),
    "IndexedDataset": ("jaxtron.data.indexed", "IndexedDataset"),
    "load_tokenizer": ("jaxtron.data.tokenizers", "load_tokenizer"),
    "generate": ("jaxtron.generate", None),
    "evaluate": ("jaxtron.evaluate", None),
}

__all__ = sorted(_EXPORTS)

from jaxtron.jax_startup import quiet_jax_import  # noqa: E402  (standard library only: JAX is not imported)

quiet_jax_import()  # the user's own `import jax` after `import jaxtron`: quiet on a machine without a GPU


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxtron' has no attribute {name!r}")
    module_name, attr = _EXPORTS[name]
    if not module_name.startswith(("jaxtron.config", "jaxtron.data")):  # those two do not need JAX
        from jaxtron.jax_startup import import_jax
        import_jax()  # quiet on a machine without a GPU
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names above are imported lazily
    from jaxtron import evaluate, generate  # noqa: F401
    from jaxtron.checkpoint import CheckpointError, Checkpointer, load_params  # noqa: F401
    from jaxtron.config import Config, ConfigError, load_config  # noqa: F401
    from jaxtron.convert.checkpoint_io import export_hf, import_hf  # noqa: F401
    from jaxtron.convert.hf import load as load_hf, save as save_hf  # noqa: F401
    from jaxtron.data.corpus import make_corpus  # noqa: F401
    from jaxtron.data.indexed import IndexedDataset  # noqa: F401
    from jaxtron.data.prepare import prepare as prepare_data  # noqa: F401
    from jaxtron.data.tokenizers import load_tokenizer  # noqa: F401
    from jaxtron.convert.loading import load_model  # noqa: F401
    from jaxtron.model.llama import Llama  # noqa: F401
    from jaxtron.parallel.layout import Layout  # noqa: F401
    from jaxtron.train.callbacks import Callback, TrainingAborted, TrainResult  # noqa: F401
    from jaxtron.train.trainer import Trainer  # noqa: F401
    from jaxtron.train.state import create_model  # noqa: F401
