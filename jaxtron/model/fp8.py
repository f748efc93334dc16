"""FP8 matmuls (``model.fp8``) for the decoder's dense projections and the routed MoE experts, tensorwise scaling.

``fp8_project(spec, x, w)`` is ``project``'s contraction with both operands quantized to float8_e4m3fn and the
incoming gradient to float8_e5m2 (Hopper's FP8 GEMMs take e4m3 x e4m3 and e5m2 x e4m3), each tensor with one
fp32 scale from its own amax in this step (``current``: Megatron/Transformer Engine's "current scaling";
scale = amax / fp8 max, so the largest value lands on the format's maximum). The dots take the FP8 operands
directly with a 16-bit or fp32 result, which XLA:GPU's GEMM rewriter turns into cuBLASLt FP8 GEMMs with the
scales folded into the epilogue; the three GEMMs of a projection (forward, dgrad, wgrad) are all FP8. The
backward keeps the FP8 copies of x and w as its residuals (half of bf16's bytes).

Shaped for XLA's fusion (docs/fp8.md, "What XLA:GPU runs"): projections of one input (Q, K, V; gate, up) take
one e4m3 copy of it (:meth:`Recipe.projects`, :func:`fp8_projects`), made outside the gradient and handed to
each projection's ``custom_vjp``; current scaling's input scales are tagged ``remat.FP8_SCALE``, which every
remat policy keeps, so a copy recomputed in the backward is one cast fused into its recomputed producer.

``delayed`` (Transformer Engine's delayed scaling): the scales come from the amaxes of the last
``model.fp8_amax_history`` steps (their max, times 2^``model.fp8_margin``), kept per projection in an
:class:`AmaxHistory` [H, 3] (input, weight, output gradient; newest first); a history with no amax yet (the
first step) gives scale 1, as Transformer Engine starts. The quantization then does not wait for this step's
amax, which is still recorded: the projection's backward returns it as the cotangent of the history, and the
train step rolls it in (:meth:`Histories.roll`) instead of handing it to the optimizer. The amaxes are global
(a sharded tensor's max is reduced over its shards), and over gradient-accumulation micro batches the max is
kept (:meth:`Histories.accumulate`).

The routed MoE experts (:func:`grouped`, under ``gmm_impl=ragged_dot``) take current scaling under either
recipe. The embedding, LM head, norms, attention's score/value products and the router stay in the compute
dtype (what Megatron and NeMo's FP8 recipes keep out of FP8 too).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.model import remat
from jaxtron.model.fp8_blockwise import LETTER_NAMES, Blockwise, blockwise_project
from jaxtron.model.projection import Matmuls, parse_spec
from jaxtron.parallel import collective_matmul
from jaxtron.parallel.sharding import matmul_weight

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


HISTORY_SUFFIX = "_amax"  # a projection's AmaxHistory is the attribute f"{weight name}{HISTORY_SUFFIX}"


class AmaxHistory(nnx.Variable):
    """Delayed scaling's state of one projection: [H, 3] amaxes of (input, weight, output gradient) over the
    last H steps, newest first. Model state (checkpointed and resharded with the params); no gradient moves it:
    the train step rolls in each step's amaxes (:meth:`Histories.roll`)."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a module's dense projections multiply (``model.fp8`` and its knobs, read once from the model config):
    the module owns its weights and, under ``delayed``, an :class:`AmaxHistory` beside each; :meth:`project` is
    every dense projection of the decoder."""

    name: str = "none"              # 'none' | 'current' | 'delayed' | 'blockwise'
    margin: int = 0                 # delayed: scales are amax * 2^margin / format max
    history: int = 16               # delayed: steps of amax history
    block: int = 128                # blockwise: the tile
    blockwise_impl: str = "auto"    # blockwise: 'pallas' | 'xla' | 'auto'
    matmuls: Matmuls = Matmuls()    # the unquantized matmuls (none), and what 'auto' resolves by

    @classmethod
    def of(cls, cfg, matmuls: Matmuls) -> "Recipe":
        """The recipe of a model config (``model.fp8``, ``fp8_margin``, ``fp8_amax_history``, ``fp8_block``,
        ``fp8_blockwise_impl``) for a model built with ``matmuls``."""
        return cls(cfg.fp8, cfg.fp8_margin, cfg.fp8_amax_history, cfg.fp8_block, cfg.fp8_blockwise_impl, matmuls)

    def add_histories(self, module, names) -> None:
        """Under ``delayed``, an :class:`AmaxHistory` beside each of ``module``'s weights ``names``."""
        for name in names if self.name == "delayed" else ():
            setattr(module, name + HISTORY_SUFFIX,
                    AmaxHistory(jnp.zeros((self.history, 3), jnp.float32), out_sharding=(None, None)))

    def blockwise(self, **names) -> Blockwise:
        """``blockwise``'s options: the block, the GEMM ('auto': the Pallas kernel on GPUs, XLA's ops with the
        CPU's :class:`Matmuls`, where the kernel would only be interpreted) and the logical names of the einsum
        letters (``names`` overrides, e.g. ``h="act_kv_heads"``)."""
        impl = self.blockwise_impl
        if impl == "auto":
            impl = "xla" if self.matmuls.cpu else "pallas"
        return Blockwise(self.block, impl, tuple({**LETTER_NAMES, **names}.items()))

    def project(self, module, name: str, spec: str, x: jax.Array, **names) -> jax.Array:
        """``einsum(spec, x, module.<name>)`` (the weight cast to x's dtype) under this recipe, with the
        weight's amax history under ``delayed``; ``names``: blockwise's letter names (:meth:`blockwise`)."""
        return self.projects(module, x, (name, spec, names))[0]

    def projects(self, module, x: jax.Array, *projections) -> list:
        """:meth:`project` of one input ``x`` by several of ``module``'s weights, each ``(name, spec)`` or
        ``(name, spec, names)``: their results, in order. Under ``current`` and ``delayed`` x is quantized once
        for all of them (:func:`fp8_projects`), the same math as one :meth:`project` each."""
        ops = []
        for name, spec, *names in projections:
            weight = getattr(module, name)
            w = matmul_weight(weight[...].astype(x.dtype), weight.get_metadata()["out_sharding"])
            hist = getattr(module, name + HISTORY_SUFFIX, None)
            ops.append((spec, w, hist, names[0] if names else {}))
        # parallel.tp_comm_overlap: parallel/ decides from the weights' logical names whether the tensor
        # collectives around these projections run as rings overlapped with their GEMMs
        ring = collective_matmul.projects(
            x, [(spec, w, getattr(module, name).get_metadata()["out_sharding"])
                for (spec, w, _, _), (name, *_) in zip(ops, projections)], self.matmuls.project, self.name != "none")
        if ring is not None:
            return ring
        if self.name in ("current", "delayed"):
            return fp8_projects(x, [(spec, w, None if hist is None else hist[...]) for spec, w, hist, _ in ops],
                                self.name, self.margin)
        return [dense(spec, x, w, self.name, hist, self.margin,
                      self.blockwise(**names) if self.name == "blockwise" else None, self.matmuls)
                for spec, w, hist, names in ops]

    def describe(self) -> str:
        """The recipe in words, for the start-up log."""
        if self.name == "none":
            return "none"
        detail = {"current": "tensorwise current scaling",
                  "delayed": f"tensorwise delayed scaling, {self.history}-step amax history, margin {self.margin}",
                  "blockwise": f"blockwise scaling, {self.block}-wide tiles"}[self.name]
        return f"{self.name} ({detail})"


def dense(spec: str, x: jax.Array, w: jax.Array, recipe: str = "none", hist=None, margin: int = 0,
          blockwise: Blockwise | None = None, matmuls: Matmuls = Matmuls()) -> jax.Array:
    """A dense projection: ``matmuls.project`` (model.fp8=none), :func:`fp8_project` (current),
    :func:`delayed_project` (delayed, with the projection's ``hist``) or ``blockwise_project`` (blockwise,
    with its options; jaxtron/model/fp8_blockwise.py)."""
    if recipe == "none":
        return matmuls.project(spec, x, w)
    if recipe == "delayed":
        return delayed_project(spec, x, w, hist[...], margin)
    if recipe == "blockwise":
        return blockwise_project(spec, x, w, blockwise or Blockwise())
    return fp8_project(spec, x, w)


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_of(x, dtype) -> jax.Array:
    """Current scaling: amax(|x|) / fp8 max, fp32 scalar (1 for an all-zero tensor)."""
    amax = _amax(x)
    return jnp.where(amax > 0, amax / fp8_max(dtype), 1.0)


def quantize(x, dtype, scale) -> jax.Array:
    """x / scale clipped to the format's range, rounded to ``dtype`` (x ~ quantize(x) * scale)."""
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def dequantize(q, scale, dtype) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _dot(spec, a, b, scale, out_dtype):
    """An FP8 x FP8 einsum with a 16-bit/fp32 result, times the product of the operands' scales."""
    acc = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
    y = jnp.einsum(spec, a, b, preferred_element_type=acc)
    return (y.astype(jnp.float32) * scale).astype(out_dtype)


def _kinds(x, w):
    """Empty arrays of x's and w's dtypes: the residuals that tell the backward its results' dtypes."""
    return jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype)


def quantized_input(x, scale=None):
    """The e4m3 copy of a projection's operand and its scale (``scale``, or current scaling's from its amax),
    outside any gradient: one copy of an input serves every projection of it (:func:`fp8_projects`), and the
    gradient reaches x through the projections' custom VJPs, not through the cast."""
    x = jax.lax.stop_gradient(x)
    # current scaling's scale is kept for the backward (remat.FP8_SCALE): a recomputed copy is then one cast
    # fused into x's recomputed producer, not an amax pass (and an all-reduce) over x before it
    scale = remat.tag(scale_of(x, E4M3), remat.FP8_SCALE) if scale is None else scale
    return quantize(x, E4M3, scale), scale


def fp8_project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` (``w`` a weight) in FP8 with current scaling; result and gradients in x's and
    w's dtypes."""
    return _current_dot(spec, x, w, *quantized_input(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _current_dot(spec, x, w, x8, sx):
    """``einsum(spec, x, w)`` in FP8 from x's e4m3 copy ``x8`` (scale ``sx``; :func:`quantized_input`, made
    once for all projections of ``x``); ``x`` itself only receives the gradient. The weight is quantized here,
    with its own amax, recomputed in the backward: quantized outside with its scale kept (as x is), its amax
    left the backward, but its all-reduce no longer joined the gradients' (one more all-reduce per layer,
    planned slower: docs/fp8.md)."""
    return _fwd(spec, x, w, x8, sx)[0]


def _fwd(spec, x, w, x8, sx):
    sw = scale_of(w, E4M3)
    w8 = quantize(w, E4M3, sw)
    # the residuals are the FP8 operands and their scales: nothing of x or w in 16 bits stays alive for the
    # backward (the cotangent dtypes travel as empty arrays)
    return _dot(spec, x8, w8, sx * sw, x.dtype), (x8, w8, sx, sw, _kinds(x, w))


def _bwd(spec, res, g):
    x8, w8, sx, sw, (x_kind, w_kind) = res
    xs, ws, ys = parse_spec(spec)
    sg = scale_of(g, E5M2)
    g8 = quantize(g, E5M2, sg)
    dx = _dot(f"{ys},{ws}->{xs}", g8, w8, sg * sw, x_kind.dtype)
    dw = _dot(f"{xs},{ys}->{ws}", x8, g8, sx * sg, w_kind.dtype)
    return dx, dw, None, None   # x's FP8 copy is made outside the gradient (quantized_input)


_current_dot.defvjp(_fwd, _bwd)


def delayed_project(spec: str, x: jax.Array, w: jax.Array, hist: jax.Array, margin: int = 0) -> jax.Array:
    """``einsum(spec, x, w)`` in FP8 with scales from ``hist`` [H, 3] (delayed scaling, module doc). The
    cotangent returned for ``hist`` is zero but for row 0: this step's (input, weight, gradient) amaxes."""
    return fp8_projects(x, [(spec, w, hist)], "delayed", margin)[0]


def fp8_projects(x: jax.Array, projections, recipe: str, margin: int = 0) -> list:
    """Several projections of one input, ``projections`` a list of (spec, w, hist) (``hist`` under
    ``delayed``, else None), under ``current`` or ``delayed`` scaling, with x quantized once for all of them:
    one amax of x (one all-reduce), one e4m3 copy. Separate calls quantize x once each, and XLA cannot merge
    them: each amax ends in its own all-reduce, so the copies differ by an operand (measured: Q, K and V each
    recomputed the RMSNorm and wrote their own copy of x, docs/fp8.md). Under ``delayed`` the input scale is
    the largest of the histories' (they hold the same amax of x every step, so each is the projection's own),
    and x's amax is taken once, beside the cast, which does not wait for it."""
    if recipe == "current":
        x8, sx = quantized_input(x)
        return [_current_dot(spec, x, w, x8, sx) for spec, w, _ in projections]
    scales = [_history_scales(hist, margin) for _, _, hist in projections]
    sx = functools.reduce(jnp.maximum, [s[0] for s in scales])
    x8, _ = quantized_input(x, sx)
    # x's amax only feeds the history through a residual; left to remat, it is taken where the backward
    # recomputes x. Kept instead (remat.FP8_SCALE), XLA wrote x in 16 bits in the forward to reduce it beside
    # the cast (memory-bound 2.04 against 1.91 s per step on Llama-3-8B, docs/fp8.md)
    ax = _amax(jax.lax.stop_gradient(x))
    return [_delayed_dot(spec, margin, x, w, hist, x8, sx, ax) for spec, w, hist in projections]


def _history_scales(hist, margin):
    amax = jnp.max(hist, axis=0)
    limits = jnp.array([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)], jnp.float32)
    return jnp.where(amax > 0, amax * (2.0 ** margin) / limits, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _delayed_dot(spec, margin, x, w, hist, x8, sx, ax):
    """Delayed scaling's projection from x's e4m3 copy ``x8`` (scale ``sx``) and x's amax ``ax`` this step
    (:func:`fp8_projects`); the weight and the gradient take their scales from ``hist``."""
    return _delayed_fwd(spec, margin, x, w, hist, x8, sx, ax)[0]


def _delayed_fwd(spec, margin, x, w, hist, x8, sx, ax):
    scales = _history_scales(hist, margin)
    w8 = quantize(w, E4M3, scales[1])
    y = _dot(spec, x8, w8, sx * scales[1], x.dtype)
    return y, (x8, w8, sx, scales, ax, _amax(w), jnp.zeros_like(hist), _kinds(x, w))


def _delayed_bwd(spec, margin, res, g):
    x8, w8, sx, scales, ax, aw, zeros, (x_kind, w_kind) = res
    xs, ws, ys = parse_spec(spec)
    g8 = quantize(g, E5M2, scales[2])
    dx = _dot(f"{ys},{ws}->{xs}", g8, w8, scales[2] * scales[1], x_kind.dtype)
    dw = _dot(f"{xs},{ys}->{ws}", x8, g8, sx * scales[2], w_kind.dtype)
    return dx, dw, zeros.at[0].set(jnp.stack([ax, aw, _amax(g)])), None, None, None


_delayed_dot.defvjp(_delayed_fwd, _delayed_bwd)


class Histories:
    """The amax histories of a model's state, found once by their variable type (:class:`AmaxHistory`) in the
    abstract model: what the train step treats apart from the weights. ``mask`` is a tree shaped as the params
    (a nested dict), True at a history. The methods take and return params-shaped trees."""

    def __init__(self, mask):
        self.mask = mask
        self.any = any(jax.tree.leaves(mask))

    @classmethod
    def of(cls, abstract_vars: nnx.State) -> "Histories":
        """Of a model's (abstract) variables, ``nnx.split(model)[1]``."""
        mask = jax.tree.map(lambda v: isinstance(v, AmaxHistory), abstract_vars,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))
        return cls(mask.to_pure_dict())

    def accumulate(self, acc, grads):
        """Gradient accumulation over micro batches: sums, but the max for the histories' rows."""
        if not self.any:
            return jax.tree.map(jnp.add, acc, grads)
        return jax.tree.map(lambda h, a, g: jnp.maximum(a, g) if h else a + g, self.mask, acc, grads)

    def without(self, grads):
        """``grads`` with the histories' cotangents zeroed: what the optimizer and the gradient norm see."""
        if not self.any:
            return grads
        return jax.tree.map(lambda h, g: jnp.zeros_like(g) if h else g, self.mask, grads)

    def roll(self, new_params, old_params, grads):
        """Each history of ``old_params`` shifted by one step with the step's amaxes (row 0 of its cotangent in
        the raw ``grads``) in front; every other leaf of ``new_params`` as it is."""
        def roll(h, new, old, g):
            return jnp.concatenate([g[..., :1, :], old[..., :-1, :]], axis=-2).astype(old.dtype) if h else new

        return jax.tree.map(roll, self.mask, new_params, old_params, grads) if self.any else new_params

    def weights_only(self, tree):
        """A params-shaped tree without its histories (what a weights-only load reads)."""
        def strip(mask, tree):
            if not isinstance(mask, dict):
                return tree
            return {k: strip(mask[k], v) for k, v in tree.items() if mask[k] is not True}

        return strip(self.mask, tree)

    def with_fresh(self, params, abstract):
        """``params`` (from :meth:`weights_only`) completed with empty histories where ``abstract`` (leaves with
        shape, dtype and sharding) has them: a fine-tune starts delayed scaling afresh, as its optimizer does."""
        def fill(mask, params, abstract):
            if mask is True:
                return jax.device_put(jnp.zeros(abstract.shape, abstract.dtype), abstract.sharding)
            if not isinstance(mask, dict):
                return params
            return {k: fill(mask[k], params.get(k) if isinstance(params, dict) else None, v)
                    for k, v in abstract.items()}

        return fill(self.mask, params, abstract)


@jax.custom_vjp
def grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x [M, K], w [G, K, N], group_sizes)`` (the routed MoE experts) in FP8 with current
    scaling: e4m3 x and w (one scale for the whole expert stack), an e5m2 incoming gradient; fp32 result. The
    backward's dgrad is a ragged dot on the transposed experts, its wgrad a ragged dot contracting each
    group's rows (``ragged_dot_general``), both on FP8 operands."""
    return _grouped_fwd(x, w, group_sizes)[0]


def _grouped_fwd(x, w, group_sizes):
    sx, sw = scale_of(x, E4M3), scale_of(w, E4M3)
    x8, w8 = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    y = jax.lax.ragged_dot(x8, w8, group_sizes, preferred_element_type=jnp.float32) * (sx * sw)
    kinds = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return y, (x8, w8, sx, sw, group_sizes, kinds)


def _grouped_bwd(res, g):
    x8, w8, sx, sw, group_sizes, (x_kind, w_kind) = res
    sg = scale_of(g, E5M2)
    g8 = quantize(g, E5M2, sg)
    dx = jax.lax.ragged_dot(g8, jnp.swapaxes(w8, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    rows = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(x8, g8, group_sizes, rows, preferred_element_type=jnp.float32)
    return (dx * (sg * sw)).astype(x_kind.dtype), (dw * (sx * sg)).astype(w_kind.dtype), None


grouped.defvjp(_grouped_fwd, _grouped_bwd)
