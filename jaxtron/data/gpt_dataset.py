"""Megatron-LM's GPT pretraining samples over an :class:`~jaxtron.data.indexed.IndexedDataset`.

Builds the same three index arrays as Megatron-LM's ``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``
and ``helpers.cpp``), value for value, from one ``np.random.RandomState(seed)`` drawn in the same order:

* ``document_index``: the split's documents repeated for ``E`` epochs (the fewest that hold
  ``num_samples * seq_len + 1`` tokens) and shuffled as ONE array, so epochs mix at their edges; when the
  last epoch is used less than 80%, the first ``E - 1`` epochs are shuffled together and the last one after
  them on its own (``separate_final_epoch``);
* ``sample_index``: ``(S + 1, 2)`` int32 pairs (position in ``document_index``, token offset) where the
  ``S = (E * tokens_per_epoch - 1) // seq_len`` samples start. Sample ``i`` is the ``seq_len + 1`` tokens
  ``[i * seq_len, (i + 1) * seq_len]`` of the concatenated stream (consecutive samples share one token);
* ``shuffle_index``: a permutation of all ``S`` samples (uint32), or, with a separate final epoch, one of the
  full epochs' samples followed by one of the rest, so every full epoch is served whole first.

The tests check these arrays and the samples against golden files made by Megatron-LM's own code
(tests/test_megatron_compat.py, scripts/megatron_golden.py). They are cached as ``.npy`` files in
``<prefix>_cache/`` keyed by an md5 of every input that changes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from jaxtron.data.indexed import IndexedDataset, idx_path

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = "jaxtron-gpt-index-v3-megatron"
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch used less than this is shuffled on its own


def parse_split(split) -> list[float]:
    """``"969,30,1"`` (any separators, as Megatron's ``[.0-9]+`` scan) or a sequence of numbers -> weights for
    train/valid/test normalized as Megatron does (float64 division), padded with zeros to three."""
    if isinstance(split, str):
        vals = [float(v) for v in re.findall(r"[.0-9]+", split)] if re.fullmatch(r"[\s.0-9,/:;]*", split) else None
        if not vals:
            raise ValueError(f"split={split!r}: expected up to 3 comma-separated numbers like '969,30,1'")
    else:
        try:
            vals = [float(v) for v in split]
        except (TypeError, ValueError):
            raise ValueError(f"split={split!r}: expected up to 3 numbers like '969,30,1'") from None
    if not 1 <= len(vals) <= 3:
        raise ValueError(f"split={split!r}: expected 1 to 3 weights (train,valid,test), got {len(vals)}")
    if any(not np.isfinite(v) or v < 0 for v in vals):
        raise ValueError(f"split={split!r}: weights must be finite and non-negative")
    if sum(vals) <= 0:
        raise ValueError(f"split={split!r}: weights sum to zero")
    w = np.array(vals + [0.0] * (3 - len(vals)), dtype=np.float64)
    return (w / w.sum()).tolist()


def split_documents(num_docs: int, split="969,30,1") -> dict[str, Optional[tuple[int, int]]]:
    """Document ranges ``[start, end)`` for train/valid/test as Megatron's ``BlendedMegatronDatasetBuilder``
    cuts them: each boundary is ``round(cumulative_weight * num_docs)`` (Python's round, half to even) of the
    cumulative float sums. A split of weight zero is ``None`` (Megatron builds no dataset for it)."""
    weights = parse_split(split)
    if num_docs < 0:
        raise ValueError(f"num_docs={num_docs} must be >= 0")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w)  # the same float additions as Megatron's split matrix
    out = {}
    for k, name in enumerate(SPLIT_NAMES):
        lo, hi = bounds[k], bounds[k + 1]
        out[name] = None if hi <= lo else (int(round(lo * float(num_docs))), int(round(hi * float(num_docs))))
    return out


@dataclass
class GPTSampleIndex:
    document_index: np.ndarray  # (num_epochs * num_docs,) int32 document ids, shuffled across epochs
    sample_index: np.ndarray  # (S + 1, 2): (position in document_index, token offset)
    shuffle_index: np.ndarray  # (S,) uint32 permutation of the samples of all epochs
    num_epochs: int
    separate_final_epoch: bool = False

    def __len__(self) -> int:
        return len(self.shuffle_index)


def num_epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: Optional[int]) -> int:
    """The fewest epochs holding ``num_samples * seq_len + 1`` tokens (one when ``num_samples`` is None)."""
    if num_samples is None:
        return 1
    needed = int(num_samples) * seq_len + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_sample_index(doc_lengths, doc_ids, seq_len: int, num_samples: Optional[int], seed: int) -> GPTSampleIndex:
    """Megatron's document/sample/shuffle indices for ``num_samples`` samples (None: one epoch).
    ``doc_lengths[d]`` is the token count of sequence ``d``; ``doc_ids`` are the split's sequences."""
    seq_len = int(seq_len)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if num_samples is not None and int(num_samples) < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    tokens_per_epoch = int(doc_lengths[doc_ids].sum()) if len(doc_ids) else 0
    if tokens_per_epoch <= 1:
        # Megatron asserts (helpers.cpp) or loops forever (_get_num_epochs) here
        raise ValueError(f"cannot build samples: the split has {tokens_per_epoch} tokens in {len(doc_ids)} "
                         f"documents")
    num_epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)
    separate = False
    full_samples = 0
    if num_epochs > 1:
        full_samples = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len  # samples of the first E-1 epochs
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate = int(num_samples) - full_samples < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)

    def shuffled_epochs(n: int) -> np.ndarray:
        arr = np.tile(doc_ids.astype(np.int32), n)
        rng.shuffle(arr)
        return arr

    if separate:
        document_index = np.concatenate([shuffled_epochs(num_epochs - 1), shuffled_epochs(1)])
    else:
        document_index = shuffled_epochs(num_epochs)

    total = (num_epochs * tokens_per_epoch - 1) // seq_len
    # sample i starts at stream token i * seq_len: the first document whose end lies beyond it (side="right"
    # skips empty documents, as Megatron's walk does); sample 0 starts at (0, 0) whatever document 0 holds
    lengths = doc_lengths[document_index]
    ends = np.cumsum(lengths, dtype=np.int64)
    starts_tok = np.arange(1, total + 1, dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts_tok, side="right")
    offsets = starts_tok - (ends[pos] - lengths[pos])
    big = max(len(document_index), int(doc_lengths.max()) if len(doc_lengths) else 0) > np.iinfo(np.int32).max
    sample_index = np.zeros((total + 1, 2), np.int64 if big else np.int32)
    sample_index[1:, 0], sample_index[1:, 1] = pos, offsets

    sdtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(full_samples if separate else total, dtype=sdtype)
    rng.shuffle(first)
    if separate:
        rest = np.arange(full_samples, total, dtype=sdtype)
        rng.shuffle(rest)
        shuffle_index = np.concatenate([first, rest])
    else:
        shuffle_index = first
    return GPTSampleIndex(document_index, sample_index, shuffle_index, num_epochs, separate)


def _cache_key(prefix: str, split_range, seq_len, num_samples, seed) -> str:
    st = os.stat(idx_path(prefix))
    desc = {
        "version": _INDEX_VERSION,
        "prefix": os.path.abspath(prefix),
        "idx_size": st.st_size,
        "idx_mtime_ns": st.st_mtime_ns,
        "split_range": [int(split_range[0]), int(split_range[1])],
        "seq_len": int(seq_len),
        "num_samples": None if num_samples is None else int(num_samples),
        "seed": int(seed),
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


def load_or_build_index(dataset: IndexedDataset, split_range, seq_len: int, num_samples: Optional[int], seed: int,
                        use_cache: bool = True) -> tuple[GPTSampleIndex, bool]:
    """The index for ``dataset`` documents ``[split_range)``; returns ``(index, loaded_from_cache)``."""
    start, end = int(split_range[0]), int(split_range[1])
    if not 0 <= start <= end <= len(dataset):
        raise ValueError(f"split range {split_range} out of bounds for {len(dataset)} documents in {dataset.prefix}")
    paths = cache_paths(dataset.prefix, (start, end), seq_len, num_samples, seed) if use_cache else None
    if paths and all(os.path.exists(p) for p in paths.values()):
        try:
            arrs = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
            n_ep = len(arrs["document_index"]) // (end - start) if end > start else 0
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
        mask[inputs == eod_id] = 0.0  # Megatron's: no loss where the INPUT is EOD (predicting a new document)
    return {"inputs": np.ascontiguousarray(inputs), "targets": np.ascontiguousarray(targets),
            "positions": positions, "segment_ids": segment_ids, "loss_mask": mask}


class GPTDataset:
    """At least ``num_samples`` samples (None: one epoch) of ``seq_len`` inputs/targets from documents
    ``split_range`` of an indexed dataset; ``len()`` is every sample of the epochs built, as in Megatron."""

    def __init__(self, data, split_range, seq_len: int, num_samples: Optional[int], seed: int,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                 eod_id: int = 0, use_cache: bool = True):
        self.indexed = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        self.split_range = (int(split_range[0]), int(split_range[1]))
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.num_samples = None if num_samples is None else int(num_samples)
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
