"""Small shared pieces for tests: a tiny fp32 config and synthetic batches."""

from __future__ import annotations

import contextlib

import numpy as np

from jaxtron import config as config_lib

TINY = [
    "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=8",
    "model.num_kv_heads=4", "model.intermediate_size=128", "model.dtype=float32", "data.seq_len=16",
    "train.global_batch_size=8", "optim.warmup_steps=1", "train.steps=3",
    "logging.progress=false", "logging.tensorboard=false",
]


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess on ``devices`` virtual CPU devices, compiling as fast as the suite's
    own processes do (conftest.FAST_COMPILE)."""
    from conftest import FAST_COMPILE

    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def tiny_config(*overrides: str) -> config_lib.Config:
    return config_lib.load(None, TINY + list(overrides))


def synthetic_batch(cfg: config_lib.Config, seed: int, documents: int = 1) -> dict:
    """Random tokens; with ``documents`` > 1 each row packs that many documents of random lengths (segment ids
    1, 2, ... and positions restarting at each, as the loader makes them with ``data.reset_at_eod``)."""
    rng = np.random.default_rng(seed)
    b, s = cfg.train.global_batch_size, cfg.data.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, size=(b, s + 1), dtype=np.int32)
    segment_ids = np.ones((b, s), np.int32)
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    for row in range(b if documents > 1 else 0):
        starts = np.sort(rng.choice(np.arange(1, s), size=documents - 1, replace=False))
        segment_ids[row] = 1 + np.searchsorted(starts, np.arange(s), side="right")
        begin = np.concatenate([[0], starts])[segment_ids[row] - 1]
        positions[row] = np.arange(s) - begin
    return {
        "inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": positions,
        "segment_ids": segment_ids, "loss_mask": np.ones((b, s), np.float32),
    }


def xla_gpu_plugin_version():
    """The installed jax-cuda12-plugin version (XLA:GPU compiles without a GPU need it to equal jax's)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Kernel tests: the accuracy criterion and lowering for cuda without a GPU
# ---------------------------------------------------------------------------------------------------------------

# Bound on rel_error(kernel, reference) per input dtype; see tests/test_kernels_flash_attention.py's docstring.
KERNEL_TOL = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 5e-4}


def rel_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norm, computed in float64)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    scale = np.linalg.norm(e)
    assert scale > 0, "relative error against an all-zero reference is undefined"
    return float(np.linalg.norm(a - e) / scale)


H100 = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def gpu_target(device_kind: str = H100):
    """Name the target GPU for Pallas Triton lowerings on a machine without a GPU.

    The Pallas Triton lowering needs the target GPU's compute capability. jax 0.10 falls back to sm_90 when no GPU
    is present; jax >= 0.11 raises "No supported GPU devices found, please specify an abstract GPU device using
    AbstractDevice" instead. Both accept the target as the abstract device of the current abstract mesh
    (`jax.sharding.use_abstract_mesh`), which this sets: a one-device mesh of `device_kind`.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=device)):
        yield


def lower_for_cuda(fn, *specs, device_kind: str = H100) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for the cuda platform without a GPU (see `gpu_target`)."""
    import jax

    with gpu_target(device_kind):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


# ---------------------------------------------------------------------------------------------------------------
# Layout equality: a parallel layout must train exactly as one device does
# ---------------------------------------------------------------------------------------------------------------

# Appended to a layout's overrides: the learning rate is non-zero from step 0 (warmup 1 would make step 0's lr
# 0 and step 2's loss depend only on the gradient's sign under Adam).
NONZERO_LR = ("optim.warmup_steps=0", "optim.schedule=constant")


def training_record(cfg, devices, steps: int = 3, batch_seed: int = 0, documents: int = 1) -> dict:
    """What a layout is compared on: the fp32 gradient of the whole batch at the initial parameters (leaf by
    leaf, through the train step's own gradient path: accumulation or pipeline), its global norm, and the
    losses and gradient norms of ``steps`` optimizer steps on one fixed batch."""
    return _record(cfg, devices, steps, batch_seed, documents, ())[0]


def moe_training_record(cfg, devices, metrics: tuple[str, ...]):
    """:func:`training_record` (3 steps) plus the MoE ``metrics`` of each step (``record["moe"]``) and the
    final aux-free biases (``record["bias"]`` [MoE layers, E], when the model has them), and the trainer. The
    bias is moved by the expert load, not by gradients: its gradient must be zero, and is left out of
    ``record["grads"]``."""
    import jax
    import numpy as np

    record, trainer = _record(cfg, devices, 3, 0, 1, metrics)
    mlp = record["grads"]["layers"]["mlp"]
    if "expert_bias" in mlp:
        assert not np.any(mlp.pop("expert_bias"))
        record["bias"] = np.asarray(jax.device_get(trainer.state["params"])["layers"]["mlp"]["expert_bias"])
    return record, trainer


def training_record_with_params(cfg, devices, steps: int = 3):
    """:func:`training_record` plus the parameters after the steps (``record["params"]``, float64), and the
    trainer: for optimizers and optimizer-state layouts, which the gradients alone cannot check."""
    import jax
    import numpy as np

    record, trainer = _record(cfg, devices, steps, 0, 1, ())
    record["params"] = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(trainer.state["params"]))
    return record, trainer


def assert_same_params(actual, expected, rtol: float) -> None:
    """Every parameter leaf of two trees agrees (relative L2 error), naming the first that does not."""
    import jax
    import numpy as np

    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)):
        err = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative parameter difference {err:.1e}"


def _record(cfg, devices, steps: int, batch_seed: int, documents: int, metrics: tuple[str, ...]):
    import jax
    import numpy as np

    from jaxtron.train.step import make_train_step
    from jaxtron.train.trainer import Trainer, put_batch

    trainer = Trainer(cfg, devices)
    batch = put_batch(synthetic_batch(cfg, batch_seed, documents), trainer.batch_sharding)
    record = {"losses": [], "grad_norms": [], "moe": []}
    if steps:  # the first step's own gradient: one compiled program for the gradient and the training
        p = trainer.program
        trainer.train_step = make_train_step(cfg, p.spec, p.tx, p.schedule, p.layout, return_grads=True)
    else:
        grads, m = trainer.gradients(batch)
        record.update(grads=jax.tree.map(lambda g: np.asarray(g, np.float64), grads), grad_norm0=float(m["grad_norm"]))
    for i in range(steps):
        m = trainer.step(batch)
        grads = m.pop("grads")
        if i == 0:
            record.update(grads=jax.tree.map(lambda g: np.asarray(g, np.float64), grads),
                          grad_norm0=float(m["grad_norm"]))
        record["losses"].append(float(m["loss"]))
        record["grad_norms"].append(float(m["grad_norm"]))
        if metrics:
            record["moe"].append([float(m[k]) for k in metrics])
    return record, trainer


def assert_same_training(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    """Losses, gradient norms and every gradient leaf (relative L2 error) of two training records agree."""
    import chex
    import jax
    import numpy as np

    np.testing.assert_allclose(actual["losses"], expected["losses"], rtol=rtol, err_msg="losses")
    np.testing.assert_allclose(actual["grad_norms"], expected["grad_norms"], rtol=rtol, err_msg="grad norms")
    np.testing.assert_allclose(actual["grad_norm0"], expected["grad_norm0"], rtol=rtol, err_msg="grad norm")
    chex.assert_trees_all_equal_shapes(actual["grads"], expected["grads"])
    flat = jax.tree_util.tree_leaves_with_path(expected["grads"])
    assert len(flat) > 0
    for (path, e), a in zip(flat, jax.tree.leaves(actual["grads"])):
        scale = np.linalg.norm(e)
        assert scale > 0, f"{jax.tree_util.keystr(path)}: the reference gradient is zero"
        err = np.linalg.norm(a - e) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative gradient difference {err:.2e} > {rtol:.0e}"
    assert actual["losses"][-1] < actual["losses"][0], "the loss did not fall: the layout does not train"
