"""The tokenizer travels with the model: prepare records it next to the data, training checks it and records
it (with a copy) in the checkpoint, generate/evaluate use it by default, export-hf writes it out and
import-hf brings it in; another tokenizer is a one-line error naming the field and both tokenizers.

A tiny byte-level BPE tokenizer.json (vocab 300) is trained here with the ``tokenizers`` library on a few of
the standard library's sources; nothing is downloaded. One tiny model trains for one step on it.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import pytest
import yaml

from helpers import TINY
from jaxtron import config as config_lib
from jaxtron.config import ConfigError
from jaxtron.data import tokenizer_record
from jaxtron.data.prepare import prepare
from jaxtron.data.tokenizers import load_tokenizer

SOURCES = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))


def _texts() -> list[str]:
    return [open(p, encoding="utf-8").read() for p in SOURCES]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer.json path, data prefix prepared with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_texts(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = str(d / "tokenizer.json")
    tok.save(path)
    docs = d / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts() * 2))
    prefix = str(d / "data" / "bpe")
    prepare([str(docs)], prefix, path, append_eod=True)
    return path, prefix


def _cfg(*overrides: str) -> config_lib.Config:
    return config_lib.load(None, TINY + ["model.vocab_size=320", "train.steps=1", "train.eval_batches=1",
                                         "checkpoint.async_save=false", *overrides])


@pytest.fixture(scope="module")
def trained(bpe, tmp_path_factory):
    """A checkpoint directory of one step on the BPE data (data.seq_len=16)."""
    from jaxtron.train.trainer import Trainer  # not run(): its log handler would hide records from caplog elsewhere

    path, prefix = bpe
    out = str(tmp_path_factory.mktemp("run"))
    Trainer(_cfg("data.source=indexed", f"data.paths={prefix}", "data.split=90,10,0", f"data.tokenizer={path}",
             f"train.output_dir={out}")).train()
    return os.path.join(out, "checkpoints")


def test_prepare_records_the_tokenizer(bpe):
    path, prefix = bpe
    rec = tokenizer_record.read_data_record(prefix)
    tok = load_tokenizer(path)
    assert rec["kind"] == "tokenizer.json" and rec["vocab_size"] == 300
    assert (rec["eod_id"], rec["bos_id"]) == (tok.eod, tok.bos) == (0, 1)
    assert tokenizer_record.same(rec, tokenizer_record.record_for(path))
    assert not tokenizer_record.same(rec, tokenizer_record.record_for("byte"))


def test_training_on_other_tokenizer_data_is_one_line_error(bpe, tmp_path, capsys):
    """data.tokenizer=byte (the default) on data prepared with the BPE tokenizer: exit 2, one error line
    naming the field and both tokenizers, before any model is built. (In this process: main() is what
    ``python -m jaxtron.train`` runs; an exception would fail the test.)"""
    from jaxtron.train.__main__ import main

    _, prefix = bpe
    assert main([*TINY, "model.vocab_size=320", "data.source=indexed", f"data.paths={prefix}",
                 f"train.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith("error: data.tokenizer: ") and "byte" in errors[0] and "tokenizer.json" in errors[0]
    assert "data.allow_tokenizer_mismatch" in errors[0]


def test_mismatch_override_warns(bpe, caplog):
    from jaxtron.data.corpus import IndexedCorpus

    _, prefix = bpe
    cfg = _cfg("data.source=indexed", f"data.paths={prefix}", "data.split=90,10,0",
               "data.allow_tokenizer_mismatch=true")
    with caplog.at_level("WARNING", logger="jaxtron"):
        IndexedCorpus(cfg)
    assert "data.allow_tokenizer_mismatch=true" in caplog.text


def test_checkpoint_records_and_generate_uses_it(bpe, trained, capsys):
    from jaxtron.generate import __main__ as generate_cli

    path, _ = bpe
    meta_tok = json.load(open(os.path.join(trained, "1", "meta", "metadata")))["tokenizer"]
    assert tokenizer_record.same(meta_tok, tokenizer_record.record_for(path))
    assert os.path.isfile(os.path.join(trained, meta_tok["copy"]))
    tok = load_tokenizer(path)

    # the default is the recorded tokenizer; --max-new-tokens past the model's 16 positions is cut, with a warning
    prompt = "import json"
    assert generate_cli.main(["--checkpoint", trained, "--prompt", prompt, "--max-new-tokens", "100000",
                              "--json"]) == 0
    out = capsys.readouterr()
    row = json.loads(out.out)
    plen = len(tok.encode(prompt))
    assert row["completion"] == tok.decode(row["tokens"][:-1] if row["stopped_at_eos"] else row["tokens"])
    assert len(row["tokens"]) == 16 - plen or row["stopped_at_eos"]
    assert "warning: --max-new-tokens 100000: the model has 16 positions" in out.err

    # a prompt that fills the positions is a one-line error
    assert generate_cli.main(["--checkpoint", trained, "--prompt", "x = 1\n" * 20]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --prompt: ") and "16 positions" in err[0]


def test_old_checkpoint_defaults_to_byte_with_a_warning():
    from jaxtron.convert.loading import checkpoint_tokenizer

    tok, note = checkpoint_tokenizer("ckpt", "jaxtron", {}, "ckpt")
    assert tok.kind == "byte" and "records no tokenizer" in note and "byte" in note


def test_evaluate_uses_checkpoint_seq_len_and_shows_progress(trained, tmp_path, capsys):
    from jaxtron.evaluate import __main__ as evaluate_cli

    text = tmp_path / "t.txt"
    text.write_text(_texts()[0][:3000])
    assert evaluate_cli.main(["--checkpoint", trained, "--data", str(text), "--json", "--batch-size", "2",
                              "--log-every", "2"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["seq_len"] == 16  # the checkpoint's data.seq_len, not 512
    lines = [x for x in out.err.splitlines() if x.startswith("evaluate: batch ")]
    assert lines and lines[-1].startswith(f"evaluate: batch {result['batches']}/{result['batches']}")
    assert "\r" not in out.err  # no progress-bar frames off a terminal


def test_finetune_with_other_tokenizer_is_an_error(bpe, trained, tmp_path):
    """Loading the BPE-trained weights for a run on the byte-level built-in corpus stops, naming the field."""
    from jaxtron.train.trainer import Trainer

    with pytest.raises(ConfigError) as info:
        Trainer(_cfg(f"checkpoint.load_weights={trained}", f"train.output_dir={tmp_path}",
                     "data.max_corpus_bytes=2000000")).train()
    msg = str(info.value)
    assert msg.startswith("checkpoint.load_weights: ") and "byte" in msg and "tokenizer.json" in msg
    assert "\n" not in msg
    # resuming it with another data.tokenizer too
    with pytest.raises(ConfigError) as info:
        Trainer(_cfg(f"checkpoint.dir={trained}", "train.steps=2", f"train.output_dir={tmp_path}",
                     "data.max_corpus_bytes=2000000")).train()
    assert str(info.value).startswith("data.tokenizer: checkpoint step 1 in ") and "tokenizer.json" in str(info.value)


def test_export_and_import_carry_the_tokenizer(bpe, trained, tmp_path):
    from jaxtron.convert import checkpoint_io
    from jaxtron.data.corpus import make_corpus

    path, _ = bpe
    out = str(tmp_path / "hf")
    checkpoint_io.export_hf(trained, out)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(out))
    gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert gen_cfg["eos_token_id"] == hf_cfg["eos_token_id"] == 0
    assert gen_cfg["bos_token_id"] == hf_cfg["bos_token_id"] == 1
    assert hf_cfg["max_position_embeddings"] == 16
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def encode(obj):\n    return obj"
    assert hf_tok(text)["input_ids"] == load_tokenizer(path).encode(text)

    # import-hf records the folder's tokenizer and names its copy in config.yaml: fine-tuning on the
    # byte-level built-in corpus is then an error naming data.tokenizer
    imported = str(tmp_path / "imported")
    checkpoint_io.import_hf(out, imported)
    meta = json.load(open(os.path.join(imported, "0", "meta", "metadata")))
    assert tokenizer_record.same(meta["tokenizer"], tokenizer_record.record_for(path))
    assert meta["max_positions"] == 16
    cfg = config_lib.load(os.path.join(imported, "config.yaml"), ["data.max_corpus_bytes=2000000"])
    assert cfg.data.tokenizer == os.path.join(imported, meta["tokenizer"]["copy"])
    with pytest.raises(ConfigError) as info:
        make_corpus(cfg)
    assert str(info.value).startswith("data.tokenizer: the built-in corpus was made with byte")
    assert yaml.safe_load(open(os.path.join(imported, "config.yaml")))["data"]["tokenizer"] == cfg.data.tokenizer


def test_sentencepiece_model_is_recorded(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "lines.txt"
    corpus.write_text("\n".join(line for t in _texts() for line in t.splitlines() if line.strip()))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    model = str(tmp_path / "sp.model")
    prefix = str(tmp_path / "sp_data")
    prepare([str(corpus)], prefix, model)
    rec = tokenizer_record.read_data_record(prefix)
    assert rec["kind"] == "sentencepiece" and rec["vocab_size"] == 200 and (rec["eod_id"], rec["bos_id"]) == (2, 1)
    assert tokenizer_record.same(rec, tokenizer_record.record_for(model))
    copied = tokenizer_record.copy_into(str(tmp_path / "ckpt"), rec)
    tok = tokenizer_record.load_recorded(str(tmp_path / "ckpt"), copied, "ckpt")
    assert tok.kind == "sentencepiece" and tok.encode("import json") == load_tokenizer(model).encode("import json")
