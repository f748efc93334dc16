"""Train/valid/test datasets from a blend, as Megatron-LM's ``BlendedMegatronDatasetBuilder``
(``megatron/core/datasets/blended_megatron_dataset_builder.py``) builds them, case for case:

* one prefix without a weight: a :class:`GPTDataset` of the split's documents with the split's size;
* weighted prefixes (``--data-path 0.3 A 0.7 B``): each prefix's split asked for
  ``ceil(ceil(size * w) * (1 + surplus))`` samples, blended to ``sum(ceil(size * w))`` samples;
* prefixes without weights (``--data-path A B``): one epoch of each, blended by their sample counts to
  ``min(size, total)`` samples (every sample when the size is None);
* per-split blends (``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``): each split uses all
  documents of its own prefixes; a single prefix there ignores its weight, as in Megatron.

Every GPTDataset draws its own ``RandomState(seed)``, so building one split never changes another.
"""

from __future__ import annotations

from typing import Callable, Optional

from jaxtron.data.blending import BlendedDataset, normalize_weights, samples_per_dataset
from jaxtron.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_documents
from jaxtron.data.indexed import IndexedDataset

Blend = tuple[list[str], Optional[list[float]]]  # (prefixes, weights or None), as parse_blend returns


class DataError(ValueError):
    """Bad data arguments; ``field`` names the config field (or file) to blame."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def build_datasets(sizes: dict[str, Optional[int]], seq_len: int, seed: int, *, blend: Optional[Blend] = None,
                   split: str = "969,30,1", per_split: Optional[dict[str, Optional[Blend]]] = None,
                   surplus: float = 0.005, open_prefix: Callable[[str], IndexedDataset] = IndexedDataset,
                   **options) -> dict[str, object]:
    """The datasets of the splits named in ``sizes`` (``None`` where a split has no data: weight 0 in
    ``split``, or no blend for it in ``per_split``). ``options``: GPTDataset's reset/eod options."""
    opened: dict[str, IndexedDataset] = {}

    def indexed(prefix: str) -> IndexedDataset:
        if prefix not in opened:
            opened[prefix] = open_prefix(prefix)
        return opened[prefix]

    def gpt(prefix: str, name: str, whole: bool, num_samples: Optional[int]) -> Optional[GPTDataset]:
        ds = indexed(prefix)
        rng = (0, len(ds)) if whole else split_documents(len(ds), split)[name]
        if rng is None:
            return None
        lo, hi = rng
        if hi <= lo:
            where = "data.split" if not whole else f"data.{name}_paths"
            raise DataError(where, f"{split!r} leaves no {name} documents in {prefix} ({len(ds)} documents)"
                            if not whole else f"{prefix} has no documents")
        try:
            return GPTDataset(ds, (lo, hi), seq_len, num_samples, seed, **options)
        except ValueError as err:
            raise DataError("data.paths", f"{prefix} {name} documents {lo}..{hi}: {err}") from None

    def one_split(name: str, b: Blend, whole: bool) -> Optional[object]:
        prefixes, weights = b
        size = sizes[name]
        if len(prefixes) == 1 and (weights is None or whole):
            return gpt(prefixes[0], name, whole, size)
        if weights is None:
            parts = [gpt(p, name, whole, None) for p in prefixes]
            if any(p is None for p in parts):
                return None
            counts = [len(p) for p in parts]
            total = None if size is None else min(size, sum(counts))
            return BlendedDataset(parts, counts, total)
        if size is None:
            raise DataError("data.paths", "weighted prefixes need a number of samples for every split")
        w = [float(x) for x in normalize_weights(weights)]
        target = samples_per_dataset(w, size)
        parts = [gpt(p, name, whole, n) for p, n in zip(prefixes, samples_per_dataset(w, size, surplus))]
        if any(p is None for p in parts):
            return None
        try:
            return BlendedDataset(parts, w, sum(target))
        except ValueError as err:
            raise DataError("data.mid_level_dataset_surplus", str(err)) from None

    out = {}
    for name in sizes:
        if name not in SPLIT_NAMES:
            raise ValueError(f"unknown split {name!r}")
        if per_split is not None:
            b = per_split.get(name)
            out[name] = None if b is None else one_split(name, b, whole=True)
        else:
            out[name] = one_split(name, blend, whole=False)
    return out
