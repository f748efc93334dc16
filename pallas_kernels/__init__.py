"""Standalone Pallas GPU kernels, importable without jaxtron; each has a plain jnp reference.

* ``pallas_kernels.rope``: rotary embedding of q and k (positions, Llama-3.1 scaling), forward + backward.
* ``pallas_kernels.swiglu``: ``silu(gate) * up``, forward + backward.

Flash attention is still to come. On CPU the kernels run in Pallas interpret mode (slow, exact)."""
