"""Standalone Pallas GPU kernels (flash attention, RoPE, SwiGLU), importable without jaxtron.

Empty until the kernels issue lands."""
