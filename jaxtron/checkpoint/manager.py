"""Training checkpoints: an Orbax ``CheckpointManager`` over three items per step.

    <dir>/<step>/params      the parameters (shard format, ``shards.py``)
    <dir>/<step>/opt_state   the optimizer state (shard format)
    <dir>/<step>/meta        JSON: step, data-iterator state, skip counters, seed, the run's config (YAML)

Params and optimizer state are separate items so that loading weights for fine-tuning reads only the
params. A step directory appears only when all items of all processes are written and read back (Orbax
writes into a temporary directory and renames it), so a killed or failed save never leaves a checkpoint
that looks complete.

Safety rules (``docs/checkpoints.md``):

- Retention is done here, not by Orbax, and only once a save is finalized: it keeps the newest ``keep``
  steps, multiples of ``keep_every``, the steps :meth:`Checkpointer.protect` names, and always the newest
  step this object saved or restored (a *good* one), so an unfinished, failed or refused save never costs a
  good checkpoint.
- A state holding NaN or Inf is not saved (a warning names the arrays; :attr:`Checkpointer.refused`).
- A step that cannot be read can be set aside as ``<step>.corrupt`` (:meth:`Checkpointer.set_aside`):
  neither restored, nor counted by retention, nor deleted. Saving at a step whose directory exists and that
  this object did not write or restore moves the old one aside (``.corrupt`` if it fails verification, else
  ``.replaced``, removed again if the new one has the same contents) instead of silently keeping it.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxtron.checkpoint import integrity
from jaxtron.checkpoint.handler import ShardedArraysHandler, ShardedRestore, ShardedSave
from jaxtron.checkpoint.integrity import (CheckpointMismatchError, CheckpointReadError, CheckpointWriteError,
                                         NonFiniteStateError)

log = logging.getLogger("jaxtron")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory, step and file."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint saved by another model or optimizer config (not damage: no fallback helps)."""


class _QuietOrbaxErrors(logging.Filter):
    """Orbax logs the traceback of a failed background save (several times); jaxtron reports it in one line
    (a :class:`CheckpointError` naming the file), so those records are dropped."""

    def __init__(self):
        super().__init__()
        self._said: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if isinstance(err, (CheckpointWriteError, OSError)) and "orbax" in (record.pathname or ""):
            return False
        text = str(record.msg)
        if text.startswith(("Failed to json parse Metadata file", "Failed to read Metadata file")):
            # Orbax ignores an unreadable step metadata file, and says so at every read (ten times a run)
            path = str(record.args[0]) if record.args else "?"
            if path not in self._said:
                self._said.add(path)
                log.warning("%s: unreadable Orbax step metadata (ignored; python -m jaxtron.checkpoint verify "
                            "reports it)", path)
            return False
        if text.startswith("Waiting for previous save to complete"):
            # a save that waits for the one before it: said once, at info level; the rest at debug
            level = logging.INFO if "wait" not in self._said else logging.DEBUG
            self._said.add("wait")
            log.log(level, "checkpoint: waited %.1f s for the previous save to finish (saves this close together "
                    "hold up training; later waits are logged at debug level)", *(record.args or (0.0,)))
            return False
        return True


_ABSL_FILTER = _QuietOrbaxErrors()
logging.getLogger("absl").addFilter(_ABSL_FILTER)


def _one_line(err: BaseException) -> str:
    text = str(err) if isinstance(err, (CheckpointWriteError, CheckpointError)) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())


def _handlers() -> dict:
    return {"params": ShardedArraysHandler(), "opt_state": ShardedArraysHandler(),
            "meta": ocp.JsonCheckpointHandler()}


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """Saves and restores the train state ``{"step", "params", "opt_state"}`` plus a JSON ``meta`` dict."""

    def __init__(self, directory: str, *, keep: int = 2, keep_every: int = 0, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.keep, self.keep_every, self.read_only = keep, keep_every, read_only
        self.good: set[int] = set()       # steps this object saved (finalized, read back) or restored
        self.protected: set[int] = set()  # never deleted by this object's retention
        self.refused: dict[int, str] = {}  # step -> why its state was not saved (non-finite values)
        self._pending: Optional[int] = None  # the step whose save may still be in flight
        self._replaced: dict[int, str] = {}  # step -> where the old directory of that step went
        self._async = async_save and not read_only
        # Orbax keeps everything: retention (_prune) runs only after a save is finalized
        options = ocp.CheckpointManagerOptions(read_only=read_only, create=not read_only, max_to_keep=None,
                                               save_interval_steps=0 if read_only else 1,
                                               enable_async_checkpointing=self._async,
                                               cleanup_tmp_directories=not read_only)
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

    def newest_good(self) -> Optional[int]:
        good = [s for s in self.all_steps() if s in self.good]
        return good[-1] if good else None

    def protect(self, step: int) -> None:
        """Retention never deletes ``step`` (e.g. the step a run fell back to)."""
        self.protected.add(int(step))

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, state: dict, meta: dict) -> bool:
        """Start saving ``state`` as ``step`` (returns once the state is copied; the write, the read-back and
        the finiteness check continue in the background when async). Returns False when ``step`` is already
        saved by this object or the (synchronous) save was refused for non-finite values; raises
        :class:`CheckpointError` (one line naming the file) when an earlier or this save failed."""
        self._settle()
        if step in self.all_steps() and not self._make_room(step):
            return False
        args = ocp.args.Composite(params=ShardedSave(state["params"]), opt_state=ShardedSave(state["opt_state"]),
                                  meta=ocp.args.JsonSave(dict(meta, step=int(step))))
        return self._start(step, args)

    def save_params(self, step: int, params: Any, meta: dict) -> None:
        """A weights-only checkpoint (no optimizer state), e.g. an imported Hugging Face model: training can
        start from it with ``checkpoint.load_weights`` but cannot resume it."""
        self._settle()
        if step in self.all_steps():
            raise CheckpointError(f"{self.step_dir(step)} exists already")
        args = ocp.args.Composite(params=ShardedSave(params), meta=ocp.args.JsonSave(dict(meta, step=int(step))))
        if not self._start(step, args):
            raise CheckpointError(f"checkpoint step {step} not saved: {self.refused[step]}")

    def _start(self, step: int, args) -> bool:
        self._pending = step
        try:
            self._mngr.save(step, args=args, force=True)
        except Exception as err:  # a synchronous save that failed
            self._pending = None
            return self._failed(step, err)
        if not self._async:
            return self._settle() is not False
        return True

    def _make_room(self, step: int) -> bool:
        """``step`` exists: False when it is one of ours (nothing to do); else move it aside, so the state
        in hand is saved in its place (a fallback's retrained state must not be dropped)."""
        if step in self.good:
            log.info("checkpoint step %d: already saved in %s", step, self.step_dir(step))
            return False
        problems, _ = integrity.verify_step(self.step_dir(step))
        moved = self.set_aside(step, "corrupt" if problems else "replaced")
        if problems:
            log.warning("checkpoint step %d existed but is damaged (%s): moved to %s; saving this state in its "
                        "place", step, problems[0], moved)
        else:
            self._replaced[step] = moved
        return True

    def _settle(self) -> Optional[bool]:
        """Wait for the save in flight; then retention. True: saved; False: refused; None: nothing pending."""
        step, self._pending = self._pending, None
        if step is None:
            return None
        try:
            self._mngr.wait_until_finished()
        except Exception as err:
            return self._failed(step, err)
        self._mngr.reload()
        if step not in self._mngr.all_steps():
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: the save did not complete")
        self.good.add(step)
        self._drop_identical_replaced(step)
        self._prune()
        return True

    def _failed(self, step: int, err: BaseException) -> bool:
        if jax.process_index() == 0:  # free the space now (Orbax would at the next start)
            for tmp in glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")):
                for _ in range(20):  # the other items' writers may still be finishing their files
                    shutil.rmtree(tmp, ignore_errors=True)
                    if not os.path.exists(tmp):
                        break
                    time.sleep(0.05)
        newest = self.newest_good() or self.latest_step()
        kept = f"the newest checkpoint is {self.step_dir(newest)}" if newest is not None else "no checkpoint kept"
        if isinstance(err, NonFiniteStateError):
            self.refused[step] = str(err)
            log.warning("checkpoint step %d not saved: the state has %s; %s", step, err, kept)
            return False
        raise CheckpointError(f"checkpoint step {step} not saved: {_one_line(err)}; {kept}") from None

    def _drop_identical_replaced(self, step: int) -> None:
        old = self._replaced.pop(step, None)
        if old and jax.process_index() == 0 and _same_arrays(old, self.step_dir(step)):
            shutil.rmtree(old, ignore_errors=True)
        elif old:
            log.warning("checkpoint step %d: saved this run's state; the different one that was there is in %s",
                        step, old)

    def _prune(self) -> None:
        if self.read_only or self.keep is None or self.keep <= 0:
            return
        steps = self.all_steps()
        last_good = self.newest_good()
        for s in steps[:-self.keep]:
            if s in self.protected or s == last_good or (self.keep_every and s % self.keep_every == 0):
                continue
            self._mngr.delete(s)

    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        """Rename ``<step>`` to ``<step>.<reason>`` (``.1``, ``.2``... if taken): no longer restored, counted
        or deleted by retention. Returns the new path. Every process calls it (process 0 renames)."""
        src = self.step_dir(step)
        dst, n = f"{src}.{reason}", 0
        while os.path.exists(dst):
            n += 1
            dst = f"{src}.{reason}.{n}"
        _barrier(f"jaxtron_set_aside_{step}_start")
        if jax.process_index() == 0:
            os.rename(src, dst)
        _barrier(f"jaxtron_set_aside_{step}_done")
        self.good.discard(step)
        self._mngr.reload()
        return dst

    def wait(self) -> None:
        """Wait until the save in flight is complete (then retention runs); raises :class:`CheckpointError`
        if it failed."""
        self._settle()

    def close(self) -> None:
        try:
            self._settle()
        finally:
            self._mngr.wait_until_finished()
            self._mngr.close()

    # ---------------------------------------------------------------------------------------- restore
    def _restore(self, step: int, **items) -> Any:
        if not os.path.isdir(self.step_dir(step)):
            raise CheckpointError(f"{self.step_dir(step)}: no such checkpoint step")
        for item in items:  # Orbax would say 'Item "opt_state" was not found', naming no directory
            item_dir = os.path.join(self.step_dir(step), item)
            if not os.path.isdir(item_dir):
                weights_only = item == "opt_state" and "opt_state" not in (integrity.saved_items(
                    self.step_dir(step), str(step))[0] or ("opt_state",))
                only = " (a weights-only step: load it with checkpoint.load_weights)" if weights_only else ""
                raise CheckpointError(f"{item_dir}: missing (checkpoint step {step}){only}")
            problem = integrity.read_meta(item_dir, str(step))[1] if item == "meta" else None
            if problem:
                raise CheckpointError(problem)
        try:
            return self._mngr.restore(step, args=ocp.args.Composite(**items))
        except CheckpointMismatchError as err:
            raise CheckpointMismatch(f"checkpoint step {step}: {err}") from None
        except CheckpointReadError as err:
            raise CheckpointError(f"checkpoint step {step}: {err}") from None
        except FileNotFoundError as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: missing file ({err})") from None
        except (ValueError, KeyError, OSError) as err:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: unreadable ({_one_line(err)})") \
                from None

    def restore_meta(self, step: int) -> dict:
        return dict(self._restore(step, meta=ocp.args.JsonRestore())["meta"])

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """The train state laid out as ``abstract_state`` says (any mesh, any sharding, any dtype), and meta.
        Every shard file is checked against its checksum (when the checkpoint has them)."""
        out = self._restore(step, params=ShardedRestore(abstract_state["params"]),
                            opt_state=ShardedRestore(abstract_state["opt_state"]), meta=ocp.args.JsonRestore())
        meta = dict(out["meta"])
        step_sharding = abstract_state["step"].sharding
        step_arr = jax.device_put(jnp.asarray(meta["step"], abstract_state["step"].dtype), step_sharding)
        self.good.add(step)
        return {"step": step_arr, "params": out["params"], "opt_state": out["opt_state"]}, meta

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        return self._restore(step, params=ShardedRestore(abstract_params))["params"]


def _same_arrays(a: str, b: str) -> bool:
    """Two step directories hold the same arrays (the same shard checksums)."""
    def sums(step_dir):
        out = []
        for item in ("params", "opt_state"):
            for path in sorted(glob.glob(os.path.join(step_dir, item, "index.p*.json"))):
                out += [(item, os.path.basename(j[0]), j[2]) for j in integrity.shard_jobs(os.path.dirname(path),
                                                                                           path)]
        return sorted(out)
    try:
        sa, sb = sums(a), sums(b)
    except CheckpointReadError:
        return False
    return bool(sa) and sa == sb and all(c is not None for _, _, c in sa)


def nonfinite_leaves(tree: Any) -> list[str]:
    """The arrays of ``tree`` holding NaN or Inf (key paths), e.g. of a restored state."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    keys = [jax.tree_util.keystr(p) for p, _ in flat]
    return integrity.nonfinite_leaves(keys, integrity.finite_flags([v for _, v in flat]))


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
