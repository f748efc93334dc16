"""The built-in corpus: this Python installation's standard-library ``.py`` sources, a real text corpus
present on every machine, with a byte-level tokenizer (vocab 256, token 0 = end of document; NUL bytes do
not occur in Python sources).

Batches are ``seq_len + 1``-token windows of the concatenated document stream, at positions drawn from a
generator seeded by (seed, step), so batch ``k`` is the same whenever it is asked for (exact resume needs no
iterator state). Documents are split into train and held-out sets by a hash of their path.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from typing import Iterator

import numpy as np

from jaxtron.config import DataConfig
from jaxtron.data.gpt_dataset import make_batch_fields

EOD = 0


class ByteTokenizer:
    vocab_size = 256
    eod = EOD

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != EOD).decode("utf-8", errors="replace")


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


class BuiltinCorpus:
    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        root = sysconfig.get_paths()["stdlib"]
        train, valid, total = [], [], 0
        threshold = int(cfg.valid_fraction * 10_000)
        for path in stdlib_files():
            if total >= cfg.max_corpus_bytes:
                break
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if not data or b"\x00" in data:
                continue
            total += len(data)
            rel = os.path.relpath(path, root).encode()
            (valid if zlib.crc32(rel) % 10_000 < threshold else train).append(data)
        if not train or not valid:
            raise RuntimeError(f"data.source=builtin: found too little text under {root} "
                               f"({len(train)} train / {len(valid)} held-out files)")
        sep = bytes([EOD])
        self.train_tokens = np.frombuffer(sep.join(train) + sep, dtype=np.uint8)
        self.valid_tokens = np.frombuffer(sep.join(valid) + sep, dtype=np.uint8)
        for name, toks in (("train", self.train_tokens), ("held-out", self.valid_tokens)):
            if len(toks) < cfg.seq_len + 2:
                raise RuntimeError(f"data.seq_len={cfg.seq_len} is longer than the {name} corpus "
                                   f"({len(toks)} tokens)")

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        win = tokens[starts[:, None] + np.arange(self.cfg.seq_len + 1)[None, :]]
        return make_batch_fields(win, reset_position_ids=self.cfg.reset_at_eod,
                                 reset_attention_mask=self.cfg.reset_at_eod, eod_mask_loss=self.cfg.eod_mask_loss,
                                 eod_id=EOD)

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.train_tokens) - self.cfg.seq_len - 1, size=batch_size)
        return self._windows(self.train_tokens, starts)

    def valid_batches(self, num_batches: int, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Fixed, evenly spaced held-out windows: the same every evaluation."""
        n = num_batches * batch_size
        last = len(self.valid_tokens) - self.cfg.seq_len - 1
        starts = np.linspace(0, last, n).astype(np.int64)
        for i in range(num_batches):
            yield self._windows(self.valid_tokens, starts[i * batch_size:(i + 1) * batch_size])
