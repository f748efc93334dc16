"""Checkpoints in-process on 8 CPU devices: restore onto other meshes and dtypes, exact resume (losses and
batches), retention, and skipping non-finite steps. (An unreadable checkpoint, its error and checkpoint.fallback:
tests/test_checkpoint_faults.py, through the CLI.)"""

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import synthetic_batch, tiny_config
from jaxtron.checkpoint import CheckpointError, Checkpointer, load_params
from jaxtron.train import loop
from jaxtron.train.callbacks import TrainingAborted
from jaxtron.train.trainer import Trainer, put_batch

SMALL_DATA = ("data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1", "logging.log_every=1")


def _assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _steps(run, batches):
    losses = []
    for b in batches:
        run.state, m = run.train_step(run.state, put_batch(b, run.batch_sharding))
        losses.append(float(m["loss"]))
    return losses


# the fsdp=8 checkpoint onto FSDP shards of another size with tensor-parallel splits (and sequence parallelism),
# and onto one device
LAYOUTS = {
    "fsdp2-tensor4-seqpar": (("parallel.data=1", "parallel.fsdp=2", "parallel.tensor=4",
                              "parallel.sequence_parallel=true"), 8),
    "one-device": (("parallel.data=1",), 1),
}


@pytest.fixture(scope="module")
def fsdp8_checkpoint(tmp_path_factory):
    """3 steps on fsdp=8, saved; then 2 more steps on fsdp=8 (the reference continuation)."""
    d = str(tmp_path_factory.mktemp("fsdp8") / "ckpt")
    cfg = tiny_config("parallel.data=1", "parallel.fsdp=8", "train.steps=5")
    batches = [synthetic_batch(cfg, i) for i in range(5)]
    run = Trainer(cfg, jax.devices())
    _steps(run, batches[:3])
    ckpt = Checkpointer(d)
    ckpt.save(3, run.state, {"note": "fsdp8"})
    ckpt.wait()
    saved = jax.device_get(run.state)
    continued = _steps(run, batches[3:])
    ckpt.close()
    return d, batches, saved, continued


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_restore_onto_another_mesh_continues_with_equal_loss(fsdp8_checkpoint, name):
    d, batches, saved, continued = fsdp8_checkpoint
    overrides, n = LAYOUTS[name]
    run = Trainer(tiny_config(*overrides, "train.steps=5"), jax.devices()[:n])
    ckpt = Checkpointer(d)
    run.state, meta = ckpt.restore(3, run.spec.abstract_state)
    ckpt.close()
    assert meta["note"] == "fsdp8" and meta["step"] == 3 and int(run.state["step"]) == 3
    _assert_trees_equal(run.state["params"], saved["params"])     # bit-exact values, new layout
    _assert_trees_equal(run.state["opt_state"], saved["opt_state"])
    wq = run.state["params"]["layers"]["attention"]["wq"]
    assert wq.sharding == run.spec.state_shardings["params"]["layers"]["attention"]["wq"]
    np.testing.assert_allclose(_steps(run, batches[3:]), continued, rtol=1e-5)


def test_weights_only_restore_with_dtype_change(fsdp8_checkpoint):
    d, _, saved, _ = fsdp8_checkpoint
    run = Trainer(tiny_config("parallel.data=2", "parallel.tensor=4"), jax.devices())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=a.sharding),
                            run.spec.abstract_state["params"])
    params, meta = load_params(d, abstract)
    assert meta["step"] == 3
    jax.tree.map(lambda p, s: np.testing.assert_array_equal(np.asarray(p), np.asarray(s).astype(jnp.bfloat16)),
                 params, saved["params"])
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    with pytest.raises(CheckpointError, match="holds no checkpoint steps"):
        load_params(os.path.dirname(d), abstract)


def test_restore_rejects_another_model(fsdp8_checkpoint):
    d = fsdp8_checkpoint[0]
    run = Trainer(tiny_config("model.hidden_size=32"), jax.devices()[:1])
    ckpt = Checkpointer(d)
    with pytest.raises(CheckpointError, match=r"step 3: .*\['embed'\].* has shape \[256, 64\] in the checkpoint, "
                                              r"\[256, 32\] in this config"):
        ckpt.restore(3, run.spec.abstract_state)
    ckpt.close()


class _StopAfter:
    """Stands in for the SIGTERM handler: reports a signal at the check after step ``n``."""

    def __init__(self, n, start=0):
        self.n, self.checks = n, start

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    @property
    def received(self):
        self.checks += 1
        return "SIGTERM" if self.checks >= self.n else None


def _record_batches(monkeypatch):
    hashes = []
    real = loop.put_local_batch

    def put(local, sharding, global_batch):
        hashes.append(hashlib.sha256(b"".join(np.ascontiguousarray(local[k]).tobytes()
                                              for k in sorted(local))).hexdigest())
        return real(local, sharding, global_batch)

    monkeypatch.setattr(loop, "put_local_batch", put)
    return hashes


def test_exact_resume_same_losses_and_batches(tmp_path, monkeypatch):
    """Stop at step 3 of 6 (as SIGTERM would), resume to 6: the losses are bit-identical to an uninterrupted
    6-step run and the batches (by hash) are the same."""
    common = ("parallel.data=2", "parallel.fsdp=4", "train.steps=6", "train.eval_every=0", *SMALL_DATA)
    hashes = _record_batches(monkeypatch)
    full = Trainer(tiny_config(*common, f"train.output_dir={tmp_path}/full", "checkpoint.enabled=false")).train()
    full_hashes = list(hashes)
    assert [s for s, _ in full.losses] == [1, 2, 3, 4, 5, 6]

    out = f"train.output_dir={tmp_path}/resumed"
    hashes.clear()
    monkeypatch.setattr(loop, "StopSignals", lambda: _StopAfter(3))
    first = Trainer(tiny_config(*common, out)).train()
    first_hashes = hashes[:3]  # it had also fetched batch 3 (the next step's) when it stopped
    hashes.clear()
    assert first.stopped_by == "SIGTERM" and first.final_step == 3
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["3"]
    monkeypatch.setattr(loop, "StopSignals", lambda: _StopAfter(10**9))
    second = Trainer(tiny_config(*common, out)).train()
    assert second.start_step == 3 and second.final_step == 6 and second.initial_eval_loss is None
    assert first.losses + second.losses == full.losses  # bit-identical floats
    assert first_hashes + hashes == full_hashes  # the same batches, by hash
    np.testing.assert_array_equal(np.asarray(second.state["params"]["embed"]),
                                  np.asarray(full.state["params"]["embed"]))
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["3", "6"]
    # a finished run started again has nothing to do
    again = Trainer(tiny_config(*common, out)).train()
    assert again.start_step == 6 and again.losses == []


def test_retention_keeps_last_k_and_every_mth(tmp_path):
    # 6 steps on 1 device: test_too_many_skipped_steps_saves_and_stops's train step (one compile for both)
    cfg = tiny_config("train.steps=6", "checkpoint.every_steps=1", "checkpoint.keep=2", "checkpoint.keep_every=3",
                      "train.eval_every=0", f"train.output_dir={tmp_path}", *SMALL_DATA)
    Trainer(cfg, jax.devices()[:1]).train()
    assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints")) == [3, 5, 6]


def _poisoned(batch):
    bad = dict(batch)
    bad["loss_mask"] = batch["loss_mask"].copy()
    bad["loss_mask"][0, 0] = np.nan
    return bad


def test_non_finite_step_leaves_params_and_optimizer_unchanged():
    """[b0, NaN batch, b2] gives the same params and optimizer state as [b0, b2]."""
    cfg = tiny_config("parallel.data=2", "parallel.fsdp=4")
    b = [synthetic_batch(cfg, i) for i in range(3)]
    run = Trainer(cfg, jax.devices())
    _steps(run, b[:1])
    before = jax.device_get(run.state)
    run.state, m = run.train_step(run.state, put_batch(_poisoned(b[1]), run.batch_sharding))
    assert bool(m["skipped"]) and not np.isfinite(float(m["loss"]))
    _assert_trees_equal(run.state["params"], before["params"])
    _assert_trees_equal(run.state["opt_state"], before["opt_state"])
    assert int(run.state["step"]) == 2  # the data position still advances
    _steps(run, b[2:])
    ref = Trainer(cfg, jax.devices())
    _steps(ref, [b[0], b[2]])
    _assert_trees_equal(run.state["params"], ref.state["params"])
    _assert_trees_equal(run.state["opt_state"], ref.state["opt_state"])


class _NaNCorpus:
    """The built-in corpus with a NaN in every training batch's loss mask."""

    def __init__(self, cfg):
        from jaxtron.data.corpus import make_corpus
        self.inner = make_corpus(cfg)

    def train_batch(self, step, batch_size):
        return _poisoned(self.inner.train_batch(step, batch_size))

    def valid_batches(self, num, batch_size):
        return self.inner.valid_batches(num, batch_size)


def test_too_many_skipped_steps_saves_and_stops(tmp_path):
    cfg = tiny_config("train.steps=6", "train.max_skipped_steps=3", "train.eval_every=0",
                      f"train.output_dir={tmp_path}", *SMALL_DATA)
    run = Trainer(cfg, jax.devices()[:1])
    initial = jax.device_get(run.state["params"])
    with pytest.raises(TrainingAborted, match=r"stopped at step 3: 3 steps in a row .*max_skipped_steps=3"):
        run.train(_NaNCorpus(cfg))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    state, meta = ckpt.restore(3, run.spec.abstract_state)
    ckpt.close()
    assert meta["skipped_total"] == 3 and meta["skipped_in_a_row"] == 3
    _assert_trees_equal(state["params"], initial)  # nothing was applied
