"""The Mixture-of-Experts feed-forward block: router (jaxtron.model.routing), routed SwiGLU experts with
dropless or capacity dispatch, optional shared experts (with Qwen's sigmoid gate).

    y, stats = MoE(cfg, rngs=rngs)(x)     # x: [batch, seq, hidden]

Expert weights are stacked on a leading axis named ``experts``: ``w_gate``/``w_up`` [E, hidden, ffn] named
("experts", "embed", "mlp"), ``w_down`` [E, ffn, hidden] named ("experts", "mlp", "embed"), so FSDP and tensor
parallelism split them as they split the dense MLP and expert parallelism splits the experts. The router's
columns and the aux-free bias are named ``router_experts``: small, never split.

Dispatch (``model.moe.dispatch``):

- ``dropless``: the T*k (token, expert) assignments are sorted by expert, the tokens gathered in that order and
  run through grouped matmuls (group e is the next ``load[e]`` rows, multiplied by expert e's weights), then
  unsorted and combined with the routing weights. No token is dropped. The grouped matmuls are
  ``model.moe.gmm_impl``: ``jax.lax.ragged_dot`` (XLA:CPU and, without the ragged-dot fusion flag, XLA:GPU
  lower it to a masked dense matmul: exact, E times the FLOPs) or the Pallas grouped-GEMM kernel
  (``pallas_kernels.grouped_matmul``, through ``jaxtron.model.kernels``). With expert parallelism
  (``parallel.expert > 1``) the tokens travel to their experts' ranks and back (``jaxtron.parallel.expert``:
  all-to-all of per-rank buffers, the same grouped matmuls on each rank's experts); a buffer smaller than the
  worst case (``model.moe.ep_capacity_factor``) drops the assignments past it.
- ``capacity``: each expert takes at most C = min(ceil(capacity_factor * T * k / E), T) assignments (a token
  sends an expert one at most, so the cap at T drops nothing), first choices before second choices
  (Switch/GShard priority: all tokens' top-1, then top-2, ... each in token order); the rest are dropped, i.e.
  contribute nothing, so the residual stream carries the token past the layer. The kept tokens are scattered
  into an [E, C, hidden] buffer and every expert runs a dense einsum over its C slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, gmm_impl
from jaxtron.model import fp8, kernels, remat, routing
from jaxtron.model.layers import SwiGLU, param
from jaxtron.model.projection import Matmuls
from jaxtron.parallel import expert as expert_parallel

EXPERTS = expert_parallel.WEIGHT_NAME  # the expert stacks' leading axis: split over the expert ranks
ROUTER_EXPERTS = "router_experts"      # the router's columns and the aux-free bias: replicated


def _swiglu_experts(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
    return jax.nn.silu(h_gate) * h_up


def _grouped_matmul(gmm_impl: str, fp8_recipe: str = "none"):
    """(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> fp32 [M, N], by ``model.moe.gmm_impl``; with
    ``model.fp8`` and ragged_dot, in FP8 (current scaling under any recipe: jaxtron.model.fp8.grouped)."""
    if gmm_impl == "ragged_dot" and fp8_recipe != "none":
        return fp8.grouped
    if gmm_impl == "pallas":
        return kernels.gmm
    return lambda a, w, sizes: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)


def expert_ffn(xs, group_sizes, w_gate, w_up, w_down, gmm_impl: str = "ragged_dot", fp8_recipe: str = "none"):
    """The routed SwiGLU experts on rows sorted by expert: group e (the next group_sizes[e] rows) through
    expert e's weights; rows past the groups come out as zeros."""
    grouped = _grouped_matmul(gmm_impl, fp8_recipe)
    dot = lambda a, w: grouped(a, w, group_sizes).astype(a.dtype)  # noqa: E731
    return dot(_swiglu_experts(dot(xs, w_gate), dot(xs, w_up)), w_down)


def dropless(x, r: routing.Routing, w_gate, w_up, w_down, gmm_impl: str = "ragged_dot", fp8_recipe: str = "none"):
    """x: [T, D]; experts/weights: [T, k]; weights [E, D, F], [E, F, D] -> [T, D]. The assignments sorted by
    expert and the tokens permuted by gathers (forward and backward: jaxtron.parallel.expert.sorted_dropless)."""
    ffn = lambda xs, sizes, *ws: expert_ffn(xs, sizes, *ws, gmm_impl, fp8_recipe)  # noqa: E731
    y = expert_parallel.sorted_dropless(x, r.experts, r.weights, (w_gate, w_up, w_down), ffn)
    return y, jnp.zeros((), jnp.float32)


def capacity_dispatch(x, r: routing.Routing, w_gate, w_up, w_down, factor: float):
    """Capacity-limited dispatch; returns ([T, D], number of dropped assignments)."""
    t, k = r.experts.shape
    num_experts = w_gate.shape[0]
    c = expert_parallel.capacity(t, k, num_experts, 1, factor)  # each expert its own queue
    experts = r.experts.T.reshape(-1)                              # choice-major: all top-1 choices first
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [k*T, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # place in its expert's queue
    kept = position < c
    slot = jnp.where(kept, experts * c + position, num_experts * c)  # E*C: out of range, i.e. dropped
    token = jnp.tile(jnp.arange(t), k)
    buf = jnp.zeros((num_experts * c, x.shape[-1]), x.dtype).at[slot].set(jnp.take(x, token, axis=0), mode="drop")
    buf = buf.reshape(num_experts, c, -1)
    ein = lambda s, a, w: jnp.einsum(s, a, w, preferred_element_type=jnp.float32).astype(a.dtype)
    h = _swiglu_experts(ein("ecd,edf->ecf", buf, w_gate), ein("ecd,edf->ecf", buf, w_up))
    out = ein("ecf,efd->ecd", h, w_down).reshape(num_experts * c, -1)
    y = out.at[slot].get(mode="fill", fill_value=0)                 # dropped assignments read zeros
    combined = jnp.sum((y.astype(jnp.float32) * r.weights.T.reshape(-1)[:, None]).reshape(k, t, -1), axis=0)
    return combined.astype(x.dtype), jnp.sum(~kept).astype(jnp.float32)


class MoE(nnx.Module):
    """Routed SwiGLU experts (+ shared experts). ``__call__(x [B, S, D]) -> (y [B, S, D], stats)`` where stats
    holds this layer's ``aux_loss`` and ``z_loss`` (scalars), ``load`` ([E] assignments per expert) and
    ``dropped``/``assigned`` (assignment counts)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Optional[Matmuls] = None):
        e = cfg.moe
        d, f, n = cfg.hidden_size, e.expert_intermediate_size, e.num_experts
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.moe = e
        self.fp8 = cfg.fp8
        self.matmuls = matmuls or Matmuls.here()
        self.gmm_impl = gmm_impl(cfg, gpu=not self.matmuls.cpu)
        self.router = param(rngs, (d, n), ("embed", ROUTER_EXPERTS), std, pd)
        self.w_gate = param(rngs, (n, d, f), (EXPERTS, "embed", "mlp"), std, pd)
        self.w_up = param(rngs, (n, d, f), (EXPERTS, "embed", "mlp"), std, pd)
        self.w_down = param(rngs, (n, f, d), (EXPERTS, "mlp", "embed"), out_std, pd)
        if e.aux_free_bias:
            self.expert_bias = routing.ExpertBias(jnp.zeros((n,), jnp.float32), out_sharding=(ROUTER_EXPERTS,))
        if e.num_shared_experts:
            size = e.num_shared_experts * (e.shared_expert_intermediate_size or f)
            self.shared = SwiGLU(dataclasses.replace(cfg, intermediate_size=size), rngs=rngs, matmuls=self.matmuls)
            if e.shared_expert_gate:
                self.shared_gate = param(rngs, (d, 1), ("embed", None), std, pd)

    def __call__(self, x: jax.Array):
        b, s, d = x.shape
        dt = x.dtype
        tokens = x.reshape(b * s, d)
        bias = self.expert_bias[...] if self.moe.aux_free_bias else None
        # The scopes name these ops in the compiled HLO, where the planner (jaxtron/plan/moe.py) finds them.
        with jax.named_scope("moe_router"):
            r = remat.tag(routing.route(tokens, self.router[...], self.moe, bias), remat.ROUTER)
        w = [p[...] for p in (self.w_gate, self.w_up, self.w_down)]  # cast where they are used (_dropless)
        with jax.named_scope("moe_experts"):
            if self.moe.dispatch == "capacity":
                y, dropped = capacity_dispatch(tokens, r, *(a.astype(dt) for a in w), self.moe.capacity_factor)
            else:
                y, dropped = self._dropless(x, r, w)
        y = y.reshape(b, s, d)
        if self.moe.num_shared_experts:
            shared = self.shared(x)
            if self.moe.shared_expert_gate:
                gate = self.matmuls.project("bsd,do->bso", x, self.shared_gate[...].astype(dt))
                shared = shared * jax.nn.sigmoid(gate)
            y = y + shared
        load = routing.expert_load(r.experts, self.moe.num_experts)  # global: from the routing, before dispatch
        stats = {"aux_loss": routing.load_balancing_loss(r, load), "z_loss": routing.router_z_loss(r),
                 "load": load, "dropped": dropped, "assigned": jnp.asarray(r.experts.size, jnp.float32)}
        return y, stats

    def _dropless(self, x, r: routing.Routing, w):
        """Dropless dispatch of x [B, S, D]: over the expert ranks (``model.moe.ep_dispatch``) where the mesh
        has them, else on the whole batch. The expert weights ``w`` come in their parameter dtype and are cast
        to x's where they are multiplied: inside the expert-parallel shard_map, so its transpose sums their
        gradients over the batch axes in that dtype (XLA:CPU aborts on the bf16 all-reduce it gets otherwise,
        in its AllReducePromotion pass)."""
        b, s, d = x.shape
        cast = lambda ws: [a.astype(x.dtype) for a in ws]  # noqa: E731
        kw = {"gmm_impl": self.gmm_impl, "fp8_recipe": self.fp8}
        plain = lambda: dropless(x.reshape(b * s, d), r, *cast(w), **kw)  # noqa: E731
        ffn = lambda xs, sizes, *ws: expert_ffn(xs, sizes, *cast(ws), **kw)  # noqa: E731
        per_token = lambda a: a.reshape(b, s, -1)  # noqa: E731
        return expert_parallel.dispatch(x, per_token(r.experts), per_token(r.weights), w, ffn, plain, self.moe)
