"""Standalone Pallas GPU kernels, importable without jaxtron; each has a plain jnp reference.

* ``pallas_kernels.rope``: rotary embedding of q and k (positions, Llama-3.1 scaling), forward + backward.
* ``pallas_kernels.swiglu``: ``silu(gate) * up``, forward + backward.
* ``pallas_kernels.grouped_matmul``: ``gmm``, the grouped matmul of dropless MoE (``jax.lax.ragged_dot``'s
  semantics), forward + backward.
* ``pallas_kernels.flash_attention``: causal / sliding-window / packed-segment attention with GQA, forward +
  backward (Pallas Triton backend; ``backend="mosaic"``: Mosaic GPU kernels for Hopper: causal or full
  attention, segment ids, in ``flash_attention_mosaic`` and ``flash_attention_mosaic_bwd``).
* ``pallas_kernels.flash_attention_lse``: the same kernels returning the log-sum-exp too, differentiable through
  it, on query and key pieces with their own segment ids (the pieces of a context-parallel sequence).

On CPU the kernels run in Pallas interpret mode (slow, exact; the Mosaic GPU ones need jax >= 0.11)."""

from .flash_attention import flash_attention, flash_attention_reference

__all__ = ["flash_attention", "flash_attention_reference"]
