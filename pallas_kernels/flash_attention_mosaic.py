"""Flash attention forward as a Mosaic GPU (Hopper, sm_90a) kernel: TMA loads, wgmma, warp specialization.

This is the `backend="mosaic"` forward of `pallas_kernels.flash_attention`; `flash_attention_mosaic_bwd` holds
the backward (both backends' kernels share the residual format: log-sum-exp in the log2 domain [batch, heads,
seq] and O / s_v in fp16). The helpers below (`mm`, `mma_into`, `kv_producer`) serve both modules.
It takes the same compute operands as the Triton forward: q, k, v in fp16, already divided by their power-of-two
scales (see flash_attention's docstring), and the per-(batch, head) logit multiplier and s_v.

Design (FlashAttention-3's forward structure, written for Pallas' Mosaic GPU dialect):
  * One CTA per (head, 2 * block_q query rows, batch) with three warpgroups: two compute warpgroups own block_q
    rows each; the third issues TMA copies of K/V blocks into `max_steps` shared-memory slots and refills a slot
    once both compute warpgroups have released it (`k_free` / `v_free` barriers, two arrivals each).
  * Compute warpgroups: S = Q K^T by wgmma from shared memory into a register accumulator; online softmax in the
    log2 domain (exp2(s * c - m), c = softmax_scale * log2(e) * s_q * s_k); O += P V by wgmma with P (fp16) in
    registers and O carried as the accumulator (`pl.run_state`).
  * FlashAttention-3's schedule: block j's S = Q K_j^T and block j-1's O += P V are issued together (the carried
    O is rescaled up to block j-1's max, without P_{j-1} V_{j-1}), and the two warpgroups take turns issuing
    (`turn`, one barrier each), so one's softmax runs under the other's matmuls. S is waited for alone
    (`wgmma_accumulator_load(wait_n=1)`) so that block j's softmax could also run under this warpgroup's own
    P V; P_j turns 16-bit only after that wgmma is done (a register feeding a wgmma in flight makes ptxas
    serialize every wgmma). In the SASS, though, ptxas gives P_{j-1}'s registers to the softmax and so waits
    for P V first: that intra-warpgroup overlap is not realized (scripts/mosaic_sass.py --sass).
  * Causal: a warpgroup visits only the kv blocks up to its diagonal; blocks entirely below the diagonal run
    without building the mask. CTAs are launched heaviest (last query tile) first. The warpgroup with fewer
    blocks still releases the slots it skips so the producer never waits forever.
  * Padding: the wrapper pads seq to a multiple of lcm(2 * block_q, block_kv). Padded keys are masked by
    position in the one block that holds them (non-causal); under causal masking they are never visible to a
    real query. Padded query rows are computed and dropped.
  * GQA: the CTA for query head h loads kv head h // group; K/V are never repeated in memory.

Segment ids (packed documents): each K/V block brings its ids along (a small TMA copy into the same slot);
every visited block is then masked (same id, and causal; a masked logit is -inf, so P is exactly 0), and a row
with no visible key gets lse = +inf and output 0, as in the Triton kernels (only padded rows can have none).
Only the blocks where the CTA's document ids occur are visited (`segments.block_spans`, read by each
warpgroup from a 128-byte row: `document_blocks`): the producer and both compute warpgroups start at that
span's first block (`start`) and stop at its end.

Not in this backend (the wrapper refuses them with a clear error; the Triton backend has them): sliding
windows, fp32 inputs (wgmma has no IEEE fp32 mode), head_dim other than 64 or 128.

Interpret mode: Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`, JAX >= 0.11) has no `run_state` and
no register operand for wgmma, so with interpret=True P goes through a shared-memory buffer and P V lands in
a fresh accumulator that is added to O, one matmul at a time; everything else (the deferred P V, barriers,
turns, TMA slots, masks, softmax) is the same code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import cdiv
from .flash_attention_mosaic_bwd import bwd_smem_bytes
from .mosaic_helpers import (COMPUTE_WGS, SPAN_WIDTH, TILED, col_of, kv_producer, kv_visibility, mma_into,
                             mosaic_interpret_params, over_kv_blocks, query_tile_kv_blocks, row_of, span_rows)

__all__ = ["mosaic_forward", "check_mosaic", "MOSAIC_HEAD_DIMS"]

MOSAIC_HEAD_DIMS = (64, 128)
_SMEM_BYTES = 227 * 1024       # H100 shared memory per CTA
_NEG = -1e30                    # the running max's start (finite: a row that sees no key never makes inf - inf)
_RCP_LN2 = 1.0 / math.log(2.0)


def smem_bytes(head_dim: int, block_q: int, block_kv: int, max_steps: int, out_itemsize: int,
               interpret: bool) -> int:
    """Shared memory one CTA allocates (q, out, K/V slots, statistics; P only in interpret mode)."""
    q = COMPUTE_WGS * block_q * head_dim * 2
    out = COMPUTE_WGS * block_q * head_dim * out_itemsize
    kv = 2 * max_steps * block_kv * head_dim * 2
    stats = COMPUTE_WGS * 4 * block_q * 4 + max_steps * block_kv * 4      # incl. segment ids
    p = COMPUTE_WGS * block_q * block_kv * 2 if interpret else 0
    return q + out + kv + stats + p


def check_mosaic(*, head_dim: int, dtype, segment_ids, sliding_window, block_q: int, block_kv: int,
                 max_steps: int, interpret: bool, block_q_bwd: int = 64, block_kv_bwd: int = 64,
                 slots_bwd: int = 2, fuse_dq: bool = True) -> None:
    """Raise ValueError naming the argument the Mosaic GPU kernels cannot take."""
    if sliding_window is not None:
        raise ValueError("flash_attention(backend='mosaic') has no sliding_window; use backend='triton'")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"flash_attention(backend='mosaic') takes bfloat16 or float16 inputs, got {jnp.dtype(dtype)}"
                         " (wgmma has no IEEE fp32); use backend='triton' for float32")
    if head_dim not in MOSAIC_HEAD_DIMS:
        raise ValueError(f"flash_attention(backend='mosaic') supports head_dim {MOSAIC_HEAD_DIMS}, got {head_dim}")
    for name, value in (("block_q", block_q), ("block_k", block_kv), ("block_q_bwd", block_q_bwd),
                        ("block_k_bwd", block_kv_bwd)):
        if value % 64:
            raise ValueError(f"flash_attention(backend='mosaic'): {name} must be a multiple of 64, got {value}")
    if block_kv < block_q:
        raise ValueError(f"flash_attention(backend='mosaic'): block_k ({block_kv}) must be >= block_q ({block_q})")
    for name, value in (("num_stages", max_steps), ("num_stages_bwd", slots_bwd)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ValueError(f"flash_attention(backend='mosaic'): {name} (shared-memory slots) must be an int >= 2, "
                             f"got {value!r}")
    need = smem_bytes(head_dim, block_q, block_kv, max_steps, jnp.dtype(dtype).itemsize, interpret)
    if need > _SMEM_BYTES:
        raise ValueError(f"flash_attention(backend='mosaic'): block_q={block_q}, block_k={block_kv}, "
                         f"num_stages={max_steps} at head_dim {head_dim} need {need} bytes of shared memory "
                         f"(H100: {_SMEM_BYTES}); lower block_k or num_stages")
    need = bwd_smem_bytes(head_dim, block_q_bwd, block_kv_bwd, slots_bwd, jnp.dtype(dtype).itemsize, interpret,
                          fuse_dq)
    if need > _SMEM_BYTES:
        raise ValueError(f"flash_attention(backend='mosaic'): block_q_bwd={block_q_bwd}, block_k_bwd={block_kv_bwd}, "
                         f"num_stages_bwd={slots_bwd}{', fuse_dq' if fuse_dq else ''} at head_dim {head_dim} need {need} "
                         f"bytes of shared memory (H100: {_SMEM_BYTES}); lower the backward blocks or "
                         f"num_stages_bwd")


def mosaic_forward(q, k, v, sc, seg=None, *, causal: bool, seq_len: int, block_q: int, block_kv: int,
                   max_steps: int, out_dtype, residual: bool, interpret: bool):
    """q [b, sp, h, d], k/v [b, sp, kv_h, d] fp16 (scaled operands), sc [b, kv_h, 2] fp32 (logit multiplier in the
    log2 domain, s_v) -> (out [b, sp, h, d] out_dtype, lse [b, h, sp] fp32 log2 domain[, O / s_v fp16]).

    sp must be a multiple of 2 * block_q and of block_kv; seq_len (static) is the real length.

    Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register state set up
    here; splitting it would only pass those around."""
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    bq, bkv, n_steps = block_q, block_kv, max_steps
    assert sp % (COMPUTE_WGS * bq) == 0 and sp % bkv == 0, (sp, bq, bkv)
    n_q_tiles = sp // (COMPUTE_WGS * bq)
    real_blocks = cdiv(seq_len, bkv)                 # kv blocks holding at least one real key
    cdt = q.dtype
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # Per-(batch, head) scalars as rows a TMA copy can bring in: [b, h, 2, block_q] fp32 (c, s_v).
    sc_rows = jnp.broadcast_to(jnp.repeat(sc, group, axis=1)[..., None], (b, h, 2, bq)).astype(jnp.float32)

    has_seg = seg is not None

    def kernel(q_ref, k_ref, v_ref, sc_ref, *rest):
        """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register state
        set up here; splitting it would only pass those around."""
        seg_ref, span_ref, rest = (rest[0], rest[1], rest[2:]) if has_seg else (None, None, rest)
        out_ref, lse_ref = rest[:2]
        ores_ref = rest[2] if residual else None
        scratch = rest[-1]
        (q_smem2, o_smem2, k_smem, v_smem, sc_smem2, lse_smem2, p_smem2, qseg_smem2, kseg_smem, span_smem), bars, \
            (k_free, v_free), turn = scratch
        k_bar, v_bar, q_bar, sc_bar, qseg_bar, kseg_bar, span_bar = bars
        batch = lax.axis_index("batch")
        head = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        tile = n_q_tiles - 1 - lax.axis_index("q_seq")                             # heaviest tiles first
        cta_base = tile * (COMPUTE_WGS * bq)

        start, visible_blocks = query_tile_kv_blocks(
            (span_ref, span_smem, span_bar) if has_seg else None, batch=batch, tile=tile, wg=wg, causal=causal,
            block_kv=bkv, real_blocks=real_blocks)
        cta_steps = visible_blocks(cta_base + COMPUTE_WGS * bq)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            """Kernel body, kept whole: one GPU program whose warpgroups share the refs, barriers and register
            state set up here; splitting it would only pass those around."""
            plgpu.set_max_registers(232, action="increase")
            q_smem, o_smem, sc_smem, lse_smem = q_smem2.at[wg], o_smem2.at[wg], sc_smem2.at[wg], lse_smem2.at[wg]
            p_smem = p_smem2.at[wg] if interpret else None
            q_base = cta_base + wg * bq
            steps = visible_blocks(q_base + bq)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], q_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(sc_ref.at[batch, head], sc_smem, sc_bar.at[wg])
            if has_seg:
                plgpu.copy_gmem_to_smem(seg_ref.at[batch, pl.ds(q_base, bq)], qseg_smem2.at[wg], qseg_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(sc_bar.at[wg])
            if has_seg:
                plgpu.barrier_wait(qseg_bar.at[wg])
                q_seg = plgpu.load(qseg_smem2.at[wg], (), layout=row_layout)
            c = plgpu.load(sc_smem.at[0], (), layout=row_layout)
            s_v = plgpu.load(sc_smem.at[1], (), layout=row_layout)
            m0 = plgpu.layout_cast(jnp.full((bq,), _NEG, jnp.float32), row_layout)
            l0 = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
            acc0 = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            def kv_slot(j):
                return lax.rem(j - start, jnp.int32(n_steps))

            # Ping-pong: the warpgroups take turns issuing their matmuls (turn[wg], one arrival each), so one's
            # softmax runs while the other's matmuls do; warpgroup 1 hands warpgroup 0 the first turn.
            def my_turn():
                plgpu.barrier_wait(turn.at[wg])

            def pass_turn():
                plgpu.barrier_arrive(turn.at[1 - wg])

            def softmax(s, j, m, l, masked: bool):
                """(m, l, alpha, P in fp32) after kv block j's logits s (scaled by c on the way)."""
                if masked:
                    vis = kv_visibility(q_base, j, block_q=bq, block_kv=bkv, causal=causal, seq_len=seq_len)
                    if has_seg:
                        plgpu.barrier_wait(kseg_bar.at[kv_slot(j)])
                        k_seg = plgpu.load(kseg_smem.at[kv_slot(j)], (), layout=plgpu.Layout.WGMMA.reduce(0))
                        vis = jnp.logical_and(vis, row_of(q_seg, bkv) == col_of(k_seg, bq))
                    # -inf, so that exp2 makes P exactly 0 without keeping the mask: m starts finite (_NEG), so a
                    # row that sees no key of this block keeps m and gets alpha 1 and P 0.
                    s = jnp.where(vis, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * row_of(c, bkv) - row_of(m_new, bkv))
                return m_new, l * alpha + p.sum(axis=1), alpha, p

            def qk(slot, then):
                """S = Q K^T for the K in `slot`, fresh; then() runs while the wgmma is in flight."""
                def body(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    then()
                    return s_ref[...]
                return pl.run_scoped(body, plgpu.ACC((bq, bkv), jnp.float32))

            # FlashAttention-3's intra-warpgroup overlap: block j's S = Q K_j^T and the previous block's
            # O += P_{j-1} V_{j-1} are issued together, and block j's softmax runs while the latter is in flight.
            # The carry holds O rescaled up to block j-1's running max, without P_{j-1} V_{j-1}.
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
            plgpu.barrier_wait(k_bar.at[0])                 # every warpgroup visits at least one block
            my_turn()
            s = qk(0, pass_turn)
            plgpu.barrier_arrive(k_free.at[0])
            m, l, alpha, p = softmax(s, start if has_seg else jnp.int32(start), m0, l0, masked=True)  # exact

            def step(j, carry, masked: bool):
                acc, m, l, alpha, p16 = carry
                slot, prev = kv_slot(j), kv_slot(j - 1)
                acc = acc * row_of(alpha, d)                # O in units of block j-1's running max
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[prev])
                if interpret:                               # no register A operand, no run_state: one at a time
                    acc = mma_into(acc, p16, v_smem.at[prev], p_smem)
                    my_turn()
                    s = qk(slot, pass_turn)
                    plgpu.barrier_arrive(k_free.at[slot])
                    m, l, alpha, p = softmax(s, j, m, l, masked)
                else:
                    # P_j becomes 16-bit only after P_{j-1} V_{j-1} is done: registers feeding a wgmma must not be
                    # written while one is in flight, or ptxas serializes every wgmma (scripts/mosaic_sass.py).
                    def issue(refs):
                        acc_ref, m_ref, l_ref, alpha_ref, p_ref = refs

                        def body(s_ref):
                            my_turn()
                            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(acc_ref, p16, v_smem.at[prev])
                            pass_turn()
                            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # S only: P V still runs
                            plgpu.barrier_arrive(k_free.at[slot])
                            m_ref[...], l_ref[...], alpha_ref[...], p_ref[...] = softmax(
                                s, j, m_ref[...], l_ref[...], masked)
                        pl.run_scoped(body, plgpu.ACC((bq, bkv), jnp.float32))
                    p = jnp.zeros((bq, bkv), jnp.float32)   # replaced inside
                    acc, m, l, alpha, p = pl.run_state(issue)((plgpu.ACC.init(acc), m, l, alpha, p))
                plgpu.barrier_arrive(v_free.at[prev])
                return acc, m, l, alpha, p.astype(cdt)

            acc, m, l, alpha, p16 = over_kv_blocks(
                step, (acc0, m, l, alpha, p.astype(cdt)), steps=steps, q_base=q_base, causal=causal,
                has_seg=has_seg, block_kv=bkv, seq_len=seq_len, start=start + 1)
            last = kv_slot(steps - 1)                       # the last block's P V
            plgpu.barrier_wait(v_bar.at[last])
            acc = mma_into(acc * row_of(alpha, d), p16, v_smem.at[last], p_smem)
            plgpu.barrier_arrive(v_free.at[last])

            def release(j, _):                              # blocks only the other warpgroup needs
                slot = kv_slot(j)
                plgpu.barrier_wait(k_bar.at[slot])          # keeps this warpgroup's barrier phases in step
                plgpu.barrier_wait(v_bar.at[slot])
                if has_seg:
                    plgpu.barrier_wait(kseg_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                my_turn()
                pass_turn()
            if causal:
                lax.fori_loop(steps, cta_steps, release, None)
            pl.when(wg == 0)(my_turn)                       # warpgroup 1's last hand-over

            if has_seg:                                     # rows that saw no key: output 0, lse +inf
                empty = l == 0.0
                l = jnp.where(empty, 1.0, l)
            inv_l = 1.0 / l
            o = acc * row_of(inv_l, d)                        # in units of s_v
            o_smem[...] = (o * row_of(s_v, d)).astype(out_dtype)
            if residual:
                q_smem[...] = o.astype(cdt)                 # the matmuls reading q are done
            lse = m + jnp.log(l) * _RCP_LN2
            lse_smem[...] = jnp.where(empty, jnp.inf, lse) if has_seg else lse
            plgpu.commit_smem()
            rows = (batch, pl.ds(q_base, bq), head)
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[rows])
            if residual:
                plgpu.copy_smem_to_gmem(q_smem, ores_ref.at[rows])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_producer(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, batch=batch,
                        kv_head=lax.div(head, jnp.int32(group)), steps=cta_steps, slots=n_steps, block=bkv,
                        seg=(seg_ref, kseg_smem, kseg_bar) if has_seg else None, start=start)

    def entry(q_ref, k_ref, v_ref, sc_ref, *outs):       # outs: [seg_ref, span_ref,] out, lse[, o_res]
        smem = (
            plgpu.SMEM((COMPUTE_WGS, bq, d), cdt, transforms=TILED),
            plgpu.SMEM((COMPUTE_WGS, bq, d), out_dtype, transforms=TILED),
            plgpu.SMEM((n_steps, bkv, d), cdt, transforms=TILED),
            plgpu.SMEM((n_steps, bkv, d), cdt, transforms=TILED),
            plgpu.SMEM((COMPUTE_WGS, 2, bq), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, bq, bkv), cdt, transforms=TILED) if interpret else None,
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32) if has_seg else None,
            plgpu.SMEM((n_steps, bkv), jnp.int32) if has_seg else None,
            plgpu.SMEM((COMPUTE_WGS + 1, SPAN_WIDTH), jnp.int32) if has_seg else None,
        )
        seg_bars = ((plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=n_steps),
                     plgpu.Barrier(num_barriers=COMPUTE_WGS + 1)) if has_seg else (None, None, None))
        bars = (plgpu.Barrier(num_barriers=n_steps), plgpu.Barrier(num_barriers=n_steps),
                plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=COMPUTE_WGS), *seg_bars)
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=n_steps),) * 2
        pl.run_scoped(lambda *scr: kernel(q_ref, k_ref, v_ref, sc_ref, *outs, scr),
                      smem, bars, free, plgpu.Barrier(num_barriers=COMPUTE_WGS), collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((b, h, sp), jnp.float32)]
    if residual:
        out_type.append(jax.ShapeDtypeStruct(q.shape, cdt))
    extra = {"interpret": mosaic_interpret_params()} if interpret else {}
    outs = plgpu.kernel(
        entry,
        out_type=tuple(out_type),
        grid=(h, n_q_tiles, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="flash_attention_mosaic_fwd",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(q, k, v, sc_rows, *([seg, span_rows(seg, COMPUTE_WGS * bq)] if has_seg else []))
    return tuple(outs)
