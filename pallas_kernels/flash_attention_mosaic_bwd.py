"""Flash attention backward as Mosaic GPU (Hopper) kernels: dk/dv with dq fused in (default), or dq and dk/dv.

The `backend="mosaic"` backward of `pallas_kernels.flash_attention`, on the same operands and residuals as the
Triton backward: q, k, v, dO in fp16 (divided by their power-of-two scales), lse [b, h, sp] (log2 domain),
delta = rowsum(dO * O) [b, h, sp] in the operands' units, sc [b, kv_h, 4] = (logit multiplier, dq, dk, dv
multipliers), optional segment ids [b, sp] (every visited block is then masked). FlashAttention-3's backward on
its Hopper machinery (TMA producer warpgroup, wgmma, shared-memory slots):

  * dk/dv: one CTA per (kv head, 2 * block_k keys, batch); two compute warpgroups of block_k keys (K and V stay
    in shared memory) and a producer streaming (q, dO, lse, delta) blocks for every query head of the GQA group
    and every visible query block, so the group sum happens in the accumulators. Per block: S^T = K Q^T,
    P^T = exp2(S^T c - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
  * dV and dK take P^T and dS^T from registers (FlashAttention-3's RS form) and are issued together.
  * fuse_dq (default): dS^T also goes to shared memory while they run; dQ_i = dS K (wgmma with the transposed
    dS^T as A) is staged in fp32 and added into a zero-initialised fp32 accumulator [b, sp, h, d] in global
    memory by a TMA reduce-add (cp.reduce.async.bulk); the wrapper applies dq's multiplier. Five matmuls per
    (query block, key block) instead of seven, and no second pass over K/V; the order of the fp32 sums varies
    from run to run.
    With head_dim 128 both warpgroups' dS^T are double-buffered and each warpgroup computes half of dQ_i's
    columns over the CTA's 2 * block_k keys, so a CTA issues one reduce-add per query block, not two.
    The accumulator goes in as a Ref (pl.run_state around pl.kernel); a vmap rule folds a vmapped axis into
    the batch dim.
  * otherwise a dq kernel: one CTA per (head, 2 * block_q query rows, batch); two compute warpgroups of block_q
    rows and a TMA producer streaming K/V blocks through `slots` shared-memory buffers
    (`flash_attention_mosaic.kv_producer`, shared with the forward). Per block: S = Q K^T and dP = dO V^T,
    P = exp2(S c - lse), dS = P (dP - delta), dQ += dS K with dS (fp16) in registers. Causal: only blocks up to
    the diagonal, the interior ones without a mask; heaviest query tiles launch first.
  * Packed documents: every kernel visits only the blocks where its CTA's document ids occur (the forward's
    `document_blocks`): the dq kernel's kv loop and the dk/dv kernel's query loop are narrowed to that span.
  * Padded query rows have dO = 0 and so add nothing; padded keys are masked (non-causal; under causal masking
    no real query sees them) so their dS is exactly 0, and their dk/dv rows are dropped by the wrapper.

Interpret mode swaps register operands and `run_state` as the forward does (see its docstring). Its interpreter
has no TMA reduce-add either: there each warpgroup stores its dq blocks into a partial sum of its own (an
[n_kv_tiles * 2, b, sp, h, d] zero-initialised buffer), summed afterwards; everything else is the same code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import cdiv
from .mosaic_helpers import (COMPUTE_WGS, SPAN_WIDTH, TILED, TILED_F32, col_of, document_blocks, mm, mm_pair,
                             mma_into, mosaic_interpret_params, opaque_zero, row_of, span_rows)
from .flash_attention_mosaic_dq import dq_kernel

__all__ = ["mosaic_backward", "bwd_smem_bytes"]

# Registers per thread in the dk/dv kernel: its compute warpgroups carry dK and dV (2 x 64 fp32) across the loop
# plus S^T and dP^T (issued together), so they get FlashAttention-3's split for two compute warpgroups, 240, and
# the TMA producer 24 (2 * 240 + 24 warpgroup-registers x 128 threads = 64,512 of the SM's 65,536).
DKV_COMPUTE_REGS, DKV_PRODUCER_REGS = 240, 24


def bwd_smem_bytes(head_dim: int, block_q: int, block_kv: int, slots: int, out_itemsize: int,
                   interpret: bool, fuse_dq: bool = True) -> int:
    """Shared memory of the larger backward kernel (with fuse_dq, the dk/dv kernel is the only one)."""
    d, w = head_dim, COMPUTE_WGS
    stage = 2 * w * block_kv * d * out_itemsize                               # dk, dv on their way out
    if fuse_dq:                                       # dq (fp32) and dS^T share it (see _dkv's `split`)
        split = d % 128 == 0
        dq_stage = w * block_q * (d // w if split else d) * 4
        stage = max(stage, dq_stage + (2 if split else 1) * w * block_kv * block_q * 2)
    dkv = (2 * w * block_kv * d * 2 + stage + 2 * slots * block_q * d * 2
           + 3 * slots * block_q * 4 + w * 4 * max(block_q, block_kv) * 4
           + (w * block_kv * block_q * 2 if interpret and not fuse_dq else 0))  # stats incl. segment ids
    if fuse_dq:
        return dkv
    dq = (2 * w * block_q * d * 2 + w * block_q * d * out_itemsize + 2 * slots * block_kv * d * 2
          + w * 5 * block_q * 4 + slots * block_kv * 4 + (w * block_q * block_kv * 2 if interpret else 0))
    return max(dq, dkv)


def _dkv(q, k, v, do, lse, delta, sc, seg, *, causal, seq_len, bq, bkv, slots, out_dtype, interpret, fuse_dq):
    """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register state set
    up here; splitting it would only pass those around."""
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    w = COMPUTE_WGS
    n_kv_tiles = sp // (w * bkv)
    n_qb = cdiv(seq_len, bq)                          # query blocks holding at least one real row
    cdt = q.dtype
    rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    width = max(bq, bkv)
    # (logit multiplier, dk multiplier, dv multiplier) per (batch, kv head) as TMA-able rows [b, kv_h, 3, width].
    sc_rows = jnp.broadcast_to(sc[..., jnp.array([0, 2, 3])][..., None], (b, kvh, 3, width))
    # Padded keys (non-causal, ragged length) are masked where they sit: their dk/dv rows are dropped anyway, but
    # with dq fused their dS must be exactly 0 (exp2(0 - lse) of a masked-out key may overflow).
    ragged = not causal and seq_len % (w * bkv) != 0
    # With head_dim 128 the two compute warpgroups share dq's work: each adds dS_0 K_0 + dS_1 K_1 for one half of
    # the columns (both dS^T double-buffered in shared memory, one rendezvous per block), so a CTA issues one
    # reduce-add per query block and 2 * block_k keys, not two. head_dim 64 would split K inside its 64-wide
    # swizzled tile, so there each warpgroup reduce-adds dS_w K_w over all columns itself.
    split = fuse_dq and d % 128 == 0
    dq_cols = d // w if split else d
    n_ds = 2 if split else 1

    def first_q_block(key_start):
        """The first query block a key range starting at key_start is visible to (clamped to n_qb)."""
        if not causal:
            return 0
        return jnp.minimum(lax.div(key_start, jnp.int32(bq)), jnp.int32(n_qb))

    has_seg = seg is not None

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, *rest):
        """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register state
        set up here; splitting it would only pass those around."""
        seg_ref, span_ref, rest = (rest[0], rest[1], rest[2:]) if has_seg else (None, None, rest)
        dq_acc_ref, rest = (rest[0], rest[1:]) if fuse_dq else (None, rest)
        dk_ref, dv_ref, scratch = rest
        (kv_smem, out_smem, q_smem, do_smem, lse_smem, delta_smem, sc_smem2, a_smem2, kseg_smem2, qseg_smem,
         span_smem, zero_smem), bars, free = scratch
        q_bar, do_bar, lse_bar, delta_bar, own_bar, qseg_bar, ds_ready, span_bar = bars
        k_smem2, v_smem2 = kv_smem
        if fuse_dq:                # the dk/dv staging shares its shared memory with dq's staging and dS^T
            (dk_smem2, dv_smem2), (dq_smem2, ds_smem3) = out_smem
        else:
            (dk_smem2, dv_smem2), dq_smem2, ds_smem3 = out_smem, None, None
        batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("wg")
        cta_base = lax.axis_index("kv_seq") * (w * bkv)   # causal: the heaviest (first) tiles first
        cta_i0 = first_q_block(cta_base)
        q_end = n_qb                                      # query blocks [cta_i0, q_end) are streamed per head
        if has_seg:        # every warpgroup (the producer too) reads the tile's document span: its query blocks
            doc_first, doc_end = document_blocks(span_ref, span_smem, span_bar, batch=batch,
                                                 tile=lax.axis_index("kv_seq"), wg=wg, block=bq)
            cta_i0 = jnp.maximum(cta_i0, doc_first)
            q_end = jnp.maximum(jnp.minimum(q_end, doc_end), cta_i0)
        per_head = q_end - cta_i0                                   # query blocks per head of the group
        total = group * per_head

        @pl.when(wg < w)
        def _compute():
            """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register
            state set up here; splitting it would only pass those around."""
            plgpu.set_max_registers(DKV_COMPUTE_REGS, action="increase")
            k_smem, v_smem, dk_smem, dv_smem = k_smem2.at[wg], v_smem2.at[wg], dk_smem2.at[wg], dv_smem2.at[wg]
            zero_smem[wg] = jnp.int32(0)                 # see opaque_zero
            # Interpret mode stages register operands ([bkv, bq], 16-bit) here; with fuse_dq in the dS^T buffer.
            a_smem = a_smem2.at[wg] if interpret and not fuse_dq else None
            kv_base = cta_base + wg * bkv
            sl = (batch, pl.ds(kv_base, bkv), kv_head)
            copies = ((k_ref.at[sl], k_smem), (v_ref.at[sl], v_smem), (sc_ref.at[batch, kv_head], sc_smem2.at[wg]))
            if has_seg:
                copies += ((seg_ref.at[batch, pl.ds(kv_base, bkv)], kseg_smem2.at[wg]),)
            for i, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, own_bar.at[wg * len(copies) + i])
            for i in range(len(copies)):
                plgpu.barrier_wait(own_bar.at[wg * len(copies) + i])
            c = plgpu.load(sc_smem2.at[wg, 0, pl.ds(0, bq)], (), layout=cols)
            dk_mult = plgpu.load(sc_smem2.at[wg, 1, pl.ds(0, bkv)], (), layout=rows)
            dv_mult = plgpu.load(sc_smem2.at[wg, 2, pl.ds(0, bkv)], (), layout=rows)
            k_seg = plgpu.load(kseg_smem2.at[wg], (), layout=rows) if has_seg else None
            # Split dq: both warpgroups visit the same query blocks (the later one's first is fully masked).
            wg_i0 = cta_i0 if split else jnp.clip(first_q_block(kv_base), cta_i0, q_end)
            # Query blocks starting at or after kv_base + bkv see every key of this warpgroup: no mask. Without
            # causal masking, only a warpgroup holding padded keys masks (all its blocks).
            if causal:
                unmasked_from = jnp.minimum(lax.div(kv_base + bkv + (bq - 1), jnp.int32(bq)), jnp.int32(n_qb))
            elif ragged:
                unmasked_from = jnp.where(kv_base + bkv > seq_len, jnp.int32(n_qb), jnp.int32(0))
            else:
                unmasked_from = 0

            def wait_inputs(slot):
                for bars_ in (q_bar, do_bar, lse_bar, delta_bar) + ((qseg_bar,) if has_seg else ()):
                    plgpu.barrier_wait(bars_.at[slot])

            def slot_of(g, i):
                return lax.rem(g * per_head + i - cta_i0, jnp.int32(slots))

            def step(i, carry, g, masked: bool):
                dk, dv = carry
                slot = slot_of(g, i)
                wait_inputs(slot)
                # K and V (and the mask's key positions) through an opaque 0, so that their wgmma descriptors are
                # computed here rather than hoisted and spilled: dk, dv, S^T and dP^T leave no room for them.
                zero = opaque_zero(zero_smem, wg)
                k_smem, v_smem = k_smem2.at[wg + zero], v_smem2.at[wg + zero]
                st, dpt = mm_pair(k_smem, q_smem.at[slot].transpose((1, 0)), v_smem,
                                  do_smem.at[slot].transpose((1, 0)), (bkv, bq))
                lse = plgpu.load(lse_smem.at[slot], (), layout=cols)
                pt = jnp.exp2(st * col_of(c, bkv) - col_of(lse, bkv))
                if masked:
                    k_pos = (kv_base + zero) + plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0,
                                                                      layout=plgpu.Layout.WGMMA)
                    vis = None
                    if causal:
                        q_pos = i * bq + plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                        vis = q_pos >= k_pos
                    elif ragged:
                        vis = k_pos < seq_len
                    if has_seg:
                        q_seg = plgpu.load(qseg_smem.at[slot], (), layout=cols)
                        same = row_of(k_seg, bq) == col_of(q_seg, bkv)
                        vis = same if vis is None else jnp.logical_and(vis, same)
                    pt = jnp.where(vis, pt, 0.0)
                delta = plgpu.load(delta_smem.at[slot], (), layout=cols)
                dst = (pt * (dpt - col_of(delta, bkv))).astype(cdt)
                if not fuse_dq:
                    dv = mma_into(dv, pt.astype(cdt), do_smem.at[slot], a_smem)
                    dk = mma_into(dk, dst, q_smem.at[slot], a_smem)
                    plgpu.barrier_arrive(free.at[slot])
                    return dk, dv
                # dV += P^T dO and dK += dS^T Q both take their A operand from registers and run together, while
                # dS^T goes to shared memory: there it is the A operand (transposed) of dQ_i = dS K, which is added
                # into the fp32 dq accumulator in global memory by a TMA reduce-add.
                ds_smem = ds_smem3.at[lax.rem(g * per_head + i - cta_i0, jnp.int32(n_ds)), wg]
                if interpret:                   # register operands are staged through ds_smem there; dS^T last
                    dv = mma_into(dv, pt.astype(cdt), do_smem.at[slot], ds_smem)
                    dk = mma_into(dk, dst, q_smem.at[slot], ds_smem)
                else:
                    def dv_dk(refs):
                        dv_ref, dk_ref = refs
                        plgpu.wgmma(dv_ref, pt.astype(cdt), do_smem.at[slot])
                        plgpu.wgmma(dk_ref, dst, q_smem.at[slot])
                        ds_smem[...] = dst
                        plgpu.commit_smem()
                    dv, dk = pl.run_state(dv_dk)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                plgpu.barrier_arrive(free.at[slot])         # q / dO of this slot are no longer read
                head = kv_head * group + g
                if split:                       # both dS^T of this block are written (the other buffer is free)
                    plgpu.barrier_arrive(ds_ready)
                    plgpu.barrier_wait(ds_ready)
                    buf = lax.rem(g * per_head + i - cta_i0, jnp.int32(n_ds))
                    for half in range(w):
                        pl.when(wg == half)(functools.partial(dq_half, i, head, buf, half, zero))
                else:
                    dq_out(mm(ds_smem.transpose((1, 0)), k_smem, (bq, d)), i, head, pl.ds(0, d))
                return dk, dv

            def dq_half(i, head, buf, half, zero):
                """dQ_i[:, half] = sum over both warpgroups' keys of dS K[:, half], reduce-added."""
                cols_ = pl.ds(half * dq_cols, dq_cols)

                def body(acc_ref):
                    for j in range(w):
                        plgpu.wgmma(acc_ref, ds_smem3.at[buf, j].transpose((1, 0)), k_smem2.at[j + zero, :, cols_])
                    return acc_ref[...]
                dq_out(pl.run_scoped(body, plgpu.ACC((bq, dq_cols), jnp.float32)), i, head, cols_)

            def dq_out(dq, i, head, cols_):
                dq_smem = dq_smem2.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous block's reduce has read dq_smem
                dq_smem[...] = dq
                plgpu.commit_smem()
                q_rows = (batch, pl.ds(i * bq, bq), head, cols_)
                if interpret:                   # the interpreter has no reduce-add: one partial sum per warpgroup
                    plgpu.copy_smem_to_gmem(dq_smem, dq_acc_ref.at[(lax.axis_index("kv_seq") * w + wg, *q_rows)])
                else:
                    plgpu.copy_smem_to_gmem(dq_smem, dq_acc_ref.at[q_rows], reduction_op="add")

            def release(i, _, g):                  # blocks only the other warpgroup's keys see
                slot = slot_of(g, i)
                wait_inputs(slot)
                plgpu.barrier_arrive(free.at[slot])

            def head_body(g, carry):
                if causal:
                    lax.fori_loop(cta_i0, wg_i0, functools.partial(release, g=g), None)
                if has_seg:                         # segment ids mask every block
                    return lax.fori_loop(wg_i0, q_end, functools.partial(step, g=g, masked=True), carry)
                if causal or ragged:
                    carry = lax.fori_loop(wg_i0, unmasked_from, functools.partial(step, g=g, masked=True), carry)
                return lax.fori_loop(unmasked_from, n_qb, functools.partial(step, g=g, masked=False), carry)

            zeros = plgpu.layout_cast(jnp.full((bkv, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
            if fuse_dq:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # dq_smem's memory is dk_smem's / dv_smem's
            dk_smem[...] = (dk * row_of(dk_mult, d)).astype(out_dtype)
            dv_smem[...] = (dv * row_of(dv_mult, d)).astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[sl])
            plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[sl])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == w)
        def _producer():
            plgpu.set_max_registers(DKV_PRODUCER_REGS, action="decrease")

            def load(t, slot):
                g = lax.div(t, per_head)
                i = cta_i0 + lax.rem(t, per_head)
                head = kv_head * group + g
                blk = (batch, pl.ds(i * bq, bq), head)
                stat = (batch, head, pl.ds(i * bq, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[blk], q_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[blk], do_smem.at[slot], do_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[stat], lse_smem.at[slot], lse_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[stat], delta_smem.at[slot], delta_bar.at[slot])
                if has_seg:
                    plgpu.copy_gmem_to_smem(seg_ref.at[batch, pl.ds(i * bq, bq)], qseg_smem.at[slot],
                                            qseg_bar.at[slot])

            for s in range(slots):
                pl.when(s < total)(functools.partial(load, jnp.int32(s), s))

            def refill(t, _):
                slot = lax.rem(t, jnp.int32(slots))
                plgpu.barrier_wait(free.at[slot])
                load(t, slot)
            lax.fori_loop(jnp.int32(slots), total, refill, None)

            def drain(t, _):
                plgpu.barrier_wait(free.at[lax.rem(t, jnp.int32(slots))])
            lax.fori_loop(jnp.maximum(total - slots, 0), total, drain, None)

    def entry(*refs):                   # q, k, v, do, lse, delta, sc, [seg, span,] [dq_acc,] dk, dv
        kv = (plgpu.SMEM((w, bkv, d), cdt, transforms=TILED), plgpu.SMEM((w, bkv, d), cdt, transforms=TILED))
        out = (plgpu.SMEM((w, bkv, d), out_dtype, transforms=TILED),
               plgpu.SMEM((w, bkv, d), out_dtype, transforms=TILED))
        if fuse_dq:
            out = plgpu.RefUnion(out, (plgpu.SMEM((w, bq, dq_cols), jnp.float32, transforms=TILED_F32),
                                       plgpu.SMEM((n_ds, w, bkv, bq), cdt, transforms=TILED)))
        smem = (kv, out,
                plgpu.SMEM((slots, bq, d), cdt, transforms=TILED), plgpu.SMEM((slots, bq, d), cdt, transforms=TILED),
                plgpu.SMEM((slots, bq), jnp.float32), plgpu.SMEM((slots, bq), jnp.float32),
                plgpu.SMEM((w, 3, width), jnp.float32),
                plgpu.SMEM((w, bkv, bq), cdt, transforms=TILED) if interpret and not fuse_dq else None,
                plgpu.SMEM((w, bkv), jnp.int32) if has_seg else None,
                plgpu.SMEM((slots, bq), jnp.int32) if has_seg else None,
                plgpu.SMEM((w + 1, SPAN_WIDTH), jnp.int32) if has_seg else None,
                plgpu.SMEM((w,), jnp.int32))
        bars = (tuple(plgpu.Barrier(num_barriers=slots) for _ in range(4))
                + (plgpu.Barrier(num_barriers=(4 if has_seg else 3) * w),
                   plgpu.Barrier(num_barriers=slots) if has_seg else None,
                   plgpu.Barrier(num_arrivals=w) if split else None,
                   plgpu.Barrier(num_barriers=w + 1) if has_seg else None))
        pl.run_scoped(lambda *scr: kernel(*refs, scr), smem, bars,
                      plgpu.Barrier(num_arrivals=w, num_barriers=slots), collective_axes="wg")

    kv_type = jax.ShapeDtypeStruct(k.shape, out_dtype)
    operands = (q, k, v, do, lse, delta, sc_rows.astype(jnp.float32)) + (
        (seg, span_rows(seg, w * bkv)) if has_seg else ())
    params = dict(compiler_params=plgpu.CompilerParams(approx_math=True))
    if interpret:
        params["interpret"] = mosaic_interpret_params()
    if not fuse_dq:
        dk, dv = plgpu.kernel(entry, out_type=(kv_type, kv_type), grid=(kvh, n_kv_tiles, b),
                              grid_names=("kv_heads", "kv_seq", "batch"), num_threads=w + 1, thread_name="wg",
                              kernel_name="flash_attention_mosaic_dkv", **params)(*operands)
        return None, dk, dv
    # The dq accumulator is a zero-initialised fp32 buffer the kernel adds into in place: a Ref operand, inside
    # pl.run_state so no Ref escapes (`pl.kernel` rather than `plgpu.kernel`, whose batching wrapper takes no
    # Refs). dk and dv are written through Refs as well.
    acc_shape = ((n_kv_tiles * w,) if interpret else ()) + q.shape
    mesh = plgpu.Mesh(grid=(kvh, n_kv_tiles, b), grid_names=("kv_heads", "kv_seq", "batch"), num_threads=w + 1,
                      thread_name="wg", kernel_name="flash_attention_mosaic_dkv_dq")
    launch = pl.kernel(entry, out_type=(), mesh=mesh, **params)
    dq_acc, dk, dv = pl.run_state(lambda refs: launch(*operands, *refs))(
        (jnp.zeros(acc_shape, jnp.float32), jnp.zeros(k.shape, out_dtype), jnp.zeros(k.shape, out_dtype)))
    return (dq_acc.sum(0) if interpret else dq_acc), dk, dv


def _fold_vmap_into_batch(dkv, *, has_seg: bool):
    """dkv(q, k, v, do, lse, delta, sc, seg) under jax.vmap (the pipeline vmaps stages): every operand and result
    leads with the batch dim and batch rows are independent, so a vmapped axis folds into it. `pl.kernel`, which
    the fused kernel needs for its in-place accumulator, has no batching rule of its own."""
    @jax.custom_batching.custom_vmap
    def run(*args):
        return dkv(*args[:7], args[7] if has_seg else None)

    @run.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args, in_batched)]
        outs = run(*(a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in args))
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return run


def mosaic_backward(q, k, v, lse, delta, do, sc, seg=None, *, causal: bool, seq_len: int, block_q: int, block_kv: int,
                    slots: int, out_dtype, interpret: bool, fuse_dq: bool = True):
    """-> (dq, dk, dv) in out_dtype. sp must be a multiple of 2 * block_q and 2 * block_kv.

    fuse_dq: dq from the dk/dv kernel (dS in shared memory, TMA reduce-add into an fp32 accumulator; five matmuls
    per block pair instead of seven, the sum order non-deterministic) rather than a dq kernel of its own."""
    sp = q.shape[1]
    assert sp % (COMPUTE_WGS * block_q) == 0 and sp % (COMPUTE_WGS * block_kv) == 0, (sp, block_q, block_kv)
    kw = dict(causal=causal, seq_len=seq_len, bq=block_q, bkv=block_kv, slots=slots, out_dtype=out_dtype,
              interpret=interpret)
    if fuse_dq:
        fused = _fold_vmap_into_batch(functools.partial(_dkv, fuse_dq=True, **kw), has_seg=seg is not None)
        dq_acc, dk, dv = fused(q, k, v, do, lse, delta, sc, *([] if seg is None else [seg]))
        group = q.shape[2] // k.shape[2]
        mult = jnp.repeat(sc[..., 1], group, axis=1)                     # [b, h]: dq's power-of-two multiplier
        return (dq_acc * mult[:, None, :, None]).astype(out_dtype), dk, dv
    dq = dq_kernel(q, k, v, do, lse, delta, sc, seg, **kw)
    if interpret:
        # Mosaic GPU's interpreter simulates one GPU in global state: two kernels interpreted at once (XLA runs
        # independent ops concurrently) deadlock. Make dk/dv wait for dq.
        dq, q, k, v, do, lse, delta, sc, seg = lax.optimization_barrier((dq, q, k, v, do, lse, delta, sc, seg))
    _, dk, dv = _dkv(q, k, v, do, lse, delta, sc, seg, fuse_dq=False, **kw)
    return dq, dk, dv
