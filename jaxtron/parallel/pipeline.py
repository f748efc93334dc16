"""Pipeline parallelism: the stacked decoder layers split over the ``stage`` mesh axis.

The pipelined region is a ``jax.shard_map`` that is manual over ``stage`` only, so data, FSDP and tensor
parallelism keep working inside each stage (those axes stay automatic). Micro batches move between stages with
``ppermute``. The model is not changed: the caller hands over three pure functions,

    pre(shared, mb) -> x                   the embedding of one micro batch
    stage(chunk, x, mb) -> (x, side)       a contiguous chunk of the stacked layers applied to x; side is
                                           (objective term, per-layer report): MoE router losses, which the
                                           pipeline adds to the loss, and their stats ({} for dense layers)
    post(shared, x, mb) -> (loss, aux)     loss sum to differentiate and a pytree of sums to report

where ``stacked`` holds the leaves with a leading ``layers`` axis, ``shared`` the rest (embedding, final norm,
head) and ``mb`` one micro batch (a dict of [micro_batch, seq] arrays). Schedules (S stages, M micro batches,
V virtual stages):

* ``gpipe``: fill-drain over M + S - 1 ticks; the loop's backward runs its ticks in reverse. Bubble
  (S-1)/(M+S-1).
* ``circular``: each device holds V non-adjacent chunks (device s runs chunks s, s+S, ...; Megatron's virtual
  pipeline, MaxText's circular pipeline); micro batches loop around the ring V times over V*M + S - 1 ticks.
  Bubble (S-1)/(V*M+S-1). The stacked weights are stored in layer order, contiguous per stage, so the step
  regroups them (one all-to-all of the layer weights, and of their gradients, per step).
* ``1f1b``: one forward and one backward per tick in one program (M + 2S - 2 ticks). The loop is not
  differentiated: each tick a stage runs the forward of micro batch t - s and the backward of micro batch
  t - (2S - 2 - s), applied to the cotangent from the next stage (the last stage differentiates the loss after
  its layers, the first one the embedding before them); activations move forward and cotangents backward with
  ``ppermute``, weight gradients accumulate in the carry. Activation memory is flat in M. Bubble (S-1)/(M+S-1).

No stage forward runs twice (``parallel.pipeline_recompute=false``, the default): the backward of a micro batch
applies the VJP residuals its forward kept, which are what ``model.remat`` saves inside the stage (everything
under ``none``, the block inputs under ``full``; :mod:`jaxtron.parallel.residuals`). 1f1b keeps them in a ring of
2S - 1 slots (:func:`one_f_one_b_slots`); gpipe and circular keep them per tick (V*M + S - 1), their tick loop's
backward written out (:func:`_kept_loop`: the ticks in reverse, each applying its residuals). With
``parallel.pipeline_recompute=true`` a stage keeps only its input per micro batch and runs its forward again
in the backward (1f1b: a ring of 2S inputs and ``jax.vjp`` again; gpipe/circular: the loop differentiated by
autodiff, each tick under ``jax.checkpoint``): the least memory, one more stage forward per micro batch (4/3
of the model's matmul FLOPs under ``remat=none``). The kept bytes are logged when the step is traced
(:func:`_log_memory`).

In ``gpipe``/``circular`` the embedding runs before the pipelined region and the loss after it, spread over the
stages (micro batches split over ``stage`` when S divides M); the loss head's gradient is taken in the same loop
as its value (a custom VJP), so the head runs once per micro batch and the step holds no loop of collectives
that is independent of the backward: XLA:CPU runs independent regions concurrently, each blocked collective
holding one of a few pool threads, and two such loops plus the weight all-gathers deadlocked 8 CPU devices
(tests/test_pipeline.py runs that command). In ``1f1b`` they run inside it, on the first and last stage,
because the backward of a micro batch starts as soon as its forward leaves the last stage.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtron.parallel.axes import CONTEXT, FSDP, STAGE
from jaxtron.parallel.residuals import KeptVJP
from jaxtron.parallel.sharding import use_rules

AXIS = STAGE  # the axis the pipelined region is manual over
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSpec:
    stages: int
    micro_batches: int
    schedule: str = "1f1b"      # '1f1b' | 'gpipe' | 'circular'
    virtual_stages: int = 1     # circular only
    gather_fsdp: bool = False   # gather the stage's weights over 'fsdp' once per step, not per tick
    recompute: bool = False     # keep only each tick's stage input and run the stage's forward again in its backward

    @property
    def chunks_per_device(self) -> int:
        return self.virtual_stages if self.schedule == "circular" else 1

    @property
    def ticks(self) -> int:
        s, m, v = self.stages, self.micro_batches, self.chunks_per_device
        return m + 2 * s - 2 if self.schedule == "1f1b" else v * m + s - 1

    @property
    def bubble(self) -> float:
        """Idle fraction: (S-1)/(V*M+S-1) (V = 1 but for circular; 1f1b's fill and drain ticks run only a
        forward or only a backward, so its M + 2S - 2 ticks last as long as M + S - 1 full ones)."""
        s, m, v = self.stages, self.micro_batches, self.chunks_per_device
        return (s - 1) / (v * m + s - 1)


def _nbytes(tree: Any) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _log_memory(spec: PipelineSpec, slots: int, slot_bytes: int, what: str) -> None:
    """The activation memory the schedule keeps between a micro batch's forward and backward, logged when the
    step is traced (at start-up). Sizes are per stage: a stage's data, FSDP and tensor devices split them."""
    mib = 2.0 ** 20
    log.info("pipeline %s: %d stages, %d micro batches, bubble %.1f%%; keeps %s of %d micro batches per stage: "
             "%d x %.2f MiB = %.1f MiB (split over the stage's devices)%s", spec.schedule, spec.stages,
             spec.micro_batches, 100 * spec.bubble, what, slots, slots, slot_bytes / mib, slots * slot_bytes / mib,
             "; parallel.pipeline_recompute runs each stage forward twice" if spec.recompute else "")


# ------------------------------------------------------------------------------------------------ layout


def _chunked(stacked: Any, stacked_specs: Any, spec: PipelineSpec, mesh: Mesh) -> Any:
    """[L, ...] leaves (contiguous per stage) -> [S, V, L/(S*V), ...], device s holding chunks s, s+S, ...

    With V = 1 this is a local reshape (no data moves); with V > 1 it regroups the layers across stages. With
    ``spec.gather_fsdp`` the ``fsdp`` axis is dropped from the weights' sharding here, once per step (an
    all-gather; the gradients are reduce-scattered once in return), instead of in every tick of the loop."""
    s, v = spec.stages, spec.chunks_per_device
    gathered = (FSDP, CONTEXT) if spec.gather_fsdp else ()  # ZeRO-3 spans both (rules.py)

    def drop(entry):
        if entry is None or isinstance(entry, str):
            return None if entry in gathered else entry
        kept = tuple(a for a in entry if a not in gathered)
        return kept or None

    def one(w, pspec):
        n = w.shape[0]
        rest = tuple(drop(e) for e in tuple(pspec)[1:]) + (None,) * (w.ndim - len(tuple(pspec)))
        if v == 1:
            w = w.reshape(s, 1, n // s, *w.shape[1:])
        else:  # chunk c = r * S + stage holds layers [c * Lc, (c + 1) * Lc)
            w = w.reshape(v, s, n // (s * v), *w.shape[1:]).swapaxes(0, 1)
        return lax.with_sharding_constraint(w, NamedSharding(mesh, P(AXIS, None, None, *rest)))

    return jax.tree.map(one, stacked, stacked_specs)


def _unchunked(chunks: Any, spec: PipelineSpec) -> Any:
    """Inverse of :func:`_chunked` (for gradients)."""
    v = spec.chunks_per_device

    def one(w):
        if v > 1:
            w = w.swapaxes(0, 1)
        return w.reshape(-1, *w.shape[3:])

    return jax.tree.map(one, chunks)


def _index(tree: Any, i) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _stage_specs(tree: Any) -> Any:
    return jax.tree.map(lambda _: P(AXIS), tree)


def _replicated(tree: Any) -> Any:
    return jax.tree.map(lambda _: P(), tree)


def _shard_map(fn, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset({AXIS}),
                         check_vma=False)


def _in_stage_rules(fn: Callable, rules) -> Callable:
    """Inside the shard_map, constraints name the automatic axes through the context (partly manual) mesh."""
    @functools.wraps(fn)
    def wrapped(*args):
        with use_rules(rules, None):
            return fn(*args)
    return wrapped


# ------------------------------------------------------------------------------------------ gpipe/circular


def _side_zeros(stage: Callable, local: Any, x: jax.Array, mb: dict, chunks: int):
    """Zeros shaped like ``stage``'s side output ``(objective term, per-layer report)``, and like the report
    of all ``chunks`` chunks ([chunks, Lc, ...] per leaf)."""
    obj, report = jax.eval_shape(lambda: stage(local, x, mb)[1])
    zeros = lambda a, lead=(): jnp.zeros(lead + a.shape, a.dtype)
    return (zeros(obj), jax.tree.map(zeros, report)), jax.tree.map(lambda a: zeros(a, (chunks,)), report)


def _layer_order(report: Any) -> Any:
    """[chunks, Lc, ...] -> [L, ...]: chunk c holds layers [c * Lc, (c + 1) * Lc) (see :func:`_chunked`)."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), report)


def _kept_loop(spec: PipelineSpec, rules, stage: Callable, act_dtype, local: Any, x0: jax.Array, micro: dict,
               no_side: Any, report0: Any) -> Callable:
    """The gpipe/circular tick loop of one device, ``loop(local, xs, micro, s) -> (outs, obj, report)``, with a
    backward written out: its forward keeps each tick's micro-batch-dependent VJP residuals (:class:`KeptVJP`,
    stacked over ticks) and the backward runs the ticks in reverse, applying them (no stage forward runs
    twice). Autodiff of the loop would not: a tick's ``lax.cond`` (fill and drain ticks skip the stage) and
    circular's tick-dependent chunk index make the weights' casts residuals of every tick; here the weights
    are one residual of the whole loop and the chunk index is a ``select`` whose weight residuals are made
    again in the backward."""
    S, M, V, T = spec.stages, spec.micro_batches, spec.chunks_per_device, spec.ticks
    ring = [(j, (j + 1) % S) for j in range(S)]
    back_ring = [((j + 1) % S, j) for j in range(S)]

    def chunk(local, x, index, v):
        m, micro = index
        y, (obj, report) = stage(_index(local, v), x.astype(act_dtype), _index(micro, m))
        return (y.astype(x.dtype), obj), report

    i0 = jnp.zeros((), jnp.int32)
    kept = KeptVJP(chunk, local, x0, (i0, micro), i0)
    no_res = lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in kept.kept_shapes)

    def where_tick(t, s):
        i = t - s
        valid = (i >= 0) & (i < V * M)
        ic = jnp.clip(i, 0, V * M - 1)
        return valid, ic // M, ic % M

    def where_back(t, s):
        """Stage 0 keeps what the last stage sends back until that micro batch's next round."""
        il = t - (S - 1)
        return (s == 0) & (il >= 0) & (il < (V - 1) * M), jnp.clip(il, 0, V * M - 1) % M

    def forward(local, xs, micro, s):
        def tick(carry, t):
            cur, loop_buf, outs, obj, report = carry
            valid, v, m = where_tick(t, s)
            first = xs[m] if V == 1 else jnp.where(v == 0, xs[m], loop_buf[m])
            x_in = jnp.where(s == 0, first, cur)

            def go():
                (y, obj_t), rep, res = kept.forward(local, x_in, (m, micro), v)
                return (y, (obj_t, rep)), res
            (y, (obj_t, report_t)), res = lax.cond(valid, go, lambda: ((x_in, no_side), no_res()))
            obj = obj + obj_t
            report = jax.tree.map(lambda r, a: r.at[v * S + s].add(a), report, report_t)
            done = valid & (s == S - 1) & (v == V - 1)
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            nxt = lax.ppermute(y, AXIS, ring)
            if V > 1:
                back, ml = where_back(t, s)
                loop_buf = loop_buf.at[ml].set(jnp.where(back, nxt, loop_buf[ml]))
            return (nxt, loop_buf, outs, obj, report), res

        zeros = jnp.zeros_like(xs[0])
        carry = (zeros, jnp.zeros_like(xs) if V > 1 else None, jnp.zeros_like(xs), no_side[0], report0)
        (_, _, outs, obj, report), res = lax.scan(tick, carry, jnp.arange(T))
        return (outs, obj, report), res

    @jax.custom_vjp
    def loop(local, xs, micro, s):
        return forward(local, xs, micro, s)[0]

    def fwd(local, xs, micro, s):
        out, res = forward(local, xs, micro, s)
        return out, (local, micro, s, res)

    @functools.partial(_in_stage_rules, rules=rules)  # traced when the step is transposed, outside the body's
    def bwd(saved, cts):                                 # rules: the stage must trace as in the forward
        """The forward's ticks transposed, last tick first: the loop buffer's and ppermute's transposes, the
        output slot's cotangent, the stage's VJP from the kept residuals, and the input select's transpose."""
        local, micro, s, res = saved
        ct_outs, ct_obj, _ = cts   # the report has no gradient (forward_loss stops it)

        def rtick(carry, inp):
            t, res_t = inp
            ct_nxt, ct_loop_buf, d_local, d_xs = carry
            valid, v, m = where_tick(t, s)
            if V > 1:
                back, ml = where_back(t, s)
                ct_nxt = ct_nxt + jnp.where(back, ct_loop_buf[ml], 0)
                ct_loop_buf = ct_loop_buf.at[ml].set(jnp.where(back, 0, ct_loop_buf[ml]))
            ct_y = lax.ppermute(ct_nxt, AXIS, back_ring)
            done = valid & (s == S - 1) & (v == V - 1)
            ct_y = ct_y + jnp.where(done, ct_outs[m], 0)
            d_l, ct_x = lax.cond(valid, lambda: kept.backward(local, res_t, (m, micro), (ct_y, ct_obj), v),
                                 lambda: (jax.tree.map(jnp.zeros_like, local), ct_y))   # skipped: y = x_in
            d_local = jax.tree.map(jnp.add, d_local, d_l)
            ct_first = jnp.where(s == 0, ct_x, 0)
            ct_cur = jnp.where(s == 0, 0, ct_x)
            if V > 1:
                d_xs = d_xs.at[m].add(jnp.where(v == 0, ct_first, 0))
                ct_loop_buf = ct_loop_buf.at[m].add(jnp.where(v == 0, 0, ct_first))
            else:
                d_xs = d_xs.at[m].add(ct_first)
            return (ct_cur, ct_loop_buf, d_local, d_xs), None

        zeros = jnp.zeros_like(ct_outs[0])
        carry = (zeros, jnp.zeros_like(ct_outs) if V > 1 else None, jax.tree.map(jnp.zeros_like, local),
                 jnp.zeros_like(ct_outs))
        (_, _, d_local, d_xs), _ = lax.scan(rtick, carry, (jnp.arange(T), res), reverse=True)
        return d_local, d_xs, None, None

    loop.defvjp(fwd, bwd)
    return loop, kept


def _forward_outputs(spec: PipelineSpec, mesh: Mesh, rules, stage: Callable, chunks: Any, xs: jax.Array,
                     micro: dict, act_dtype, log_memory: bool):
    """Run the stage loop on embedded micro batches xs [M, mb, seq, d]: the last chunk's outputs [M, ...],
    split over ``stage`` along M when S divides M (else replicated), the sum of the stages' objective terms
    and their per-layer reports summed over micro batches (layer order)."""
    S, M, V = spec.stages, spec.micro_batches, spec.chunks_per_device
    split_out = M % S == 0

    @jax.checkpoint
    def recomputed_chunk(local, v, x, m, valid, no_side):
        """One tick of one stage under ``parallel.pipeline_recompute``, rematerialized (the backward keeps only
        the stage input per tick). Fill and drain ticks skip the stage: the cond sits inside the checkpoint, so
        its operands (the stage weights) are not residuals of every tick (measured: no change in temp memory at
        M = 64)."""
        def run():
            y, side = stage(_index(local, v), x.astype(act_dtype), _index(micro, m))
            return y.astype(x.dtype), side
        return lax.cond(valid, run, lambda: (x, no_side))

    def body(chunks, xs, micro_in):
        local = jax.tree.map(lambda a: a[0], chunks)                     # [V, Lc, ...]
        s = lax.axis_index(AXIS)
        ring = [(j, (j + 1) % S) for j in range(S)]
        no_side, report0 = _side_zeros(stage, _index(local, 0), xs[0].astype(act_dtype), _index(micro, 0), S * V)
        if not spec.recompute:
            loop, kept = _kept_loop(spec, rules, stage, act_dtype, local, xs[0], micro_in, no_side, report0)
            if log_memory:
                _log_memory(spec, spec.ticks, kept.kept_bytes(), "the stage's VJP residuals (every tick's)")
            return _gathered(*loop(local, xs, micro_in, s))
        run_chunk = recomputed_chunk
        if log_memory:
            _log_memory(spec, spec.ticks, _nbytes(xs[0]), "the stage inputs (every tick's)")

        def tick(carry, t):
            cur, loop_buf, outs, obj, report = carry
            i = t - s
            valid = (i >= 0) & (i < V * M)
            ic = jnp.clip(i, 0, V * M - 1)
            v, m = ic // M, ic % M
            first = xs[m] if V == 1 else jnp.where(v == 0, xs[m], loop_buf[m])
            x_in = jnp.where(s == 0, first, cur)
            y, (obj_t, report_t) = run_chunk(local, v, x_in, m, valid, no_side)
            obj = obj + obj_t
            report = jax.tree.map(lambda r, a: r.at[v * S + s].add(a), report, report_t)
            done = valid & (s == S - 1) & (v == V - 1)
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            nxt = lax.ppermute(y, AXIS, ring)
            if V > 1:  # stage 0 keeps what the last stage sends back until that micro batch's next repeat
                il = t - (S - 1)
                back = (s == 0) & (il >= 0) & (il < (V - 1) * M)
                ml = jnp.clip(il, 0, V * M - 1) % M
                loop_buf = loop_buf.at[ml].set(jnp.where(back, nxt, loop_buf[ml]))
            return (nxt, loop_buf, outs, obj, report), None

        zeros = jnp.zeros_like(xs[0])
        carry = (zeros, jnp.zeros_like(xs) if V > 1 else None, jnp.zeros_like(xs), no_side[0], report0)
        (_, _, outs, obj, report), _ = lax.scan(tick, carry, jnp.arange(spec.ticks))
        return _gathered(outs, obj, report)

    def _gathered(outs, obj, report):
        s = lax.axis_index(AXIS)
        outs = jnp.where(s == S - 1, outs, jnp.zeros_like(outs))
        obj, report = lax.psum((obj, report), AXIS)   # each stage holds the terms of its own chunks
        if split_out:
            return lax.psum_scatter(outs, AXIS, scatter_dimension=0, tiled=True), obj, report
        return lax.psum(outs, AXIS), obj, report

    fn = _shard_map(_in_stage_rules(body, rules), mesh, (_stage_specs(chunks), P(), _replicated(micro)),
                    (P(AXIS) if split_out else P(), P(), P()))
    outs, obj, report = fn(chunks, xs, micro)
    return outs, obj, _layer_order(report)


def _over_micro(spec: PipelineSpec, fn: Callable, shared: Any, xs: Any, micro: dict, carry0: Any):
    """Scan ``fn(shared, xs[m], micro[m]) -> (sums, per_m)`` over micro batches: (summed ``sums``, stacked
    ``per_m`` [M, ...]). When S divides M the stages work on different micro batches at once (vmap sharded
    over ``stage``) and ``sums`` keep a leading [S] axis until one reduction after the loop."""
    S, M = spec.stages, spec.micro_batches
    if M % S:
        def body(acc, xm):
            sums, per_m = fn(shared, *xm)
            return jax.tree.map(jnp.add, acc, sums), per_m
        return lax.scan(body, carry0(()), (xs, micro))
    # [M] (split over stage in S contiguous blocks) -> [M/S, S]: step r works on micro batch j*M/S + r on stage j
    regroup = lambda a: a.reshape(S, M // S, *a.shape[1:]).swapaxes(0, 1)
    group = jax.vmap(fn, in_axes=(None, 0, 0), spmd_axis_name=AXIS)

    def body(acc, xm):
        sums, per_m = group(shared, *xm)
        return jax.tree.map(jnp.add, acc, sums), per_m

    sums, per_m = lax.scan(body, carry0((S,)), jax.tree.map(regroup, (xs, micro)))
    ungroup = lambda a: a.swapaxes(0, 1).reshape(M, *a.shape[2:])
    return jax.tree.map(lambda a: a.sum(0), sums), jax.tree.map(ungroup, per_m)


def _zeros_like_out(fn: Callable, *args) -> Callable:
    out = jax.eval_shape(fn, *args)
    return lambda lead: jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), out)


def _post_loss(spec: PipelineSpec, post: Callable, shared: Any, outs: jax.Array, micro: dict):
    """(loss, aux) summed over micro batches. Its VJP is computed in the forward, in the same loop as the loss
    (one pass of the head per micro batch instead of a forward and a rematerialized one), which also leaves
    no second loop of collectives independent of the backward. ``aux`` is for reporting: it has no gradient."""
    mb0 = _index((outs, micro), 0)
    dtypes = jax.tree.map(lambda p: p.dtype, shared)

    def value(shared, x, mb):
        return post(shared, x, mb), None

    def value_and_grad(shared, x, mb):
        (loss, aux), (d_shared, dx) = jax.value_and_grad(post, argnums=(0, 1), has_aux=True)(shared, x, mb)
        d_shared = jax.tree.map(lambda g: g.astype(jnp.float32), d_shared)
        return ((loss, aux), d_shared), dx

    @jax.custom_vjp
    def total(shared, outs):
        return _over_micro(spec, value, shared, outs, micro, _zeros_like_out(post, shared, *mb0))[0]

    def fwd(shared, outs):
        (sums, d_shared), d_outs = _over_micro(spec, value_and_grad, shared, outs, micro,
                                               _zeros_like_out(lambda *a: value_and_grad(*a)[0], shared, *mb0))
        return sums, (d_shared, d_outs)

    def bwd(res, ct):
        d_shared, d_outs = res
        g = ct[0]
        return (jax.tree.map(lambda d, t: (d * g).astype(t), d_shared, dtypes),
                (d_outs * g.astype(d_outs.dtype)))

    total.defvjp(fwd, bwd)
    return total(shared, outs)


def forward_loss(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                 stacked: Any, stacked_specs: Any, shared: Any, micro: dict, log_memory: bool = True):
    """``(loss, (aux, report))`` summed over the micro batches, through the gpipe/circular forward loop: the
    loss includes the stages' objective terms; ``report`` is theirs in layer order. Differentiable.
    ``log_memory``: log what differentiating it keeps (False for a forward that is not differentiated)."""
    chunks = _chunked(stacked, stacked_specs, spec, mesh)
    xs = jax.vmap(pre, in_axes=(None, 0))(shared, micro)                      # [M, mb, seq, d]
    dtype = xs.dtype
    if mesh.devices.flat[0].platform == "cpu":
        # XLA:CPU's bf16 all-reduce rewrite (ChangeOpDataType) aborts on the stage reductions of 16-bit
        # arrays at this boundary, so on CPU they cross it in fp32.
        xs = xs.astype(jnp.float32)
    outs, obj, report = _forward_outputs(spec, mesh, rules, stage, chunks, xs, micro, dtype, log_memory)
    loss, aux = _post_loss(spec, post, shared, outs.astype(dtype), micro)
    return loss + obj, (aux, jax.tree.map(lax.stop_gradient, report))


# -------------------------------------------------------------------------------------------------- 1f1b


def _one_f_one_b(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                 stacked: Any, stacked_specs: Any, shared: Any, micro: dict, accumulate: Callable):
    S = spec.stages
    chunks = _chunked(stacked, stacked_specs, spec, mesh)
    mb0 = _index(micro, 0)
    x_aval = jax.eval_shape(pre, shared, mb0)
    aux_aval = jax.eval_shape(lambda: post(shared, jnp.zeros(x_aval.shape, x_aval.dtype), mb0)[1])
    tick_fn = _recomputing_tick if spec.recompute else _kept_tick

    def body(chunks, shared, micro):
        local = jax.tree.map(lambda a: a[0, 0], chunks)                    # [Lc, ...]
        s = lax.axis_index(AXIS)
        zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
        zero_aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_aval)
        _, report0 = _side_zeros(stage, local, zeros_x, _index(micro, 0), S)
        ctx = _TickContext(spec, pre, stage, post, local, shared, micro, s, zeros_x, zero_aux, accumulate)
        tick, ring0 = tick_fn(ctx)
        grads0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), (local, shared))
        carry = (zeros_x, zeros_x, ring0, grads0, (zero_aux, report0))
        (_, _, _, (g_local, g_shared), sums), _ = lax.scan(tick, carry, jnp.arange(spec.ticks))
        g_shared = lax.psum(g_shared, AXIS)   # embedding grads live on the first stage, head grads on the last
        sums = lax.psum(sums, AXIS)           # the loss's sums from the last stage, each stage's own report
        return jax.tree.map(lambda g: g[None, None], g_local), g_shared, sums

    fn = _shard_map(_in_stage_rules(body, rules), mesh,
                    (_stage_specs(chunks), _replicated(shared), _replicated(micro)),
                    (_stage_specs(chunks), _replicated(shared), P()))
    g_chunks, g_shared, (sums, report) = fn(chunks, shared, micro)
    return (sums, _layer_order(report)), (_unchunked(g_chunks, spec), g_shared)


@dataclass(frozen=True)
class _TickContext:
    """What a 1f1b tick closes over, inside the shard_map body (``s``: this device's stage index)."""
    spec: PipelineSpec
    pre: Callable
    stage: Callable
    post: Callable
    local: Any
    shared: Any
    micro: dict
    s: Any
    zeros_x: jax.Array
    zero_aux: Any
    accumulate: Callable

    def add_grads(self, grads, d):
        return self.accumulate(grads, jax.tree.map(lambda g, x: x.astype(g.dtype), grads, d))

    def send(self, y, dx):
        """Activations one stage on, cotangents one stage back (the ends send nothing)."""
        S = self.spec.stages
        return (lax.ppermute(y, AXIS, [(j, j + 1) for j in range(S - 1)]),
                lax.ppermute(dx, AXIS, [(j, j - 1) for j in range(1, S)]))


def one_f_one_b_slots(stages: int) -> int:
    """Ring slots for the micro batches a stage holds between its forward and backward under 1f1b: stage s runs
    the forward of micro batch m at tick m + s and its backward at tick m + 2S - 2 - s, so it holds
    2(S - 1 - s) + 1 micro batches (the one written this tick included); stage 0 holds the most, 2S - 1. (In
    Megatron's 1F1B, whose ticks are one forward or one backward, stage 0 holds S: here a tick runs both, so a
    micro batch's round trip through the stages takes 2S - 2 ticks of one forward each.)"""
    return 2 * stages - 1


def _kept_tick(c: _TickContext):
    """The 1f1b tick that keeps the stage's VJP residuals: each forward tick runs ``jax.vjp`` of the embedding (on
    the first stage) and the stage's layers and keeps the residuals that depend on the micro batch in a ring
    slot; the backward tick applies them to the cotangent (the last stage first differentiates the post, on
    the output of its forward in the same tick). No stage forward runs twice."""
    S, M = c.spec.stages, c.spec.micro_batches
    R = one_f_one_b_slots(S)
    is_first, is_last = c.s == 0, c.s == S - 1

    def f(params, x_in, m, _select):
        """The stage's part before the loss: ((output, objective term), report)."""
        local, shared = params
        mb = _index(c.micro, m)
        x0 = lax.cond(is_first, lambda: c.pre(shared, mb), lambda: x_in)
        y, (obj, report) = c.stage(local, x0, mb)
        return (y, obj), report

    params = (c.local, c.shared)
    kept = KeptVJP(f, params, c.zeros_x, jnp.zeros((), jnp.int32))
    obj_dtype = jax.eval_shape(f, params, c.zeros_x, 0, ())[0][1].dtype
    _log_memory(c.spec, R, kept.kept_bytes(), "the stage's VJP residuals")
    ring0 = tuple(jnp.zeros((R,) + a.shape, a.dtype) for a in kept.kept_shapes)

    def tick(carry, t):
        fwd_in, bwd_in, ring, grads, (sums, report) = carry
        m_f = t - c.s
        valid_f = (m_f >= 0) & (m_f < M)
        mf = jnp.clip(m_f, 0, M - 1)

        def forward():
            (y, _), rep, res = kept.forward(params, fwd_in, mf)
            return y, rep, res

        def skip_forward():
            return c.zeros_x, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), report), \
                tuple(jnp.zeros(a.shape, a.dtype) for a in kept.kept_shapes)

        y, rep, res = lax.cond(valid_f, forward, skip_forward)
        report = jax.tree.map(lambda r, a: r.at[c.s].add(a), report, rep)
        # Slot m_f mod R, m_f unclipped: outside [0, M) it holds no live micro batch (before this stage's first
        # forward, or after micro batch m_f - R, whose backward ran 2S - 2 - 2s < R ticks after its forward), so
        # the zeros a skipped tick writes there are harmless and no select over the slot is needed.
        slot_f = jnp.mod(m_f, R)
        ring = tuple(lax.dynamic_update_index_in_dim(r, a, slot_f, 0) for r, a in zip(ring, res))

        m_b = t - (2 * S - 2 - c.s)
        valid_b = (m_b >= 0) & (m_b < M)
        mb_i = jnp.clip(m_b, 0, M - 1)

        def backward(grads, sums):
            mb = _index(c.micro, mb_i)

            def head():  # the last stage's backward starts at the loss, on its own forward of this tick
                loss, pull, aux = jax.vjp(lambda sh, y: c.post(sh, y, mb), c.shared, y, has_aux=True)
                d_shared, dy = pull(jnp.ones((), loss.dtype))
                return dy, d_shared, aux

            def from_next():
                return bwd_in, jax.tree.map(jnp.zeros_like, c.shared), c.zero_aux

            dy, d_post, aux = lax.cond(is_last, head, from_next)
            slot = tuple(lax.dynamic_index_in_dim(r, jnp.mod(mb_i, R), 0, keepdims=False) for r in ring)
            (d_local, d_shared), dx = kept.backward(params, slot, mb_i, (dy, jnp.ones((), obj_dtype)))
            d_shared = jax.tree.map(jnp.add, d_shared, d_post)
            grads = c.add_grads(grads, (d_local, d_shared))
            return grads, jax.tree.map(jnp.add, sums, aux), dx

        grads, sums, dx = lax.cond(valid_b, backward, lambda g, a: (g, a, c.zeros_x), grads, sums)
        fwd_next, bwd_next = c.send(y, dx)
        return (fwd_next, bwd_next, ring, grads, (sums, report)), None

    return tick, ring0


def _recomputing_tick(c: _TickContext):
    """The 1f1b tick of ``parallel.pipeline_recompute``: a forward tick keeps only the stage's input (a ring of 2S
    slots), the backward tick runs ``jax.vjp`` of the stage on it again. The least activation memory, one
    stage forward more per micro batch."""
    S, M = c.spec.stages, c.spec.micro_batches
    R = 2 * S  # a stage holds at most 2(S-1-s)+1 inputs between their forward and backward
    is_first, is_last = c.s == 0, c.s == S - 1
    ring0 = jnp.zeros((R,) + c.zeros_x.shape, c.zeros_x.dtype)
    _log_memory(c.spec, R, _nbytes(c.zeros_x), "the stage inputs (and one micro batch's residuals while its "
                "backward runs)")

    def f(params, x_in, m):
        """This stage's part of micro batch m: ((output, loss), (aux, report)); the loss is the stage's objective
        term, plus the post's loss on the last stage."""
        local, shared = params
        mb = _index(c.micro, m)
        x0 = lax.cond(is_first, lambda: c.pre(shared, mb), lambda: x_in)
        y, (obj, report) = c.stage(local, x0, mb)
        loss, aux = lax.cond(is_last, lambda: c.post(shared, y, mb),
                             lambda: (jnp.zeros((), jnp.float32), c.zero_aux))
        return (y, loss + obj), (aux, report)

    def tick(carry, t):
        fwd_in, bwd_in, ring, grads, (sums, report) = carry
        m_f = t - c.s
        valid_f = (m_f >= 0) & (m_f < M)
        mf = jnp.clip(m_f, 0, M - 1)
        ring = ring.at[mf % R].set(jnp.where(valid_f, fwd_in, ring[mf % R]))
        # The last stage's forward is recomputed by its backward in this same tick.
        y = lax.cond(valid_f & ~is_last, lambda: f((c.local, c.shared), fwd_in, mf)[0][0], lambda: c.zeros_x)

        m_b = t - (2 * S - 2 - c.s)
        valid_b = (m_b >= 0) & (m_b < M)
        mb_i = jnp.clip(m_b, 0, M - 1)

        def backward(grads, sums):
            (_, loss), vjp, (aux, rep) = jax.vjp(lambda p, x: f(p, x, mb_i), (c.local, c.shared),
                                                 ring[mb_i % R], has_aux=True)
            dy = jnp.where(is_last, jnp.zeros_like(bwd_in), bwd_in)
            dparams, dx = vjp((dy, jnp.ones((), loss.dtype)))
            grads = c.add_grads(grads, dparams)
            report = jax.tree.map(lambda r, a: r.at[c.s].add(a), sums[1], rep)
            return grads, (jax.tree.map(jnp.add, sums[0], aux), report), dx

        grads, sums, dx = lax.cond(valid_b, backward, lambda g, a: (g, a, c.zeros_x), grads, (sums, report))
        fwd_next, bwd_next = c.send(y, dx)
        return (fwd_next, bwd_next, ring, grads, sums), None

    return tick, ring0


# ----------------------------------------------------------------------------------------------- public


def add_grads(acc: Any, grads: Any) -> Any:
    """The default ``accumulate`` of :func:`value_and_grad`: a sum."""
    return jax.tree.map(jnp.add, acc, grads)


def value_and_grad(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                   stacked: Any, stacked_specs: Any, shared: Any, micro: dict, accumulate: Callable = add_grads):
    """``((aux_sums, report), (grads_stacked, grads_shared))`` of the summed loss over ``micro`` ([M, mb, seq]
    arrays).

    ``post`` returns ``(loss, aux)`` and ``stage`` ``(x, (objective term, per-layer report))``; the gradient is
    that of the sum over micro batches of ``loss`` and the stages' terms, in fp32; ``report`` is the stages'
    reports summed over micro batches, in layer order.
    ``stacked_specs`` are the PartitionSpecs of the stacked leaves (leading axis over 'stage').
    ``accumulate(acc, grads)`` adds a micro batch's gradients (``(stacked, shared)`` pairs) into the running
    total under 1f1b, whose loop accumulates them itself: a caller whose parameters hold state that combines
    otherwise than by a sum passes its own; the other schedules differentiate their loop, which sums."""
    if spec.schedule == "1f1b":
        return _one_f_one_b(spec, mesh, rules, pre, stage, post, stacked, stacked_specs, shared, micro, accumulate)

    def total(stacked, shared):
        loss, aux = forward_loss(spec, mesh, rules, pre, stage, post, stacked, stacked_specs, shared, micro)
        return loss, aux

    (_, aux), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(stacked, shared)
    return aux, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
