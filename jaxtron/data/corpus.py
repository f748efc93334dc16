"""Training data for a run: Megatron ``.bin/.idx`` prefixes (a weighted blend, or the built-in corpus prepared
as such) cut into GPTDataset samples. Either way batch ``k`` is a pure function of (config, k), so a resumed run sees the
batches an uninterrupted run would."""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from jaxtron.config import Config, ConfigError
from jaxtron.data.blending import BlendedDataset, parse_data_paths
from jaxtron.data.gpt_dataset import GPTDataset, split_documents
from jaxtron.data.indexed import IndexedDataset, IndexedDatasetError


class IndexedCorpus:
    """``sources``: split name -> weighted prefixes whose documents all belong to that split (the built-in
    corpus); default: the blend in ``data.paths``, each prefix's documents cut by ``data.split``."""

    def __init__(self, cfg: Config, sources: Optional[dict[str, list[tuple[float, str]]]] = None,
                 eod_id: Optional[int] = None, prepared_with: Optional[dict] = None):
        from jaxtron.data import tokenizer_record  # here: tokenizers -> builtin -> corpus would be a cycle

        d, t = cfg.data, cfg.train
        # ``prepared_with``: the tokenizer record of every source (the built-in corpus's); default: each
        # prefix's <prefix>.meta.json, checked against data.tokenizer before any sample is cut
        self.tokenizer = tokenizer_record.run_record(d, cfg.model.vocab_size)
        eod_id = eod_id if eod_id is not None else d.eod_id if d.eod_id is not None else self.tokenizer["eod_id"]
        checked: set = set()
        if sources is None:
            try:
                blend = parse_data_paths(d.paths or "")
            except ValueError as err:
                raise ConfigError("data.paths", str(err)) from None
        self.vocab_size = cfg.model.vocab_size
        num = {"train": t.steps * t.global_batch_size, "valid": t.eval_batches * t.global_batch_size}
        self.splits = {}
        for name, count in num.items():
            if sources is not None:
                blend = sources[name]
            weights = [w for w, _ in blend]
            needed = BlendedDataset.samples_needed(weights, count)
            parts = []
            for (_, prefix), need in zip(blend, needed):
                try:
                    indexed = IndexedDataset(prefix)
                    if prefix not in checked:
                        checked.add(prefix)
                        rec = prepared_with or tokenizer_record.read_data_record(prefix)
                        where = "the built-in corpus" if prepared_with else f"data.paths {prefix}"
                        tokenizer_record.check_match(self.tokenizer, rec, where, d.allow_tokenizer_mismatch)
                except (IndexedDatasetError, ValueError) as err:
                    if isinstance(err, ConfigError):
                        raise
                    raise ConfigError("data.paths", str(err)) from None
                try:
                    lo, hi = (0, len(indexed)) if sources is not None else split_documents(len(indexed),
                                                                                           d.split)[name]
                except ValueError as err:
                    raise ConfigError("data.split", str(err)) from None
                if hi <= lo:
                    raise ConfigError("data.split", f"{d.split!r} leaves no {name} documents in {prefix} "
                                                    f"({len(indexed)} documents)")
                parts.append(GPTDataset(indexed, (lo, hi), d.seq_len, max(need, 1), t.seed,
                                        reset_position_ids=d.reset_at_eod, reset_attention_mask=d.reset_at_eod,
                                        eod_mask_loss=d.eod_mask_loss, eod_id=eod_id))
            self.splits[name] = parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, count)

    def _rows(self, split: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        ds = self.splits[split]
        samples = [ds[int(i)] for i in rows]
        batch = {k: np.stack([s[k] for s in samples]) for k in samples[0]}
        top = int(max(batch["inputs"].max(), batch["targets"].max()))
        if top >= self.vocab_size:
            raise ConfigError("model.vocab_size", f"{self.vocab_size} is too small for data.paths: token id {top} "
                                                  "occurs (tokenizer/vocab mismatch?)")
        return batch

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        return self._rows("train", step * batch_size + np.arange(batch_size))

    def valid_batches(self, num_batches: int, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for i in range(num_batches):
            yield self._rows("valid", i * batch_size + np.arange(batch_size))


def make_corpus(cfg: Config):
    """The run's data source (``data.source``)."""
    if cfg.data.source == "indexed":
        return IndexedCorpus(cfg)
    from jaxtron.data.builtin import BuiltinCorpus
    return BuiltinCorpus(cfg)
