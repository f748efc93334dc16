"""The train state (a plain pytree: step, params, opt_state), created already sharded on the mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.config import Config
from jaxtron.model import Llama
from jaxtron.parallel.sharding import param_shardings, use_rules


@dataclass
class ModelSpec:
    """What the train step needs to rebuild the model from its params: the graph and the shardings."""

    graphdef: Any
    param_shardings: dict
    state_shardings: dict
    abstract_state: dict
    init_fn: Callable[[], dict]  # creates the real state; jit it with out_shardings=state_shardings


def model_factory(cfg: Config):
    return lambda: Llama(cfg.model, rngs=nnx.Rngs(cfg.train.seed))


def abstract_train_state(cfg: Config, tx: optax.GradientTransformation, mesh: Mesh, rules) -> ModelSpec:
    """Shapes, dtypes and shardings of the train state; nothing is allocated."""
    make = model_factory(cfg)
    with use_rules(rules, mesh):
        abstract_model = nnx.eval_shape(make)
    graphdef, abstract_vars = nnx.split(abstract_model)
    p_sh = param_shardings(abstract_vars, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())

    def init():
        _, params = nnx.split(make())
        params = params.to_pure_dict()
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    abstract = jax.eval_shape(init)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], p_sh,
                                   transform_non_params=lambda _: replicated)
    shardings = {"step": replicated, "params": p_sh, "opt_state": opt_sh}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return ModelSpec(graphdef, p_sh, shardings, abstract, init)


def init_train_state(cfg: Config, tx: optax.GradientTransformation, mesh: Mesh, rules) -> tuple[dict, ModelSpec]:
    """Create params and optimizer state directly in their shards (jit with out_shardings): no device ever
    holds a full copy of a sharded weight."""
    spec = abstract_train_state(cfg, tx, mesh, rules)
    state = jax.jit(spec.init_fn, out_shardings=spec.state_shardings)()
    return state, spec


def create_model(cfg: Config, mesh: Optional[Mesh] = None, devices=None) -> Llama:
    """A freshly initialized :class:`~jaxtron.model.Llama` (seed ``train.seed``, the init a training run
    starts from) whose parameters are created directly in their shards on ``mesh`` (default: the mesh
    ``cfg.parallel`` describes over ``devices``, default all devices). Call it under ``jax.set_mesh(mesh)``
    and ``jaxtron.parallel.use_rules`` to keep activations sharded too; outside them it runs as GSPMD
    propagates from the parameters."""
    from jaxtron import config as config_lib
    from jaxtron.parallel import build_mesh, logical_rules

    if mesh is None:
        devices = list(devices if devices is not None else jax.devices())
        config_lib.validate_for_devices(cfg, len(devices), devices[0].platform)
        mesh = build_mesh(cfg.parallel, devices)
    rules = logical_rules(cfg.parallel)
    make = model_factory(cfg)
    with use_rules(rules, mesh):
        abstract_model = nnx.eval_shape(make)
    graphdef, abstract_vars = nnx.split(abstract_model)
    shardings = param_shardings(abstract_vars, mesh, rules)
    params = jax.jit(lambda: nnx.split(make())[1].to_pure_dict(), out_shardings=shardings)()
    return nnx.merge(graphdef, params)
