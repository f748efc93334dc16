"""The built-in corpus's files: this Python installation's standard-library ``.py`` sources, a real text
corpus present on every machine, with the byte-level tokenizer (vocab 256, token 0 = end of document; NUL
bytes do not occur in Python sources). :class:`jaxtron.data.corpus.BuiltinCorpus` reads them.

It goes through the same path as any Megatron dataset: the first run writes the documents (each followed by
an end-of-document token) as ``.bin/.idx`` files into a cache directory (``data.cache_dir``, default
``$JAXTRON_CACHE_DIR`` or ``~/.cache/jaxtron``), one prefix for training and one held out (files are
assigned by a hash of their path); later runs reuse them. Samples are GPTDataset samples of those prefixes,
so batch ``k`` is a pure function of the config and ``k``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
import zlib

import numpy as np

from jaxtron.config import ConfigError, DataConfig
from jaxtron.data.indexed import IndexedDatasetWriter, idx_path
from jaxtron.data.tokenizers import BYTE_EOD

FORMAT_VERSION = 2


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def default_cache_dir() -> str:
    return os.environ.get("JAXTRON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxtron")


def _candidates(cfg: DataConfig) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the source files the corpus reads, in order, up to ``max_corpus_bytes``."""
    out, total = [], 0
    for path in stdlib_files():
        if total >= cfg.max_corpus_bytes:
            break
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_size:
            out.append((path, st.st_size, st.st_mtime_ns))
            total += st.st_size
    return out


def prepare_builtin(cfg: DataConfig) -> dict[str, str]:
    """Write (once) the built-in corpus as ``.bin/.idx``; returns ``{"train": prefix, "valid": prefix}``.
    The cache name hashes every input that changes the files: the source list (paths, sizes, mtimes),
    ``max_corpus_bytes`` and ``valid_fraction``."""
    files = _candidates(cfg)
    root = stdlib_root()
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, cfg.max_corpus_bytes, cfg.valid_fraction,
                                     [(os.path.relpath(p, root), n, t) for p, n, t in files]]).encode()).hexdigest()
    root_dir = cfg.cache_dir or default_cache_dir()
    try:
        os.makedirs(root_dir, exist_ok=True)
    except OSError as err:
        if cfg.cache_dir:
            raise ConfigError("data.cache_dir", f"cannot create {root_dir}: {err.strerror}") from None
        root_dir = os.path.join(tempfile.gettempdir(), "jaxtron-cache")  # e.g. a read-only home directory
    directory = os.path.join(root_dir, f"builtin-{key[:16]}")
    prefixes = {"train": os.path.join(directory, "train"), "valid": os.path.join(directory, "valid")}
    if all(os.path.exists(idx_path(p)) for p in prefixes.values()):
        return prefixes
    threshold = int(cfg.valid_fraction * 10_000)
    counts = {"train": 0, "valid": 0}
    writers = {name: IndexedDatasetWriter(p, dtype=np.uint8) for name, p in prefixes.items()}
    try:
        for path, _, _ in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if not data or b"\x00" in data:
                continue
            rel = os.path.relpath(path, root).encode()
            name = "valid" if zlib.crc32(rel) % 10_000 < threshold else "train"
            writers[name].add_document(np.frombuffer(data + bytes([BYTE_EOD]), dtype=np.uint8))
            counts[name] += 1
        if not counts["train"] or not counts["valid"]:
            raise ConfigError("data.max_corpus_bytes", f"data.source=builtin found too little text under {root} "
                              f"({counts['train']} train / {counts['valid']} held-out files); raise "
                              f"data.max_corpus_bytes or data.valid_fraction")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.finalize()
    return prefixes

