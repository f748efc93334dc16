"""The training run: config -> mesh -> sharded state -> jitted step -> metrics, evaluation."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from jaxtron import config as config_lib
from jaxtron.config import Config
from jaxtron.data.corpus import make_corpus
from jaxtron.data.loader import batch_stream, put_local_batch
from jaxtron.parallel import build_mesh, logical_rules
from jaxtron.train.flops import device_peak_tflops, flops_per_token
from jaxtron.train.metrics import MetricsWriter
from jaxtron.train.optimizer import make_optimizer
from jaxtron.train.state import init_train_state
from jaxtron.train.step import accumulation_steps, batch_sharding, make_eval_step, make_train_step

log = logging.getLogger("jaxtron")


@dataclass
class RunResult:
    steps: int
    losses: list = field(default_factory=list)       # train loss of every step
    eval_losses: list = field(default_factory=list)  # (step, held-out loss)
    initial_eval_loss: Optional[float] = None
    compile_seconds: float = 0.0
    state: Optional[dict] = None


def put_batch(batch: dict, sharding) -> dict:
    """Host numpy batch (the global batch, identical on every process) -> global sharded arrays."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}


class Run:
    """Everything a training run needs, built from a validated config; ``train()`` runs it."""

    def __init__(self, cfg: Config, devices=None):
        self.cfg = cfg
        devices = list(devices if devices is not None else jax.devices())
        self.mesh_shape = config_lib.validate_for_devices(cfg, len(devices), devices[0].platform)
        self.mesh = build_mesh(cfg.parallel, devices)
        self.rules = logical_rules(cfg.parallel)
        self.dp = self.mesh_shape["data"] * self.mesh_shape["fsdp"]
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.train.steps)
        self.state, self.spec = init_train_state(cfg, self.tx, self.mesh, self.rules)
        self.train_step = make_train_step(cfg, self.spec, self.tx, self.schedule, self.mesh, self.rules, self.dp)
        self.eval_step = make_eval_step(cfg, self.spec, self.mesh, self.rules, self.dp)
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        self.num_devices = len(devices)
        peak = cfg.train.peak_tflops or device_peak_tflops(devices[0].device_kind)
        self.peak_flops = peak * 1e12 if peak else None

    def evaluate(self, data) -> float:
        total, count = 0.0, 0.0
        for b in data.valid_batches(self.cfg.train.eval_batches, self.cfg.train.global_batch_size):
            out = self.eval_step(self.state["params"], put_batch(b, self.batch_sharding))
            total += float(out["loss_sum"])
            count += float(out["tokens"])
        return total / max(count, 1.0)

    def train(self, data=None) -> RunResult:
        cfg = self.cfg
        t = cfg.train
        data = data or make_corpus(cfg)
        result = RunResult(steps=t.steps)
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        fpt = {c: flops_per_token(cfg.model, cfg.data.seq_len, c) for c in ("full", "causal")}

        stream = batch_stream(data, t.global_batch_size, 0, t.steps)
        first = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
        t0 = time.perf_counter()
        self.train_step = self.train_step.lower(self.state, first).compile()
        result.compile_seconds = time.perf_counter() - t0
        log.info("compiled the train step in %.1f s on %d devices, mesh %s", result.compile_seconds,
                 self.num_devices, self.mesh_shape)

        writer = MetricsWriter(t.output_dir, t.steps, cfg.logging.tensorboard, cfg.logging.progress)
        try:
            result.initial_eval_loss = self.evaluate(data)
            writer.write(0, {"eval_loss": result.initial_eval_loss})
            log.info("step 0: held-out loss %.4f", result.initial_eval_loss)
            window_start, window_steps = time.perf_counter(), 0
            batch = first
            for step in range(t.steps):
                self.state, metrics = self.train_step(self.state, batch)
                if step + 1 < t.steps:  # prepare the next batch while the device works
                    batch = put_local_batch(next(stream), self.batch_sharding, t.global_batch_size)
                window_steps += 1
                writer.advance()
                done = step + 1
                if done % cfg.logging.log_every == 0 or done == t.steps:
                    m = jax.device_get(metrics)
                    elapsed = time.perf_counter() - window_start
                    step_time = elapsed / window_steps
                    record = self._throughput(m, step_time, tokens_per_step, fpt)
                    result.losses.append((done, float(m["loss"])))
                    writer.write(done, record)
                    if not math.isfinite(record["loss"]):
                        raise FloatingPointError(f"step {done}: the loss is {record['loss']}")
                    window_start, window_steps = time.perf_counter(), 0
                if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                    loss = self.evaluate(data)
                    result.eval_losses.append((done, loss))
                    writer.write(done, {"eval_loss": loss})
                    log.info("step %d: held-out loss %.4f", done, loss)
                    window_start, window_steps = time.perf_counter(), 0
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


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def run(cfg: Config) -> RunResult:
    setup_logging(cfg.logging.level)
    if jax.process_index() == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        with open(os.path.join(cfg.train.output_dir, "config.yaml"), "w") as f:
            f.write(config_lib.to_yaml(cfg))
    r = Run(cfg)
    log.info("model: %.2fM params; %d steps of %d x %d tokens; grad accumulation %d",
             sum(np.prod(x.shape) for x in jax.tree.leaves(r.state["params"])) / 1e6, cfg.train.steps,
             cfg.train.global_batch_size, cfg.data.seq_len, accumulation_steps(cfg, r.dp))
    return r.train()
