"""The training batch stream on grain: each process builds only its own rows of every global batch, grain
threads prefetch ahead of the train step, and the position in the stream is the step number (the whole
iterator state: batch ``k`` is a pure function of the config and ``k``)."""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np


def process_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch that ``process_index`` reads (contiguous blocks, as the data axis spans
    processes outermost)."""
    if global_batch % process_count:
        raise ValueError(f"train.global_batch_size={global_batch} is not divisible by {process_count} processes")
    per = global_batch // process_count
    return slice(process_index * per, (process_index + 1) * per)


class _LocalBatch:
    def __init__(self, corpus, global_batch: int, rows: slice):
        self.corpus, self.global_batch, self.rows = corpus, global_batch, rows

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        if hasattr(self.corpus, "batch_rows"):
            return self.corpus.batch_rows(int(step), self.global_batch, self.rows)
        return {k: v[self.rows] for k, v in self.corpus.train_batch(int(step), self.global_batch).items()}


def batch_stream(corpus, global_batch: int, start_step: int, end_step: int, prefetch: int = 4,
                 threads: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of the global batches ``start_step .. end_step - 1``, prefetched by grain."""
    rows = process_rows(global_batch, jax.process_index(), jax.process_count())
    ds = grain.MapDataset.range(start_step, end_step).map(_LocalBatch(corpus, global_batch, rows))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)))


def put_local_batch(local: dict[str, np.ndarray], sharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble the global sharded batch from every process's rows."""
    return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch,) + v.shape[1:])
            for k, v in local.items()}
