"""The built-in corpus goes through the indexed-dataset path: prepared once into the cache as .bin/.idx."""

import os

import numpy as np
import pytest

from helpers import tiny_config
from jaxtron.config import ConfigError
from jaxtron.data import IndexedDataset
from jaxtron.data.builtin import prepare_builtin, stdlib_root
from jaxtron.data.corpus import BuiltinCorpus
from jaxtron.data.tokenizers import BYTE_EOD as EOD


def test_builtin_corpus_is_prepared_once_as_indexed_files(tmp_path):
    cfg = tiny_config(f"data.cache_dir={tmp_path}", "data.max_corpus_bytes=300000", "data.valid_fraction=0.2")
    prefixes = prepare_builtin(cfg.data)
    assert set(prefixes) == {"train", "valid"} and all(p.startswith(str(tmp_path)) for p in prefixes.values())
    mtimes = {p: os.stat(p + ".bin").st_mtime_ns for p in prefixes.values()}
    train, valid = IndexedDataset(prefixes["train"]), IndexedDataset(prefixes["valid"])
    assert len(train) > 0 and len(valid) > 0 and train.dtype == np.uint8
    docs = [train[i] for i in range(len(train))] + [valid[i] for i in range(len(valid))]
    assert all(d[-1] == EOD and EOD not in d[:-1] for d in docs)  # one EOD, at each document's end
    # the documents are the source files' bytes
    texts = {bytes(d[:-1]) for d in docs}
    first = sorted(f for f in os.listdir(stdlib_root()) if f.endswith(".py"))[0]
    with open(os.path.join(stdlib_root(), first), "rb") as f:
        assert f.read() in texts

    corpus = BuiltinCorpus(cfg)  # a second preparation reuses the files
    assert corpus.prefixes == prefixes
    assert {p: os.stat(p + ".bin").st_mtime_ns for p in prefixes.values()} == mtimes
    other = prepare_builtin(tiny_config(f"data.cache_dir={tmp_path}", "data.max_corpus_bytes=200000",
                                        "data.valid_fraction=0.2").data)
    assert other["train"] != prefixes["train"]  # another setting, another cache entry
    b = corpus.train_batch(0, 8)
    assert b["inputs"].shape == (8, cfg.data.seq_len) and int(b["inputs"].max()) < 256


def test_too_small_a_corpus_is_a_one_line_config_error(tmp_path):
    # 1000 bytes hold a few files, none of them held out
    cfg = tiny_config(f"data.cache_dir={tmp_path}", "data.max_corpus_bytes=1000", "data.valid_fraction=0.01")
    with pytest.raises(ConfigError, match=r"^data.max_corpus_bytes: .*too little text.*held-out") as err:
        prepare_builtin(cfg.data)
    assert "\n" not in str(err.value)
