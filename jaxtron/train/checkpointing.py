"""A training run's checkpoints (:class:`Checkpointing`, owned by the :class:`~jaxtron.train.trainer.Trainer`):
save, restore, resume (with its fallback to an older checkpoint) or load initial weights, and the data-iterator
state and tokenizer record a checkpoint carries. Restoring returns what it read (:class:`Restored`); the trainer
decides what to do with it."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np
import optax

from jaxtron import config as config_lib
from jaxtron.checkpoint import CheckpointError, Checkpointer, integrity, load_params, nonfinite_leaves
from jaxtron.checkpoint.manager import CheckpointMismatch
from jaxtron.config import Config
from jaxtron.data import tokenizer_record
from jaxtron.train.state import ModelSpec

log = logging.getLogger("jaxtron")

SKIPPED_KEYS = ("skipped_total", "skipped_in_a_row")


@dataclass
class Restored:
    """A train state read from disk: ``state`` on the mesh, its ``step`` and the ``meta`` it was saved with."""

    state: dict
    step: int
    meta: dict

    @property
    def skipped(self) -> dict:
        """The skipped-step counters the run had when it saved."""
        return {k: int(self.meta.get(k, 0)) for k in SKIPPED_KEYS}


class Checkpointing:
    """The checkpoints of a run of ``cfg`` (``checkpoint.*``) with the train state ``spec`` describes.

    :meth:`open` starts a run's checkpoint directory (``checkpoint.dir``), :meth:`resume` reads its newest
    readable checkpoint, :meth:`save` starts an (asynchronous) save in it, :meth:`close` waits for the last.
    :meth:`restore` and :meth:`save_to` work on any directory, synchronously."""

    def __init__(self, cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation):
        self.cfg, self.spec, self.tx = cfg, spec, tx
        self.manager: Optional[Checkpointer] = None  # the run's, between open() and close()

    # ------------------------------------------------------------------------------------------ the run's
    def open(self) -> None:
        c = self.cfg.checkpoint
        if c.enabled and self.manager is None:
            self.manager = Checkpointer(config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                                        async_save=c.async_save)

    def close(self) -> None:
        """Waits for a save in flight."""
        if self.manager is not None:
            self.manager.close()
            self.manager = None

    def step_dir(self, step: int) -> Optional[str]:
        return self.manager.step_dir(step) if self.manager is not None else None

    def resume(self) -> Optional[Restored]:
        """The newest checkpoint of the open directory that reads and is finite (``checkpoint.fallback``: a
        corrupt one is set aside and the previous one tried); None when there is none or ``checkpoint.resume``
        is off."""
        c, ckpt = self.cfg.checkpoint, self.manager
        steps = ckpt.all_steps() if (ckpt is not None and c.resume) else []
        set_aside = []
        for step in reversed(steps):
            try:
                t0 = time.perf_counter()
                restored = self._read(ckpt, step)
            except CheckpointError as err:
                if not c.fallback or isinstance(err, CheckpointMismatch):  # an older step would not fit either
                    raise CheckpointError(f"{err}. Set checkpoint.fallback=true to resume from the previous "
                                          f"checkpoint instead, or move {ckpt.step_dir(step)} away") from None
                moved = ckpt.set_aside(step, "corrupt")  # never restored again, nor counted by retention
                set_aside.append(step)
                log.warning("%s; moved it to %s and falling back to the previous checkpoint "
                            "(checkpoint.fallback=true)", err, moved)
                continue
            log.info("resumed from %s (step %d) in %.1f s", ckpt.step_dir(step), step, time.perf_counter() - t0)
            if set_aside:  # retention must never delete the step this run fell back to
                ckpt.protect(step)
            self._check_resumed_data(restored.meta)
            self._check_tokenizer(restored.meta, f"checkpoint step {step} in {ckpt.directory}", "data.tokenizer")
            return restored
        if steps:
            raise CheckpointError(f"none of the checkpoints {steps} in {ckpt.directory} could be read")
        return None

    def load_weights(self) -> Optional[Restored]:
        """``checkpoint.load_weights``' parameters with a fresh optimizer state at step 0 (None when unset); the
        meta keeps only the sequence length the weights were trained for."""
        path = self.cfg.checkpoint.load_weights
        if not path:
            return None
        t0 = time.perf_counter()
        abstract, histories = self.spec.abstract_state["params"], self.spec.histories
        params, meta = load_params(path, histories.weights_only(abstract))
        params = histories.with_fresh(params, abstract)
        self._check_tokenizer(meta, path, "checkpoint.load_weights")
        opt_init = jax.jit(self.tx.init, out_shardings=self.spec.state_shardings["opt_state"])
        step0 = jax.device_put(np.zeros((), np.int32), self.spec.state_shardings["step"])
        log.info("loaded weights from %s (step %s) in %.1f s; fresh optimizer state", path, meta.get("step"),
                 time.perf_counter() - t0)
        return Restored({"step": step0, "params": params, "opt_state": opt_init(params)}, 0,
                        {"max_positions": meta.get("max_positions")})

    def save(self, step: int, state: dict, skipped: dict, meta: dict) -> bool:
        """Start a save of ``state`` as ``step`` in the open directory (see :meth:`Checkpointer.save`); False
        when none is open or the save was refused. ``meta``: what the run resumed with (its ``max_positions``
        carries over)."""
        if self.manager is None:
            return False
        return self._save(self.manager, step, state, skipped, meta)

    def saved_note(self, step: int) -> str:
        """Where the state of ``step`` went, for a message (waits for the save)."""
        ckpt = self.manager
        if ckpt is None:
            return ""
        ckpt.wait()
        if step in ckpt.refused:
            newest = ckpt.newest_good() or ckpt.latest_step()
            return (f"; the state was not saved ({ckpt.refused[step]})" +
                    (f", the newest checkpoint is {ckpt.step_dir(newest)}" if newest is not None else ""))
        return f"; the state is saved in {ckpt.step_dir(step)}"

    # ------------------------------------------------------------------------------------ any directory
    def save_to(self, directory: Optional[str], step: int, state: dict, skipped: dict, meta: dict) -> str:
        """Save ``state`` as ``step`` in ``directory`` (default ``checkpoint.dir``) and wait; returns the step
        directory. Raises :class:`CheckpointError` when the save is refused (e.g. a non-finite state)."""
        c = self.cfg.checkpoint
        ckpt = Checkpointer(directory or config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                            async_save=False)
        try:
            self._save(ckpt, step, state, skipped, meta)
            if step in ckpt.refused:
                raise CheckpointError(f"checkpoint step {step} not saved: {ckpt.refused[step]}")
            return ckpt.step_dir(step)
        finally:
            ckpt.close()

    def restore(self, directory: Optional[str] = None, step: Optional[int] = None) -> Restored:
        """Checkpoint ``step`` (default: the newest) of ``directory`` (default ``checkpoint.dir``) on this run's
        mesh (any mesh it was saved from). Raises :class:`CheckpointError` naming the directory when there is
        none."""
        directory = directory or config_lib.checkpoint_dir(self.cfg)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{os.path.abspath(directory)}: no such checkpoint directory")
        ckpt = Checkpointer(directory, read_only=True)
        try:
            steps = ckpt.all_steps()
            if not steps:
                raise CheckpointError(f"{ckpt.directory}: holds no checkpoints")
            if step is None:
                step = steps[-1]
            elif step not in steps:
                raise CheckpointError(f"{ckpt.directory}: no checkpoint of step {step} (steps: {steps})")
            return self._read(ckpt, step)
        finally:
            ckpt.close()

    # ------------------------------------------------------------------------------------------ helpers
    def _read(self, ckpt: Checkpointer, step: int) -> Restored:
        """Restore ``step`` (checksums verified by the reader) and check that the state is finite."""
        state, meta = ckpt.restore(step, self.spec.abstract_state)
        bad = nonfinite_leaves({"params": state["params"], "opt_state": state["opt_state"]})
        if bad:
            ckpt.good.discard(step)
            item, _, key = bad[0][2:].partition("']")  # "['params']['embed']": item params, array ['embed']
            files = integrity.leaf_files(ckpt.step_dir(step), item, key)
            raise CheckpointError(f"checkpoint step {step} in {ckpt.directory}: non-finite values (NaN or Inf) in "
                                  f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}"
                                  + (f" (the first in {files[0]})" if files else ""))
        return Restored(state, step, meta)

    def _save(self, ckpt: Checkpointer, step: int, state: dict, skipped: dict, meta: dict) -> bool:
        t0 = time.perf_counter()
        started = ckpt.save(step, state, {"data": self.data_state(step), **skipped,
                                          **self._tokenizer_meta(ckpt, meta), "config": config_lib.to_yaml(self.cfg)})
        if started:
            log.info("checkpoint step %d: save started, blocked %.3f s", step, time.perf_counter() - t0)
        return started

    def _check_tokenizer(self, meta: dict, what: str, field: str) -> None:
        """The checkpoint's tokenizer must be data.tokenizer (``data.allow_tokenizer_mismatch`` overrides)."""
        rec = meta.get("tokenizer")
        run = tokenizer_record.run_record(self.cfg.data)
        if rec is None and meta.get("source") == "hf" and self.cfg.model.vocab_size != run["vocab_size"]:
            log.warning("%s records no tokenizer (its Hugging Face folder had none) and model.vocab_size=%d, but "
                        "data.tokenizer=%s has %d ids: check that the data was prepared with the model's tokenizer",
                        what, self.cfg.model.vocab_size, self.cfg.data.tokenizer, run["vocab_size"])
            return
        tokenizer_record.check_match(run, rec, what, self.cfg.data.allow_tokenizer_mismatch, field)

    def _tokenizer_meta(self, ckpt: Checkpointer, meta: dict) -> dict:
        """The meta entries that let generate/evaluate/export-hf use the model without being told how: the
        tokenizer's record (its files copied into the checkpoint directory once) and the longest sequence
        the model was trained on (``max_positions``: RoPE has no table, so this is the honest limit)."""
        rec = tokenizer_record.run_record(self.cfg.data)
        if jax.process_index() == 0:
            try:
                rec = tokenizer_record.copy_into(ckpt.directory, rec)
            except OSError as err:  # the checkpoint is worth more than the copy: record the identity only
                log.warning("could not copy the tokenizer into %s (%s); the checkpoint records its path and hash",
                            ckpt.directory, err)
        else:  # every process writes the same meta
            rec = {**rec, "copy": os.path.join(f"tokenizer-{rec['sha256'][:12]}", rec["file"])} if rec["sha256"] \
                else rec
        before = meta.get("max_positions") or 0
        return {"tokenizer": rec, "max_positions": max(int(before), self.cfg.data.seq_len)}

    def _check_resumed_data(self, meta: dict) -> None:
        saved, now = meta.get("data", {}), self.data_state(0)
        changed = [k for k in now if k != "next_step" and k in saved and saved[k] != now[k]]
        if changed:
            log.warning("the data settings changed since the checkpoint (%s): the batches after resuming are "
                        "not the ones the original run would have seen", ", ".join(
                            f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed))

    def data_state(self, next_step: int) -> dict:
        """The data-iterator state: batch k is a pure function of these settings and k."""
        d, t = self.cfg.data, self.cfg.train
        return {"next_step": next_step, "source": d.source, "paths": d.paths, "split": d.split,
                "seq_len": d.seq_len, "seed": t.seed, "global_batch_size": t.global_batch_size,
                "num_samples": t.steps * t.global_batch_size}  # the sample shuffle depends on it, as Megatron's
