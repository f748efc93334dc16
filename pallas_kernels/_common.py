"""Shared helpers for the Pallas kernels (no jaxtron imports)."""

from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None -> True when JAX's default backend is the CPU (Pallas GPU kernels only run interpreted there)."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick_block(requested: int, size: int, name: str) -> int:
    """A power-of-two block (Triton needs power-of-two block shapes), clamped to the padded size."""
    if not isinstance(requested, int) or requested <= 0 or not is_pow2(requested):
        raise ValueError(f"{name} must be a positive power of two, got {requested!r}")
    return min(requested, next_pow2(size))


def check_backend(backend: str, impls: dict, fn: str) -> None:
    if backend not in impls:
        raise ValueError(f"{fn}: unknown backend {backend!r}; implemented: {sorted(impls)}")
