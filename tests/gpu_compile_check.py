"""Compile with the real XLA:GPU compiler for an H100 (no GPU needed): the Pallas kernels forward and backward
at Llama-3-8B shapes (bf16; the grouped matmul at a Mixtral-like expert shape), and jaxtron's train step with
every Triton kernel on 2 GPUs (FSDP), and an MoE step with the grouped matmul and the Mosaic attention kernels.
Run as a script in a fresh process (the test suite pins JAX to the CPU); prints one JSON line."""

import json
import os
import sys
import time

os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
os.environ.pop("JAX_PLATFORMS", None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from helpers import gpu_target  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.grouped_matmul import gmm  # noqa: E402
from pallas_kernels.rope import apply_rope  # noqa: E402
from pallas_kernels.swiglu import swiglu  # noqa: E402

TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100_sxm.txtpb")


def _compile(fn, *specs):
    t0 = time.perf_counter()
    with gpu_target(specs[0].sharding.device_set.pop().device_kind):   # jax >= 0.11 needs the target named
        compiled = jax.jit(fn).trace(*specs).lower().compile()
    return {"seconds": time.perf_counter() - t0, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "triton_calls": compiled.as_text().count("__gpu$xla.gpu.triton"),
            "mosaic_calls": compiled.as_text().count("custom_call_target=\"mosaic_gpu")}


def main() -> dict:
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x2", target_config=open(TARGET).read())
    dev = topo.devices[0]
    sh = SingleDeviceSharding(dev)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    b, s, h, kv, d, ffn = 1, 8192, 32, 8, 128, 14336
    q, k, seg = spec((b, s, h, d)), spec((b, s, kv, d)), spec((b, s), jnp.int32)
    out = {"device_kind": dev.device_kind, "platform": dev.platform}

    def attn(q, k, v, seg):
        f = lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, interpret=False).astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
    out["flash_attention"] = _compile(attn, q, k, k, seg)

    def attn_causal(q, k, v):   # plain causal: the kernels' split (unmasked + masked) block loops
        f = lambda q, k, v: flash_attention(q, k, v, interpret=False).astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
    out["flash_attention_causal"] = _compile(attn_causal, q, k, k)

    def attn_mosaic(q, k, v):   # the Mosaic GPU kernels, forward and backward
        f = lambda q, k, v: flash_attention(q, k, v, backend="mosaic", interpret=False).astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
    out["flash_attention_mosaic"] = _compile(attn_mosaic, q, k, k)

    def attn_mosaic_dq_kernel(q, k, v):   # ... with the separate dq kernel
        f = lambda q, k, v: flash_attention(q, k, v, backend="mosaic", interpret=False,
                                            fuse_dq=False).astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
    out["flash_attention_mosaic_dq_kernel"] = _compile(attn_mosaic_dq_kernel, q, k, k)

    pos, inv = spec((b, s), jnp.int32), spec((d // 2,), jnp.float32)

    def rope(q, k, pos, inv):
        f = lambda q, k: sum(x.astype(jnp.float32).sum() for x in apply_rope(q, k, pos, inv, interpret=False))
        return jax.value_and_grad(f, argnums=(0, 1))(q, k)
    out["rope"] = _compile(rope, q, k, pos, inv)

    x = spec((b * s, ffn))
    mlp = lambda g, u: jax.value_and_grad(lambda g, u: swiglu(g, u, interpret=False).astype(jnp.float32).sum(),
                                          argnums=(0, 1))(g, u)
    out["swiglu"] = _compile(mlp, x, x)

    # Mixtral-like expert matmul: 4096 sorted (token, expert) rows, hidden 1024 -> ffn 2048, 8 experts.
    def grouped(lhs, rhs, sizes):
        f = lambda a, b: gmm(a, b, sizes, interpret=False).astype(jnp.float32).sum()
        return jax.value_and_grad(f, argnums=(0, 1))(lhs, rhs)
    out["gmm"] = _compile(grouped, spec((4096, 1024)), spec((8, 1024, 2048)), spec((8,), jnp.int32))

    from jaxtron import config as config_lib
    from jaxtron.train.aot import lower_train_step
    base = ["model.hidden_size=512", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
            "model.intermediate_size=1024", "model.vocab_size=1024", "data.seq_len=1024",
            "train.global_batch_size=4", "parallel.data=1", "parallel.fsdp=2"]
    cfg = config_lib.load(None, base + ["model.attention_impl=pallas", "model.rope_impl=pallas",
                                        "model.mlp_impl=pallas", "data.reset_at_eod=true"])
    out["train_step"] = _compile_step(lower_train_step, cfg, topo.devices)
    # A dropless MoE model (bf16) with the grouped-matmul kernel and the Mosaic attention kernels, per shard
    # under FSDP (plain causal: no packed documents); one train step compile for both kernels.
    cfg = config_lib.load(None, base + ["model.moe.num_experts=8", "model.moe.num_experts_per_token=2",
                                        "model.moe.expert_intermediate_size=512", "model.moe.gmm_impl=pallas",
                                        "model.attention_impl=mosaic", "data.reset_at_eod=false",
                                        "model.dtype=bfloat16"])
    out["train_step_moe_mosaic"] = _compile_step(lower_train_step, cfg, topo.devices)
    return out


def _compile_step(lower_train_step, cfg, devices) -> dict:
    t0 = time.perf_counter()
    compiled = lower_train_step(cfg, devices).compile()
    text = compiled.as_text()
    return {"seconds": time.perf_counter() - t0, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "triton_calls": text.count("__gpu$xla.gpu.triton"),
            "mosaic_calls": text.count("custom_call_target=\"mosaic_gpu")}


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
