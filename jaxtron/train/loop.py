"""The training run: config -> mesh -> sharded state -> jitted step -> metrics, evaluation."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from jaxtron import config as config_lib
from jaxtron.checkpoint import CheckpointError, Checkpointer, load_params
from jaxtron.config import Config
from jaxtron.data.corpus import make_corpus
from jaxtron.data.loader import batch_stream, put_local_batch
from jaxtron.parallel import build_mesh, logical_rules
from jaxtron.train.flops import device_peak_tflops, flops_per_token
from jaxtron.train.metrics import MetricsWriter
from jaxtron.train.optimizer import make_optimizer
from jaxtron.train.preemption import StopSignals
from jaxtron.train.state import abstract_train_state
from jaxtron.train.step import accumulation_steps, batch_sharding, make_eval_step, make_train_step

log = logging.getLogger("jaxtron")


@dataclass
class RunResult:
    steps: int
    losses: list = field(default_factory=list)       # (step, train loss) at every log point
    eval_losses: list = field(default_factory=list)  # (step, held-out loss)
    initial_eval_loss: Optional[float] = None
    compile_seconds: float = 0.0
    state: Optional[dict] = None
    start_step: int = 0                               # > 0 when resumed from a checkpoint
    final_step: int = 0
    skipped_steps: int = 0
    stopped_by: Optional[str] = None                  # "SIGTERM"/"SIGINT" when a signal ended the run early


class TrainingAborted(RuntimeError):
    """The run stopped before train.steps for a reason the user must look at (the state is saved)."""


def put_batch(batch: dict, sharding) -> dict:
    """Host numpy batch (the global batch, identical on every process) -> global sharded arrays."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}


def _agree(flag: bool) -> bool:
    """True on every process when any process has ``flag`` (so all stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


class Run:
    """Everything a training run needs, built from a validated config; ``train()`` runs it.

    ``state`` is created on first use: freshly initialized, or (in ``train()``) restored from the newest
    checkpoint in ``checkpoint.dir`` / loaded from ``checkpoint.load_weights``."""

    def __init__(self, cfg: Config, devices=None):
        self.cfg = cfg
        devices = list(devices if devices is not None else jax.devices())
        self.mesh_shape = config_lib.validate_for_devices(cfg, len(devices), devices[0].platform)
        self.mesh = build_mesh(cfg.parallel, devices)
        self.rules = logical_rules(cfg.parallel)
        self.dp = self.mesh_shape["data"] * self.mesh_shape["fsdp"]
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.train.steps)
        self.spec = abstract_train_state(cfg, self.tx, self.mesh, self.rules)
        self._state: Optional[dict] = None
        self.train_step = make_train_step(cfg, self.spec, self.tx, self.schedule, self.mesh, self.rules, self.dp)
        self.eval_step = make_eval_step(cfg, self.spec, self.mesh, self.rules, self.dp)
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        self.num_devices = len(devices)
        peak = cfg.train.peak_tflops or device_peak_tflops(devices[0].device_kind)
        self.peak_flops = peak * 1e12 if peak else None
        self.meta: dict = {}  # what the checkpoint this run resumed from recorded (empty when fresh)

    @property
    def state(self) -> dict:
        if self._state is None:
            self._state = jax.jit(self.spec.init_fn, out_shardings=self.spec.state_shardings)()
        return self._state

    @state.setter
    def state(self, value: dict) -> None:
        self._state = value

    def log_summary(self) -> None:
        """The start-up summary: model size, steps, batch, accumulation and the pipeline schedule's bubble."""
        cfg = self.cfg
        accum = accumulation_steps(cfg, self.dp)
        log.info("model: %.2fM params; %d steps of %d x %d tokens; %s %d",
                 sum(np.prod(x.shape) for x in jax.tree.leaves(self.spec.abstract_state["params"])) / 1e6,
                 cfg.train.steps, cfg.train.global_batch_size, cfg.data.seq_len,
                 "micro batches" if self.mesh_shape["stage"] > 1 else "grad accumulation", accum)
        stages = self.mesh_shape["stage"]
        if stages > 1:
            p = cfg.parallel
            virtual = f" x {p.virtual_stages} virtual" if p.pipeline_schedule == "circular" else ""
            log.info("pipeline %s: %d stages%s, %d micro batches, bubble %.1f%% (MFU counts only model FLOPs)",
                     p.pipeline_schedule, stages, virtual, accum,
                     100 * config_lib.pipeline_bubble(p, stages, accum))

    # ------------------------------------------------------------------------------------ checkpoints
    def _open_checkpoints(self) -> Optional[Checkpointer]:
        c = self.cfg.checkpoint
        if not c.enabled:
            return None
        return Checkpointer(config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                            async_save=c.async_save)

    def _restore_or_init(self, ckpt: Optional[Checkpointer]) -> int:
        """Set ``self.state``; returns the step to start from."""
        c = self.cfg.checkpoint
        steps = ckpt.all_steps() if (ckpt is not None and c.resume) else []
        for i, step in enumerate(reversed(steps)):
            try:
                t0 = time.perf_counter()
                self.state, self.meta = ckpt.restore(step, self.spec.abstract_state)
            except CheckpointError as err:
                if not c.fallback:
                    raise CheckpointError(f"{err}. Set checkpoint.fallback=true to resume from the previous "
                                          f"checkpoint instead, or move {ckpt.step_dir(step)} away") from None
                log.warning("%s; falling back to the previous checkpoint (checkpoint.fallback=true)", err)
                continue
            log.info("resumed from %s (step %d) in %.1f s", ckpt.step_dir(step), step, time.perf_counter() - t0)
            self._check_resumed_data()
            return step
        if steps:
            raise CheckpointError(f"none of the checkpoints {steps} in {ckpt.directory} could be read")
        if c.load_weights:
            t0 = time.perf_counter()
            params, meta = load_params(c.load_weights, self.spec.abstract_state["params"])
            opt_init = jax.jit(self.tx.init, out_shardings=self.spec.state_shardings["opt_state"])
            step0 = jax.device_put(np.zeros((), np.int32), self.spec.state_shardings["step"])
            self.state = {"step": step0, "params": params, "opt_state": opt_init(params)}
            log.info("loaded weights from %s (step %s) in %.1f s; fresh optimizer state", c.load_weights,
                     meta.get("step"), time.perf_counter() - t0)
        else:
            self.state  # noqa: B018  (initialize)
        return 0

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

    def _save(self, ckpt: Optional[Checkpointer], step: int, skipped: dict) -> None:
        if ckpt is None:
            return
        t0 = time.perf_counter()
        ckpt.save(step, self.state, {"data": self._data_state(step), **skipped,
                                     "config": config_lib.to_yaml(self.cfg)})
        log.info("checkpoint step %d: save started, blocked %.3f s", step, time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------ train / eval
    def evaluate(self, data) -> float:
        total, count = 0.0, 0.0
        for b in data.valid_batches(self.cfg.train.eval_batches, self.cfg.train.global_batch_size):
            out = self.eval_step(self.state["params"], put_batch(b, self.batch_sharding))
            total += float(out["loss_sum"])
            count += float(out["tokens"])
        return total / max(count, 1.0)

    def train(self, data=None) -> RunResult:
        ckpt = self._open_checkpoints()
        try:
            return self._train(data, ckpt)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for a save in flight

    def _train(self, data, ckpt: Optional[Checkpointer]) -> RunResult:
        cfg = self.cfg
        t = cfg.train
        start = self._restore_or_init(ckpt)
        result = RunResult(steps=t.steps, start_step=start, final_step=start)
        skipped = {"skipped_total": int(self.meta.get("skipped_total", 0)),
                   "skipped_in_a_row": int(self.meta.get("skipped_in_a_row", 0))}
        result.skipped_steps = skipped["skipped_total"]
        if start >= t.steps:
            log.info("the checkpoint is at step %d and train.steps=%d: nothing to do", start, t.steps)
            result.state = self.state
            return result
        data = data or make_corpus(cfg)
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        fpt = {c: flops_per_token(cfg.model, cfg.data.seq_len, c) for c in ("full", "causal")}

        stream = batch_stream(data, t.global_batch_size, start, t.steps)
        first = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
        t0 = time.perf_counter()
        self.train_step = self.train_step.lower(self.state, first).compile()
        result.compile_seconds = time.perf_counter() - t0
        log.info("compiled the train step in %.1f s on %d devices, mesh %s", result.compile_seconds,
                 self.num_devices, self.mesh_shape)

        writer = MetricsWriter(t.output_dir, t.steps, cfg.logging.tensorboard, cfg.logging.progress, start)
        try:
            if start == 0:
                result.initial_eval_loss = self.evaluate(data)
                writer.write(0, {"eval_loss": result.initial_eval_loss})
                log.info("step 0: held-out loss %.4f", result.initial_eval_loss)
            window_start, window_steps = time.perf_counter(), 0
            batch = first
            with StopSignals() as signals:
                for step in range(start, t.steps):
                    self.state, metrics = self.train_step(self.state, batch)
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
                        m = jax.device_get(metrics)
                        step_time = (time.perf_counter() - window_start) / window_steps
                        record = self._throughput(m, step_time, tokens_per_step, fpt)
                        record["skipped_steps"] = skipped["skipped_total"]
                        result.losses.append((done, float(m["loss"])))
                        writer.write(done, record)
                        window_start, window_steps = time.perf_counter(), 0
                    if skipped["skipped_in_a_row"] >= t.max_skipped_steps:
                        self._save(ckpt, done, skipped)
                        raise TrainingAborted(
                            f"stopped at step {done}: {skipped['skipped_in_a_row']} steps in a row had a non-finite "
                            f"loss or gradient norm (train.max_skipped_steps={t.max_skipped_steps})"
                            + (f"; the state is saved in {ckpt.step_dir(done)}" if ckpt else ""))
                    if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                        loss = self.evaluate(data)
                        result.eval_losses.append((done, loss))
                        writer.write(done, {"eval_loss": loss})
                        log.info("step %d: held-out loss %.4f", done, loss)
                        window_start, window_steps = time.perf_counter(), 0
                    if _agree(signals.received is not None):
                        result.stopped_by = signals.received or "a signal on another process"
                        self._save(ckpt, done, skipped)
                        log.warning("stopped by %s after step %d%s", result.stopped_by, done,
                                    f"; checkpoint {ckpt.step_dir(done)}" if ckpt else "")
                        break
                    if ckpt is not None and done < t.steps and cfg.checkpoint.every_steps \
                            and done % cfg.checkpoint.every_steps == 0:
                        self._save(ckpt, done, skipped)
                else:
                    self._save(ckpt, t.steps, skipped)
        finally:
            writer.close()
        result.state = self.state
        return result

    def _throughput(self, m: dict, step_time: float, tokens_per_step: int, fpt: dict) -> dict:
        tps = tokens_per_step / step_time
        record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                  "step_time_s": step_time, "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.num_devices}
        for conv, f in fpt.items():
            per_dev = f * tps / self.num_devices
            suffix = "" if conv == "full" else "_causal"
            record[f"tflops_per_device{suffix}"] = per_dev / 1e12
            record[f"mfu{suffix}"] = per_dev / self.peak_flops if self.peak_flops else None
        return record


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced, e.g. by pytest's capture)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(level: str) -> None:
    """jaxtron's log lines on stderr. A handler of its own: absl (imported by Orbax) claims the root logger."""
    logger = logging.getLogger("jaxtron")
    # one voice: processes other than 0 report only warnings and errors
    logger.setLevel(getattr(logging, level.upper()) if jax.process_index() == 0 else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False


def run(cfg: Config) -> RunResult:
    setup_logging(cfg.logging.level)
    if jax.process_index() == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        with open(os.path.join(cfg.train.output_dir, "config.yaml"), "w") as f:
            f.write(config_lib.to_yaml(cfg))
    r = Run(cfg)
    r.log_summary()
    return r.train()
