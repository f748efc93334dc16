"""The train state (a plain pytree: step, params, opt_state), created already sharded on the mesh."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.config import Config
from jaxtron.model.llama import Llama
from jaxtron.model.fp8 import Histories
from jaxtron.model.projection import Matmuls
from jaxtron.parallel.layout import Layout
from jaxtron.parallel.sharding import logical_names, param_shardings
from jaxtron.parallel.zero import zero_shardings


@dataclass
class ModelSpec:
    """What the train step needs to rebuild the model from its params: the graph and the shardings."""

    graphdef: Any
    param_shardings: dict
    state_shardings: dict
    abstract_state: dict
    init_fn: Callable[[], dict]  # creates the real state; jit it with out_shardings=state_shardings
    histories: Histories         # the FP8 amax histories among the params (none unless model.fp8=delayed)
    # the shardings of the optimizer's moments (parallel.zero >= 1: split over data too) and, with zero 2, of the
    # gradients the optimizer takes
    moment_shardings: Optional[dict] = None


def model_factory(cfg: Config, matmuls: Optional[Matmuls] = None):
    return lambda: Llama(cfg.model, rngs=nnx.Rngs(cfg.train.seed), matmuls=matmuls)


def layout_matmuls(layout: Layout) -> Matmuls:
    """The matmuls of a model run on ``layout``: its mesh's devices' (a step compiled ahead of time for GPUs on a
    CPU-only machine gets the GPU's), else the platform it was planned for, else the default backend's."""
    platform = layout.mesh.devices.flat[0].platform if layout.mesh is not None else layout.platform
    return Matmuls.on(platform) if platform else Matmuls.here()


def param_names(cfg: Config) -> dict:
    """The logical axis names (PartitionSpecs of names) of each parameter, in the layout of the params' dict."""
    return logical_names(nnx.split(nnx.eval_shape(model_factory(cfg)))[1])


def _abstract_model(cfg: Config, layout: Layout):
    """(graphdef, make, NamedShardings of the params, abstract variables) of the model ``cfg`` describes, on
    ``layout``'s mesh."""
    make = model_factory(cfg, layout_matmuls(layout))
    with layout.tracing():
        abstract_model = nnx.eval_shape(make)
    graphdef, abstract_vars = nnx.split(abstract_model)
    return graphdef, make, param_shardings(abstract_vars, layout.mesh, layout.rules), abstract_vars


def opt_state_shardings(opt_state, params: dict, p_sh: dict, other):
    """Each optimizer-state leaf that mirrors a parameter (a moment: the leaf under the same dict keys, of the
    same shape) is sharded as the parameter; the rest (counts, coefficients) take ``other``. Matched by key path
    rather than optax.tree_map_params, which cannot see through the masked subtrees of optax.partition."""
    by_path = {}
    for (path, p), sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(p_sh)):
        by_path[tuple(k.key for k in path)] = (p.shape, sh)

    def pick(path, leaf):
        keys = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        shape, sh = by_path.get(tuple(keys), (None, other))
        return sh if shape == leaf.shape else other

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def abstract_train_state(cfg: Config, tx: optax.GradientTransformation, layout: Layout) -> ModelSpec:
    """Shapes, dtypes and shardings of the train state; nothing is allocated."""
    graphdef, make, p_sh, abstract_vars = _abstract_model(cfg, layout)
    replicated = NamedSharding(layout.mesh, PartitionSpec())

    def init():
        _, params = nnx.split(make())
        params = params.to_pure_dict()
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    abstract = jax.eval_shape(init)
    m_sh = zero_shardings(p_sh, abstract["params"]) if cfg.parallel.zero else p_sh
    opt_sh = opt_state_shardings(abstract["opt_state"], abstract["params"], m_sh, replicated)
    shardings = {"step": replicated, "params": p_sh, "opt_state": opt_sh}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return ModelSpec(graphdef, p_sh, shardings, abstract, init, Histories.of(abstract_vars), m_sh)


def create_model(cfg: Config, mesh: Optional[Mesh] = None, devices=None, layout: Optional[Layout] = None) -> Llama:
    """A freshly initialized :class:`~jaxtron.model.Llama` (seed ``train.seed``, the init a training run
    starts from) whose parameters are created directly in their shards: on ``layout``, else on ``mesh``, else
    on the layout ``cfg.parallel`` describes over ``devices`` (default all devices). Call it under
    ``layout.tracing()`` (or ``jax.set_mesh(mesh)`` and ``jaxtron.parallel.sharding.use_rules``) to keep activations
    sharded too; outside them it runs as GSPMD propagates from the parameters."""
    if layout is None:
        layout = Layout.build(cfg, devices if mesh is None else list(mesh.devices.flat))
        if mesh is not None:
            layout = dataclasses.replace(layout, mesh=mesh)
    graphdef, make, shardings, _ = _abstract_model(cfg, layout)
    params = jax.jit(lambda: nnx.split(make())[1].to_pure_dict(), out_shardings=shardings)()
    return nnx.merge(graphdef, params)
