"""A Hugging Face folder's weight files: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards
with a ``model.safetensors.index.json``; read lazily as one name -> array mapping, written in shards."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection, Mapping
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype strings that numpy itself cannot represent (read through ml_dtypes instead).
_ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class SafetensorsFiles(Mapping):
    """Lazy name -> numpy array over a HF folder's ``model.safetensors`` or sharded
    ``model-*.safetensors`` + ``model.safetensors.index.json``. Tensors are read when indexed."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_NAME)
        single = os.path.join(hf_dir, WEIGHTS_NAME)
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        if os.path.exists(index):
            self.source = index
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{index}: not a safetensors index ({err})") from None
            self._files = {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}
            for path in set(self._files.values()):
                if not os.path.exists(path):
                    raise ValueError(f"{index}: shard {os.path.basename(path)} does not exist")
        elif os.path.exists(single):
            self.source = single
            self._open(single)
            self._files = dict.fromkeys(sorted(self._keys[single]), single)
        else:
            raise ValueError(f"{hf_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME} exists")

    def _open(self, path: str):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="np")
            self._keys[path] = set(self._handles[path].keys())
        return self._handles[path]

    def _header(self, path: str) -> tuple[int, dict]:
        if path not in self._headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        return self._headers[path]

    def file_of(self, name: str) -> str:
        return self._files.get(name, self.source)

    def _handle_for(self, name: str):
        path = self._files[name]
        handle = self._open(path)
        if name not in self._keys[path]:
            raise ValueError(f"{self.source}: tensor {name} is listed for {os.path.basename(path)} but that "
                             f"file does not hold it")
        return path, handle

    def shape_of(self, name: str) -> list[int]:
        """The tensor's shape from the file header (no data is read)."""
        return self._handle_for(name)[1].get_slice(name).get_shape()

    def __getitem__(self, name: str) -> np.ndarray:
        path, handle = self._handle_for(name)
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in _ML_DTYPES:
            return handle.get_tensor(name)
        # numpy has no bfloat16/float8: map the bytes through ml_dtypes (read-only, no copy).
        start, header = self._header(path)
        entry = header[name]
        begin, _ = entry["data_offsets"]
        return np.memmap(path, dtype=_ML_DTYPES[dtype], mode="r", offset=start + begin,
                         shape=tuple(entry["shape"]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files


def plan_shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int, itemsize: int) -> list[list[str]]:
    """Group tensor names (in order) into shards of at most ``max_shard_bytes``; a bigger tensor gets a
    shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        nbytes = math.prod(arr.shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def remove_old_weights(hf_dir: str) -> None:
    """Delete weight files an earlier save may have left (a stale index or shard would shadow new ones)."""
    for fname in os.listdir(hf_dir):
        if fname in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(fname):
            os.remove(os.path.join(hf_dir, fname))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write(tensors: Mapping[str, np.ndarray], hf_dir: str, max_shard_bytes: int, dtype: np.dtype,
          keep_fp32: Collection[str] = ()) -> None:
    """Write ``tensors`` in ``dtype`` (those named in ``keep_fp32`` in float32) as ``model.safetensors``, or
    above ``max_shard_bytes`` as shards with an index, replacing the weight files an earlier save left in
    ``hf_dir``."""
    shards = plan_shards(tensors, max_shard_bytes, dtype.itemsize)
    os.makedirs(hf_dir, exist_ok=True)
    remove_old_weights(hf_dir)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        chunk = {n: np.ascontiguousarray(tensors[n], dtype=np.float32 if n in keep_fp32 else dtype) for n in names}
        save_file(chunk, os.path.join(hf_dir, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(hf_dir, fname), 0o666 & ~_umask())  # safetensors writes 0600; the rest are 0666-umask
        total += sum(a.nbytes for a in chunk.values())
        weight_map.update(dict.fromkeys(names, fname))
        del chunk
    if len(shards) > 1:
        with open(os.path.join(hf_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
