"""jaxtron: Megatron-LM's capabilities rebuilt on JAX/XLA with SPMD sharding."""

__version__ = "0.1.0"
