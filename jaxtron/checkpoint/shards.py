"""jaxtron's array format inside an Orbax checkpoint: each array shard as one raw file, plus a JSON index.

Why not Orbax's own array format: on this machine (2 cores, 8 CPU devices, 2 GiB fp32 state) Orbax restores at
0.5-0.75 GiB/s (OCDBT, plain zarr and zarr3 measured alike), while a raw read of each shard straight into
the buffer the device keeps reaches the page-cache/disk speed. Orbax still does everything around the
arrays (temporary directory + atomic rename, async commit, retention, multi-host barriers); see
``handler.py``.

Layout of one item directory (e.g. ``<step>/params``)::

    index.p<process>.json   {"format": ..., "leaves": {keypath: {"shape", "dtype", "shards": [
                                {"file", "start", "shape", "xxh3_64"}]}}}
    p<process>.<leaf>.<shard>.bin   the shard's bytes, C order, little-endian, the array's dtype

``xxh3_64`` is the checksum of the file (``integrity.py``): computed from memory while saving, checked by
reading each file back before the index is written (so an index exists only for files that read back
correctly), and checked again on every restore. Indexes without it (older checkpoints) restore unverified.
A save of a state holding NaN or Inf is refused (:class:`NonFiniteStateError`) before anything is written.

Each distinct shard is written once, by the process that holds its replica 0. Restoring reads, for every
device shard of the *target* sharding, the saved shards that overlap it, so a checkpoint restores onto any
mesh and any sharding; a different target dtype is a cast.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import jax
import numpy as np

from jaxtron.checkpoint import integrity
from jaxtron.checkpoint.integrity import (HASH, CheckpointMismatchError, CheckpointReadError,
                                          CheckpointWriteError, NonFiniteStateError)

FORMAT = "jaxtron-shards-1"
IO_THREADS = int(os.environ.get("JAXTRON_CHECKPOINT_IO_THREADS", 0)) or max(2, min(16, os.cpu_count() or 2))
WRITE_DELAY_ENV = "JAXTRON_CHECKPOINT_WRITE_DELAY_S"  # fault-injection tests: sleep after each shard file
VERIFY_SAVE_ENV = "JAXTRON_CHECKPOINT_VERIFY_SAVE"  # "0": skip reading each file back after a save


def _keystr(path) -> str:
    return jax.tree_util.keystr(path)


def _unique_shards(x: jax.Array):
    return [s for s in x.addressable_shards if s.replica_id == 0]


def _start(index: tuple, shape: tuple) -> list[int]:
    return [sl.indices(n)[0] for sl, n in zip(index, shape)]


# ----------------------------------------------------------------------------------------------- save


def _bytes(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (any dtype, bfloat16 included), without a copy."""
    return memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")


def _host_finite(x: np.ndarray) -> bool:
    try:
        return bool(np.isfinite(x).all())
    except TypeError:  # integers, booleans
        return True


def _write_file(path: str, data: memoryview) -> None:
    """Write one shard file and fsync it (the one place that writes shard bytes: fault-injection tests patch
    it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class PendingSave:
    """Host-side work of a save, after the blocking part: ``write(directory)`` writes the files. ``flags``
    (one boolean per leaf, computed on the devices in the background) says which leaves are finite."""

    def __init__(self, leaves: list[tuple[str, Any]], flags: Any = None):  # flags: array or a function giving it
        self.leaves = leaves  # (keypath, jax.Array or np.ndarray)
        self.flags, self.flag_keys, self.check_host = flags, [], False

    def nonfinite(self) -> list[str]:
        """The leaves holding NaN or Inf (waits for the check dispatched by :func:`start_save`)."""
        if callable(self.flags):
            self.flags = self.flags()
        bad = integrity.nonfinite_leaves(self.flag_keys, self.flags) if self.flags is not None else []
        if self.check_host:
            bad += [k for k, x in self.leaves if isinstance(x, np.ndarray) and not _host_finite(x)]
        return bad

    def _plan(self, directory: str, pid: int) -> tuple[list, dict]:
        jobs, index = [], {}
        for k, (key, x) in enumerate(self.leaves):
            shape = tuple(x.shape)
            entry = {"shape": list(shape), "dtype": np.dtype(x.dtype).name, "shards": []}
            if isinstance(x, np.ndarray):  # host value (process 0 writes it)
                parts = [((0,) * len(shape), x)] if pid == 0 else []
            else:
                parts = [(_start(s.index, shape), s.data) for s in _unique_shards(x)]
            for j, (start, data) in enumerate(parts):
                fname = f"p{pid}.{k}.{j}.bin"
                shard = {"file": fname, "start": list(start), "shape": list(data.shape)}
                entry["shards"].append(shard)
                jobs.append((os.path.join(directory, fname), data, shard, key))
            index[key] = entry
        return jobs, index

    def write(self, directory: str) -> None:
        bad = self.nonfinite()
        if bad:
            raise NonFiniteStateError(bad)
        pid = jax.process_index()
        delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        verify = os.environ.get(VERIFY_SAVE_ENV, "1") != "0"
        jobs, index = self._plan(directory, pid)

        def write_one(job):
            path, data, shard, key = job
            arr = np.ascontiguousarray(np.asarray(data))
            buf = _bytes(arr)
            shard[HASH] = integrity.digest(buf)
            try:
                _write_file(path, buf)
            except OSError as err:
                raise CheckpointWriteError(f"{path}: {err.strerror or err} while writing the shard of {key}"
                                           + (f" [Errno {err.errno}]" if err.errno else "")) from None
            if delay:
                time.sleep(delay)
            if verify:
                problem = integrity.check_file(path, buf.nbytes, shard[HASH], f"array {key}, read back after "
                                                                             f"writing")
                if problem:
                    raise CheckpointWriteError(problem)

        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(write_one, jobs))
        tmp = os.path.join(directory, f"index.p{pid}.json.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "leaves": index}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, f"index.p{pid}.json"))
        except OSError as err:
            raise CheckpointWriteError(f"{tmp}: {err.strerror or err} while writing the index") from None


def _device_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """Fresh device buffers holding the same values (an asynchronous copy; nothing to compile), so the train
    step may donate the originals while the copies are written."""
    return jax.device_put(arrays, [a.sharding for a in arrays], may_alias=False)


def start_save(tree: Any, check_finite: bool = True) -> PendingSave:
    """The blocking part of a save. On CPU an on-device copy is dispatched (cheap, asynchronous); on
    accelerators every unique shard is transferred to host memory here, all transfers in flight at once.
    With ``check_finite``, a per-leaf finiteness check is dispatched too; ``write`` waits for it (off the
    training thread) and refuses a state with NaN or Inf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    keys = [_keystr(p) for p, _ in flat]
    values = [v for _, v in flat]
    arrays = [(i, v) for i, v in enumerate(values) if isinstance(v, jax.Array)]
    out: list[Any] = [np.asarray(v) if not isinstance(v, jax.Array) else None for v in values]
    flags = None
    if arrays:
        platform = arrays[0][1].sharding._device_assignment[0].platform
        if platform == "cpu":
            copies = _device_copy([v for _, v in arrays])
            for (i, _), c in zip(arrays, copies):
                out[i] = c
            if check_finite:  # on the copies (never donated), from the writing thread: no compile here
                flags = lambda: integrity.finite_flags(copies)  # noqa: E731
        else:
            if check_finite:
                flags = integrity.finite_flags([v for _, v in arrays])
            for _, v in arrays:
                for s in _unique_shards(v):
                    s.data.copy_to_host_async()
            for i, v in arrays:
                out[i] = _HostArray(v)
    pending = PendingSave(list(zip(keys, out)), flags)
    pending.flag_keys = [keys[i] for i, _ in arrays]
    pending.check_host = check_finite
    return pending


class _HostArray:
    """An accelerator array's unique shards, already in host memory (so the device array may be donated)."""

    def __init__(self, x: jax.Array):
        self.shape, self.dtype = x.shape, x.dtype
        self.addressable_shards = [_HostShard(s.index, np.asarray(s.data)) for s in _unique_shards(x)]


class _HostShard:
    replica_id = 0

    def __init__(self, index, data):
        self.index, self.data = index, data


# -------------------------------------------------------------------------------------------- restore


def read_index(directory: str) -> dict[str, dict]:
    """All processes' index files of an item directory merged: keypath -> entry."""
    files = sorted(glob.glob(os.path.join(directory, "index.p*.json")))
    if not files:
        raise CheckpointReadError(f"{directory}: no index.p*.json (not a jaxtron checkpoint item, or incomplete)")
    leaves: dict[str, dict] = {}
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
            fmt = data.get("format") if isinstance(data, dict) else None
            if fmt != FORMAT:
                raise CheckpointReadError(f"{path}: format {fmt!r}, expected {FORMAT!r}")
            for key, entry in data["leaves"].items():
                if key in leaves:
                    leaves[key]["shards"].extend(entry["shards"])
                else:
                    leaves[key] = entry
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointReadError(f"{path}: unreadable index ({type(err).__name__}: {err})") from None
    return leaves


def _read_into(path: str, out: np.ndarray, checksum: Optional[str] = None, what: str = "") -> None:
    """Read a shard file into ``out`` (its exact size), checking its checksum on the way when given."""
    view, done = _bytes(out), 0
    hasher = integrity.new_hasher() if checksum else None
    with open(path, "rb", buffering=0) as f:
        while done < len(view):  # chunks: hashed while in the cache (one read() is at most ~2 GiB anyway)
            n = f.readinto(view[done:done + integrity.CHUNK])
            if not n:
                raise CheckpointReadError(f"{path}: ended after {done} of {len(view)} bytes ({what})")
            if hasher is not None:
                hasher.update(view[done:done + n])
            done += n
    if hasher is not None and integrity.hexdigest(hasher) != checksum:
        raise CheckpointReadError(f"{path}: checksum mismatch ({what}; {HASH} {integrity.hexdigest(hasher)}, the "
                                  f"index says {checksum}): the file is corrupt")


def _region(index: tuple, shape: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    return tuple(b[0] for b in bounds), tuple(b[1] - b[0] for b in bounds)


class _LeafReader:
    def __init__(self, directory: str, key: str, entry: dict):
        self.directory, self.key, self.entry = directory, key, entry
        self.dtype = np.dtype(entry["dtype"])
        self.shards = [(tuple(s["start"]), tuple(s["shape"]), os.path.join(directory, s["file"]), s.get(HASH))
                       for s in entry["shards"]]
        self._lock = threading.Lock()
        self._given: set = set()
        self._verified: set = set()

    def _open_checked(self, path: str, shape: tuple, checksum: Optional[str] = None):
        """Size check; with ``checksum``, the whole file is hashed once (for partial reads)."""
        problem = integrity.check_file(path, math.prod(shape) * self.dtype.itemsize, None, f"array {self.key}")
        if problem:
            raise CheckpointReadError(problem)
        if checksum and path not in self._verified:
            problem = integrity.check_file(path, math.prod(shape) * self.dtype.itemsize, checksum,
                                           f"array {self.key}")
            if problem:
                raise CheckpointReadError(problem)
            with self._lock:
                self._verified.add(path)

    def read(self, start: tuple, shape: tuple) -> np.ndarray:
        """The region [start, start + shape) of the saved array, in a fresh buffer."""
        for s_start, s_shape, path, checksum in self.shards:
            if s_start == start and s_shape == shape:  # the common case: the same shard as saved
                self._open_checked(path, shape)
                out = np.empty(shape, self.dtype)
                _read_into(path, out, checksum, f"array {self.key}")
                return out
        out = np.empty(shape, self.dtype)
        covered = 0
        for s_start, s_shape, path, checksum in self.shards:
            lo = [max(a, b) for a, b in zip(start, s_start)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, shape, s_start, s_shape)]
            if any(h <= l for l, h in zip(lo, hi)) and shape:
                continue
            self._open_checked(path, s_shape, checksum)
            src = np.memmap(path, self.dtype, "r", shape=s_shape) if math.prod(s_shape) else np.empty(s_shape,
                                                                                                     self.dtype)
            dst_sl = tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, start))
            src_sl = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, s_start))
            out[dst_sl] = src[src_sl]
            covered += math.prod(h - l for l, h in zip(lo, hi))
            del src
        if covered != math.prod(shape):
            raise CheckpointReadError(f"{self.directory}: the saved shards of {self.key} cover {covered} of the "
                                      f"{math.prod(shape)} elements asked for (shard files missing?)")
        return out

    def region(self, index: tuple, shape: tuple, dtype) -> np.ndarray:
        start, rshape = _region(index, shape)
        out = self.read(start, rshape)
        if out.dtype != np.dtype(dtype):
            out = out.astype(dtype)
        with self._lock:  # never hand one host buffer to two devices: each may be donated and written
            if (start, rshape) in self._given:
                out = out.copy()
            self._given.add((start, rshape))
        return out


def restore_tree(directory: str, target: Any) -> Any:
    """Restore the item saved in ``directory`` as ``target`` describes it: a pytree whose leaves are
    ``jax.ShapeDtypeStruct`` with a ``sharding`` (the new layout and dtype). Extra arrays in the checkpoint
    are ignored; a missing one or a shape mismatch raises :class:`CheckpointReadError`."""
    index = read_index(directory)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    jobs = []
    for path, leaf in flat:
        key = _keystr(path)
        entry = index.get(key)
        if entry is None:
            raise CheckpointMismatchError(f"{directory}: has no array {key} (saved by a different model or "
                                      f"optimizer config?)")
        if tuple(entry["shape"]) != tuple(leaf.shape):
            raise CheckpointMismatchError(f"{directory}: {key} has shape {entry['shape']} in the checkpoint, "
                                      f"{list(leaf.shape)} in this config")
        jobs.append((_LeafReader(directory, key, entry), leaf))

    def restore_one(job):
        reader, leaf = job
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            return reader.region(tuple(slice(None) for _ in leaf.shape), tuple(leaf.shape), leaf.dtype)
        return jax.make_array_from_callback(tuple(leaf.shape), sharding,
                                            lambda idx: reader.region(idx, tuple(leaf.shape), leaf.dtype))

    with ThreadPoolExecutor(IO_THREADS) as pool:
        values = list(pool.map(restore_one, jobs))
    return jax.tree_util.tree_unflatten(treedef, values)


def describe(directory: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """keypath -> (shape, dtype) of every array saved in an item directory."""
    return {k: (tuple(e["shape"]), e["dtype"]) for k, e in read_index(directory).items()}
