"""The training loop (:func:`train_loop`, what :meth:`Trainer.train <jaxtron.train.trainer.Trainer.train>` runs):
resume, compile, step, log metrics (throughput, MFU), evaluate, checkpoint, and stop cleanly on signals,
``request_stop`` or too many skipped steps. It drives the trainer through its public methods."""

from __future__ import annotations

import logging
import time
from typing import Optional

import jax
import numpy as np
import yaml

from jaxtron.config import Config
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


def train_loop(trainer) -> TrainResult:
    """Run ``trainer`` (a :class:`~jaxtron.train.trainer.Trainer`) to ``train.steps`` in its checkpoint
    directory: resume (or load weights), evaluate, step, log ``metrics.jsonl``/TensorBoard, checkpoint, stop
    cleanly on SIGTERM/SIGINT or ``trainer.request_stop``."""
    ckpt = trainer.checkpointing
    ckpt.open()
    try:
        return _run(trainer, ckpt)
    finally:
        ckpt.close()  # waits for a save in flight


def _run(trainer, ckpt) -> TrainResult:
    cfg = trainer.cfg
    t = cfg.train
    trainer.stop_requested = None
    began = time.monotonic()  # train.exit_after_minutes counts from here
    start = trainer.resume_or_init()
    if start and jax.process_index() == 0:  # one copy
        warn_changed_steps(cfg, trainer.meta, start)
    result = TrainResult(steps=t.steps, start_step=start, final_step=start)
    skipped = trainer.skipped
    result.skipped_steps = skipped["skipped_total"]
    if start >= t.steps:
        log.info("the checkpoint is at step %d and train.steps=%d: nothing to do", start, t.steps)
        result.state = trainer.state
        return result
    trainer.check_kernels()
    data = trainer.data
    fpt = {c: flops_per_token(cfg.model, cfg.data.seq_len, c) for c in ("full", "causal")}

    stream = batch_stream(data, t.global_batch_size, start, t.steps)
    first = put_local_batch(next(stream), trainer.batch_sharding, t.global_batch_size)
    t0 = time.perf_counter()
    trainer.train_step = trainer.program.train_step.lower(trainer.state, first).compile()
    result.compile_seconds = time.perf_counter() - t0
    log.info("compiled the train step in %.1f s on %d devices, mesh %s", result.compile_seconds,
             trainer.num_devices, trainer.layout.describe())
    save = lambda step: ckpt.save(step, trainer.state, trainer.skipped, trainer.meta)  # noqa: E731

    writer = MetricsWriter(t.output_dir, t.steps, cfg.logging.tensorboard, cfg.logging.progress, start)
    if writer.dropped:
        log.info("metrics.jsonl: dropped %d row(s) after step %d that this run writes again", writer.dropped,
                 start)
    try:
        for cb in trainer.callbacks:
            cb.on_train_begin(start, trainer)
        if start == 0:
            result.initial_eval_loss = trainer.evaluate(data)
            writer.write(0, {"eval_loss": result.initial_eval_loss})
            log.info("step 0: held-out loss %.4f", result.initial_eval_loss)
        window_start, window_steps = time.perf_counter(), 0
        batch = first
        with StopSignals() as signals:
            for step in range(start, t.steps):
                metrics = trainer.step(batch)
                done = step + 1
                if done < t.steps:  # prepare the next batch while the device works
                    fetch = time.perf_counter()
                    batch = put_local_batch(next(stream), trainer.batch_sharding, t.global_batch_size)
                    trainer.data_wait_s += time.perf_counter() - fetch
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
                    _log_step(trainer, done, jax.device_get(metrics), step_time, fpt, writer, result)
                    window_start, window_steps = time.perf_counter(), 0
                if skipped["skipped_in_a_row"] >= t.max_skipped_steps:
                    save(done)
                    raise TrainingAborted(
                        f"stopped at step {done}: {skipped['skipped_in_a_row']} steps in a row had a non-finite "
                        f"loss or gradient norm (train.max_skipped_steps={t.max_skipped_steps})"
                        + ckpt.saved_note(done))
                if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                    loss = trainer.evaluate(data, step=done)
                    result.eval_losses.append((done, loss))
                    writer.write(done, {"eval_loss": loss})
                    log.info("step %d: held-out loss %.4f", done, loss)
                    for cb in trainer.callbacks:
                        cb.on_eval(done, {"eval_loss": loss}, trainer)
                    window_start, window_steps = time.perf_counter(), 0
                stop = signals.received or trainer.stop_requested or exit_due(cfg, done, start, began)
                if _agree(stop is not None):
                    result.stopped_by = stop or "a stop on another process"
                    save(done)
                    log.warning("stopped by %s after step %d%s", result.stopped_by, done,
                                f"; checkpoint {ckpt.step_dir(done)}" if ckpt.manager else "")
                    break
                if done < t.steps and cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0:
                    save(done)
            else:
                save(t.steps)
    finally:
        writer.close()
    result.state = trainer.state
    for cb in trainer.callbacks:
        cb.on_train_end(result.final_step, result, trainer)
    return result


def _log_step(trainer, done: int, m: dict, step_time: float, fpt: dict, writer: MetricsWriter,
              result: TrainResult) -> None:
    """The metrics of log step ``done``: callbacks, ``metrics.jsonl``/TensorBoard and one log line."""
    t = trainer.cfg.train
    record = _throughput(trainer, m, step_time, t.global_batch_size * trainer.cfg.data.seq_len, fpt)
    record["consumed_samples"] = done * t.global_batch_size
    record["consumed_tokens"] = done * t.global_batch_size * trainer.cfg.data.seq_len
    record.update(device_memory([d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]))
    record["skipped_steps"] = trainer.skipped["skipped_total"]
    for cb in trainer.callbacks:
        cb.on_log(done, record, trainer)
    result.losses.append((done, float(m["loss"])))
    writer.write(done, record)
    log.info("%s", log_line(done, t.steps, record))


def exit_due(cfg: Config, done: int, start: int, began: float) -> Optional[str]:
    """Why the run stops after step ``done`` by ``train.exit_after_steps``/``exit_after_minutes`` (None: it
    does not); ``start``: the step it started from, ``began``: its ``time.monotonic()`` then."""
    t = cfg.train
    if done >= t.steps:
        return None
    if t.exit_after_steps and done - start >= t.exit_after_steps:
        return f"train.exit_after_steps={t.exit_after_steps}"
    if t.exit_after_minutes and time.monotonic() - began >= 60.0 * t.exit_after_minutes:
        return f"train.exit_after_minutes={t.exit_after_minutes:g}"
    return None


def warn_changed_steps(cfg: Config, meta: dict, start: int) -> None:
    """A resume (at ``start``, from a checkpoint with ``meta``) with another ``train.steps`` than the
    checkpoint's run changes the learning-rate schedule: say so."""
    saved = meta.get("config")
    if not saved:
        return
    try:
        before = int(yaml.safe_load(saved)["train"]["steps"])
    except (yaml.YAMLError, KeyError, TypeError, ValueError):
        return
    if before != cfg.train.steps:
        log.warning("train.steps changed since the checkpoint (%d -> %d): the learning-rate schedule "
                    "(optim.schedule=%s) now differs from the one steps 1-%d followed; to stop a run early "
                    "without changing it use train.exit_after_steps or train.exit_after_minutes",
                    before, cfg.train.steps, cfg.optim.schedule, start)


def _throughput(trainer, m: dict, step_time: float, tokens_per_step: int, fpt: dict) -> dict:
    tps = tokens_per_step / step_time
    record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
              "step_time_s": step_time, "tokens_per_s": tps, "tokens_per_s_per_device": tps / trainer.num_devices}
    for conv, f in fpt.items():
        per_dev = f * tps / trainer.num_devices
        suffix = "" if conv == "full" else "_causal"
        record[f"tflops_per_device{suffix}"] = per_dev / 1e12
        record[f"mfu{suffix}"] = per_dev / trainer.peak_flops if trainer.peak_flops else None
    for k in m:  # a custom loss's aux entries
        if k not in ("loss", "grad_norm", "lr", "tokens", "skipped"):
            record[k] = float(m[k])
    return record
