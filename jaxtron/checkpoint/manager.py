"""Training checkpoints: an Orbax ``CheckpointManager`` over three items per step.

    <dir>/<step>/params      the parameters (shard format, ``shards.py``)
    <dir>/<step>/opt_state   the optimizer state (shard format)
    <dir>/<step>/meta        JSON: step, data-iterator state, skip counters, seed, the run's config (YAML)

Params and optimizer state are separate items so that loading weights for fine-tuning reads only the
params. A step directory appears only when all items of all processes are written (Orbax writes into a
temporary directory and renames it), so a killed save never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxtron.checkpoint.handler import ShardedArraysHandler, ShardedRestore, ShardedSave
from jaxtron.checkpoint.shards import CheckpointReadError

log = logging.getLogger("jaxtron")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory, step and file."""


def _handlers() -> dict:
    return {"params": ShardedArraysHandler(), "opt_state": ShardedArraysHandler(),
            "meta": ocp.JsonCheckpointHandler()}


class Checkpointer:
    """Saves and restores the train state ``{"step", "params", "opt_state"}`` plus a JSON ``meta`` dict."""

    def __init__(self, directory: str, *, keep: int = 2, keep_every: int = 0, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                                   save_interval_steps=0)
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep, keep_period=keep_every or None, enable_async_checkpointing=async_save,
                create=True, cleanup_tmp_directories=True)
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        if read_only:  # Orbax warns that a read-only manager is read-only
            absl_log.setLevel(logging.ERROR)
        try:
            self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        finally:
            absl_log.setLevel(level)

    # ------------------------------------------------------------------------------------------ query
    def all_steps(self) -> list[int]:
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, state: dict, meta: dict) -> None:
        """Start saving ``state`` as ``step`` (returns once the state is copied; the write continues in the
        background when async). A step that is already saved is left alone."""
        if step in self._mngr.all_steps():
            return
        args = ocp.args.Composite(params=ShardedSave(state["params"]), opt_state=ShardedSave(state["opt_state"]),
                                  meta=ocp.args.JsonSave(dict(meta, step=int(step))))
        self._mngr.save(step, args=args, force=True)

    def save_params(self, step: int, params: Any, meta: dict) -> None:
        """A weights-only checkpoint (no optimizer state), e.g. an imported Hugging Face model: training can
        start from it with ``checkpoint.load_weights`` but cannot resume it."""
        if step in self._mngr.all_steps():
            raise CheckpointError(f"{self.step_dir(step)} exists already")
        args = ocp.args.Composite(params=ShardedSave(params), meta=ocp.args.JsonSave(dict(meta, step=int(step))))
        self._mngr.save(step, args=args, force=True)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    # ---------------------------------------------------------------------------------------- restore
    def _restore(self, step: int, **items) -> Any:
        if not os.path.isdir(self.step_dir(step)):
            raise CheckpointError(f"{self.step_dir(step)}: no such checkpoint step")
        try:
            return self._mngr.restore(step, args=ocp.args.Composite(**items))
        except CheckpointReadError as err:
            raise CheckpointError(f"checkpoint step {step}: {err}") from None
        except FileNotFoundError as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: missing file ({err})") from None
        except (ValueError, KeyError, OSError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: unreadable ({err})") from None

    def restore_meta(self, step: int) -> dict:
        return dict(self._restore(step, meta=ocp.args.JsonRestore())["meta"])

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """The train state laid out as ``abstract_state`` says (any mesh, any sharding, any dtype), and meta."""
        out = self._restore(step, params=ShardedRestore(abstract_state["params"]),
                            opt_state=ShardedRestore(abstract_state["opt_state"]), meta=ocp.args.JsonRestore())
        meta = dict(out["meta"])
        step_sharding = abstract_state["step"].sharding
        step_arr = jax.device_put(jnp.asarray(meta["step"], abstract_state["step"].dtype), step_sharding)
        return {"step": step_arr, "params": out["params"], "opt_state": out["opt_state"]}, meta

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        return self._restore(step, params=ShardedRestore(abstract_params))["params"]


def resolve_weights_path(path: str, what: str = "checkpoint.load_weights") -> tuple[str, int]:
    """A checkpoint path given by the user (``what`` names the setting in errors) -> (checkpoint directory,
    step): a checkpoint directory (its newest step) or one of its step directories."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{what}: {path} is not a directory")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and os.path.isdir(os.path.join(path, "params")):
        return os.path.dirname(path), int(base)
    steps = sorted(int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d)))
    if not steps:
        raise CheckpointError(f"{what}: {path} holds no checkpoint steps (expected <step>/params)")
    return path, steps[-1]


def load_params(path: str, abstract_params: Any) -> tuple[Any, dict]:
    """Parameters (and meta) of a checkpoint for fine-tuning, laid out as ``abstract_params`` says."""
    directory, step = resolve_weights_path(path)
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.restore_params(step, abstract_params), ckpt.restore_meta(step)
    finally:
        ckpt.close()
