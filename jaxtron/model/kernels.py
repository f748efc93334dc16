"""The one door from jaxtron to ``pallas_kernels``: the kernels the model runs (flash attention, fused RoPE and
SwiGLU, each per shard under the mesh; the MoE grouped matmul), and :func:`check`, what :mod:`jaxtron.preflight`
asks about them (head dims, dtypes, platforms, the Mosaic interpreter's limits). No other jaxtron
module imports ``pallas_kernels``; ``pallas_kernels`` is imported here only when a kernel is used or checked,
so a run that selects none loads none of them."""

from __future__ import annotations

import functools
from typing import Optional

from jaxtron.config.schema import require
from jaxtron.config.model_schema import compute_dtype, head_dim
from jaxtron.parallel.sharding import devices_are_cpu, per_shard

# ``interpret=devices_are_cpu()`` below is read from the mesh the kernel is traced under, not from the model's
# ``Matmuls``: interpreting a Pallas kernel is a property of the devices it runs on (a kernel cannot run
# compiled on CPUs), not a choice of numerics.
# The flash kernel masks causally by index, so each device runs it on whole sequences: batch and heads split,
# the sequence not (attention over a split sequence is jaxtron.parallel.ring_attention's, with its own names).
WHOLE_SEQ_Q_NAMES = ("act_batch", None, "act_heads", None)
WHOLE_SEQ_KV_NAMES = ("act_batch", None, "act_kv_heads", None)


def flash_attention(q, k, v, segment_ids, scale: float, backend: str = "triton", **kernel_kw):
    """``pallas_kernels.flash_attention`` (causal) run per shard: batch and heads split as the rules say, the
    sequence whole. ``backend``: 'triton' or 'mosaic'."""
    from pallas_kernels.flash_attention import flash_attention as kernel_fn

    interpret = devices_are_cpu()

    def kernel(q, k, v, segment_ids):
        return kernel_fn(q, k, v, causal=True, segment_ids=segment_ids, softmax_scale=scale, interpret=interpret,
                         backend=backend, **kernel_kw)

    seg_names = ("act_batch", None) if segment_ids is not None else None
    return per_shard(kernel, (WHOLE_SEQ_Q_NAMES, WHOLE_SEQ_KV_NAMES, WHOLE_SEQ_KV_NAMES, seg_names),
                     WHOLE_SEQ_Q_NAMES)(q, k, v, segment_ids)


def flash_piece(scale: float):
    """``flash(q, k, v, q_seg, kv_seg, causal) -> (out, lse)`` on one device's pieces (already inside a
    ``shard_map``): ``pallas_kernels.flash_attention_lse``, for attention split over the context axis."""
    from pallas_kernels.flash_attention_lse import flash_attention_lse

    interpret = devices_are_cpu()

    def flash(q, k, v, q_seg, kv_seg, causal: bool):
        return flash_attention_lse(q, k, v, causal=causal, segment_ids=q_seg,
                                   kv_segment_ids=None if q_seg is None else kv_seg, softmax_scale=scale,
                                   interpret=interpret)

    return flash


def rope(q, k, positions, inv_freq):
    """The fused q/k RoPE kernel (``pallas_kernels.rope.apply_rope``), per shard."""
    import jax.numpy as jnp
    from pallas_kernels.rope import apply_rope as fused_rope

    q_names = ("act_batch", "act_seq", "act_heads", None)
    k_names = ("act_batch", "act_seq", "act_kv_heads", None)
    kernel = functools.partial(fused_rope, interpret=devices_are_cpu())
    return per_shard(kernel, (q_names, k_names, ("act_batch", "act_seq"), (None,)),
                     [q_names, k_names])(q, k, positions.astype(jnp.int32), inv_freq)


def swiglu(gate, up):
    """silu(gate) * up with the fused kernel (``pallas_kernels.swiglu``), per shard."""
    from pallas_kernels.swiglu import swiglu as fused_swiglu

    names = ("act_batch", "act_seq", "act_mlp")
    return per_shard(functools.partial(fused_swiglu, interpret=devices_are_cpu()), (names, names), names)(gate, up)


def gmm(lhs, rhs, group_sizes):
    """The grouped matmul of dropless MoE dispatch (``pallas_kernels.grouped_matmul.gmm``), fp32 output: rows
    of lhs sorted by group, group g multiplied by rhs[g]. Not per shard: dropless dispatch sorts the (token,
    expert) assignments of the whole batch, so under a mesh every device holds all the sorted rows (with
    ragged_dot too), and XLA runs the kernel on whole, gathered operands on each device. That is exact but not
    split across devices; with expert parallelism (``jaxtron.parallel.expert``) each rank runs it on the rows
    sent to its own experts."""
    import jax.numpy as jnp
    from pallas_kernels.grouped_matmul import gmm as grouped_matmul

    return grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, interpret=devices_are_cpu())


def blockwise_gemm(impl: str, block: int):
    """``gemm(a, a_scale, b, b_scale, out_dtype)``: the block-scaled FP8 matmul of ``model.fp8=blockwise``
    (``pallas_kernels.fp8_blockwise``; scales per ``block`` of the contraction). ``impl`` 'pallas': the Triton
    kernel (interpret mode on CPU), run on each device's blocks by the caller; 'xla': its jnp reference, the
    same sums in XLA's ops."""
    from pallas_kernels.fp8_blockwise import blockwise_matmul, blockwise_matmul_reference

    if impl == "pallas":
        return lambda a, sa, b, sb, out_dtype: blockwise_matmul(a, sa, b, sb, block=block, out_dtype=out_dtype,
                                                                interpret=devices_are_cpu())
    return lambda a, sa, b, sb, out_dtype: blockwise_matmul_reference(a, sa, b, sb, block=block, out_dtype=out_dtype)


def padded_head_dim(d: int, implementation: str) -> int:
    """The head width an attention kernel runs MLA's d-wide q/k heads at: the Triton kernel ('pallas') takes
    powers of two, so DeepSeek-V3's 192 runs at 256; the others take d. Zero channels added to q, k and v
    change no score (the softmax scale is passed) and come out as zero channels, sliced off."""
    return 1 << (d - 1).bit_length() if implementation == "pallas" else d


def check(cfg, platform: Optional[str] = None, *, num_devices: int = 1, micro_batch_size: Optional[int] = None,
          tensor: int = 1) -> None:
    """Raise :class:`ConfigError` (one line naming the field) if the kernels ``cfg.model`` selects cannot run:
    head dims and dtypes always; with ``platform`` ('cpu', 'gpu', ...) the platform, and for the Mosaic
    interpreter on CPU its thread and memory limits for ``micro_batch_size`` rows per data-parallel replica and
    heads split ``tensor`` ways over ``num_devices`` devices."""
    m = cfg.model
    # MLA's q/k heads are qk_nope_head_dim + qk_rope_head_dim wide; v is padded to that for the kernels, and all
    # three to the Triton kernel's width (padded_head_dim)
    d = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim if m.mla.kv_lora_rank else head_dim(m)
    if m.mla.kv_lora_rank:
        d = padded_head_dim(d, m.attention_impl)
    if m.attention_impl == "mosaic":
        from pallas_kernels.flash_attention_mosaic import MOSAIC_HEAD_DIMS

        require(d in MOSAIC_HEAD_DIMS, "model.attention_impl",
               f"'mosaic' supports head_dim {MOSAIC_HEAD_DIMS}, the model has {d}; use 'pallas'")
        require(m.dtype != "float32", "model.attention_impl",
               "'mosaic' computes in bf16/fp16 (wgmma has no IEEE fp32); model.dtype=float32 needs 'pallas'")
    if m.attention_impl == "pallas":
        from pallas_kernels.flash_attention import head_dim_supported

        require(head_dim_supported(d), "model.attention_impl",
               f"'pallas' needs head_dim a power of two >= 16 (64, 128, 256), the model has {d}; "
               "use 'xla'")
    if m.rope_impl == "pallas":
        from pallas_kernels.rope import head_dim_supported as rope_head_dim_supported

        require(rope_head_dim_supported(head_dim(m)), "model.rope_impl",
               f"'pallas' needs head_dim/2 a power of two (head_dim 64, 128, 256), the model has {head_dim(m)}; "
               "use 'xla'")
    if platform is None:
        return
    if m.attention_impl == "cudnn":
        require(platform in ("gpu", "cuda"), "model.attention_impl",
               f"'cudnn' needs an NVIDIA GPU; the devices here are {platform!r} (use model.attention_impl=xla)")
    for name in ("attention_impl", "rope_impl", "mlp_impl", "moe.gmm_impl"):
        impl = functools.reduce(getattr, name.split("."), m)
        require(impl != "pallas" or platform in ("gpu", "cuda", "cpu"), f"model.{name}",
               f"'pallas' kernels are Triton (NVIDIA GPU; interpret mode on CPU), not {platform!r}")
    if m.attention_impl != "mosaic":
        return
    require(platform in ("gpu", "cuda", "cpu"), "model.attention_impl",
           f"'mosaic' is a Mosaic GPU kernel (NVIDIA Hopper; interpret mode on CPU), not {platform!r}")
    if platform == "cpu":
        import jax
        from jax.experimental.pallas import mosaic_gpu as plgpu

        require(hasattr(plgpu, "InterpretGPUParams"), "model.attention_impl",
               f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which jax {jax.__version__} lacks "
               "(jax >= 0.11); use 'pallas'")
    require(compute_dtype(m) != "float32", "model.dtype",
           "float32 compute (model.dtype=auto on CPU) cannot use attention_impl='mosaic'; set model.dtype=bfloat16")
    if platform == "cpu" and not m.deterministic_attention:
        from pallas_kernels.flash_attention import INTERPRET_DQ_BYTES, interpret_dq_bytes

        seq = -(-cfg.data.seq_len // 128) * 128
        need = interpret_dq_bytes(micro_batch_size, seq, m.num_heads // tensor, d)
        require(need <= INTERPRET_DQ_BYTES, "model.deterministic_attention",
               f"'mosaic' on CPU (interpreted) sums its fused dq through {need / 2**30:.1f} GiB of partial sums at "
               f"data.seq_len={cfg.data.seq_len}; set model.deterministic_attention=true or a shorter data.seq_len")
    if platform == "cpu":
        from pallas_kernels.mosaic_helpers import INTERPRET_THREADS, interpret_threads

        require(num_devices == 1, "model.attention_impl",
               f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which simulates one GPU per process: kernels "
               f"interpreted on {num_devices} CPU devices at once trip over each other's barriers; train on one "
               "device (jaxtron.Trainer(cfg, devices=jax.devices()[:1])) or use 'pallas'")
        require(interpret_threads() >= INTERPRET_THREADS, "model.attention_impl",
               f"'mosaic' on CPU needs {INTERPRET_THREADS} XLA CPU threads for Mosaic GPU's interpreter and XLA "
               f"has {interpret_threads()} here (max of cores and CPU devices), so it would deadlock; use "
               "'pallas'")
