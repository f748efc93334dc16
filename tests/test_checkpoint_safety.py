"""Fault injection on real checkpoints (tiny model, one CPU device): a truncated shard, a flipped exponent bit, a
NaN written into a shard (with and without a matching checksum), fallback with retention, a save that fails
mid-way (ENOSPC), and a non-finite state. Each test ends by restoring a good checkpoint left on disk."""

import errno
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from helpers import tiny_config
from jaxtron.checkpoint import CheckpointError, Checkpointer, shards
from jaxtron.checkpoint.__main__ import main as checkpoint_cli
from jaxtron.train.callbacks import TrainingAborted
from jaxtron.train.trainer import Trainer

COMMON = ("train.eval_every=0", "data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
          "logging.log_every=1", "checkpoint.every_steps=2", "checkpoint.keep=3")


def _cfg(out, *extra):
    return tiny_config(*COMMON, f"train.output_dir={out}", *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints 2, 4, 6 of a 6-step run, and a trainer whose abstract state restores them."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run = Trainer(_cfg(out, "train.steps=6"), jax.devices()[:1])
    run.train()
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4", "6"]
    return out, run


@pytest.fixture
def run_dir(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    return out


def _restores(trained, ckpt_dir, step):
    """The step restores (checksums verified) onto the trainer's layout and holds finite values."""
    ckpt = Checkpointer(str(ckpt_dir), read_only=True)
    try:
        state, meta = ckpt.restore(step, trained[1].spec.abstract_state)
    finally:
        ckpt.close()
    assert meta["step"] == step
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def _shard(ckpt_dir, step, item="params", leaf="['embed']"):
    d = ckpt_dir / str(step) / item
    index = json.loads((d / "index.p0.json").read_text())
    return d / index["leaves"][leaf]["shards"][0]["file"], d / "index.p0.json"


def _verify(path, capsys):
    rc = checkpoint_cli(["verify", str(path)])
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def test_truncated_shard_is_named_and_fails_verify(run_dir, trained, capsys):
    ckpt_dir = run_dir / "checkpoints"
    shard, _ = _shard(ckpt_dir, 6)
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(CheckpointError) as err:
        Trainer(_cfg(run_dir, "train.steps=8"), jax.devices()[:1]).train()
    msg = str(err.value)
    assert "\n" not in msg and str(shard) in msg and "step 6" in msg and "['embed']" in msg and "truncated" in msg
    rc, _, errors = _verify(ckpt_dir, capsys)
    assert rc == 1 and len(errors) == 1 and str(shard) in errors[0] and "step 6" in errors[0]
    assert _verify(ckpt_dir / "4", capsys)[0] == 0
    _restores(trained, ckpt_dir, 4)


def _flip_exponent_bit(path, offset_floats=3):
    data = bytearray(path.read_bytes())
    data[4 * offset_floats + 3] ^= 0x40  # float32 little-endian: the high byte holds the sign and 7 exponent bits
    path.write_bytes(bytes(data))


def test_bit_flip_fails_the_checksum(run_dir, trained, capsys):
    ckpt_dir = run_dir / "checkpoints"
    shard, _ = _shard(ckpt_dir, 6, "opt_state", "[1][0].mu['layers']['mlp']['w_down']")
    _flip_exponent_bit(shard)
    ckpt = Checkpointer(str(ckpt_dir), read_only=True)
    with pytest.raises(CheckpointError, match=r"^checkpoint step 6: .*checksum mismatch") as err:
        ckpt.restore(6, trained[1].spec.abstract_state)
    ckpt.close()
    assert str(shard) in str(err.value) and "w_down" in str(err.value) and "\n" not in str(err.value)
    rc, _, errors = _verify(ckpt_dir / "6", capsys)
    assert rc == 1 and len(errors) == 1 and "checksum mismatch" in errors[0] and str(shard) in errors[0]
    _restores(trained, ckpt_dir, 4)


def _write_nan(path):
    data = np.fromfile(path, np.float32)
    data[1] = np.nan
    data.tofile(path)


def test_nan_in_shard_fails_the_checksum(run_dir, trained, capsys):
    ckpt_dir = run_dir / "checkpoints"
    shard, _ = _shard(ckpt_dir, 6)
    _write_nan(shard)
    rc, _, errors = _verify(ckpt_dir, capsys)
    assert rc == 1 and len(errors) == 1 and "checksum mismatch" in errors[0]
    result = Trainer(_cfg(run_dir, "train.steps=6", "checkpoint.fallback=true"), jax.devices()[:1]).train()
    assert result.start_step == 4 and result.final_step == 6 and result.skipped_steps == 0
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "6", "6.corrupt"]
    assert _verify(ckpt_dir, capsys)[0] == 0
    _restores(trained, ckpt_dir, 6)


def test_nan_without_checksums_is_refused_on_resume(run_dir, trained, capsys):
    """A checkpoint written before checksums (none in the index) still restores; a NaN in it stops the resume
    (or falls back), instead of skipping steps and then saving the NaN state over good checkpoints."""
    ckpt_dir = run_dir / "checkpoints"
    for step in (4, 6):
        for item in ("params", "opt_state"):
            index_path = ckpt_dir / str(step) / item / "index.p0.json"
            index = json.loads(index_path.read_text())
            for entry in index["leaves"].values():
                for s in entry["shards"]:
                    del s[shards.HASH]
            index_path.write_text(json.dumps(index))
    rc, out, errors = _verify(ckpt_dir / "4", capsys)
    assert rc == 0 and "no checksums" in out and not errors
    _restores(trained, ckpt_dir, 4)  # old checkpoints restore, unverified
    _write_nan(_shard(ckpt_dir, 6)[0])
    with pytest.raises(CheckpointError, match=r"step 6 .*non-finite values .*\['embed'\].* \(the first in "
                                              r"\S*/checkpoints/6/params/p0\.\d+\.0\.bin\)"):
        Trainer(_cfg(run_dir, "train.steps=8"), jax.devices()[:1]).train()
    result = Trainer(_cfg(run_dir, "train.steps=6", "checkpoint.fallback=true"), jax.devices()[:1]).train()
    assert result.start_step == 4 and result.skipped_steps == 0
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "6", "6.corrupt"]
    _restores(trained, ckpt_dir, 6)


def test_fallback_sets_the_bad_step_aside_and_retention_keeps_the_good_one(run_dir, trained, capsys):
    """The issue's reproduction, shortened: every 2 steps, keep 3, truncate the newest (6), resume to 10 with
    fallback. The run resumes from 4, saves a new 6 (not skipped because 6/ existed), and never deletes 4."""
    ckpt_dir = run_dir / "checkpoints"
    shard, _ = _shard(ckpt_dir, 6, "opt_state", "[1][0].nu['embed']")
    with open(shard, "r+b") as f:
        f.truncate(3)
    result = Trainer(_cfg(run_dir, "train.steps=10", "checkpoint.fallback=true"), jax.devices()[:1]).train()
    assert result.start_step == 4 and result.final_step == 10
    assert sorted(os.listdir(ckpt_dir)) == ["10", "4", "6", "6.corrupt", "8"]  # 2 pruned; 4 protected
    assert os.path.getsize(ckpt_dir / "6.corrupt" / "opt_state" / shard.name) == 3  # kept for inspection
    rc, out, errors = _verify(ckpt_dir, capsys)
    assert rc == 0 and not errors and "6.corrupt" in out
    for step in (4, 6, 10):
        _restores(trained, ckpt_dir, step)


def test_save_failing_midway_keeps_the_previous_checkpoints(run_dir, trained, monkeypatch, caplog):
    ckpt_dir = run_dir / "checkpoints"
    real = shards._write_file

    def disk_full(path, data):
        if "opt_state" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)

    monkeypatch.setattr(shards, "_write_file", disk_full)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as err:
        Trainer(_cfg(run_dir, "train.steps=8"), jax.devices()[:1]).train()
    msg = str(err.value)
    assert msg.startswith("checkpoint step 8 not saved: ") and "No space left on device" in msg and "\n" not in msg
    assert "/opt_state" in msg and ".bin" in msg and str(ckpt_dir / "6") in msg  # the file, and what is kept
    assert not [r for r in caplog.records if r.exc_info]  # no tracebacks logged by Orbax
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "6"]  # nothing pruned, the partial save removed
    monkeypatch.setattr(shards, "_write_file", real)
    _restores(trained, ckpt_dir, 6)


def test_non_finite_state_is_not_saved_over_good_checkpoints(run_dir, trained, caplog):
    ckpt_dir = run_dir / "checkpoints"
    run = Trainer(_cfg(run_dir, "train.steps=12", "train.max_skipped_steps=3", "checkpoint.keep=1"),
                  jax.devices()[:1])
    assert run.restore() == 6
    state = dict(run.state)
    state["params"] = jax.tree.map(lambda x: x * np.float32(np.nan), state["params"])
    run.state = state
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingAborted) as err:
        run.train()  # steps 7, 8, 9 skipped; the saves at 8 and 9 refused
    assert "the state was not saved (non-finite values" in str(err.value)
    assert f"the newest checkpoint is {ckpt_dir / '6'}" in str(err.value)
    assert any("checkpoint step 8 not saved" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "6"]  # keep=1, yet nothing was deleted for it
    with pytest.raises(CheckpointError, match="step 9 not saved: non-finite"):
        run.save()
    _restores(trained, ckpt_dir, 6)
