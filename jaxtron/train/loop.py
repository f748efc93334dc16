"""The training run: config -> mesh -> sharded state -> jitted step -> metrics, evaluation.

:class:`Trainer` (``jaxtron.Trainer``) holds the pieces and runs them: :meth:`Trainer.step` is one optimizer
step, :meth:`Trainer.train` the whole loop (data, evaluation, metrics, checkpoints, signals) built on it.
A custom loss (``loss_fn``) and :class:`Callback` objects extend it without copying the loop."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtron import config as config_lib
from flax import nnx

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
from jaxtron.parallel.sharding import use_rules
from jaxtron.train.step import (BATCH_KEYS, accumulation_steps, batch_sharding, make_eval_step, make_loss_and_grads,
                                 make_train_step)

log = logging.getLogger("jaxtron")


@dataclass
class TrainResult:
    """What :meth:`Trainer.train` did."""

    steps: int                                        # train.steps
    losses: list = field(default_factory=list)       # (step, train loss) at every log point
    eval_losses: list = field(default_factory=list)  # (step, held-out loss)
    initial_eval_loss: Optional[float] = None         # held-out loss before the first step (fresh runs)
    compile_seconds: float = 0.0
    state: Optional[dict] = None                      # the final train state {"step", "params", "opt_state"}
    start_step: int = 0                               # > 0 when resumed from a checkpoint
    final_step: int = 0
    skipped_steps: int = 0
    stopped_by: Optional[str] = None                  # "SIGTERM"/"SIGINT"/a request_stop reason, when stopped early


RunResult = TrainResult  # the former name


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


class Callback:
    """Hooks into :class:`Trainer`. Subclass it and override the hooks you need (all default to doing nothing);
    pass instances as ``Trainer(cfg, callbacks=[...])``. A plain function ``fn(step, metrics, trainer)`` given
    as a callback is called as :meth:`on_log`.

    ``step`` is always the number of optimizer steps done (1 after the first step). Callbacks run on every
    process of a multi-process run. To end training early, call ``trainer.request_stop(reason)``: the loop
    saves a checkpoint after the current step and returns (the next ``train()`` resumes from there)."""

    def on_train_begin(self, step: int, trainer: "Trainer") -> None:
        """Before the first step of :meth:`Trainer.train`; ``step`` > 0 when it resumed from a checkpoint."""

    def on_step(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """After every optimizer step (in ``train()`` and in ``step()``). ``metrics`` holds device scalars:
        reading one (``float(metrics["loss"])``) waits for the step to finish, so read sparingly."""

    def on_log(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """Every ``logging.log_every`` steps (and at the last) in ``train()``: ``metrics`` is the record about to
        be written to ``metrics.jsonl`` and TensorBoard (host floats: loss, grad_norm, lr, throughput, MFU,
        aux entries of a custom loss). Entries a callback adds to it are written too."""

    def on_eval(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """After each held-out evaluation in ``train()``: ``metrics == {"eval_loss": float}``."""

    def on_train_end(self, step: int, result: TrainResult, trainer: "Trainer") -> None:
        """When ``train()`` returns (done, or stopped by a signal or ``request_stop``); not when it raises."""


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable):
        self.fn = fn

    def on_log(self, step, metrics, trainer):
        self.fn(step, metrics, trainer)


def _as_callback(cb) -> Callback:
    if isinstance(cb, Callback):
        return cb
    if callable(cb):
        return _FunctionCallback(cb)
    raise TypeError(f"Trainer: callbacks must be Callback instances or functions fn(step, metrics, trainer), "
                    f"got {type(cb).__name__}")


class Trainer:
    """A training run built from a validated config: the mesh, the logical-axis rules, the optimizer, the
    abstract (sharded) state, the jitted train and eval steps, and the loop.

        trainer = jaxtron.Trainer(cfg)
        result = trainer.train()                     # the whole run, as `python -m jaxtron.train` does it

        trainer = jaxtron.Trainer(cfg, loss_fn=my_loss, callbacks=[MyCallback()])
        for k in range(10):                          # or drive it yourself, one optimizer step at a time
            metrics = trainer.step(trainer.batch(k))
        print(float(metrics["loss"]), trainer.evaluate())

    ``devices``: the devices of the mesh (default: all); ``cfg.parallel`` sizes must multiply to their number.

    ``loss_fn(model, batch) -> (loss_sum, aux)`` replaces the built-in loss (next-token cross entropy plus
    ``optim.z_loss``) inside the jitted step, so it composes with gradient accumulation and every parallel
    layout. ``model`` is the :class:`~jaxtron.model.Llama` (call it as
    ``model(batch["inputs"], batch["positions"], batch["segment_ids"])`` for logits ``[batch, seq, vocab]``);
    ``batch`` is one micro batch (the keys of :meth:`step`). Return the loss **summed** over the tokens, not
    averaged: the step adds the sums of all micro batches and divides by the number of loss tokens of the
    global batch (the sum of ``loss_mask``), so accumulation equals one big batch exactly. ``aux`` is ``None``
    or a dict of scalar sums, treated the same way (summed, divided by the token count) and reported in the
    metrics under their names. The reported ``loss`` is ``loss_sum / tokens`` (the built-in loss reports the
    cross entropy without its z-loss term). Held-out evaluation always measures plain cross entropy.
    :func:`jaxtron.train.loss.cross_entropy_sums` is the built-in's building block.

    ``callbacks``: :class:`Callback` instances or functions ``fn(step, metrics, trainer)`` (called at log
    points).

    ``state`` (``{"step", "params", "opt_state"}``, sharded on the mesh) is created on first use, freshly
    initialized; :meth:`train` first restores the newest checkpoint in ``checkpoint.dir`` (or loads
    ``checkpoint.load_weights``) unless this trainer has already stepped."""

    def __init__(self, cfg: Config, devices=None, *, loss_fn: Optional[Callable] = None,
                 callbacks: Iterable = ()):
        if not isinstance(cfg, Config):
            raise TypeError(f"Trainer: cfg must be a jaxtron Config (see jaxtron.load_config), got "
                            f"{type(cfg).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Trainer: loss_fn must be a function loss_fn(model, batch) -> (loss_sum, aux), got "
                            f"{type(loss_fn).__name__}")
        self.cfg = cfg
        devices = list(devices if devices is not None else jax.devices())
        self.mesh_shape = config_lib.validate_for_devices(cfg, len(devices), devices[0].platform)
        self.mesh = build_mesh(cfg.parallel, devices)
        self.rules = logical_rules(cfg.parallel)
        self.dp = self.mesh_shape["data"] * self.mesh_shape["fsdp"]
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.train.steps)
        self.spec = abstract_train_state(cfg, self.tx, self.mesh, self.rules)
        self.loss_fn = loss_fn
        self.callbacks = [_as_callback(cb) for cb in callbacks]
        self._state: Optional[dict] = None
        self._step_count: Optional[int] = None  # host copy of state["step"] (None: read it from the state)
        self._jitted_train_step = make_train_step(cfg, self.spec, self.tx, self.schedule, self.mesh, self.rules,
                                                  self.dp, loss_fn=loss_fn)
        self.train_step = self._jitted_train_step  # train() replaces it with its ahead-of-time compiled form
        self.eval_step = make_eval_step(cfg, self.spec, self.mesh, self.rules, self.dp)
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        self.num_devices = len(devices)
        peak = cfg.train.peak_tflops or device_peak_tflops(devices[0].device_kind)
        self.peak_flops = peak * 1e12 if peak else None
        self.meta: dict = {}  # what the checkpoint this run resumed from recorded (empty when fresh)
        self.skipped = {"skipped_total": 0, "skipped_in_a_row": 0}
        self._data = None
        self._stop_reason: Optional[str] = None
        self._kernels_checked = False
        self._grad_fn = None

    # ------------------------------------------------------------------------------------------ state
    @property
    def state(self) -> dict:
        """The train state ``{"step", "params", "opt_state"}``, sharded on the mesh (created on first use)."""
        if self._state is None:
            self._state = jax.jit(self.spec.init_fn, out_shardings=self.spec.state_shardings)()
            self._step_count = 0
        return self._state

    @state.setter
    def state(self, value: dict) -> None:
        self._state = value
        self._step_count = None

    @property
    def step_count(self) -> int:
        """Optimizer steps the state has taken (``state["step"]``)."""
        if self._step_count is None:
            self._step_count = int(self.state["step"])
        return self._step_count

    @property
    def model(self):
        """The :class:`~jaxtron.model.Llama` with the current parameters (the state's own arrays, sharded on
        the mesh, not a copy), e.g. for ``jaxtron.generate``. The train step donates the state's buffers, so
        take it again after further steps."""
        return nnx.merge(self.spec.graphdef, self.state["params"])

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.spec.abstract_state["params"])))

    # ------------------------------------------------------------------------------------------- data
    @property
    def data(self):
        """The run's data (``data.source``: the built-in corpus or indexed datasets), built on first use.
        Anything with ``train_batch(step, batch_size)`` and ``valid_batches(num, batch_size)`` may be set."""
        if self._data is None:
            self._data = make_corpus(self.cfg)
        return self._data

    @data.setter
    def data(self, value) -> None:
        self._data = value

    def batch(self, step: int) -> dict:
        """Global training batch ``step`` of :attr:`data` as host arrays (a pure function of the config and
        ``step``: the batch ``train()`` feeds to optimizer step ``step + 1``)."""
        return self.data.train_batch(int(step), self.cfg.train.global_batch_size)

    def _device_batch(self, batch: Mapping) -> dict:
        """A global batch on the mesh; missing positions/segment_ids/loss_mask get their defaults."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch: must be a dict of arrays with keys {BATCH_KEYS}, got {type(batch).__name__}")
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown:
            raise ValueError(f"batch: unknown key(s) {unknown}; expected {BATCH_KEYS}")
        shape = (self.cfg.train.global_batch_size, self.cfg.data.seq_len)
        out = {}
        for key in BATCH_KEYS:
            value = batch.get(key)
            if value is None:
                if key in ("inputs", "targets"):
                    raise ValueError(f"batch[{key!r}]: missing (token ids of shape {list(shape)})")
                value = (np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape) if key == "positions"
                         else np.ones(shape, np.float32 if key == "loss_mask" else np.int32))
            if tuple(value.shape) != shape:
                raise ValueError(f"batch[{key!r}]: shape {list(value.shape)}, expected [train.global_batch_size, "
                                 f"data.seq_len] = {list(shape)}")
            if isinstance(value, jax.Array):
                if not value.sharding.is_equivalent_to(self.batch_sharding, value.ndim):
                    value = jax.device_put(value, self.batch_sharding)
                out[key] = value
            else:
                out[key] = np.asarray(value, np.float32 if key == "loss_mask" else np.int32)
        host = {k: v for k, v in out.items() if not isinstance(v, jax.Array)}
        return {**out, **put_batch(host, self.batch_sharding)} if host else out

    # ------------------------------------------------------------------------------------------- step
    def step(self, batch: Mapping) -> dict:
        """One optimizer step on the global ``batch``; returns its metrics and calls the callbacks' ``on_step``.

        ``batch``: a dict of ``[train.global_batch_size, data.seq_len]`` arrays: ``inputs`` and ``targets``
        (token ids), optionally ``positions`` (default 0..seq_len-1), ``segment_ids`` (default all 1: one
        document per row; attention follows them only with ``data.reset_at_eod=true``, as Megatron's
        reset_attention_mask, else it is plain causal) and ``loss_mask`` (default all 1). Host (numpy) arrays are put on the mesh; global
        ``jax.Array`` s pass through (a multi-process run needs those, or the same host batch on every process).

        Metrics (device scalars; reading one waits for the step): ``loss`` (per loss token), ``grad_norm``,
        ``lr``, ``tokens``, ``skipped`` (a non-finite loss or gradient norm skips the update), and the aux
        entries of a custom loss."""
        device_batch = self._device_batch(batch)
        done = self.step_count + 1
        self.state, metrics = self.train_step(self.state, device_batch)
        self._step_count = done
        for cb in self.callbacks:
            cb.on_step(done, metrics, self)
        return metrics

    def gradients(self, batch: Mapping) -> tuple[dict, dict]:
        """``(grads, metrics)`` of the global ``batch`` at the current parameters, without updating them: the
        fp32 gradient of the loss per loss token (what the train step hands the optimizer, before clipping),
        through the same accumulation or pipeline path, and ``loss``, ``grad_norm``, ``tokens``."""
        if self._grad_fn is None:
            loss_and_grads = make_loss_and_grads(self.cfg, self.spec, self.mesh, self.rules, self.dp,
                                                 self.loss_fn)

            def grads(params, batch):
                with use_rules(self.rules, self.mesh):
                    (ce, n, _), g = loss_and_grads(params, batch)
                    n = jnp.maximum(n, 1.0)
                    g = jax.tree.map(lambda x: x / n, g)
                    return g, {"loss": ce / n, "grad_norm": optax.global_norm(g), "tokens": n}

            self._grad_fn = jax.jit(grads, in_shardings=(self.spec.param_shardings, self.batch_sharding))
        return self._grad_fn(self.state["params"], self._device_batch(batch))

    def request_stop(self, reason: str = "request_stop") -> None:
        """Ask :meth:`train` to stop after the current step (it saves a checkpoint first); for callbacks."""
        self._stop_reason = str(reason)

    def log_summary(self) -> None:
        """The start-up summary: model size, steps, batch, accumulation and the pipeline schedule's bubble."""
        cfg = self.cfg
        accum = accumulation_steps(cfg, self.dp)
        log.info("model: %.2fM params; %d steps of %d x %d tokens; %s %d",
                 self.num_params / 1e6, cfg.train.steps, cfg.train.global_batch_size, cfg.data.seq_len,
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
        if self._state is not None and self.step_count > 0:
            log.info("continuing from this trainer's state at step %d", self.step_count)
            return self.step_count
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
            self._step_count = step
            self._check_resumed_data()
            self._restore_skipped()
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

    def _save(self, ckpt: Optional[Checkpointer], step: int) -> None:
        if ckpt is None:
            return
        t0 = time.perf_counter()
        ckpt.save(step, self.state, {"data": self._data_state(step), **self.skipped,
                                     "config": config_lib.to_yaml(self.cfg)})
        log.info("checkpoint step %d: save started, blocked %.3f s", step, time.perf_counter() - t0)

    def save(self, directory: Optional[str] = None) -> str:
        """Save the current state as a checkpoint of step ``state["step"]`` in ``directory`` (default:
        ``checkpoint.dir``, i.e. ``<train.output_dir>/checkpoints``) and wait until it is complete; returns the
        step directory. ``train()``, ``restore()``, ``jaxtron.load_model`` and ``export_hf`` read it. Old
        checkpoints are pruned as ``checkpoint.keep``/``keep_every`` say."""
        c = self.cfg.checkpoint
        ckpt = Checkpointer(directory or config_lib.checkpoint_dir(self.cfg), keep=c.keep, keep_every=c.keep_every,
                            async_save=False)
        try:
            self._save(ckpt, self.step_count)
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
            self.state, self.meta = ckpt.restore(step, self.spec.abstract_state)
        finally:
            ckpt.close()
        self._restore_skipped()
        self._step_count = step
        return step

    # ------------------------------------------------------------------------------------ train / eval
    def evaluate(self, data=None) -> float:
        """Mean held-out cross entropy per token over ``train.eval_batches`` batches of ``data`` (default:
        :attr:`data`)."""
        data = data if data is not None else self.data
        total, count = 0.0, 0.0
        for b in data.valid_batches(self.cfg.train.eval_batches, self.cfg.train.global_batch_size):
            out = self.eval_step(self.state["params"], put_batch(b, self.batch_sharding))
            total += float(out["loss_sum"])
            count += float(out["tokens"])
        return total / max(count, 1.0)

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
        start = self._restore_or_init(ckpt)
        result = TrainResult(steps=t.steps, start_step=start, final_step=start)
        skipped = self.skipped
        result.skipped_steps = skipped["skipped_total"]
        if start >= t.steps:
            log.info("the checkpoint is at step %d and train.steps=%d: nothing to do", start, t.steps)
            result.state = self.state
            return result
        self._check_kernels()
        data = self.data
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        fpt = {c: flops_per_token(cfg.model, cfg.data.seq_len, c) for c in ("full", "causal")}

        stream = batch_stream(data, t.global_batch_size, start, t.steps)
        first = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
        t0 = time.perf_counter()
        self.train_step = self._jitted_train_step.lower(self.state, first).compile()
        result.compile_seconds = time.perf_counter() - t0
        log.info("compiled the train step in %.1f s on %d devices, mesh %s", result.compile_seconds,
                 self.num_devices, self.mesh_shape)

        writer = MetricsWriter(t.output_dir, t.steps, cfg.logging.tensorboard, cfg.logging.progress, start)
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
                        m = jax.device_get(metrics)
                        step_time = (time.perf_counter() - window_start) / window_steps
                        record = self._throughput(m, step_time, tokens_per_step, fpt)
                        record["skipped_steps"] = skipped["skipped_total"]
                        for cb in self.callbacks:
                            cb.on_log(done, record, self)
                        result.losses.append((done, float(m["loss"])))
                        writer.write(done, record)
                        window_start, window_steps = time.perf_counter(), 0
                    if skipped["skipped_in_a_row"] >= t.max_skipped_steps:
                        self._save(ckpt, done)
                        raise TrainingAborted(
                            f"stopped at step {done}: {skipped['skipped_in_a_row']} steps in a row had a non-finite "
                            f"loss or gradient norm (train.max_skipped_steps={t.max_skipped_steps})"
                            + (f"; the state is saved in {ckpt.step_dir(done)}" if ckpt else ""))
                    if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                        loss = self.evaluate(data)
                        result.eval_losses.append((done, loss))
                        writer.write(done, {"eval_loss": loss})
                        log.info("step %d: held-out loss %.4f", done, loss)
                        for cb in self.callbacks:
                            cb.on_eval(done, {"eval_loss": loss}, self)
                        window_start, window_steps = time.perf_counter(), 0
                    stop = signals.received or self._stop_reason
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


Run = Trainer  # the former name


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


def run(cfg: Config) -> TrainResult:
    """What ``python -m jaxtron.train`` does: log to stderr, write ``<output_dir>/config.yaml``, train."""
    setup_logging(cfg.logging.level)
    if jax.process_index() == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        with open(os.path.join(cfg.train.output_dir, "config.yaml"), "w") as f:
            f.write(config_lib.to_yaml(cfg))
    trainer = Trainer(cfg)
    trainer.log_summary()
    return trainer.train()
