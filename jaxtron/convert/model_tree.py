"""The model a :class:`~jaxtron.config.ModelConfig` describes, without random weights: its graph and abstract
state (shapes and dtypes), and the model built from a pure dict of weights. Every converter starts here."""

from __future__ import annotations

from typing import Mapping, Optional

from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model.llama import Llama


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and an abstract state (shapes and dtypes only; no weights are allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def model_from_params(cfg: ModelConfig, params: Mapping, graphdef: Optional[nnx.GraphDef] = None,
                      abstract: Optional[nnx.State] = None) -> Llama:
    """The model with ``params`` (a pure dict, ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``'s shape) as
    its weights; ``graphdef``/``abstract`` from :func:`abstract_model` if the caller has them."""
    if graphdef is None or abstract is None:
        graphdef, abstract = abstract_model(cfg)
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)
