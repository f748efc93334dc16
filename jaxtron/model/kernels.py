"""(Placeholder written by the lead while helper-1 builds the real kernel boundary: the kernel checks moved out
of config.py, unchanged. helper-1: this file is yours; replace it.)"""

from __future__ import annotations

from typing import Optional

from jaxtron.config.schema import ConfigError, compute_dtype, head_dim


def _check(cond, field, msg):
    if not cond:
        raise ConfigError(field, msg)


def check(cfg, platform: Optional[str] = None, *, num_devices: int = 1, micro_batch_size: Optional[int] = None,
          tensor: int = 1) -> None:
    m = cfg.model
    if m.attention_impl == "mosaic":
        from pallas_kernels.flash_attention_mosaic import MOSAIC_HEAD_DIMS

        _check(head_dim(m) in MOSAIC_HEAD_DIMS, "model.attention_impl",
               f"'mosaic' supports head_dim {MOSAIC_HEAD_DIMS}, the model has {head_dim(m)}; use 'pallas'")
        _check(m.dtype != "float32", "model.attention_impl",
               "'mosaic' computes in bf16/fp16 (wgmma has no IEEE fp32); model.dtype=float32 needs 'pallas'")
    if m.attention_impl == "pallas":
        from pallas_kernels.flash_attention import head_dim_supported

        _check(head_dim_supported(head_dim(m)), "model.attention_impl",
               f"'pallas' needs head_dim a power of two >= 16 (64, 128, 256), the model has {head_dim(m)}; "
               "use 'xla'")
    if m.rope_impl == "pallas":
        from pallas_kernels.rope import head_dim_supported as rope_head_dim_supported

        _check(rope_head_dim_supported(head_dim(m)), "model.rope_impl",
               f"'pallas' needs head_dim/2 a power of two (head_dim 64, 128, 256), the model has {head_dim(m)}; "
               "use 'xla'")
    if platform is None:
        return
    if m.attention_impl == "cudnn":
        _check(platform in ("gpu", "cuda"), "model.attention_impl",
               f"'cudnn' needs an NVIDIA GPU; the devices here are {platform!r} (use model.attention_impl=xla)")
    for name in ("attention_impl", "rope_impl", "mlp_impl"):
        _check(getattr(m, name) != "pallas" or platform in ("gpu", "cuda", "cpu"), f"model.{name}",
               f"'pallas' kernels are Triton (NVIDIA GPU; interpret mode on CPU), not {platform!r}")
    if m.attention_impl != "mosaic":
        return
    _check(platform in ("gpu", "cuda", "cpu"), "model.attention_impl",
           f"'mosaic' is a Mosaic GPU kernel (NVIDIA Hopper; interpret mode on CPU), not {platform!r}")
    if platform == "cpu":
        import jax
        from jax.experimental.pallas import mosaic_gpu as plgpu

        _check(hasattr(plgpu, "InterpretGPUParams"), "model.attention_impl",
               f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which jax {jax.__version__} lacks "
               "(jax >= 0.11); use 'pallas'")
    _check(compute_dtype(m) != "float32", "model.dtype",
           "float32 compute (model.dtype=auto on CPU) cannot use attention_impl='mosaic'; set model.dtype=bfloat16")
    if platform == "cpu" and not m.deterministic_attention:
        from pallas_kernels.flash_attention import INTERPRET_DQ_BYTES, interpret_dq_bytes

        seq = -(-cfg.data.seq_len // 128) * 128
        need = interpret_dq_bytes(micro_batch_size, seq, m.num_heads // tensor, head_dim(m))
        _check(need <= INTERPRET_DQ_BYTES, "model.deterministic_attention",
               f"'mosaic' on CPU (interpreted) sums its fused dq through {need / 2**30:.1f} GiB of partial sums at "
               f"data.seq_len={cfg.data.seq_len}; set model.deterministic_attention=true or a shorter data.seq_len")
    if platform == "cpu":
        from pallas_kernels.flash_attention_mosaic import INTERPRET_THREADS, interpret_threads

        _check(num_devices == 1, "model.attention_impl",
               f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which simulates one GPU per process: kernels "
               f"interpreted on {num_devices} CPU devices at once trip over each other's barriers; train on one "
               "device (jaxtron.Trainer(cfg, devices=jax.devices()[:1])) or use 'pallas'")
        _check(interpret_threads() >= INTERPRET_THREADS, "model.attention_impl",
               f"'mosaic' on CPU needs {INTERPRET_THREADS} XLA CPU threads for Mosaic GPU's interpreter and XLA "
               f"has {interpret_threads()} here (max of cores and CPU devices), so it would deadlock; use "
               "'pallas'")
