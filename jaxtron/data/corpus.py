"""Training data for a run: Megatron ``.bin/.idx`` prefixes (a weighted blend, or the built-in corpus prepared
as such) cut into GPTDataset samples. Either way batch ``k`` is a pure function of (config, k), so a resumed run sees the
batches an uninterrupted run would."""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from jaxtron.config import Config, ConfigError
from jaxtron.data import tokenizer_record
from jaxtron.data.blending import parse_blend
from jaxtron.data.builder import DataError, build_datasets
from jaxtron.data.builtin import prepare_builtin
from jaxtron.data.gpt_dataset import SPLIT_NAMES
from jaxtron.data.indexed import IndexedDataset, IndexedDatasetError
from jaxtron.data.tokenizers import BYTE_EOD


class IndexedCorpus:
    """``sources``: split name -> weighted prefixes whose documents all belong to that split (the built-in
    corpus); default: ``data.train_paths/valid_paths/test_paths`` when set, else the blend in ``data.paths``,
    each prefix's documents cut by ``data.split`` (Megatron's BlendedMegatronDatasetBuilder, see builder.py)."""

    def __init__(self, cfg: Config, sources: Optional[dict[str, list[tuple[float, str]]]] = None,
                 eod_id: Optional[int] = None, prepared_with: Optional[dict] = None):
        d, t = cfg.data, cfg.train
        # ``prepared_with``: the tokenizer record of every source (the built-in corpus's); default: each
        # prefix's <prefix>.meta.json, checked against data.tokenizer before any sample is cut
        self.tokenizer = tokenizer_record.run_record(d, cfg.model.vocab_size)
        eod_id = eod_id if eod_id is not None else d.eod_id if d.eod_id is not None else self.tokenizer["eod_id"]
        checked: set = set()
        self.vocab_size = cfg.model.vocab_size
        self.eval_every, self.eval_batches = t.eval_every, t.eval_batches
        sizes = {"train": t.steps * t.global_batch_size,
                 "valid": valid_samples(t.steps, t.eval_every, t.eval_batches, t.global_batch_size)}

        def open_prefix(prefix: str) -> IndexedDataset:
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
            return indexed

        per_split = None
        blend = None
        try:
            if sources is not None:  # the built-in corpus: one prefix per split, all of its documents
                per_split = {name: ([p for _, p in src], None) for name, src in sources.items()}
            elif any((d.train_paths, d.valid_paths, d.test_paths)):
                per_split = {name: parse_blend(v) if v else None
                             for name, v in zip(SPLIT_NAMES, (d.train_paths, d.valid_paths, d.test_paths))}
            else:
                blend = parse_blend(d.paths or "")
        except ValueError as err:
            field = "data.paths" if per_split is None else "data.train_paths/valid_paths/test_paths"
            raise ConfigError(field, str(err)) from None
        reset_pos = d.reset_position_ids or d.reset_at_eod
        reset_mask = d.reset_attention_mask or d.reset_at_eod
        try:
            self.splits = build_datasets(sizes, d.seq_len, d.seed, blend=blend, split=d.split, per_split=per_split,
                                         surplus=d.mid_level_dataset_surplus, open_prefix=open_prefix,
                                         reset_position_ids=reset_pos, reset_attention_mask=reset_mask,
                                         eod_mask_loss=d.eod_mask_loss, eod_id=eod_id)
        except ConfigError:
            raise
        except DataError as err:
            raise ConfigError(err.field, str(err)) from None
        except ValueError as err:
            raise ConfigError("data.split", str(err)) from None
        for name in sizes:
            if self.splits[name] is None:
                raise ConfigError("data.split" if per_split is None else f"data.{name}_paths",
                                  f"no {name} data (its split weight is 0 or it has no prefixes); training needs "
                                  f"train and valid data")

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

    def valid_batches(self, num_batches: int, batch_size: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Validation batches ``start .. start + num_batches - 1``: evaluation after step ``s`` starts at
        :func:`valid_start_batch` ``(s, ...)``, so evaluations walk through the validation set as Megatron's."""
        for i in range(start, start + num_batches):
            yield self._rows("valid", i * batch_size + np.arange(batch_size))


class BuiltinCorpus(IndexedCorpus):
    """The built-in corpus (``data.source: builtin``): the standard library's sources in the byte tokenizer,
    written once by :func:`jaxtron.data.builtin.prepare_builtin`."""

    def __init__(self, cfg: Config):
        self.prefixes = prepare_builtin(cfg.data)
        super().__init__(cfg, sources={name: [(1.0, p)] for name, p in self.prefixes.items()}, eod_id=BYTE_EOD,
                         prepared_with=tokenizer_record.BYTE_RECORD)


def valid_samples(steps: int, eval_every: int, eval_batches: int, global_batch: int) -> int:
    """Megatron's validation size: ``(train_iters // eval_interval + 1) * eval_iters * global_batch`` (an
    evaluation every ``eval_every`` steps and one after training; ``eval_every`` 0: only that one)."""
    points = steps // eval_every + 1 if eval_every else 1
    return points * eval_batches * global_batch


def valid_start_batch(step: int, eval_every: int, eval_batches: int) -> int:
    """The first validation batch of the evaluation after ``step``: evaluation ``k`` (at step
    ``(k + 1) * eval_every``, the last at the final step) reads batches ``k * eval_batches ...``, as Megatron's
    validation iterator continues from one evaluation to the next (and resumes at ``step // eval_interval *
    eval_iters`` batches)."""
    if not eval_every or step <= 0:
        return 0
    return (-(-step // eval_every) - 1) * eval_batches


def make_corpus(cfg: Config):
    """The run's data source (``data.source``)."""
    if cfg.data.source == "indexed":
        return IndexedCorpus(cfg)
    return BuiltinCorpus(cfg)
