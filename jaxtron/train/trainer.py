"""The Trainer (``jaxtron.Trainer``): a config's program (``program.py``: layout, sharded state, optimizer,
jitted steps) with its state, data, checkpoints and callbacks. :meth:`Trainer.step` is one optimizer step,
:meth:`Trainer.train` the whole loop (``loop.py``: data, evaluation, metrics, checkpoints, signals) built on it.
A custom loss (``loss_fn``) and :class:`~jaxtron.train.callbacks.Callback` objects extend it without copying
the loop. Also :func:`run`, what ``python -m jaxtron.train`` does.

Beside it: ``checkpointing.py`` (save, restore, resume) and ``callbacks.py`` (``Callback``, ``TrainResult``,
``TrainingAborted``)."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Callable, Iterable, Mapping, Optional

import jax
import numpy as np
from flax import nnx

from jaxtron import config as config_lib
from jaxtron.config import Config
from jaxtron.data.corpus import make_corpus, valid_start_batch
from jaxtron.model.fp8 import Recipe
from jaxtron.model.projection import Matmuls
from jaxtron.model import kernel_check
from jaxtron.parallel.expert import describe_buffers, dispatch_tokens
from jaxtron.train.callbacks import TrainResult, as_callback
from jaxtron.train.checkpointing import Checkpointing, Restored
from jaxtron.train.flops import device_peak_tflops
from jaxtron.train.loop import train_loop
from jaxtron.train import monitoring
from jaxtron.train.program import build_program
from jaxtron.train.step import BATCH_KEYS

log = logging.getLogger("jaxtron")


def put_batch(batch: dict, sharding) -> dict:
    """Host numpy batch (the global batch, identical on every process) -> global sharded arrays."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}


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
        self.program = program = build_program(cfg, devices, loss_fn=loss_fn)
        self.layout, self.spec, self.tx, self.schedule = program.layout, program.spec, program.tx, program.schedule
        self.mesh, self.rules = self.layout.mesh, self.layout.rules
        self.loss_fn = loss_fn
        self.callbacks = [as_callback(cb) for cb in callbacks]
        self.checkpointing = Checkpointing(cfg, self.spec, self.tx)
        self.train_step = program.train_step  # train() replaces it with its ahead-of-time compiled form
        self.eval_step = program.eval_step
        self.batch_sharding = program.batch_sharding
        self.num_devices = len(program.devices)
        peak = cfg.train.peak_tflops or device_peak_tflops(program.devices[0].device_kind)
        self.peak_flops = peak * 1e12 if peak else None
        self.meta: dict = {}  # what the checkpoint this run resumed from recorded (empty when fresh)
        self.skipped = {"skipped_total": 0, "skipped_in_a_row": 0}
        self.data_wait_s = 0.0  # seconds train() has spent fetching batches (read by the health monitor)
        self.stop_requested: Optional[str] = None  # a reason, once request_stop() asked train() to stop
        self._state: Optional[dict] = None
        self._step_count: Optional[int] = None  # host copy of state["step"] (None: read it from the state)
        self._data = None
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
            self._grad_fn = self.program.gradients_step()
        return self._grad_fn(self.state["params"], self._device_batch(batch))

    def request_stop(self, reason: str = "request_stop") -> None:
        """Ask :meth:`train` to stop after the current step (it saves a checkpoint first); for callbacks."""
        self.stop_requested = str(reason)

    def log_summary(self) -> None:
        """The start-up summary: model size, steps, batch, accumulation and the pipeline schedule's bubble."""
        cfg, lay = self.cfg, self.layout
        log.info("model: %.2fM params; %d steps of %d x %d tokens; %s; %s %d",
                 self.num_params / 1e6, cfg.train.steps, cfg.train.global_batch_size, cfg.data.seq_len,
                 lay.describe(), "micro batches" if lay.stages > 1 else "grad accumulation", lay.accumulation_steps)
        if lay.stages > 1:
            p = cfg.parallel
            virtual = f" x {p.virtual_stages} virtual" if p.pipeline_schedule == "circular" else ""
            log.info("pipeline %s: %d stages%s, %d micro batches, bubble %.1f%% (MFU counts only model FLOPs)",
                     p.pipeline_schedule, lay.stages, virtual, lay.accumulation_steps, 100 * lay.bubble)
        cpu = self.mesh.devices.flat[0].platform == "cpu"
        recipe = Recipe.of(cfg.model, Matmuls(cpu=cpu))
        if recipe.name != "none":
            log.info("FP8 matmuls: model.fp8=%s%s", recipe.describe(),
                     "; emulated on CPU (the same quantization; XLA:CPU runs the FP8 dots in wider types)"
                     if cpu else "")
        moe = cfg.model.moe
        if moe.num_experts and moe.dispatch == "dropless" and moe.gmm_impl == "auto":
            log.info("MoE grouped matmuls: model.moe.gmm_impl=auto took %s", "ragged_dot (exact on CPU; the Pallas "
                     "kernel would run interpreted)" if cpu else "pallas, the grouped-GEMM kernel (XLA:GPU runs "
                     "ragged_dot over every expert)" + ("; the routed experts run in model.dtype, not FP8"
                                                       if recipe.name != "none" else ""))
        buffers = describe_buffers(moe, lay.expert, dispatch_tokens(cfg, lay.micro_batch_size, lay.context, lay.tp))
        if buffers:
            log.info(buffers)

    # ------------------------------------------------------------------------------------ train / eval
    def evaluate(self, data=None, step: int | None = None) -> float:
        """Mean held-out cross entropy per token over ``train.eval_batches`` batches of ``data`` (default:
        :attr:`data`). With ``step``, the evaluation after that step reads the validation batches Megatron's
        would (each evaluation continues where the last one stopped; ``data.corpus.valid_start_batch``)."""
        data = data if data is not None else self.data
        t = self.cfg.train
        start = valid_start_batch(step, t.eval_every, t.eval_batches) if step else 0
        # data sources of the two-argument protocol (no ``start``) read their first batches at every evaluation
        kw = {"start": start} if start and "start" in inspect.signature(data.valid_batches).parameters else {}
        total, count = 0.0, 0.0
        for b in data.valid_batches(t.eval_batches, t.global_batch_size, **kw):
            out = self.eval_step(self.state["params"], put_batch(b, self.batch_sharding))
            total += float(out["loss_sum"])
            count += float(out["tokens"])
        return total / max(count, 1.0)

    def train(self, data=None) -> TrainResult:
        """Run to ``train.steps`` (``loop.py``): resume (or load weights), evaluate, step, log
        ``metrics.jsonl``/TensorBoard, checkpoint, stop cleanly on SIGTERM/SIGINT or :meth:`request_stop`.
        ``data`` replaces :attr:`data`."""
        if data is not None:
            self.data = data
        return train_loop(self)

    def check_kernels(self) -> None:
        """On GPUs, the selected Pallas/Mosaic kernels against XLA, once per trainer
        (``jaxtron/model/kernel_check.py``); a disagreement raises KernelCheckError (a ConfigError naming the
        field)."""
        if not self._kernels_checked and kernel_check.needs_check(self.cfg, self.mesh.devices.flat[0].platform):
            kernel_check.check_kernels(self.cfg)
        self._kernels_checked = True

    # ------------------------------------------------------------------------------------- checkpoints
    def resume_or_init(self) -> int:
        """The state ``train()`` starts from: this trainer's own once it has stepped, else the newest checkpoint
        of ``checkpoint.dir`` (``checkpoint.resume``), else ``checkpoint.load_weights``, else a fresh one;
        returns its step."""
        if self._state is not None and self.step_count > 0:
            log.info("continuing from this trainer's state at step %d", self.step_count)
            return self.step_count
        restored = self.checkpointing.resume() or self.checkpointing.load_weights()
        if restored is None:
            self.state  # noqa: B018  (initialize)
            return 0
        self._take(restored)
        return restored.step

    def _take(self, restored: Restored) -> None:
        self._state, self._step_count, self.meta = restored.state, restored.step, restored.meta
        self.skipped = restored.skipped

    def save(self, directory: Optional[str] = None) -> str:
        """Save the current state as a checkpoint of step ``state["step"]`` in ``directory`` (default:
        ``checkpoint.dir``, i.e. ``<train.output_dir>/checkpoints``) and wait until it is complete; returns the
        step directory. ``train()``, ``restore()``, ``jaxtron.load_model`` and ``export_hf`` read it. Old
        checkpoints are pruned as ``checkpoint.keep``/``keep_every`` say. A state with NaN or Inf is not saved
        (:class:`~jaxtron.checkpoint.CheckpointError`)."""
        return self.checkpointing.save_to(directory, self.step_count, self.state, self.skipped, self.meta)

    def restore(self, directory: Optional[str] = None, step: Optional[int] = None) -> int:
        """Restore the train state from checkpoint ``step`` (default: the newest) in ``directory`` (default:
        ``checkpoint.dir``) onto this trainer's mesh (any mesh it was saved from); returns the step. Raises
        :class:`~jaxtron.checkpoint.CheckpointError` naming the directory when there is none."""
        restored = self.checkpointing.restore(directory, step)
        self._take(restored)
        return restored.step


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
    # one voice: processes other than 0 report only errors (the warnings are about state every process shares,
    # so process 0 says them once); what only one process sees goes to "jaxtron.process", at warning level
    logger.setLevel(getattr(logging, level.upper()) if jax.process_index() == 0 else logging.ERROR)
    logging.getLogger("jaxtron.process").setLevel(logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False


def run(cfg: Config) -> TrainResult:
    """What ``python -m jaxtron.train`` does: log to stderr, write ``<output_dir>/config.yaml``, train."""
    setup_logging(cfg.logging.level)
    data = make_corpus(cfg)  # bad data paths fail here, in a second, before the model is built
    # the Layout's checks first: a config that cannot run writes nothing
    trainer = Trainer(cfg, callbacks=monitoring.callbacks(cfg))
    trainer.data = data
    if jax.process_index() == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        with open(os.path.join(cfg.train.output_dir, "config.yaml"), "w") as f:
            f.write(config_lib.to_yaml(cfg))
    trainer.log_summary()
    return trainer.train()
