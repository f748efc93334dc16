"""Token datasets on disk in Megatron-LM's ``MMapIndexedDataset`` layout (``.bin`` + ``.idx``), byte-compatible
with files written by Megatron-LM's ``tools/preprocess_data.py``.

``<prefix>.idx`` (little-endian)::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    uint64    sequence count N
    uint64    document count M (= documents + 1)
    int32     sequence lengths  x N
    int64     byte offsets of the sequences in .bin  x N
    int64     document boundaries (sequence indices, starting at 0)  x M
    [int8     modes x N  -- multimodal only; not supported here]

``<prefix>.bin``: the tokens of all sequences back to back in that dtype. Every document is one sequence.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, M  (34 bytes)


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated, or inconsistent; the message names the file."""


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    for code, t in DTYPES.items():
        if np.dtype(t) == dt:
            return code
    raise ValueError(f"dtype {dt} has no MMapIndexedDataset code (supported: "
                     f"{', '.join(np.dtype(t).name for t in DTYPES.values())})")


def best_dtype(vocab_size: int) -> type:
    """The smallest token dtype Megatron-LM uses for this vocabulary: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return str(prefix) + ".idx"


def bin_path(prefix: str) -> str:
    return str(prefix) + ".bin"


def _read_index(path: str):
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise IndexedDatasetError(f"{path}: cannot read index file ({e.strerror or e})") from e
    if size < _HEADER.size:
        raise IndexedDatasetError(f"{path}: truncated index file ({size} bytes, header needs {_HEADER.size})")
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    magic, version, code, n, m = _HEADER.unpack(header)
    if magic != MAGIC:
        raise IndexedDatasetError(f"{path}: not an MMapIndexedDataset index (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: unsupported index version {version} (expected {VERSION})")
    if code not in DTYPES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    need = _HEADER.size + 4 * n + 8 * n + 8 * m
    if size < need:
        raise IndexedDatasetError(f"{path}: truncated index file ({size} bytes, {n} sequences and {m} document "
                                  f"boundaries need {need})")
    if size == need + n and n > 0:
        raise IndexedDatasetError(f"{path}: multimodal index (per-sequence modes) is not supported")
    if size != need:
        raise IndexedDatasetError(f"{path}: index file has {size - need} unexpected trailing bytes "
                                  f"({size} bytes, expected {need})")
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    off = _HEADER.size
    lengths = np.frombuffer(mm, dtype="<i4", count=n, offset=off)
    off += 4 * n
    pointers = np.frombuffer(mm, dtype="<i8", count=n, offset=off)
    off += 8 * n
    docs = np.frombuffer(mm, dtype="<i8", count=m, offset=off)
    return np.dtype(DTYPES[code]).newbyteorder("<"), lengths, pointers, docs


class IndexedDataset:
    """Memory-mapped reader of ``<prefix>.bin`` / ``<prefix>.idx``."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_index(ipath)
        try:
            bsize = os.path.getsize(bpath)
        except OSError as e:
            raise IndexedDatasetError(f"{bpath}: cannot read data file ({e.strerror or e})") from e
        lengths, pointers, itemsize = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        n = len(lengths)
        if n:
            if (lengths < 0).any():
                bad = int(np.argmax(lengths < 0))
                raise IndexedDatasetError(f"{ipath}: negative sequence length at sequence {bad}")
            if (pointers < 0).any() or (pointers % itemsize).any():
                bad = int(np.argmax((pointers < 0) | (pointers % itemsize != 0)))
                raise IndexedDatasetError(f"{ipath}: invalid byte offset {int(pointers[bad])} for sequence {bad}")
            ends = pointers + lengths.astype(np.int64) * itemsize
            if int(ends.max()) > bsize:
                bad = int(np.argmax(ends > bsize))
                raise IndexedDatasetError(
                    f"{bpath}: data file too short ({bsize} bytes) for the index {ipath}: sequence {bad} ends at "
                    f"byte {int(ends[bad])} (truncated .bin or mismatched .idx)")
        elif bsize % itemsize:
            raise IndexedDatasetError(f"{bpath}: size {bsize} is not a multiple of the token size {itemsize}")
        d = self.document_indices
        if len(d) and (d[0] != 0 or d[-1] != n or (np.diff(d) < 0).any()):
            raise IndexedDatasetError(f"{ipath}: document boundaries must rise from 0 to the sequence count {n}")
        self._bin = (np.memmap(bpath, mode="r", dtype=self.dtype) if bsize >= itemsize
                     else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences in {self.prefix}")
        seq_len = int(self.sequence_lengths[i])
        if offset < 0 or offset > seq_len:
            raise IndexError(f"offset {offset} out of range for sequence {i} of length {seq_len}")
        if length is None:
            length = seq_len - offset
        length = min(length, seq_len - offset)
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start:start + length])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    def __iter__(self):
        for i in range(len(self)):
            yield self.get(i)


class IndexedDatasetWriter:
    """Writes ``<prefix>.bin`` while documents are added and ``<prefix>.idx`` at :meth:`finalize`; both go to
    temporary names first and are renamed into place only once complete."""

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.code = dtype_code(dtype)
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._tmp_bin = bin_path(prefix) + f".tmp{os.getpid()}"
        self._tmp_idx = idx_path(prefix) + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._doc_sizes: list[int] = []  # sequences per document (1 each; 0: add_empty_document)
        self._finalized = False

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token sequence, got shape {arr.shape}")
        if arr.size and np.issubdtype(arr.dtype, np.integer) and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"token ids {lo}..{hi} do not fit in {self.dtype.name} ({self.prefix})")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self._doc_sizes.append(1)

    def add_empty_document(self) -> None:
        """A document of no sequences, as Megatron's preprocess_data.py records a text that tokenizes to nothing
        (``document_indices`` repeats, e.g. ``[0, 1, 1, 2]``); GPTDataset never sees it."""
        self._doc_sizes.append(0)

    def _add_index(self, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
        base = len(self._lengths)
        self._lengths.extend(int(x) for x in lengths)
        self._doc_sizes.extend(int(x) for x in np.diff(doc_indices))
        assert len(self._lengths) == base + len(lengths)

    def finalize(self) -> None:
        if self._finalized:
            return
        self._bin.close()
        n = len(self._lengths)
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(n, dtype="<i8")
        if n > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.concatenate([[0], np.cumsum(self._doc_sizes, dtype=np.int64)]).astype("<i8")
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self.code, n, len(docs)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Drop everything written so far (no files are left under the final names)."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        self._finalized = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    @staticmethod
    def merge(prefixes: Sequence[str], out_prefix: str) -> None:
        """Concatenate datasets (same dtype required) into ``out_prefix``, keeping their document boundaries."""
        if not prefixes:
            raise ValueError("merge: no input datasets given")
        datasets = [IndexedDataset(p) for p in prefixes]
        dtype = datasets[0].dtype
        for p, ds in zip(prefixes, datasets):
            if ds.dtype != dtype:
                raise IndexedDatasetError(f"{idx_path(p)}: dtype {ds.dtype.name} differs from {dtype.name} of "
                                          f"{idx_path(prefixes[0])}; merge needs one dtype")
        w = IndexedDatasetWriter(out_prefix, dtype)
        try:
            for ds in datasets:
                with open(bin_path(ds.prefix), "rb") as f:
                    remaining = ds.num_tokens * dtype.itemsize
                    # sequences are contiguous from offset 0 in files we and Megatron write; copy in chunks
                    if len(ds) and int(ds.sequence_pointers[0]) != 0 or not _contiguous(ds):
                        for seq in ds:
                            w._bin.write(seq.astype(w.dtype).tobytes())
                    else:
                        while remaining:
                            chunk = f.read(min(remaining, 1 << 24))
                            if not chunk:
                                raise IndexedDatasetError(f"{bin_path(ds.prefix)}: ended early during merge")
                            w._bin.write(chunk)
                            remaining -= len(chunk)
                d = ds.document_indices if len(ds.document_indices) else np.array([0, len(ds)])
                w._add_index(ds.sequence_lengths, d)
        except BaseException:
            w.abort()
            raise
        w.finalize()


def _contiguous(ds: IndexedDataset) -> bool:
    if len(ds) == 0:
        return True
    ends = ds.sequence_pointers[:-1] + ds.sequence_lengths[:-1].astype(np.int64) * ds.dtype.itemsize
    return bool((ds.sequence_pointers[1:] == ends).all())


def merge(prefixes: Sequence[str], out_prefix: str) -> None:
    IndexedDatasetWriter.merge(prefixes, out_prefix)


def write_dataset(prefix: str, documents: Iterable, dtype=np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)
