"""jaxtron's array format inside an Orbax checkpoint: each array shard as one raw file, plus a JSON index.

Why not Orbax's own array format: on this machine (2 cores, 8 CPU devices, 2 GiB fp32 state) Orbax restores at
0.5-0.75 GiB/s (OCDBT, plain zarr and zarr3 measured alike), while a raw read of each shard straight into
the buffer the device keeps reaches the page-cache/disk speed. Orbax still does everything around the
arrays (temporary directory + atomic rename, async commit, retention, multi-host barriers); see
``handler.py``.

Layout of one item directory (e.g. ``<step>/params``)::

    index.p<process>.json   {"format": ..., "leaves": {keypath: {"shape", "dtype", "shards": [
                                {"file", "start", "shape"}]}}}
    p<process>.<leaf>.<shard>.bin   the shard's bytes, C order, little-endian, the array's dtype

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
from typing import Any

import jax
import numpy as np

FORMAT = "jaxtron-shards-1"
IO_THREADS = int(os.environ.get("JAXTRON_CHECKPOINT_IO_THREADS", 0)) or max(2, min(16, os.cpu_count() or 2))
WRITE_DELAY_ENV = "JAXTRON_CHECKPOINT_WRITE_DELAY_S"  # fault-injection tests: sleep after each shard file


class CheckpointReadError(RuntimeError):
    """A checkpoint item that cannot be read; the message names the file and what is wrong."""


def _keystr(path) -> str:
    return jax.tree_util.keystr(path)


def _unique_shards(x: jax.Array):
    return [s for s in x.addressable_shards if s.replica_id == 0]


def _start(index: tuple, shape: tuple) -> list[int]:
    return [sl.indices(n)[0] for sl, n in zip(index, shape)]


# ----------------------------------------------------------------------------------------------- save


class PendingSave:
    """Host-side work of a save, after the blocking part: ``write(directory)`` writes the files."""

    def __init__(self, leaves: list[tuple[str, Any]]):
        self.leaves = leaves  # (keypath, jax.Array or np.ndarray)

    def write(self, directory: str) -> None:
        pid = jax.process_index()
        delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
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
                entry["shards"].append({"file": fname, "start": list(start), "shape": list(data.shape)})
                jobs.append((os.path.join(directory, fname), data))
            index[key] = entry

        def write_one(job):
            path, data = job
            arr = np.ascontiguousarray(np.asarray(data))
            with open(path, "wb") as f:
                f.write(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")
                f.flush()
                os.fsync(f.fileno())
            if delay:
                time.sleep(delay)

        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(write_one, jobs))
        tmp = os.path.join(directory, f"index.p{pid}.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "leaves": index}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, f"index.p{pid}.json"))


def _device_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """Fresh device buffers holding the same values (an asynchronous copy; nothing to compile), so the train
    step may donate the originals while the copies are written."""
    return jax.device_put(arrays, [a.sharding for a in arrays], may_alias=False)


def start_save(tree: Any) -> PendingSave:
    """The blocking part of a save. On CPU an on-device copy is dispatched (cheap, asynchronous); on
    accelerators every unique shard is transferred to host memory here, all transfers in flight at once."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    keys = [_keystr(p) for p, _ in flat]
    values = [v for _, v in flat]
    arrays = [(i, v) for i, v in enumerate(values) if isinstance(v, jax.Array)]
    out: list[Any] = [np.asarray(v) if not isinstance(v, jax.Array) else None for v in values]
    if arrays:
        platform = arrays[0][1].sharding._device_assignment[0].platform
        if platform == "cpu":
            copies = _device_copy([v for _, v in arrays])
            for (i, _), c in zip(arrays, copies):
                out[i] = c
        else:
            for _, v in arrays:
                for s in _unique_shards(v):
                    s.data.copy_to_host_async()
            for i, v in arrays:
                out[i] = _HostArray(v)
    return PendingSave(list(zip(keys, out)))


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
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointReadError(f"{path}: unreadable index ({err})") from None
        if data.get("format") != FORMAT:
            raise CheckpointReadError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
        for key, entry in data["leaves"].items():
            if key in leaves:
                leaves[key]["shards"].extend(entry["shards"])
            else:
                leaves[key] = entry
    return leaves


def _read_into(path: str, out: np.ndarray) -> None:
    view, done = memoryview(out.reshape(-1)).cast("B"), 0
    with open(path, "rb", buffering=0) as f:
        while done < len(view):  # one read() returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointReadError(f"{path}: ended after {done} of {len(view)} bytes")
            done += n


def _region(index: tuple, shape: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    return tuple(b[0] for b in bounds), tuple(b[1] - b[0] for b in bounds)


class _LeafReader:
    def __init__(self, directory: str, key: str, entry: dict):
        self.directory, self.key, self.entry = directory, key, entry
        self.dtype = np.dtype(entry["dtype"])
        self.shards = [(tuple(s["start"]), tuple(s["shape"]), os.path.join(directory, s["file"]))
                       for s in entry["shards"]]
        self._lock = threading.Lock()
        self._given: set = set()

    def _open_checked(self, path: str, shape: tuple):
        expected = math.prod(shape) * self.dtype.itemsize
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointReadError(f"{path}: missing (array {self.key})") from None
        if size != expected:
            raise CheckpointReadError(f"{path}: {size} bytes, expected {expected} for the {list(shape)} "
                                      f"{self.dtype.name} shard of {self.key} (truncated or corrupt)")

    def read(self, start: tuple, shape: tuple) -> np.ndarray:
        """The region [start, start + shape) of the saved array, in a fresh buffer."""
        for s_start, s_shape, path in self.shards:
            if s_start == start and s_shape == shape:  # the common case: the same shard as saved
                self._open_checked(path, shape)
                out = np.empty(shape, self.dtype)
                _read_into(path, out)
                return out
        out = np.empty(shape, self.dtype)
        covered = 0
        for s_start, s_shape, path in self.shards:
            lo = [max(a, b) for a, b in zip(start, s_start)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, shape, s_start, s_shape)]
            if any(h <= l for l, h in zip(lo, hi)) and shape:
                continue
            self._open_checked(path, s_shape)
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
            raise CheckpointReadError(f"{directory}: has no array {key} (saved by a different model or "
                                      f"optimizer config?)")
        if tuple(entry["shape"]) != tuple(leaf.shape):
            raise CheckpointReadError(f"{directory}: {key} has shape {entry['shape']} in the checkpoint, "
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
