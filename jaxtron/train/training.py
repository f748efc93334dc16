"""The loop of :meth:`Trainer.train <jaxtron.train.loop.Trainer.train>`: resume, compile, step, log metrics
(throughput, MFU), evaluate, checkpoint, and stop cleanly on signals, ``request_stop`` or too many skipped
steps."""

from __future__ import annotations

import logging
import time
from typing import Optional

import jax
import numpy as np
import yaml

from jaxtron.checkpoint import Checkpointer
from jaxtron.data.loader import batch_stream, put_local_batch
from jaxtron.train.callbacks import TrainingAborted, TrainResult
from jaxtron.train.flops import flops_per_token
from jaxtron.train.metrics import MetricsWriter, device_memory, log_line
from jaxtron.train.preemption import StopSignals

log = logging.getLogger("jaxtron")


def _agree(flag: bool) -> bool:
    """True on every process when any process has ``flag`` (so all stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


class TrainerLoop:
    """The training loop of :class:`~jaxtron.train.loop.Trainer` (a mixin: it drives the trainer's ``step``,
    ``evaluate``, checkpoint methods and callbacks)."""

    def train(self, data=None) -> TrainResult:
        """Run to ``train.steps``: resume (or load weights), evaluate, step, log ``metrics.jsonl``/TensorBoard,
        checkpoint, stop cleanly on SIGTERM/SIGINT or :meth:`request_stop`. ``data`` replaces :attr:`data`."""
        if data is not None:
            self.data = data
        ckpt = self._open_checkpoints()
        try:
            return self._train(ckpt)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for a save in flight

    def _check_kernels(self) -> None:
        """On GPUs, the selected Pallas/Mosaic kernels against XLA, once per trainer (kernel_check.py); a
        disagreement raises KernelCheckError (a ConfigError naming the field)."""
        from jaxtron.train.kernel_check import check_kernels, needs_check

        if not self._kernels_checked and needs_check(self.cfg, self.mesh.devices.flat[0].platform):
            check_kernels(self.cfg)
        self._kernels_checked = True

    def _train(self, ckpt: Optional[Checkpointer]) -> TrainResult:
        cfg = self.cfg
        t = cfg.train
        self._stop_reason = None
        began = time.monotonic()  # train.exit_after_minutes counts from here
        start = self._restore_or_init(ckpt)
        self._warn_changed_steps(start)
        result = TrainResult(steps=t.steps, start_step=start, final_step=start)
        skipped = self.skipped
        result.skipped_steps = skipped["skipped_total"]
        if start >= t.steps:
            log.info("the checkpoint is at step %d and train.steps=%d: nothing to do", start, t.steps)
            result.state = self.state
            return result
        self._check_kernels()
        data = self.data
        fpt = {c: flops_per_token(cfg.model, cfg.data.seq_len, c) for c in ("full", "causal")}

        stream = batch_stream(data, t.global_batch_size, start, t.steps)
        first = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
        t0 = time.perf_counter()
        self.train_step = self._jitted_train_step.lower(self.state, first).compile()
        result.compile_seconds = time.perf_counter() - t0
        log.info("compiled the train step in %.1f s on %d devices, mesh %s", result.compile_seconds,
                 self.num_devices, self.layout.describe())

        writer = MetricsWriter(t.output_dir, t.steps, cfg.logging.tensorboard, cfg.logging.progress, start)
        if writer.dropped:
            log.info("metrics.jsonl: dropped %d row(s) after step %d that this run writes again", writer.dropped,
                     start)
        try:
            for cb in self.callbacks:
                cb.on_train_begin(start, self)
            if start == 0:
                result.initial_eval_loss = self.evaluate(data)
                writer.write(0, {"eval_loss": result.initial_eval_loss})
                log.info("step 0: held-out loss %.4f", result.initial_eval_loss)
            window_start, window_steps = time.perf_counter(), 0
            batch = first
            with StopSignals() as signals:
                for step in range(start, t.steps):
                    metrics = self.step(batch)
                    done = step + 1
                    if done < t.steps:  # prepare the next batch while the device works
                        batch = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
                    result.final_step = done
                    if bool(metrics["skipped"]):
                        skipped["skipped_total"] += 1
                        skipped["skipped_in_a_row"] += 1
                        log.warning("step %d: loss %s, gradient norm %s: not finite, update skipped (%d in a row)",
                                    done, float(metrics["loss"]), float(metrics["grad_norm"]),
                                    skipped["skipped_in_a_row"])
                    else:
                        skipped["skipped_in_a_row"] = 0
                    result.skipped_steps = skipped["skipped_total"]
                    window_steps += 1
                    writer.advance()
                    if done % cfg.logging.log_every == 0 or done == t.steps:
                        step_time = (time.perf_counter() - window_start) / window_steps
                        self._log_step(done, jax.device_get(metrics), step_time, fpt, writer, result)
                        window_start, window_steps = time.perf_counter(), 0
                    if skipped["skipped_in_a_row"] >= t.max_skipped_steps:
                        self._save(ckpt, done)
                        raise TrainingAborted(
                            f"stopped at step {done}: {skipped['skipped_in_a_row']} steps in a row had a non-finite "
                            f"loss or gradient norm (train.max_skipped_steps={t.max_skipped_steps})"
                            + self._saved_note(ckpt, done))
                    if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                        loss = self.evaluate(data, step=done)
                        result.eval_losses.append((done, loss))
                        writer.write(done, {"eval_loss": loss})
                        log.info("step %d: held-out loss %.4f", done, loss)
                        for cb in self.callbacks:
                            cb.on_eval(done, {"eval_loss": loss}, self)
                        window_start, window_steps = time.perf_counter(), 0
                    stop = signals.received or self._stop_reason or self._exit_due(done, start, began)
                    if _agree(stop is not None):
                        result.stopped_by = stop or "a stop on another process"
                        self._save(ckpt, done)
                        log.warning("stopped by %s after step %d%s", result.stopped_by, done,
                                    f"; checkpoint {ckpt.step_dir(done)}" if ckpt else "")
                        break
                    if ckpt is not None and done < t.steps and cfg.checkpoint.every_steps \
                            and done % cfg.checkpoint.every_steps == 0:
                        self._save(ckpt, done)
                else:
                    self._save(ckpt, t.steps)
        finally:
            writer.close()
        result.state = self.state
        for cb in self.callbacks:
            cb.on_train_end(result.final_step, result, self)
        return result

    def _log_step(self, done: int, m: dict, step_time: float, fpt: dict, writer: MetricsWriter,
                  result: TrainResult) -> None:
        """The metrics of log step ``done``: callbacks, ``metrics.jsonl``/TensorBoard and one log line."""
        t = self.cfg.train
        record = self._throughput(m, step_time, t.global_batch_size * self.cfg.data.seq_len, fpt)
        record["consumed_samples"] = done * t.global_batch_size
        record["consumed_tokens"] = done * t.global_batch_size * self.cfg.data.seq_len
        record.update(device_memory([d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]))
        record["skipped_steps"] = self.skipped["skipped_total"]
        for cb in self.callbacks:
            cb.on_log(done, record, self)
        result.losses.append((done, float(m["loss"])))
        writer.write(done, record)
        log.info("%s", log_line(done, t.steps, record))

    def _exit_due(self, done: int, start: int, began: float) -> Optional[str]:
        """Why the run stops here by ``train.exit_after_steps``/``exit_after_minutes`` (None: it does not)."""
        t = self.cfg.train
        if done >= t.steps:
            return None
        if t.exit_after_steps and done - start >= t.exit_after_steps:
            return f"train.exit_after_steps={t.exit_after_steps}"
        if t.exit_after_minutes and time.monotonic() - began >= 60.0 * t.exit_after_minutes:
            return f"train.exit_after_minutes={t.exit_after_minutes:g}"
        return None

    def _warn_changed_steps(self, start: int) -> None:
        """A resume with another ``train.steps`` than the checkpoint's run changes the learning-rate schedule."""
        saved = self.meta.get("config") if start and jax.process_index() == 0 else None  # one copy
        if not saved:
            return
        try:
            before = int(yaml.safe_load(saved)["train"]["steps"])
        except (yaml.YAMLError, KeyError, TypeError, ValueError):
            return
        if before != self.cfg.train.steps:
            log.warning("train.steps changed since the checkpoint (%d -> %d): the learning-rate schedule "
                        "(optim.schedule=%s) now differs from the one steps 1-%d followed; to stop a run early "
                        "without changing it use train.exit_after_steps or train.exit_after_minutes",
                        before, self.cfg.train.steps, self.cfg.optim.schedule, start)

    def _throughput(self, m: dict, step_time: float, tokens_per_step: int, fpt: dict) -> dict:
        tps = tokens_per_step / step_time
        record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                  "step_time_s": step_time, "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.num_devices}
        for conv, f in fpt.items():
            per_dev = f * tps / self.num_devices
            suffix = "" if conv == "full" else "_causal"
            record[f"tflops_per_device{suffix}"] = per_dev / 1e12
            record[f"mfu{suffix}"] = per_dev / self.peak_flops if self.peak_flops else None
        for k in m:  # a custom loss's aux entries
            if k not in ("loss", "grad_norm", "lr", "tokens", "skipped"):
                record[k] = float(m[k])
        return record
