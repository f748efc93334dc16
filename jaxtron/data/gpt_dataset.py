"""Megatron-LM style GPT pretraining samples over an :class:`~jaxtron.data.indexed.IndexedDataset`.

Reimplements the index building of Megatron-LM's ``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``) in
vectorized numpy:

* ``document_index``: the split's documents, shuffled with ``np.random.RandomState(seed)``, one shuffle per epoch,
  for as many epochs as are needed to hold ``num_samples * seq_len + 1`` tokens;
* ``sample_index``: ``(S + 1, 2)`` pairs (position in ``document_index``, token offset in that document) for all
  ``S`` samples those epochs hold. Sample ``i`` is the ``seq_len + 1`` tokens from entry ``i`` to entry ``i + 1``
  inclusive, i.e. the tokens at ``[i * seq_len, (i + 1) * seq_len]`` of the concatenated shuffled stream:
  consecutive samples share one token and samples may cross document boundaries;
* ``shuffle_index``: a permutation of all ``S`` samples (the order in which they are served), so even a run
  shorter than an epoch draws from the whole split. As in Megatron, when the last epoch is less than 80% used,
  its samples are shuffled separately (after those of the full epochs), so every full epoch is served whole.

The three arrays are cached as ``.npy`` files in ``<prefix>_cache/`` keyed by an md5 of every input that changes
them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from jaxtron.data.indexed import IndexedDataset, idx_path

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = "jaxtron-gpt-index-v2"


def parse_split(split) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or a sequence of numbers) -> normalized weights for train/valid/test."""
    if isinstance(split, str):
        text = split.strip()
        parts = text.replace("/", ",").split(",")
        try:
            vals = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"split={split!r}: expected up to 3 comma-separated numbers like '969,30,1'") from None
    else:
        try:
            vals = [float(v) for v in split]
        except (TypeError, ValueError):
            raise ValueError(f"split={split!r}: expected up to 3 numbers like '969,30,1'") from None
    if not 1 <= len(vals) <= 3:
        raise ValueError(f"split={split!r}: expected 1 to 3 weights (train,valid,test), got {len(vals)}")
    if any(not np.isfinite(v) or v < 0 for v in vals):
        raise ValueError(f"split={split!r}: weights must be finite and non-negative")
    total = sum(vals)
    if total <= 0:
        raise ValueError(f"split={split!r}: weights sum to zero")
    vals = vals + [0.0] * (3 - len(vals))
    return [v / total for v in vals]


def split_documents(num_docs: int, split="969,30,1") -> dict[str, tuple[int, int]]:
    """Document ranges ``[start, end)`` for train/valid/test, with Megatron's ``get_split_indices`` rounding:
    cumulative rounded boundaries, shifted so that the last one is exactly ``num_docs``."""
    weights = parse_split(split)
    if num_docs < 0:
        raise ValueError(f"num_docs={num_docs} must be >= 0")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_docs))))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = list(np.clip(np.maximum.accumulate(bounds), 0, num_docs).astype(int))
    assert bounds[-1] == num_docs
    return {name: (int(bounds[k]), int(bounds[k + 1])) for k, name in enumerate(SPLIT_NAMES)}


@dataclass
class GPTSampleIndex:
    document_index: np.ndarray  # (num_epochs * num_docs,) document ids, shuffled per epoch
    sample_index: np.ndarray  # (S + 1, 2) int64: (position in document_index, token offset), S >= num_samples
    shuffle_index: np.ndarray  # (S,) int64 permutation of the samples of all epochs
    num_epochs: int

    def __len__(self) -> int:
        return len(self.shuffle_index)


def build_sample_index(doc_lengths, doc_ids, seq_len: int, num_samples: int, seed: int) -> GPTSampleIndex:
    """Build Megatron's document/sample/shuffle indices. ``doc_lengths[d]`` is the token count of document ``d``;
    ``doc_ids`` are the documents of this split."""
    seq_len, num_samples = int(seq_len), int(num_samples)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    rng = np.random.RandomState(seed)
    tokens_per_epoch = int(doc_lengths[doc_ids].sum()) if len(doc_ids) else 0
    needed = num_samples * seq_len + 1
    if num_samples == 0:
        num_epochs = 0
    else:
        if tokens_per_epoch <= 0:
            raise ValueError(f"cannot build {num_samples} samples: the split has no tokens "
                             f"({len(doc_ids)} documents)")
        num_epochs = -(-needed // tokens_per_epoch)
    index_dtype = np.int32 if (len(doc_lengths) < 2**31) else np.int64
    if num_epochs:
        document_index = np.concatenate([rng.permutation(doc_ids) for _ in range(num_epochs)]).astype(index_dtype)
    else:
        document_index = np.zeros(0, index_dtype)

    # every sample the epochs hold (Megatron builds them all and shuffles them all, not only the ones needed)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_len if num_epochs else 0
    # stream position of token t = i * seq_len, located by searching the cumulative document ends
    ends = np.cumsum(doc_lengths[document_index], dtype=np.int64)
    starts_tok = np.arange(total_samples + 1, dtype=np.int64) * seq_len
    if total_samples:
        pos = np.searchsorted(ends, starts_tok, side="right")
        doc_start = ends[pos] - doc_lengths[document_index[pos]]
        sample_index = np.stack([pos, starts_tok - doc_start], axis=1).astype(np.int64)
    else:
        sample_index = np.zeros((1, 2), np.int64)
    separate_last = False
    if num_epochs > 1:
        full = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len  # samples of the full epochs
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate_last = num_samples - full < int(0.8 * per_epoch)
    if separate_last:
        shuffle_index = np.concatenate([rng.permutation(full), full + rng.permutation(total_samples - full)])
    else:
        shuffle_index = rng.permutation(total_samples)
    shuffle_index = shuffle_index.astype(np.int64)
    return GPTSampleIndex(document_index, sample_index, shuffle_index, num_epochs)


def _cache_key(prefix: str, split_range, seq_len, num_samples, seed) -> str:
    st = os.stat(idx_path(prefix))
    desc = {
        "version": _INDEX_VERSION,
        "prefix": os.path.abspath(prefix),
        "idx_size": st.st_size,
        "idx_mtime_ns": st.st_mtime_ns,
        "split_range": [int(split_range[0]), int(split_range[1])],
        "seq_len": int(seq_len),
        "num_samples": int(num_samples),
        "seed": int(seed),
        "per_epoch_shuffle": True,
    }
    return hashlib.md5(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def cache_paths(prefix: str, split_range, seq_len, num_samples, seed) -> dict[str, str]:
    key = _cache_key(prefix, split_range, seq_len, num_samples, seed)
    d = str(prefix) + "_cache"
    base = os.path.basename(str(prefix))
    return {name: os.path.join(d, f"{base}_{key}_{name}.npy")
            for name in ("document_index", "sample_index", "shuffle_index")}


def _save_atomic(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def load_or_build_index(dataset: IndexedDataset, split_range, seq_len: int, num_samples: int, seed: int,
                        use_cache: bool = True) -> tuple[GPTSampleIndex, bool]:
    """The index for ``dataset`` documents ``[split_range)``; returns ``(index, loaded_from_cache)``."""
    start, end = int(split_range[0]), int(split_range[1])
    if not 0 <= start <= end <= len(dataset):
        raise ValueError(f"split range {split_range} out of bounds for {len(dataset)} documents in {dataset.prefix}")
    paths = cache_paths(dataset.prefix, (start, end), seq_len, num_samples, seed) if use_cache else None
    if paths and all(os.path.exists(p) for p in paths.values()):
        try:
            arrs = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
            n_ep = 0
            if len(arrs["document_index"]) and end > start:
                n_ep = len(arrs["document_index"]) // (end - start)
            return GPTSampleIndex(arrs["document_index"], arrs["sample_index"], arrs["shuffle_index"], n_ep), True
        except (OSError, ValueError):
            pass  # unreadable cache: rebuild
    index = build_sample_index(dataset.sequence_lengths, np.arange(start, end), seq_len, num_samples, seed)
    if paths:
        try:
            os.makedirs(os.path.dirname(next(iter(paths.values()))), exist_ok=True)
            _save_atomic(paths["document_index"], index.document_index)
            _save_atomic(paths["sample_index"], index.sample_index)
            _save_atomic(paths["shuffle_index"], index.shuffle_index)
        except OSError:
            pass  # read-only data directory: keep the in-memory index
    return index, False


def make_batch_fields(win: np.ndarray, reset_position_ids=False, reset_attention_mask=False,
                      eod_mask_loss=False, eod_id=0) -> dict[str, np.ndarray]:
    """``win``: ``(b, s + 1)`` token windows -> the model's batch fields: inputs/targets/positions/segment_ids
    /loss_mask (int32, loss_mask float32), shared by every data source."""
    win = np.asarray(win).astype(np.int32)
    inputs, targets = win[:, :-1], win[:, 1:]
    b, s = inputs.shape
    ar = np.broadcast_to(np.arange(s, dtype=np.int32), inputs.shape)
    if reset_position_ids or reset_attention_mask:
        seg = np.zeros_like(inputs)
        seg[:, 1:] = np.cumsum(inputs[:, :-1] == eod_id, axis=1)
    if reset_position_ids:
        new = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
        starts_at = np.where(new, ar, 0)
        positions = (ar - np.maximum.accumulate(starts_at, axis=1)).astype(np.int32)
    else:
        positions = ar.copy()
    segment_ids = (seg + 1).astype(np.int32) if reset_attention_mask else np.ones_like(inputs)
    mask = np.ones(inputs.shape, np.float32)
    if eod_mask_loss:
        mask[targets == eod_id] = 0.0
    return {"inputs": np.ascontiguousarray(inputs), "targets": np.ascontiguousarray(targets),
            "positions": positions, "segment_ids": segment_ids, "loss_mask": mask}


class GPTDataset:
    """``num_samples`` samples of ``seq_len`` inputs/targets from documents ``split_range`` of an indexed dataset."""

    def __init__(self, data, split_range, seq_len: int, num_samples: int, seed: int,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                 eod_id: int = 0, use_cache: bool = True):
        self.indexed = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        self.split_range = (int(split_range[0]), int(split_range[1]))
        self.seq_len, self.num_samples, self.seed = int(seq_len), int(num_samples), int(seed)
        self.options = dict(reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                            eod_mask_loss=eod_mask_loss, eod_id=eod_id)
        self.index, self.from_cache = load_or_build_index(self.indexed, self.split_range, self.seq_len,
                                                          self.num_samples, self.seed, use_cache=use_cache)
        self.document_index = self.index.document_index
        self.sample_index = self.index.sample_index
        self.shuffle_index = self.index.shuffle_index

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def tokens(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``i`` (after the sample shuffle)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        j = int(self.shuffle_index[i])
        d0, o0 = (int(x) for x in self.sample_index[j])
        d1, o1 = (int(x) for x in self.sample_index[j + 1])
        get, di = self.indexed.get, self.document_index
        if d0 == d1:
            return get(int(di[d0]), o0, o1 - o0 + 1)
        pieces = [get(int(di[d0]), o0)]
        pieces.extend(get(int(di[d])) for d in range(d0 + 1, d1))
        pieces.append(get(int(di[d1]), 0, o1 + 1))
        return np.concatenate(pieces)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        out = make_batch_fields(self.tokens(int(i))[None, :], **self.options)
        return {k: v[0] for k, v in out.items()}

    def batch(self, indices) -> dict[str, np.ndarray]:
        win = np.stack([self.tokens(int(i)) for i in indices])
        return make_batch_fields(win, **self.options)
