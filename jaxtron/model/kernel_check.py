"""Start-up check of the Pallas kernels a run selected, on its own devices, against the XLA reference.

The kernels are tested in interpret mode on CPU and compiled for an H100 without one, but a kernel can still
be wrong on a particular GPU, driver or JAX version (Mosaic GPU's register operands and in-place accumulators
have no interpreter at all). A wrong attention gradient does not crash: the loss just drifts. So before a run
compiles its train step on GPUs, :func:`check_kernels` runs each selected kernel (``model.attention_impl``
'pallas' or 'mosaic', ``model.rope_impl`` / ``model.mlp_impl`` / ``model.moe.gmm_impl`` 'pallas') forward and
backward on a small problem with the model's head layout (expert count) and compute dtype, and compares the
output and every gradient with the XLA implementation computed in fp32 from the same inputs. A relative error
(L2 norm of the difference over the reference's) above :data:`TOLERANCE` raises :class:`KernelCheckError`
naming the config field. bf16 kernels that work sit near 2e-3 to 5e-3 (1e-7 in fp32); a broken one is off by
order 0.1 to 1.

``model.check_kernels=false`` skips it. It costs one small compile per kernel, seconds on a GPU. On CPU the
kernels run interpreted (exact by construction) and the trainer does not call it.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron import config as config_lib
from jaxtron.config import Config, gmm_impl
from jaxtron.model.attention import attention
from jaxtron.model import kernels
from jaxtron.model.layers import apply_rope, rope_frequencies

log = logging.getLogger(__name__)

TOLERANCE = 2e-2


class KernelCheckError(config_lib.ConfigError):
    """A selected kernel disagrees with the XLA reference on these devices."""


def relative_error(ours, ref) -> float:
    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _errors(kernel: Callable, reference: Callable, args, dtype) -> dict[str, float]:
    """Relative error of kernel's output and of its gradient for each argument, against reference run in fp32
    on the same (dtype-rounded) inputs, under one random cotangent."""
    args = [a.astype(dtype) for a in args]
    out_type = jax.eval_shape(kernel, *args)
    cot = jax.random.normal(jax.random.key(1), out_type.shape, jnp.float32)

    def fwd_bwd(fn, cast):
        def run(*xs):
            out, vjp = jax.vjp(fn, *[cast(x) for x in xs])
            return (out, *vjp(cot.astype(out.dtype)))
        return jax.jit(run)(*args)

    ours = fwd_bwd(kernel, lambda x: x)
    truth = fwd_bwd(reference, lambda x: x.astype(jnp.float32))
    names = ["out"] + [f"d{i}" for i in range(len(args))]
    return {n: relative_error(o, t) for n, o, t in zip(names, ours, truth)}


def _attention_cases(cfg: Config, seq: int):
    m = cfg.model
    d = config_lib.head_dim(m)
    group = m.num_heads // m.num_kv_heads
    kvh = 2
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, seq, group * kvh, d))
    k = jax.random.normal(ks[1], (1, seq, kvh, d))
    v = jax.random.normal(ks[2], (1, seq, kvh, d))
    # Three documents of uneven lengths, the boundaries off the kernels' block edges.
    cuts = np.array([0, seq // 5, (2 * seq) // 3, seq])
    seg = jnp.asarray(np.repeat(np.arange(3, dtype=np.int32), np.diff(cuts))[None])
    scale = d ** -0.5
    impl, det = m.attention_impl, m.deterministic_attention
    for name, sg in (("causal", None), ("packed documents", seg)):
        yield (f"attention {name}", "model.attention_impl",
               lambda q, k, v, sg=sg: attention(q, k, v, sg, implementation=impl, scale=scale, deterministic=det),
               lambda q, k, v, sg=sg: attention(q, k, v, sg, implementation="xla", scale=scale),
               [q, k, v])


def _rope_case(cfg: Config, seq: int):
    m = cfg.model
    d = config_lib.head_dim(m)
    ks = jax.random.split(jax.random.key(2), 2)
    q = jax.random.normal(ks[0], (1, seq, 4, d))
    k = jax.random.normal(ks[1], (1, seq, 2, d))
    # Positions restart at a document boundary, as packed batches' do.
    pos = jnp.asarray(np.concatenate([np.arange(seq // 3), np.arange(seq - seq // 3)]).astype(np.int32)[None])
    inv = rope_frequencies(m)

    def fused(q, k):
        return jnp.concatenate([x.reshape(-1) for x in kernels.rope(q, k, pos, inv)])

    def reference(q, k):
        return jnp.concatenate([apply_rope(x, pos, inv).reshape(-1) for x in (q, k)])
    return "rope", "model.rope_impl", fused, reference, [q, k]


def _swiglu_case(cfg: Config, seq: int):
    width = min(cfg.model.intermediate_size, 1024)
    ks = jax.random.split(jax.random.key(3), 2)
    gate, up = (jax.random.normal(key, (1, seq, width)) for key in ks)
    return "swiglu", "model.mlp_impl", kernels.swiglu, lambda g, u: jax.nn.silu(g) * u, [gate, up]


def _gmm_case(cfg: Config, seq: int):
    e = cfg.model.moe
    rows, k, n = seq * e.num_experts_per_token, min(cfg.model.hidden_size, 512), min(e.expert_intermediate_size, 512)
    # Uneven loads with one idle expert, so group boundaries fall inside the kernel's row tiles.
    rng = np.random.default_rng(4)
    share = rng.dirichlet(np.ones(e.num_experts))
    share[-1] = 0.0 if e.num_experts > 1 else share[-1]
    sizes = jnp.asarray(rng.multinomial(rows, share / share.sum()), jnp.int32)
    ks = jax.random.split(jax.random.key(5), 2)
    x, w = jax.random.normal(ks[0], (rows, k)), jax.random.normal(ks[1], (e.num_experts, k, n)) * k ** -0.5
    return ("grouped matmul", "model.moe.gmm_impl", lambda x, w: kernels.gmm(x, w, sizes),
            lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32), [x, w])


def selected_kernels(cfg: Config) -> list[str]:
    """The config fields that select a Pallas or Mosaic kernel."""
    m = cfg.model
    fields = ["model.attention_impl"] if m.attention_impl in ("pallas", "mosaic") else []
    fields += [f"model.{f}" for f in ("rope_impl", "mlp_impl") if getattr(m, f) == "pallas"]
    # the check runs on GPUs only, where gmm_impl=auto is the Pallas kernel
    return fields + (["model.moe.gmm_impl"] if m.moe.num_experts and gmm_impl(m, gpu=True) == "pallas" else [])


def kernel_cases(cfg: Config, seq: int = 512):
    """(name, config field, kernel, reference, inputs) for every Pallas kernel cfg selects."""
    build = {"model.attention_impl": lambda: _attention_cases(cfg, seq),
             "model.rope_impl": lambda: [_rope_case(cfg, seq)], "model.mlp_impl": lambda: [_swiglu_case(cfg, seq)],
             "model.moe.gmm_impl": lambda: [_gmm_case(cfg, seq)]}
    for field in selected_kernels(cfg):
        yield from build[field]()


def needs_check(cfg: Config, platform: str) -> bool:
    """Whether a trainer on `platform` devices checks cfg's kernels: on GPUs, when model.check_kernels is on
    and a Pallas or Mosaic kernel is selected."""
    return cfg.model.check_kernels and platform in ("gpu", "cuda") and bool(selected_kernels(cfg))


def check_kernels(cfg: Config, seq: int = 512, tolerance: float = TOLERANCE,
                  dtype: Optional[str] = None) -> list[dict]:
    """Run every selected kernel against the reference (module docstring); returns one row per case
    ``{"case", "field", "errors": {"out", "d0", ...}}`` or raises :class:`KernelCheckError` for the first
    case over tolerance (or failing to compile or run), naming its config field."""
    dtype = jnp.dtype(dtype or config_lib.compute_dtype(cfg.model))
    rows = []
    for name, field, kernel, reference, args in kernel_cases(cfg, seq):
        value = functools.reduce(getattr, field.split(".")[1:], cfg.model)
        try:
            errors = _errors(kernel, reference, args, dtype)
        except Exception as err:  # a kernel that does not compile or run here: say which, and why
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise KernelCheckError(field, f"{value!r}: the {name} kernel failed its start-up check on "
                                          f"{jax.devices()[0].device_kind}: {type(err).__name__}: {first}") from err
        worst = max(errors, key=errors.get)
        log.info("kernel check %s (%s=%s, %s): max relative error %.2e (%s)", name, field, value, dtype.name,
                 errors[worst], worst)
        if not errors[worst] <= tolerance:
            detail = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
            xla = "ragged_dot" if field == "model.moe.gmm_impl" else "xla (or cudnn for attention)"
            raise KernelCheckError(
                field, f"{value!r}: the {name} kernel disagrees with the XLA reference on "
                       f"{jax.devices()[0].device_kind} ({dtype.name}; relative errors {detail}; tolerance "
                       f"{tolerance:g}). Use {field}={xla}, or model.check_kernels=false to train anyway")
        rows.append({"case": name, "field": field, "errors": errors})
    return rows
