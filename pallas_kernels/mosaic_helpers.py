"""Mosaic GPU building blocks shared by the flash attention forward (`flash_attention_mosaic`) and backward
(`flash_attention_mosaic_bwd`, `flash_attention_mosaic_dq`): the warpgroup count and the interpreter's
parameters, wgmma operand layouts in shared memory, matmul helpers, which kv blocks a query tile sees (causal
diagonal, packed-document spans), and the warpgroup that streams K/V blocks into shared-memory slots by TMA
(`kv_producer`)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .segments import block_spans

COMPUTE_WGS = 2   # compute warpgroups per CTA (FlashAttention-3's ping-pong pair); a third produces K/V by TMA
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # wgmma operand layout in shared memory
TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))  # the same 128-byte swizzle for fp32


# Mosaic GPU's interpreter runs each warpgroup (two compute, one producer) as an XLA computation of its own that
# blocks in callbacks on simulated barriers, while the kernel's own computation waits for them: all four need an
# XLA CPU thread at once. XLA's CPU client has max(cores, CPU devices) threads; with fewer it deadlocks.
INTERPRET_THREADS = COMPUTE_WGS + 2


def interpret_threads() -> int:
    """Threads of XLA's CPU client here: max(usable cores, CPU devices)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores, len(jax.devices("cpu")))


def mosaic_interpret_params():
    """Mosaic GPU interpret-mode parameters, or a clear error where this JAX has no public GPU interpreter or
    where XLA's CPU client has too few threads to run it without deadlocking."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        raise NotImplementedError(
            f"flash_attention(backend='mosaic', interpret=True) needs Mosaic GPU's interpreter "
            f"(jax >= 0.11; this is jax {jax.__version__}); use backend='triton' on CPU")
    if interpret_threads() < INTERPRET_THREADS:
        raise RuntimeError(
            f"flash_attention(backend='mosaic', interpret=True) needs {INTERPRET_THREADS} XLA CPU threads (one per "
            f"simulated warpgroup, and the kernel's own), and XLA has {interpret_threads()} here (max of cores "
            f"and CPU devices); with fewer the interpreter deadlocks. Start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={INTERPRET_THREADS}, or use backend='triton'")
    return params()


def row_of(x, n):
    """[rows] statistics broadcast over a [rows, n] tile."""
    return lax.broadcast_in_dim(x, (x.shape[0], n), [0])


def col_of(x, n):
    """[cols] statistics broadcast over an [n, cols] tile."""
    return lax.broadcast_in_dim(x, (n, x.shape[0]), [1])


def mm(a_ref, b_ref, shape):
    """a @ b, both in shared memory, into a fresh fp32 [m, n] tile (registers)."""
    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def mm_pair(a1_ref, b1_ref, a2_ref, b2_ref, shape):
    """(a1 @ b1, a2 @ b2), all four in shared memory, into fresh fp32 [m, n] tiles: both wgmmas are issued before
    either is waited for, so the tensor cores run them back to back."""
    def body(acc1, acc2):
        plgpu.wgmma(acc1, a1_ref, b1_ref)
        plgpu.wgmma(acc2, a2_ref, b2_ref)
        return acc1[...], acc2[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def mma_into(acc, a, b_ref, a_smem=None):
    """acc + a @ b_ref: acc an fp32 register tile, a a 16-bit register tile, b in shared memory. On hardware the
    wgmma accumulates into acc in place (pl.run_state). Interpret mode (a_smem given) stages a through shared
    memory and adds a fresh product (see the module docstring)."""
    if a_smem is not None:
        a_smem[...] = a

        def staged(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(staged, plgpu.ACC(acc.shape, jnp.float32))

    def in_place(acc_ref):
        plgpu.wgmma(acc_ref, a, b_ref)
    return pl.run_state(in_place)(plgpu.ACC.init(acc))


def opaque_zero(zero_smem, wg):
    """0, read from shared memory (`zero_smem[wg]`, which warpgroup wg set to 0) where the compiler cannot prove
    it. A loop indexes its loop-invariant tiles with it (`tiles.at[wg + zero]`, positions `base + zero + iota`):
    otherwise LLVM hoists their wgmma descriptors (one 64-bit value per 16-wide k-step and operand) and the
    masks' per-thread iota values out of the loop, and ptxas spills them (see scripts/mosaic_sass.py). Inside
    the loop they cost a few uniform-register adds; the load itself is one shared-memory read per iteration."""
    return zero_smem[wg]


def visible_kv_blocks(q_end, *, causal: bool, block_kv: int, real_blocks: int):
    """kv blocks a query range ending (exclusive) at q_end visits: those up to its diagonal under causal masking
    (traced), every block holding a real key otherwise (a Python int)."""
    if not causal:
        return real_blocks
    return jnp.minimum(lax.div(q_end + (block_kv - 1), jnp.int32(block_kv)), jnp.int32(real_blocks))


def kv_visibility(q_base, j, *, block_q: int, block_kv: int, causal: bool, seq_len: int):
    """Bool [block_q, block_kv] (WGMMA layout) of the keys of kv block j that rows q_base.. see: the causal mask,
    or without it the real (unpadded) keys."""
    kv_pos = j * block_kv + plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
    if not causal:
        return kv_pos < seq_len
    q_pos = q_base + plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
    return q_pos >= kv_pos


SPAN_WIDTH = 32    # int32 per document-span row: 128 bytes, the smallest copy a whole warpgroup issues


def span_rows(seg, block: int):
    """[b, sp // block, SPAN_WIDTH] int32: `segments.block_spans` (positions [lo, hi) where each block's document ids
    occur) padded to a TMA-able row."""
    spans = block_spans(seg, block)
    return jnp.pad(spans, ((0, 0), (0, 0), (0, SPAN_WIDTH - 2)))


def document_blocks(span_ref, span_smem, span_bar, *, batch, tile, wg, block: int):
    """(first, end) block indices (of `block` positions) overlapping the document span of `tile`, read by
    warpgroup wg from its own copy: with segment ids the block loops run over [first, end) only."""
    plgpu.copy_gmem_to_smem(span_ref.at[batch, tile], span_smem.at[wg], span_bar.at[wg])
    plgpu.barrier_wait(span_bar.at[wg])
    lo, hi = span_smem[wg, 0], span_smem[wg, 1]
    return lax.div(lo, jnp.int32(block)), lax.div(hi + (block - 1), jnp.int32(block))


def query_tile_kv_blocks(span, *, batch, tile, wg, causal: bool, block_kv: int, real_blocks: int):
    """(start, visible_blocks) for a query tile: its kv loop runs over blocks start..visible_blocks(q_end) - 1
    for the rows before q_end, within the causal diagonal and the real keys and, with segment ids (span =
    (span_ref, span_smem, span_bar); every warpgroup, the producer too, reads it), within the blocks of the
    tile's documents (at least one block, so that no loop waits on a slot nothing fills)."""
    start, doc_end = 0, None
    if span is not None:
        start, doc_end = document_blocks(*span, batch=batch, tile=tile, wg=wg, block=block_kv)

    def visible_blocks(q_end):
        n = visible_kv_blocks(q_end, causal=causal, block_kv=block_kv, real_blocks=real_blocks)
        return n if span is None else jnp.maximum(jnp.minimum(n, doc_end), start + 1)
    return start, visible_blocks


def over_kv_blocks(step, carry, *, steps, q_base, causal: bool, has_seg: bool, block_kv: int, seq_len: int,
                   start=0):
    """carry through `step(j, carry, masked)` for kv blocks start..steps-1 of a query tile starting at q_base, in
    order, masking only where needed: every block with segment ids; under causal masking the blocks reaching the
    diagonal (padded keys only sit there); otherwise the last block when it holds padded keys. start: the first
    block of the tile's documents (segment ids), or a Python int (the forward starts after its first block)."""
    if has_seg:
        return lax.fori_loop(start, steps, functools.partial(step, masked=True), carry)
    if causal:
        full = jnp.maximum(jnp.minimum(lax.div(q_base, jnp.int32(block_kv)), steps), start)
        carry = lax.fori_loop(start, full, functools.partial(step, masked=False), carry)
        return lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
    ragged_last = seq_len % block_kv != 0
    full = steps - 1 if ragged_last else steps
    carry = lax.fori_loop(start, full, functools.partial(step, masked=False), carry)
    return step(jnp.int32(full), carry, masked=True) if ragged_last and full >= start else carry


def kv_producer(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, *, batch, kv_head, steps, slots: int,
                block: int, seg=None, start=0):
    """The TMA warpgroup: K/V blocks start..steps-1 of (batch, kv_head) into `slots` rotating shared-memory slots
    (block j in slot (j - start) % slots).
    A slot's K is refilled once both compute warpgroups have released its K (k_free, two arrivals), and its V
    once they have released its V (v_free): K is read first and released first, so the next K load starts
    while the last V is still in use. The last releases are waited for too, so every barrier phase is observed
    (the interpreter checks this). steps may be a Python int (then the first loads are unconditional).
    seg: (seg_ref [b, sp], seg_smem [slots, block], seg_bar) to bring each block's segment ids along (packed
    documents). They go in with V, after both K and V of the slot are released: the forward reads them after
    releasing K, the dq kernel after releasing V."""
    def load_k(j, slot):
        plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(j * block, block), kv_head], k_smem.at[slot], k_bar.at[slot])

    def load_v(j, slot):
        plgpu.copy_gmem_to_smem(v_ref.at[batch, pl.ds(j * block, block), kv_head], v_smem.at[slot], v_bar.at[slot])
        if seg is not None:
            seg_ref, seg_smem, seg_bar = seg
            plgpu.copy_gmem_to_smem(seg_ref.at[batch, pl.ds(j * block, block)], seg_smem.at[slot], seg_bar.at[slot])

    def load(j, slot):
        load_k(j, slot)
        load_v(j, slot)

    static = isinstance(steps, int)
    for i in range(slots):
        if not static:
            pl.when(start + i < steps)(functools.partial(load, start + jnp.int32(i), i))
        elif i < steps:
            load(jnp.int32(i), i)

    def refill(j, _):
        slot = lax.rem(j - start, jnp.int32(slots))
        plgpu.barrier_wait(k_free.at[slot])            # both warpgroups are done with K of block j - slots
        load_k(j, slot)
        plgpu.barrier_wait(v_free.at[slot])            # ... and with its V
        load_v(j, slot)
    lax.fori_loop(start + jnp.int32(slots), steps, refill, None)

    def drain(j, _):
        slot = lax.rem(j - start, jnp.int32(slots))
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
    lax.fori_loop(jnp.maximum(steps - slots, start), steps, drain, None)
