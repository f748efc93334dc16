"""Checkpoints of a :class:`~jaxtron.train.loop.Trainer`: open, save, restore, resume (with its fallback to an
older checkpoint) or load initial weights, and the data-iterator state a checkpoint records."""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import jax
import numpy as np

from jaxtron import config as config_lib
from jaxtron.checkpoint import CheckpointError, Checkpointer, load_params, nonfinite_leaves
from jaxtron.model import fp8
from jaxtron.checkpoint.manager import CheckpointMismatch

log = logging.getLogger("jaxtron")


class TrainerCheckpoints:
    """The checkpoint methods of :class:`~jaxtron.train.loop.Trainer` (a mixin: it uses the trainer's
    ``cfg``, ``spec``, ``tx``, ``state``, ``meta`` and ``skipped``)."""

    def _open_checkpoints(self) -> Optional[Checkpointer]:
        c = self.cfg.checkpoint
        if not c.enabled:
            return None
        return Checkpointer(config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                            async_save=c.async_save)

    def _restore_or_init(self, ckpt: Optional[Checkpointer]) -> int:
        """Set ``self.state``; returns the step to start from."""
        c = self.cfg.checkpoint
        if self._state is not None and self.step_count > 0:
            log.info("continuing from this trainer's state at step %d", self.step_count)
            return self.step_count
        steps = ckpt.all_steps() if (ckpt is not None and c.resume) else []
        set_aside = []
        for step in reversed(steps):
            try:
                t0 = time.perf_counter()
                self.state, self.meta = self._restore_checked(ckpt, step)
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
            self._step_count = step
            self._check_resumed_data()
            self._check_tokenizer(self.meta, f"checkpoint step {step} in {ckpt.directory}", "data.tokenizer")
            self._restore_skipped()
            return step
        if steps:
            raise CheckpointError(f"none of the checkpoints {steps} in {ckpt.directory} could be read")
        if c.load_weights:
            t0 = time.perf_counter()
            abstract = self.spec.abstract_state["params"]
            params, meta = load_params(c.load_weights, fp8.weights_only(abstract))
            params = fp8.with_fresh_histories(params, abstract)
            self._check_tokenizer(meta, c.load_weights, "checkpoint.load_weights")
            self.meta = {"max_positions": meta.get("max_positions")}  # what the weights were trained for
            opt_init = jax.jit(self.tx.init, out_shardings=self.spec.state_shardings["opt_state"])
            step0 = jax.device_put(np.zeros((), np.int32), self.spec.state_shardings["step"])
            self.state = {"step": step0, "params": params, "opt_state": opt_init(params)}
            log.info("loaded weights from %s (step %s) in %.1f s; fresh optimizer state", c.load_weights,
                     meta.get("step"), time.perf_counter() - t0)
        else:
            self.state  # noqa: B018  (initialize)
        return 0

    def _restore_checked(self, ckpt: Checkpointer, step: int) -> tuple[dict, dict]:
        """Restore ``step`` (checksums verified by the reader) and check that the state is finite."""
        state, meta = ckpt.restore(step, self.spec.abstract_state)
        bad = nonfinite_leaves({"params": state["params"], "opt_state": state["opt_state"]})
        if bad:
            ckpt.good.discard(step)
            raise CheckpointError(f"checkpoint step {step} in {ckpt.directory}: non-finite values (NaN or Inf) in "
                                  f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
        return state, meta

    def _check_tokenizer(self, meta: dict, what: str, field: str) -> None:
        """The checkpoint's tokenizer must be data.tokenizer (``data.allow_tokenizer_mismatch`` overrides)."""
        from jaxtron.data import tokenizer_record

        rec = meta.get("tokenizer")
        run = tokenizer_record.run_record(self.cfg.data)
        if rec is None and meta.get("source") == "hf" and self.cfg.model.vocab_size != run["vocab_size"]:
            log.warning("%s records no tokenizer (its Hugging Face folder had none) and model.vocab_size=%d, but "
                        "data.tokenizer=%s has %d ids: check that the data was prepared with the model's tokenizer",
                        what, self.cfg.model.vocab_size, self.cfg.data.tokenizer, run["vocab_size"])
            return
        tokenizer_record.check_match(run, rec, what, self.cfg.data.allow_tokenizer_mismatch, field)

    def _tokenizer_meta(self, ckpt: Checkpointer) -> dict:
        """The meta entries that let generate/evaluate/export-hf use the model without being told how: the
        tokenizer's record (its files copied into the checkpoint directory once) and the longest sequence
        the model was trained on (``max_positions``: RoPE has no table, so this is the honest limit)."""
        from jaxtron.data import tokenizer_record

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
        before = self.meta.get("max_positions") or 0
        return {"tokenizer": rec, "max_positions": max(int(before), self.cfg.data.seq_len)}

    def _restore_skipped(self) -> None:
        self.skipped = {k: int(self.meta.get(k, 0)) for k in ("skipped_total", "skipped_in_a_row")}

    def _check_resumed_data(self) -> None:
        saved, now = self.meta.get("data", {}), self._data_state(0)
        changed = [k for k in now if k != "next_step" and k in saved and saved[k] != now[k]]
        if changed:
            log.warning("the data settings changed since the checkpoint (%s): the batches after resuming are "
                        "not the ones the original run would have seen", ", ".join(
                            f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed))

    def _data_state(self, next_step: int) -> dict:
        """The data-iterator state: batch k is a pure function of these settings and k."""
        d, t = self.cfg.data, self.cfg.train
        return {"next_step": next_step, "source": d.source, "paths": d.paths, "split": d.split,
                "seq_len": d.seq_len, "seed": t.seed, "global_batch_size": t.global_batch_size,
                "num_samples": t.steps * t.global_batch_size}  # the sample shuffle depends on it, as Megatron's

    def _save(self, ckpt: Optional[Checkpointer], step: int) -> bool:
        """Start a save (see :meth:`Checkpointer.save`); False when it was not started or was refused."""
        if ckpt is None:
            return False
        t0 = time.perf_counter()
        started = ckpt.save(step, self.state, {"data": self._data_state(step), **self.skipped,
                                               **self._tokenizer_meta(ckpt), "config": config_lib.to_yaml(self.cfg)})
        if started:
            log.info("checkpoint step %d: save started, blocked %.3f s", step, time.perf_counter() - t0)
        return started

    def _saved_note(self, ckpt: Optional[Checkpointer], step: int) -> str:
        """Where the state of ``step`` went, for a message (waits for the save)."""
        if ckpt is None:
            return ""
        ckpt.wait()
        if step in ckpt.refused:
            newest = ckpt.newest_good() or ckpt.latest_step()
            return (f"; the state was not saved ({ckpt.refused[step]})" +
                    (f", the newest checkpoint is {ckpt.step_dir(newest)}" if newest is not None else ""))
        return f"; the state is saved in {ckpt.step_dir(step)}"

    def save(self, directory: Optional[str] = None) -> str:
        """Save the current state as a checkpoint of step ``state["step"]`` in ``directory`` (default:
        ``checkpoint.dir``, i.e. ``<train.output_dir>/checkpoints``) and wait until it is complete; returns the
        step directory. ``train()``, ``restore()``, ``jaxtron.load_model`` and ``export_hf`` read it. Old
        checkpoints are pruned as ``checkpoint.keep``/``keep_every`` say. A state with NaN or Inf is not saved
        (:class:`~jaxtron.checkpoint.CheckpointError`)."""
        c = self.cfg.checkpoint
        ckpt = Checkpointer(directory or config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                            async_save=False)
        try:
            self._save(ckpt, self.step_count)
            if self.step_count in ckpt.refused:
                raise CheckpointError(f"checkpoint step {self.step_count} not saved: {ckpt.refused[self.step_count]}")
            return ckpt.step_dir(self.step_count)
        finally:
            ckpt.close()

    def restore(self, directory: Optional[str] = None, step: Optional[int] = None) -> int:
        """Restore the train state from checkpoint ``step`` (default: the newest) in ``directory`` (default:
        ``checkpoint.dir``) onto this trainer's mesh (any mesh it was saved from); returns the step. Raises
        :class:`~jaxtron.checkpoint.CheckpointError` naming the directory when there is none."""
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
            self.state, self.meta = self._restore_checked(ckpt, step)
        finally:
            ckpt.close()
        self._restore_skipped()
        self._step_count = step
        return step
