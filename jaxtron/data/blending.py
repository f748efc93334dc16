"""Weighted blends of datasets, as Megatron-LM's ``BlendedDataset`` (``megatron/core/datasets/blended_dataset.py``).

Sample ``i`` of the blend comes from the dataset with the largest error ``weight * (i + 1) - samples_taken_so_far``
(ties go to the first dataset); it is the next unused sample of that dataset.
"""

from __future__ import annotations

import math

import numpy as np


def parse_data_paths(text) -> list[tuple[float, str]]:
    """``"0.3 prefixA 0.7 prefixB"`` -> ``[(0.3, "prefixA"), (0.7, "prefixB")]`` (weights normalized to sum 1).
    A single prefix gets weight 1. Also accepts a list of tokens."""
    tokens = text.split() if isinstance(text, str) else [str(t) for t in text]
    if not tokens:
        raise ValueError("data paths: empty (expected 'PREFIX' or 'WEIGHT PREFIX [WEIGHT PREFIX ...]')")
    if len(tokens) == 1:
        try:
            float(tokens[0])
        except ValueError:
            return [(1.0, tokens[0])]
        raise ValueError(f"data paths: {tokens[0]!r} looks like a weight with no dataset prefix after it")
    if len(tokens) % 2:
        raise ValueError(f"data paths: odd number of tokens ({len(tokens)}); expected WEIGHT PREFIX pairs, "
                         f"the last token {tokens[-1]!r} has no partner")
    out = []
    for w_tok, prefix in zip(tokens[0::2], tokens[1::2]):
        try:
            w = float(w_tok)
        except ValueError:
            raise ValueError(f"data paths: weight {w_tok!r} (before {prefix!r}) is not a number") from None
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"data paths: weight {w_tok!r} for {prefix!r} must be a finite non-negative number")
        out.append((w, prefix))
    total = sum(w for w, _ in out)
    if total <= 0:
        raise ValueError(f"data paths: weights {' '.join(tokens[0::2])} sum to zero")
    return [(w / total, p) for w, p in out]


def normalize_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w):
        raise ValueError(f"weights {weights!r}: expected a non-empty list")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights {list(weights)}: must be finite and non-negative")
    if w.sum() <= 0:
        raise ValueError(f"weights {list(weights)}: sum to zero")
    return w / w.sum()


def build_blend_index(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` for ``num_samples`` blended samples by Megatron's greedy rule."""
    w = normalize_weights(weights)
    k, n = len(w), int(num_samples)
    dataset_index = np.zeros(n, dtype=np.uint8 if k < 256 else np.int16)
    dataset_sample_index = np.zeros(n, dtype=np.int64)
    if n == 0:
        return dataset_index, dataset_sample_index
    if k == 1:
        dataset_sample_index[:] = np.arange(n)
        return dataset_index, dataset_sample_index
    wl = [float(x) for x in w]
    counts = [0] * k
    choice = [0] * n
    rng_k = range(1, k)
    if k == 2:
        w0, w1 = wl
        c0 = c1 = 0
        for i in range(n):
            t = i + 1.0
            if w1 * t - c1 > w0 * t - c0:
                c1 += 1
                choice[i] = 1
            else:
                c0 += 1
        counts = [c0, c1]
    else:
        for i in range(n):
            t = i + 1.0
            best, best_err = 0, wl[0] * t - counts[0]
            for d in rng_k:
                e = wl[d] * t - counts[d]
                if e > best_err:
                    best, best_err = d, e
            counts[best] += 1
            choice[i] = best
    dataset_index[:] = choice
    # per-dataset running count: position of each sample among the earlier samples of its dataset
    for d in range(k):
        sel = dataset_index == d
        dataset_sample_index[sel] = np.arange(int(sel.sum()))
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets, weights, num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.dataset_index, self.dataset_sample_index = build_blend_index(self.weights, num_samples)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, need) in enumerate(zip(self.datasets, needed)):
            if len(ds) < need:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples but the blend of {num_samples} "
                                 f"needs {int(need)} from it")

    @staticmethod
    def samples_needed(weights, num_samples: int) -> list[int]:
        """How many samples each dataset must provide (build each with at least this many)."""
        di, _ = build_blend_index(weights, num_samples)
        return [int(c) for c in np.bincount(di, minlength=len(weights))]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} blended samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
