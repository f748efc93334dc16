"""The ZB-H1 schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): its tick table in the lockstep ticks
of jaxtron's 1f1b loop, which micro batch each stage runs F (forward), B (backward to the stage's input, which
the previous stage needs now) and W (backward to the weights, which nothing waits for) on at each tick.

``parallel.pipeline_schedule=zb_h1`` runs the table in 1f1b's loop (:func:`zb_h1_tick`): F keeps the stage's VJP
residuals; B runs the part of the stage's pullback its input cotangent needs and keeps, beside the residuals,
the output cotangent and what the rest of the pullback reads from B's part (per layer: the cotangents at the
weight matmuls' outputs and the activations they multiply; :mod:`jaxtron.parallel.backward_split`); W runs that
rest: the weight-gradient matmuls, not the chain of input cotangents again. Measured (python -m jaxtron.plan,
H100, tiny model of 8 layers, remat=none, 64 micro batches): dot FLOPs over model FLOPs 1.039 at 2 stages
against 1f1b's 1.043, 1.708 at 4 stages (8 micro batches) against 1.809 (docs/parallelism.md).

The ticks. As in 1f1b (:mod:`jaxtron.parallel.one_f_one_b`), stage s runs F of micro batch m at tick m + s and B
at tick m + 2S - 2 - s; all stages run each tick together, so a tick lasts as long as its busiest stage. With F,
B and W one time unit each (the paper's assumption), 1f1b runs W with B: its S - 1 fill ticks last 1, its M
full ticks 3 and its S - 1 drain ticks 2 (B and W), (S-1)/(M+S-1) idle. Here B leaves W behind: stage 0, which
is never idle after its first B, runs W with each B (it has no later idle tick to put W in); every other
stage puts its W's, oldest first, into whatever time the tick leaves it (the tick's length minus its own F
and B), and from its last B on runs the rest two to a tick, in ticks stage 0's B and W make two long. Fill
ticks then last 1, the ticks with some B but no stage-0 W 2, stage 0's steady ticks 3 and its drain 2: in
all 3M + S - 1 units against 1f1b's 3M + 3(S - 1), a bubble of (S-1)/(3M+S-1), the paper's (S-1)(F+B-W)
against (S-1)(F+B+W), one third. Every stage ends with stage 0's last B (checked: :func:`zb_h1_table` raises
if a W is left over). The price is memory: a stage holds a micro batch's residuals from its F to its W, up to
2S - 1 on stage 0 (as in 1f1b) and up to 2S - 2 on the others (1f1b: 2(S - 1 - s) + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtron.parallel.one_f_one_b import TickContext
from jaxtron.parallel.pipeline_layout import log_memory, nbytes, tree_index
from jaxtron.parallel.residuals import KeptVJP


@dataclass(frozen=True)
class TickTable:
    """``work[t][s]``: (F micro batch or None, B micro batch or None, W micro batches) of stage s at tick t;
    ``lengths[t]``: the tick's length in units (its busiest stage's F + B + W count); ``bubble``: the idle
    fraction of a stage, 1 - 3M / sum(lengths); ``peak_in_flight[s]``: the most micro batches stage s holds
    residuals of at once (F run, W not yet finished, the one whose W runs in that tick included)."""

    stages: int
    micro_batches: int
    work: tuple
    lengths: tuple
    bubble: float
    peak_in_flight: tuple

    def describe(self, stage: int) -> list[str]:
        """Stage ``stage``'s ticks as text: 'F3 B1 W0', '-' for an idle tick."""
        out = []
        for tick in self.work:
            f, b, ws = tick[stage]
            parts = ([f"F{f}"] if f is not None else []) + ([f"B{b}"] if b is not None else []) + \
                [f"W{w}" for w in ws]
            out.append(" ".join(parts) or "-")
        return out


def one_f_one_b_bubble(stages: int, micro_batches: int) -> float:
    """1f1b's idle fraction in the same units: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def zb_h1_table(stages: int, micro_batches: int) -> TickTable:
    """The ZB-H1 ticks for ``stages`` stages and ``micro_batches`` micro batches (see the module docstring)."""
    S, M = stages, micro_batches
    if S < 1 or M < 1:
        raise ValueError(f"zb_h1_table: stages and micro_batches must be positive (got {S}, {M})")
    T = M + 2 * S - 2

    def f_of(s, t):
        m = t - s
        return m if 0 <= m < M else None

    def b_of(s, t):
        m = t - (2 * S - 2 - s)
        return m if 0 <= m < M else None

    # a tick's length: its busiest stage's F + B, and W on stage 0 wherever stage 0 runs a B
    lengths = [max((f_of(s, t) is not None) + (b_of(s, t) is not None) + (s == 0 and b_of(s, t) is not None)
                   for s in range(S)) for t in range(T)]
    work = [[None] * S for _ in range(T)]
    w_tick = [[None] * M for _ in range(S)]
    for s in range(S):
        pending: list[int] = []
        for t in range(T):
            f, b = f_of(s, t), b_of(s, t)
            if b is not None:
                pending.append(b)
            room = lengths[t] - (f is not None) - (b is not None)
            done = pending[:max(room, 0)]
            pending = pending[len(done):]
            for m in done:
                w_tick[s][m] = t
            work[t][s] = (f, b, tuple(done))
        if pending:
            raise AssertionError(f"zb_h1_table: stage {s} has W of micro batches {pending} left after tick {T - 1}")
    peak = tuple(max(sum(1 for m in range(M) if m + s <= t <= w_tick[s][m]) for t in range(T)) for s in range(S))
    total = sum(lengths)
    return TickTable(S, M, tuple(tuple(row) for row in work), tuple(lengths), 1.0 - 3 * M / total, peak)


def tick_arrays(table: TickTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The table as arrays a compiled loop indexes by (tick, stage): F's and B's micro batch ([T, S], -1 where
    none), the W's ([T, S, K], K the most W's a stage runs in a tick, -1 padding), and the slots a stage needs
    to hold a micro batch's residuals from its F to its W: one more than the longest such span, so that the F
    of micro batch m + slots, which reuses m's slot, comes after m's W."""
    T, S = len(table.work), table.stages
    K = max(len(ws) for row in table.work for _, _, ws in row)
    f_at, b_at, w_at = (np.full(shape, -1, np.int32) for shape in ((T, S), (T, S), (T, S, K)))
    span = 0
    for t, row in enumerate(table.work):
        for s, (f, b, ws) in enumerate(row):
            f_at[t, s] = -1 if f is None else f
            b_at[t, s] = -1 if b is None else b
            w_at[t, s, :len(ws)] = ws
            span = max([span] + [t - (m + s) for m in ws])   # F of m on stage s ran at tick m + s
    return f_at, b_at, w_at, span + 1


def zb_h1_tick(c: TickContext):
    """The ZB-H1 tick, in the 1f1b loop (:func:`jaxtron.parallel.one_f_one_b.value_and_grad`): F as 1f1b's
    (keeping the stage's VJP residuals), B the input part of the stage's pullback (``KeptVJP.split``), keeping
    the output cotangent and B's stash in slots beside the residuals, and the table's W's: the weight part, from
    a micro batch's residuals, output cotangent and stash. The ticks run as phases by how many W's they hold
    (:func:`tick_phases`)."""
    S = c.spec.stages
    f_np, b_np, w_np, R = tick_arrays(zb_h1_table(S, c.spec.micro_batches))
    f_at, b_at, w_at = jnp.asarray(f_np), jnp.asarray(b_np), jnp.asarray(w_np)
    is_first, is_last = c.s == 0, c.s == S - 1

    def f(params, x_in, m, _select):
        """The stage's part before the loss: ((output, objective term), report)."""
        local, shared = params
        mb = tree_index(c.micro, m)
        # Every stage runs the embedding (a gather; with leading dense stacks, those too): 1f1b's lax.cond on
        # the stage index fails XLA's verifier here (data 2 x tensor 2): in the W tick's transpose of that cond
        # one branch gives the embedding's cotangent replicated, the other vocab-sharded over tensor.
        x0 = jnp.where(is_first, c.pre(shared, mb), x_in)
        y, (obj, report) = c.stage(local, x0, mb)
        return (y, obj), report

    params = (c.local, c.shared)
    m0 = jnp.zeros((), jnp.int32)
    kept = KeptVJP(f, params, c.zeros_x, m0)
    split = kept.split(params, m0)
    obj_one = jnp.ones((), jax.eval_shape(f, params, c.zeros_x, 0, ())[0][1].dtype)
    log_memory(c.spec, R, kept.kept_bytes() + nbytes(c.zeros_x) + nbytes(split.stash_shapes),
               "the stage's VJP residuals, output cotangent and what W reads from B")
    zeros = lambda shapes: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    ring0 = (tuple(jnp.zeros((R,) + a.shape, a.dtype) for a in kept.kept_shapes),
             jnp.zeros((R,) + c.zeros_x.shape, c.zeros_x.dtype),
             jax.tree.map(lambda s: jnp.zeros((R,) + s.shape, s.dtype), split.stash_shapes))
    no_local = jax.tree.map(jnp.zeros_like, c.local)

    def slot_of(ring, m):
        return jax.tree.map(lambda r: lax.dynamic_index_in_dim(r, m % R, 0, keepdims=False), ring)

    def tick(carry, t, has_f, has_b, w_slots):
        fwd_in, bwd_in, (ring, dys, stashes), grads, (sums, report) = carry
        m_f = f_at[t, c.s]
        mf = jnp.maximum(m_f, 0)

        def forward():
            (y, _), rep, res = kept.forward(params, fwd_in, mf)
            return y, rep, res

        def skip_forward():
            return c.zeros_x, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), report), \
                tuple(jnp.zeros(a.shape, a.dtype) for a in kept.kept_shapes)

        y = c.zeros_x
        if has_f:
            y, rep, res = lax.cond(m_f >= 0, forward, skip_forward)
            report = jax.tree.map(lambda r, a: r.at[c.s].add(a), report, rep)
            # A skipped F writes zeros into slot (t - s) mod R, whose last user's W ran at least a tick ago (R is
            # one more than the longest F-to-W span), as in 1f1b's ring.
            ring = tuple(lax.dynamic_update_index_in_dim(r, a, (t - c.s) % R, 0) for r, a in zip(ring, res))

        m_b = b_at[t, c.s]
        mb_i = jnp.maximum(m_b, 0)

        def backward(grads, sums):
            mb = tree_index(c.micro, mb_i)
            dy, d_post, aux = c.output_cotangent(is_last, y, mb, bwd_in)
            dx, early, stash = split.input_part(params, slot_of(ring, mb_i), mb_i, (dy, obj_one), ())
            grads = c.add_grads(grads, jax.tree.map(jnp.add, early, (no_local, d_post)))
            return grads, jax.tree.map(jnp.add, sums, aux), dx, dy, stash

        def skip_backward(grads, sums):
            return grads, sums, c.zeros_x, c.zeros_x, zeros(split.stash_shapes)

        dx = c.zeros_x
        if has_b:
            grads, sums, dx, dy, stash = lax.cond(m_b >= 0, backward, skip_backward, grads, sums)
            # B of micro batch m writes slot m mod R, which m's W reads before the B of m + R (the span bound)
            slot_b = mb_i % R
            keep = lambda r, a: lax.dynamic_update_index_in_dim(r, jnp.where(m_b >= 0, a, r[slot_b]), slot_b, 0)
            dys = keep(dys, dy)
            stashes = jax.tree.map(keep, stashes, stash)

        for k in range(w_slots):
            m_w = w_at[t, c.s, k]
            mw = jnp.maximum(m_w, 0)

            def weights(grads, mw=mw):
                d_params = split.weight_part(params, slot_of(ring, mw), mw, (dys[mw % R], obj_one), (),
                                             slot_of(stashes, mw))
                return c.add_grads(grads, d_params)

            grads = lax.cond(m_w >= 0, weights, lambda g: g, grads)
        fwd_next, bwd_next = c.send(y, dx)
        return (fwd_next, bwd_next, (ring, dys, stashes), grads, (sums, report)), None

    kinds = [(bool((f_np[t] >= 0).any()), bool((b_np[t] >= 0).any()), int((w_np[t] >= 0).sum(axis=1).max()))
             for t in range(len(f_np))]
    return tick_phases(kinds, tick), ring0


def tick_phases(kinds: list, tick: Callable) -> tuple:
    """The ticks as consecutive loops of ticks alike: ``kinds[t]`` is a tuple of static facts of tick t (whether
    any stage runs a forward in it, a backward, how many W's; ``tick(carry, t, *kinds[t])`` leaves out what
    its tick never runs). The fill ticks then compile no backward and the drain ticks no forward: a conditional
    never taken still costs its code, and the planner counts its slowest branch (an SPMD program's branches are
    what different devices run). The price: each loop after the first holds its own copy of the operands the
    loops share (1f1b therefore keeps one loop: :func:`jaxtron.parallel.one_f_one_b.value_and_grad`)."""
    out, start = [], 0
    for t in range(1, len(kinds) + 1):
        if t == len(kinds) or kinds[t] != kinds[start]:
            out.append((start, t, lambda carry, t, k=tuple(kinds[start]): tick(carry, t, *k)))
            start = t
    return tuple(out)
