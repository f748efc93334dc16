"""jaxtron's samples equal Megatron-LM's, index for index, against golden files made by Megatron-LM's own data
code (scripts/megatron_golden.py; the commit is in tests/data/megatron/cases.json). No Megatron or torch here."""

import json
import os

import numpy as np
import pytest

from jaxtron.data.blending import BlendedDataset, parse_blend
from jaxtron.data.builder import build_datasets
from jaxtron.data.gpt_dataset import GPTDataset, split_documents
from jaxtron.data.indexed import IndexedDataset, IndexedDatasetWriter, idx_path

DATA = os.path.join(os.path.dirname(__file__), "data", "megatron")
CASES = json.load(open(os.path.join(DATA, "cases.json")))
SEQ, EOD = CASES["_source"]["seq_length"], CASES["_source"]["eod"]
SPLITS = ("train", "valid", "test")


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(DATA, "golden.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def prefixes(golden, tmp_path_factory):
    """Every golden dataset written by jaxtron's writer; its .idx bytes are Megatron's."""
    root = tmp_path_factory.mktemp("megatron_golden")
    out = {}
    for key in golden:
        if key.startswith("docs/") and key.endswith("/lengths"):
            name = key.split("/")[1]
            lengths, tokens = golden[f"docs/{name}/lengths"], golden[f"docs/{name}/tokens"]
            w = IndexedDatasetWriter(str(root / name), np.uint16)
            for doc in np.split(tokens, np.cumsum(lengths)[:-1]):
                w.add_document(doc) if len(doc) else w.add_empty_document()
            w.finalize()
            out[name] = str(root / name)
    return out


def test_writer_gives_megatrons_idx_bytes(golden, prefixes):
    """Empty documents are recorded as Megatron's preprocessing records them (document_indices repeat)."""
    for name, prefix in prefixes.items():
        with open(idx_path(prefix), "rb") as f:
            assert f.read() == golden[f"docs/{name}/idx_bytes"].tobytes(), name
    flags = IndexedDataset(prefixes["flags"])
    assert (np.diff(flags.document_indices) == 0).any()  # the empty documents are there


def _build(case, prefixes, options=None):
    sizes = dict(zip(SPLITS, case["sizes"]))
    if "per_split" in case:
        per = {k: ([prefixes[p] for p in v["prefixes"]], v["weights"]) for k, v in case["per_split"].items()}
        return build_datasets(sizes, SEQ, case["seed"], per_split=per, **(options or {}))
    blend = ([prefixes[p] for p in case["prefixes"]], case.get("weights"))
    return build_datasets(sizes, SEQ, case["seed"], blend=blend, split=case["split"], **(options or {}))


def _check_gpt(golden, key, ds: GPTDataset):
    lo, hi = ds.split_range
    np.testing.assert_array_equal(np.arange(lo, hi), golden[f"{key}/indices"], err_msg=key)
    for arr in ("document_index", "sample_index", "shuffle_index"):
        ours, theirs = np.asarray(getattr(ds, arr)), golden[f"{key}/{arr}"]
        assert ours.dtype == theirs.dtype, (key, arr)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{key}/{arr}")
    if f"{key}/tokens" in golden:
        want = golden[f"{key}/tokens"]
        got = np.stack([ds[i]["inputs"] for i in range(len(want))])
        np.testing.assert_array_equal(got, want, err_msg=key)
        np.testing.assert_array_equal(np.stack([ds[i]["targets"] for i in range(len(want))]),
                                      golden[f"{key}/labels"], err_msg=key)


def _check_split(golden, key, ds):
    if isinstance(ds, BlendedDataset):
        np.testing.assert_array_equal(ds.dataset_index, golden[f"{key}/dataset_index"], err_msg=key)
        np.testing.assert_array_equal(ds.dataset_sample_index, golden[f"{key}/dataset_sample_index"], err_msg=key)
        for j, sub in enumerate(ds.datasets):
            assert sub.num_samples == int(golden[f"{key}/ds{j}/num_samples"]) or (
                sub.num_samples is None and int(golden[f"{key}/ds{j}/num_samples"]) == -1)
            _check_gpt(golden, f"{key}/ds{j}", sub)
        want = golden[f"{key}/tokens"]
        np.testing.assert_array_equal(np.stack([ds[i]["inputs"] for i in range(len(want))]), want, err_msg=key)
    else:
        assert f"{key}/document_index" in golden, f"{key}: Megatron built a blend here"
        _check_gpt(golden, key, ds)


@pytest.mark.parametrize("name", ["one_epoch", "three_epochs_separate", "three_epochs_whole", "seed_7", "blend2",
                                  "blend3", "blend_unweighted", "blend_per_split", "validation"])
def test_indices_and_samples_equal_megatron(golden, prefixes, name):
    case = CASES[name]
    sizes = case.get("sizes") or [case["train_iters"] * case["global_batch_size"], case["eval_samples"],
                                  case["eval_iters"] * case["global_batch_size"]]
    built = _build(dict(case, sizes=sizes), prefixes)
    for split in SPLITS:
        key = f"{name}/{split}"
        if built[split] is None:
            assert f"{key}/document_index" not in golden and f"{key}/dataset_index" not in golden, key
        elif name != "validation" or split == "valid":
            _check_split(golden, key, built[split])
    if name.startswith("three_epochs"):
        train = built["train"]
        assert train.index.num_epochs == 3
        assert train.index.separate_final_epoch == (name == "three_epochs_separate")
    if name == "blend2":  # the 0.5% surplus asks blend_a for one sample more than an epoch holds
        assert built["train"].datasets[0].index.num_epochs == 2


def test_split_boundaries_equal_megatron(golden):
    counts = golden["splits/counts"]
    for split in CASES["splits"]["strings"]:
        want = golden[f"splits/{split}"]
        for n, ranges in zip(counts, want):
            got = split_documents(int(n), split)
            for name, (lo, hi) in zip(SPLITS, ranges):
                r = got[name]
                if lo == -1:  # weight 0: Megatron builds no dataset
                    assert r is None, (split, n, name)
                elif lo == -3:  # an empty range
                    assert r is not None and r[0] == r[1], (split, n, name, r)
                else:
                    assert r == (lo, hi), (split, int(n), name, r, (lo, hi))


def test_split_rounding_is_cumulative():
    # 969,30,1 over 37 documents: the cumulative boundaries round 35.853 and 36.963 (train 0..36, valid 36..37);
    # rounding each split's size on its own would give train 36 and valid 1 too, but over 115 documents it
    # gives valid 3 where the boundaries round 111.435 and 114.885 (valid 111..115 = 4)
    assert split_documents(115, "969,30,1") == {"train": (0, 111), "valid": (111, 115), "test": (115, 115)}
    assert split_documents(1000, "969,30,1") == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}
    assert split_documents(10, "98,2,0")["test"] is None


@pytest.mark.parametrize("name", ["flags_none", "flags_pos", "flags_mask", "flags_loss", "flags_all"])
def test_reset_and_eod_mask_equal_megatron(golden, prefixes, name):
    case = CASES[name]
    opts = {k: case[k] for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")}
    train = _build(case, prefixes, dict(opts, eod_id=EOD))["train"]
    key = f"{name}/train"
    _check_gpt(golden, key, train)
    n = len(golden[f"{key}/loss_mask"])
    batch = train.batch(range(n))
    np.testing.assert_array_equal(batch["loss_mask"], golden[f"{key}/loss_mask"])
    np.testing.assert_array_equal(batch["positions"], golden[f"{key}/position_ids"])
    # Megatron's mask (True = may not attend) against causal attention within equal segment ids
    masked = np.unpackbits(golden[f"{key}/attention_mask_bits"], axis=-1, count=SEQ).astype(bool)
    seg = batch["segment_ids"]
    allowed = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((SEQ, SEQ), bool))[None]
    np.testing.assert_array_equal(allowed, ~masked)
    if case["eod_mask_loss"]:
        assert (batch["loss_mask"] == 0).any()


def test_validation_walk_equals_megatron(golden, prefixes):
    """Evaluation k reads validation samples [k * eval_iters * batch, (k + 1) * eval_iters * batch), the
    samples Megatron's one validation iterator gives its k-th evaluation."""
    from jaxtron.data.corpus import valid_samples, valid_start_batch

    case = CASES["validation"]
    t_iters, interval, iters, gbs = (case[k] for k in ("train_iters", "eval_interval", "eval_iters",
                                                       "global_batch_size"))
    assert valid_samples(t_iters, interval, iters, gbs) == case["eval_samples"]
    walk = golden["validation/walk"]  # [evaluation, batch, row]
    for k in range(len(walk)):
        step = (k + 1) * interval if k < t_iters // interval else t_iters  # the last one: after training
        start = valid_start_batch(step, interval, iters)
        if k == len(walk) - 1 and t_iters % interval == 0:
            continue  # jaxtron evaluates once at a final step that is also an interval step
        rows = (start + np.arange(iters))[:, None] * gbs + np.arange(gbs)[None]
        np.testing.assert_array_equal(rows, walk[k])


def test_parse_blend_forms():
    assert parse_blend("A") == (["A"], None)
    assert parse_blend("A B") == (["A", "B"], None)
    assert parse_blend("0.3 A 0.7 B") == (["A", "B"], [0.3, 0.7])
    for bad in ("0.3 A B", "abc A 0.5 B", "-1 A 2 B", "0 A 0 B", "0.5", ""):
        with pytest.raises(ValueError):
            parse_blend(bad)


def _prepare(tmp_path, name, *flags):
    from jaxtron.data.prepare import main

    out = tmp_path / name
    assert main(["--input", os.path.join(DATA, "preprocess_input.jsonl"), "--output-prefix", str(out),
                 "--tokenizer", os.path.join(DATA, "tokenizer"), "--no-progress", *flags]) == 0
    return out


@pytest.mark.parametrize("name,flags", [("default", []), ("append_eod", ["--append-eod"]),
                                        ("no_special_append_eod", ["--append-eod", "--no-special-tokens"])])
def test_prepare_is_byte_identical_to_preprocess_data(tmp_path, name, flags):
    out = _prepare(tmp_path, name, *flags)
    for ext in ("bin", "idx"):
        with open(f"{out}.{ext}", "rb") as a, open(os.path.join(DATA, f"preprocess_{name}.{ext}"), "rb") as b:
            assert a.read() == b.read(), (name, ext)


def test_prepare_eod_token_and_bos(tmp_path):
    """The end-of-document id is the tokenizer's eos_token (</s> here, although <|endoftext|> is in the
    vocabulary too); --eod-token chooses another; --add-bos adds BOS where the tokenizer does not."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DATA, "tokenizer", "tokenizer.json"))
    eos, other, bos = tok.token_to_id("</s>"), tok.token_to_id("<|endoftext|>"), tok.token_to_id("<s>")
    plain = IndexedDataset(str(_prepare(tmp_path, "a", "--append-eod")))
    assert all(plain.get(i)[-1] == eos for i in range(len(plain)))
    chosen = IndexedDataset(str(_prepare(tmp_path, "b", "--append-eod", "--eod-token", "<|endoftext|>")))
    assert all(chosen.get(i)[-1] == other for i in range(len(chosen)))
    nobos = IndexedDataset(str(_prepare(tmp_path, "c", "--no-special-tokens", "--add-bos")))
    assert all(nobos.get(i)[0] == bos for i in range(len(nobos)))
    assert len(nobos) == len(plain) - 1  # the empty text stays an empty document (no sequence)
    assert not any(nobos.get(i)[1] == bos for i in range(len(nobos)) if len(nobos.get(i)) > 1)


def test_prepare_unknown_eod_token_is_one_line(tmp_path, capsys):
    from jaxtron.data.prepare import main

    rc = main(["--input", os.path.join(DATA, "preprocess_input.jsonl"), "--output-prefix", str(tmp_path / "x"),
               "--tokenizer", os.path.join(DATA, "tokenizer"), "--eod-token", "<nope>", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("error: ") and "<nope>" in err[0]
