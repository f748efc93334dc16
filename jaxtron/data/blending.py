"""Weighted blends of datasets, as Megatron-LM's ``BlendedDataset`` (``megatron/core/datasets/blended_dataset.py``,
``build_blending_indices`` in ``helpers.cpp``).

Sample ``i`` of the blend comes from the dataset with the largest error ``weight * max(i, 1) - samples_taken``
(ties go to the first dataset); it is the next unused sample of that dataset. Megatron's builder asks each
dataset for ``ceil(ceil(size * weight) * (1 + surplus))`` samples (``--mid-level-dataset-surplus``, 0.5%) and
makes the blend ``sum(ceil(size * weight))`` long: :func:`samples_per_dataset`.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np


def parse_blend(text) -> tuple[list[str], Optional[list[float]]]:
    """Megatron's ``--data-path`` forms: ``"PREFIX"``, ``"W1 PREFIX1 W2 PREFIX2 ..."`` or ``"PREFIX1 PREFIX2 ..."``
    (weights then come from the datasets' sample counts) -> ``(prefixes, weights or None)``; weights are
    returned as given (the builder normalizes them as Megatron does). Also accepts a list of tokens."""
    tokens = text.split() if isinstance(text, str) else [str(t) for t in text]
    if not tokens:
        raise ValueError("data paths: empty (expected 'PREFIX' or 'WEIGHT PREFIX [WEIGHT PREFIX ...]')")

    def number(tok):
        try:
            return float(tok)
        except ValueError:
            return None

    numbers = [number(t) for t in tokens[0::2]]
    if len(tokens) % 2 or all(v is None for v in numbers):
        bad = [t for t in tokens if number(t) is not None]
        if bad:
            raise ValueError(f"data paths: {bad[0]!r} looks like a weight, but the list is not WEIGHT PREFIX "
                             f"pairs ({len(tokens)} tokens)")
        return tokens, None
    for w_tok, w, prefix in zip(tokens[0::2], numbers, tokens[1::2]):
        if w is None:
            raise ValueError(f"data paths: weight {w_tok!r} (before {prefix!r}) is not a number")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"data paths: weight {w_tok!r} for {prefix!r} must be a finite non-negative number")
        if number(prefix) is not None:
            raise ValueError(f"data paths: {prefix!r} after weight {w_tok!r} is a number, not a dataset prefix")
    if sum(numbers) <= 0:
        raise ValueError(f"data paths: weights {' '.join(tokens[0::2])} sum to zero")
    return tokens[1::2], numbers


def parse_data_paths(text) -> list[tuple[float, str]]:
    """``"0.3 prefixA 0.7 prefixB"`` -> ``[(0.3, "prefixA"), (0.7, "prefixB")]`` (weights normalized to sum 1; no
    weights: equal ones)."""
    prefixes, weights = parse_blend(text)
    w = normalize_weights(weights if weights is not None else [1.0] * len(prefixes))
    return [(float(x), p) for x, p in zip(w, prefixes)]


def samples_per_dataset(weights, size: int, surplus: float = 0.0) -> list[int]:
    """Megatron's ``_get_size_per_split_per_dataset`` for one split: samples to ask of each dataset."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def normalize_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w):
        raise ValueError(f"weights {weights!r}: expected a non-empty list")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights {list(weights)}: must be finite and non-negative")
    if w.sum() <= 0:
        raise ValueError(f"weights {list(weights)}: sum to zero")
    return w / w.sum()


def _running_counts(dataset_index: np.ndarray, k: int) -> np.ndarray:
    """Position of each sample among the earlier samples of its dataset."""
    out = np.zeros(len(dataset_index), np.int64)
    for d in range(k):
        sel = dataset_index == d
        out[sel] = np.arange(int(sel.sum()))
    return out


def build_blend_index(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` for ``num_samples`` blended samples by Megatron's greedy rule.
    ``weights`` are used as given (float64), so pass them normalized the way Megatron normalizes them."""
    wl = [float(x) for x in np.asarray(weights, dtype=np.float64)]
    k, n = len(wl), int(num_samples)
    counts = [0] * k
    choice = np.zeros(n, dtype=np.int16)
    for i in range(n):
        t = float(max(i, 1))  # Megatron's max(sample_idx, 1.0): samples 0 and 1 see the same target
        best, best_err = 0, wl[0] * t - counts[0]
        for d in range(1, k):
            e = wl[d] * t - counts[d]
            if e > best_err:
                best, best_err = d, e
        counts[best] += 1
        choice[i] = best
    return choice, _running_counts(choice, k)


def build_exhaustive_blend_index(sizes) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every dataset (``sizes[d]`` of dataset ``d``), interleaved by the same greedy rule over
    the datasets not yet spent (Megatron's ``build_exhaustive_blending_indices``, for a blend of unweighted
    prefixes with no requested size)."""
    sizes = [int(x) for x in sizes]
    total = sum(sizes)
    w = [x / float(total) for x in sizes]
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    choice = np.zeros(total, dtype=np.int16)
    for i in range(total):
        t = float(max(i, 1))
        best, best_err = -1, -np.inf
        for d in unspent:
            e = w[d] * t - counts[d]
            if e > best_err:
                best, best_err = d, e
        choice[i] = best
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return choice, _running_counts(choice, len(sizes))


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets, weights, num_samples: Optional[int]):
        """``num_samples`` None: every sample of each dataset, ``weights`` being their sample counts."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        if num_samples is None:
            self.weights = np.asarray(weights, dtype=np.int64)
            self.dataset_index, self.dataset_sample_index = build_exhaustive_blend_index(self.weights)
        else:
            self.weights = normalize_weights(weights)  # Megatron's BlendedDataset normalizes once more
            self.dataset_index, self.dataset_sample_index = build_blend_index(self.weights, num_samples)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, need) in enumerate(zip(self.datasets, needed)):
            if len(ds) < need:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples but the blend of {len(self)} "
                                 f"needs {int(need)} from it (raise data.mid_level_dataset_surplus)")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} blended samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
