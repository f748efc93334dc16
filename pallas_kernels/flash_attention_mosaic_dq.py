"""The Mosaic GPU dq kernel of the flash attention backward, used with ``fuse_dq=False``
(``model.deterministic_attention``): dQ from its own kernel, one CTA per query tile looping over the kv blocks,
so its summation order is fixed (the fused path reduce-adds dq from the dk/dv kernel instead). See
``flash_attention_mosaic_bwd`` for the shared design and the residual format."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import cdiv
from .mosaic_helpers import (COMPUTE_WGS, SPAN_WIDTH, TILED, col_of, kv_producer, kv_visibility, mm_pair, mma_into,
                             mosaic_interpret_params, over_kv_blocks, query_tile_kv_blocks, row_of, span_rows)


def dq_kernel(q, k, v, do, lse, delta, sc, seg, *, causal, seq_len, bq, bkv, slots, out_dtype, interpret):
    """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register state set
    up here; splitting it would only pass those around."""
    b, sp, h, d = q.shape
    group = h // k.shape[2]
    n_q_tiles = sp // (COMPUTE_WGS * bq)
    real_blocks = cdiv(seq_len, bkv)
    cdt = q.dtype
    rows = plgpu.Layout.WGMMA.reduce(1)
    # (logit multiplier, dq multiplier) per (batch, head) as TMA-able rows [b, h, 2, bq].
    sc_rows = jnp.broadcast_to(jnp.repeat(sc[..., :2], group, axis=1)[..., None], (b, h, 2, bq))

    has_seg = seg is not None

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, *rest):
        seg_ref, span_ref, dq_ref, scratch = rest if has_seg else (None, None, *rest)
        (q_smem2, do_smem2, dq_smem2, k_smem, v_smem, lse_smem2, delta_smem2, sc_smem2, a_smem2, qseg_smem2,
         kseg_smem, span_smem), bars, free = scratch
        k_bar, v_bar, in_bar, kseg_bar, span_bar = bars
        k_free, v_free = free
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        tile = n_q_tiles - 1 - lax.axis_index("q_seq")                             # heaviest tiles first
        cta_base = tile * (COMPUTE_WGS * bq)

        start, visible_blocks = query_tile_kv_blocks(
            (span_ref, span_smem, span_bar) if has_seg else None, batch=batch, tile=tile, wg=wg, causal=causal,
            block_kv=bkv, real_blocks=real_blocks)
        cta_steps = visible_blocks(cta_base + COMPUTE_WGS * bq)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem, dq_smem = q_smem2.at[wg], do_smem2.at[wg], dq_smem2.at[wg]
            a_smem = a_smem2.at[wg] if interpret else None
            q_base = cta_base + wg * bq
            steps = visible_blocks(q_base + bq)
            sl = (batch, pl.ds(q_base, bq), head)
            copies = ((q_ref.at[sl], q_smem), (do_ref.at[sl], do_smem),
                      (lse_ref.at[batch, head, pl.ds(q_base, bq)], lse_smem2.at[wg]),
                      (delta_ref.at[batch, head, pl.ds(q_base, bq)], delta_smem2.at[wg]),
                      (sc_ref.at[batch, head], sc_smem2.at[wg]))
            if has_seg:
                copies += ((seg_ref.at[batch, pl.ds(q_base, bq)], qseg_smem2.at[wg]),)
            for i, (src, dst) in enumerate(copies):            # all in flight at once, one barrier each
                plgpu.copy_gmem_to_smem(src, dst, in_bar.at[wg * len(copies) + i])
            for i in range(len(copies)):
                plgpu.barrier_wait(in_bar.at[wg * len(copies) + i])
            lse = plgpu.load(lse_smem2.at[wg], (), layout=rows)
            delta = plgpu.load(delta_smem2.at[wg], (), layout=rows)
            c = plgpu.load(sc_smem2.at[wg, 0], (), layout=rows)
            mult = plgpu.load(sc_smem2.at[wg, 1], (), layout=rows)
            q_seg = plgpu.load(qseg_smem2.at[wg], (), layout=rows) if has_seg else None

            def step(j, dq, masked: bool):
                slot = lax.rem(j - start, jnp.int32(slots))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                s, dp = mm_pair(q_smem, k_smem.at[slot].transpose((1, 0)), do_smem, v_smem.at[slot].transpose((1, 0)),
                                (bq, bkv))
                plgpu.barrier_arrive(v_free.at[slot])
                p = jnp.exp2(s * row_of(c, bkv) - row_of(lse, bkv))
                if masked:
                    vis = kv_visibility(q_base, j, block_q=bq, block_kv=bkv, causal=causal, seq_len=seq_len)
                    if has_seg:
                        plgpu.barrier_wait(kseg_bar.at[slot])
                        k_seg = plgpu.load(kseg_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
                        vis = jnp.logical_and(vis, row_of(q_seg, bkv) == col_of(k_seg, bq))
                    p = jnp.where(vis, p, 0.0)
                ds = p * (dp - row_of(delta, bkv))
                dq = mma_into(dq, ds.astype(cdt), k_smem.at[slot], a_smem)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            dq = over_kv_blocks(step, dq, steps=steps, q_base=q_base, causal=causal, has_seg=has_seg, block_kv=bkv,
                                seq_len=seq_len, start=start)
            if causal or has_seg:
                def release(j, _):
                    slot = lax.rem(j - start, jnp.int32(slots))
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])
                    if has_seg:
                        plgpu.barrier_wait(kseg_bar.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                lax.fori_loop(steps, cta_steps, release, None)
            dq_smem[...] = (dq * row_of(mult, d)).astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[sl])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_producer(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, batch=batch,
                        kv_head=lax.div(head, jnp.int32(group)), steps=cta_steps, slots=slots, block=bkv,
                        seg=(seg_ref, kseg_smem, kseg_bar) if has_seg else None, start=start)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, *rest):   # rest: [seg_ref, span_ref,] dq
        w = COMPUTE_WGS
        smem = (plgpu.SMEM((w, bq, d), cdt, transforms=TILED), plgpu.SMEM((w, bq, d), cdt, transforms=TILED),
                plgpu.SMEM((w, bq, d), out_dtype, transforms=TILED),
                plgpu.SMEM((slots, bkv, d), cdt, transforms=TILED), plgpu.SMEM((slots, bkv, d), cdt, transforms=TILED),
                plgpu.SMEM((w, bq), jnp.float32), plgpu.SMEM((w, bq), jnp.float32),
                plgpu.SMEM((w, 2, bq), jnp.float32),
                plgpu.SMEM((w, bq, bkv), cdt, transforms=TILED) if interpret else None,
                plgpu.SMEM((w, bq), jnp.int32) if has_seg else None,
                plgpu.SMEM((slots, bkv), jnp.int32) if has_seg else None,
                plgpu.SMEM((w + 1, SPAN_WIDTH), jnp.int32) if has_seg else None)
        bars = (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
                plgpu.Barrier(num_barriers=(6 if has_seg else 5) * w),
                plgpu.Barrier(num_barriers=slots) if has_seg else None,
                plgpu.Barrier(num_barriers=w + 1) if has_seg else None)
        free = (plgpu.Barrier(num_arrivals=w, num_barriers=slots),) * 2
        pl.run_scoped(lambda *scr: kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, *rest, scr),
                      smem, bars, free, collective_axes="wg")

    extra = {"interpret": mosaic_interpret_params()} if interpret else {}
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(q.shape, out_dtype), grid=(h, n_q_tiles, b),
                        grid_names=("heads", "q_seq", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
                        kernel_name="flash_attention_mosaic_dq", compiler_params=plgpu.CompilerParams(approx_math=True),
                        **extra,
                        )(q, k, v, do, lse, delta, sc_rows.astype(jnp.float32),
                          *([seg, span_rows(seg, COMPUTE_WGS * bq)] if has_seg else []))
