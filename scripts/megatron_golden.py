"""Regenerate the Megatron-LM golden files under tests/data/megatron/ by running Megatron-LM's own data code.

tests/test_megatron_compat.py compares jaxtron against these files without Megatron or torch installed. Run this
again to check jaxtron against a newer Megatron-LM:

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/megatron          # or any checkout
    python -m venv /tmp/mgvenv && /tmp/mgvenv/bin/pip install torch pybind11 numpy tokenizers transformers
    cd /tmp/megatron/megatron/core/datasets && g++ -O3 -shared -std=c++17 -fPIC \\
        $(/tmp/mgvenv/bin/python -m pybind11 --includes) helpers.cpp \\
        -o helpers_cpp$(/tmp/mgvenv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    /tmp/mgvenv/bin/python scripts/megatron_golden.py --megatron /tmp/megatron

What runs is Megatron's: BlendedMegatronDatasetBuilder, GPTDataset (document/sample/shuffle indices,
helpers.cpp, __getitem__ with its masks and position ids), BlendedDataset, IndexedDatasetBuilder, the
MegatronPretrainingSampler that walks the validation set, and tools/preprocess_data.py. Only imports that
pull in the model stack (megatron.core.__init__, megatron.training.__init__, parallel state, argument
parsing of the whole trainer) are replaced by the small stubs in megatron_stubs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "megatron")

SEQ = 16
EOD = 0
VOCAB = 500


def make_docs(n: int, seed: int, lo: int = 1, hi: int = 30, empty_every: int = 0) -> list[np.ndarray]:
    """Random documents ending in EOD (with an EOD-free empty document every ``empty_every``)."""
    rng = np.random.RandomState(seed)
    docs = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            docs.append(np.zeros(0, np.uint16))
            continue
        k = int(rng.randint(lo, hi))
        body = rng.randint(1, VOCAB, size=k - 1)
        # an EOD inside some documents too, so reset flags see several documents per sample
        if k > 6 and rng.rand() < 0.3:
            body[rng.randint(0, k - 1)] = EOD
        docs.append(np.concatenate([body, [EOD]]).astype(np.uint16))
    return docs


def pack_docs(docs) -> dict[str, np.ndarray]:
    return {"lengths": np.array([len(d) for d in docs], np.int64),
            "tokens": np.concatenate(docs).astype(np.uint16) if docs else np.zeros(0, np.uint16)}


class Golden:
    def __init__(self, mg, tmp):
        self.mg, self.tmp = mg, tmp
        self.arrays: dict[str, np.ndarray] = {}
        self.cases: dict[str, dict] = {}

    # ------------------------------------------------------------------------------------------ helpers
    def write_prefix(self, name, docs) -> str:
        """Write ``docs`` with Megatron's IndexedDatasetBuilder, as its preprocessing does (an empty document
        is recorded in document_indices and adds no sequence)."""
        prefix = os.path.join(self.tmp, name)
        b = self.mg.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for d in docs:
            b.add_document(d, [len(d)] if len(d) else [])
        b.finalize(prefix + ".idx")
        for k, v in pack_docs(docs).items():
            self.arrays[f"docs/{name}/{k}"] = v
        with open(prefix + ".idx", "rb") as f:  # jaxtron's writer must give these bytes
            self.arrays[f"docs/{name}/idx_bytes"] = np.frombuffer(f.read(), np.uint8)
        return prefix

    def build(self, blend=None, blend_per_split=None, split=None, sizes=(None, None, None), seed=1234,
              flags=(False, False, False)):
        mg = self.mg
        cfg = mg.GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, blend=blend,
                                  blend_per_split=blend_per_split, split=split,
                                  path_to_cache=tempfile.mkdtemp(dir=self.tmp), tokenizer=mg.Tok(),
                                  reset_position_ids=flags[0], reset_attention_mask=flags[1],
                                  eod_mask_loss=flags[2])
        return mg.BlendedMegatronDatasetBuilder(mg.GPTDataset, list(sizes), lambda: True, cfg).build()

    def store_gpt(self, key, ds, n_items: int | None = None):
        self.arrays[f"{key}/document_index"] = np.asarray(ds.document_index)
        self.arrays[f"{key}/sample_index"] = np.asarray(ds.sample_index)
        self.arrays[f"{key}/shuffle_index"] = np.asarray(ds.shuffle_index)
        self.arrays[f"{key}/indices"] = np.asarray(ds.indices)
        n = len(ds) if n_items is None else min(n_items, len(ds))
        if n:
            self.arrays[f"{key}/tokens"] = np.stack([ds[i]["tokens"].numpy() for i in range(n)]).astype(np.int32)
            self.arrays[f"{key}/labels"] = np.stack([ds[i]["labels"].numpy() for i in range(n)]).astype(np.int32)

    def store_split(self, key, ds, n_items=None):
        """One split of a build: a GPTDataset or a BlendedDataset over several."""
        if ds is None:
            self.cases[key] = None
            return
        if isinstance(ds, self.mg.BlendedDataset):
            self.arrays[f"{key}/dataset_index"] = np.asarray(ds.dataset_index)
            self.arrays[f"{key}/dataset_sample_index"] = np.asarray(ds.dataset_sample_index)
            for j, sub in enumerate(ds.datasets):
                self.store_gpt(f"{key}/ds{j}", sub, 0)
                n_sub = -1 if sub.num_samples is None else sub.num_samples
                self.arrays[f"{key}/ds{j}/num_samples"] = np.asarray(n_sub)
            n = len(ds) if n_items is None else min(n_items, len(ds))
            self.arrays[f"{key}/tokens"] = np.stack([ds[i]["tokens"].numpy() for i in range(n)]).astype(np.int32)
        else:
            self.store_gpt(key, ds, n_items)
            self.arrays[f"{key}/num_samples"] = np.asarray(-1 if ds.num_samples is None else ds.num_samples)

    # ------------------------------------------------------------------------------------------ cases
    # Every split of a case holds documents: Megatron loops forever in GPTDataset._get_num_epochs when a
    # split with a weight has no tokens (and asserts in helpers.cpp when asked for one epoch of nothing).

    def epochs(self):
        """One epoch; three epochs whose last is used less (separate final epoch) and more than 80%."""
        docs = make_docs(60, seed=1)
        prefix = self.write_prefix("epochs", docs)
        tokens = sum(len(d) for d in docs)
        train_docs = int(round(0.9 * 60))  # only to size the requests; the split itself is Megatron's
        per_epoch = (sum(len(d) for d in docs[:train_docs]) - 1) // SEQ
        for name, train_samples in (("one_epoch", per_epoch // 2), ("three_epochs_separate", 2 * per_epoch + 5),
                                    ("three_epochs_whole", 2 * per_epoch + int(0.9 * per_epoch))):
            train, valid, test = self.build(blend=([prefix], None), split="90,8,2",
                                            sizes=(train_samples, 40, 8))
            self.cases[name] = {"prefixes": ["epochs"], "split": "90,8,2", "sizes": [train_samples, 40, 8],
                                "seed": 1234, "tokens": tokens}
            for split_name, ds in (("train", train), ("valid", valid), ("test", test)):
                self.store_split(f"{name}/{split_name}", ds, 64)
        self.cases["seed_7"] = {"prefixes": ["epochs"], "split": "90,8,2", "sizes": [100, 10, 5], "seed": 7}
        train, valid, test = self.build(blend=([prefix], None), split="90,8,2", sizes=(100, 10, 5), seed=7)
        for split_name, ds in (("train", train), ("valid", valid), ("test", test)):
            self.store_split(f"seed_7/{split_name}", ds, 16)

    def splits(self):
        """Split boundaries as the builder rounds them, for several split strings and document counts."""
        mg = self.mg
        out = {}
        counts = list(range(1, 301)) + [997, 999, 1000, 1001, 1333, 4999, 12345]
        for split in ("969,30,1", "98,2,0", "90,5,5", "1,1,1"):
            ranges = []
            for n in counts:
                cfg = mg.GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=([str(n)], None),
                                          split=split, tokenizer=mg.Tok(), reset_position_ids=False,
                                          reset_attention_mask=False, eod_mask_loss=False)
                b = mg.BlendedMegatronDatasetBuilder(mg.SplitProbe, [None, None, None], lambda: True, cfg)
                got = b._build_megatron_dataset_splits(str(n), cfg.split_matrix, [None, None, None])
                ranges.append([[-1, -1] if d is None else [d.beg, d.end] for d in got])
            out[split] = ranges
        self.arrays["splits/counts"] = np.array(counts, np.int64)
        for split, ranges in out.items():
            self.arrays[f"splits/{split}"] = np.array(ranges, np.int64)
        self.cases["splits"] = {"strings": list(out)}

    def blends(self):
        """Blends of two and three datasets with uneven weights (one of them sized so that the 0.5% surplus
        adds an epoch), per-split blends, and prefixes without weights."""
        da, db, dc = make_docs(40, seed=2), make_docs(70, seed=3, hi=20), make_docs(25, seed=4, hi=50)
        pa, pb, pc = (self.write_prefix(n, d) for n, d in (("blend_a", da), ("blend_b", db), ("blend_c", dc)))
        # samples in one epoch of blend_a's train split; 0.3 * size of them fills the epoch exactly, the
        # surplus asks for one more epoch
        train_a = sum(len(d) for d in da[:int(round(0.85 * 40))])
        per_epoch_a = (train_a - 1) // SEQ
        size2 = int(per_epoch_a / 0.3)
        while int(np.ceil(size2 * 0.3)) > per_epoch_a:
            size2 -= 1
        cases = {
            "blend2": (["blend_a", "blend_b"], [0.3, 0.7], (size2, 30, 6)),
            "blend3": (["blend_a", "blend_b", "blend_c"], [0.2, 0.5, 0.3], (300, 24, 6)),
            "blend_unweighted": (["blend_a", "blend_b"], None, (150, 20, 4)),
        }
        paths = {"blend_a": pa, "blend_b": pb, "blend_c": pc}
        for name, (names, weights, sizes) in cases.items():
            res = self.build(blend=([paths[n] for n in names], weights), split="85,10,5", sizes=sizes)
            self.cases[name] = {"prefixes": names, "weights": weights, "split": "85,10,5", "sizes": list(sizes),
                                "seed": 1234}
            for split_name, ds in zip(("train", "valid", "test"), res):
                self.store_split(f"{name}/{split_name}", ds, 48)
        per_split = {"train": (["blend_a", "blend_c"], [0.6, 0.4]), "valid": (["blend_b"], None),
                     "test": (["blend_a", "blend_b"], [0.5, 0.5])}
        res = self.build(blend_per_split=[([paths[n] for n in v[0]], v[1]) for v in per_split.values()],
                         sizes=(120, 20, 10))
        self.cases["blend_per_split"] = {"per_split": {k: {"prefixes": v[0], "weights": v[1]}
                                                       for k, v in per_split.items()},
                                         "sizes": [120, 20, 10], "seed": 1234}
        for split_name, ds in zip(("train", "valid", "test"), res):
            self.store_split(f"blend_per_split/{split_name}", ds, 32)

    def flags(self):
        """reset_position_ids / reset_attention_mask / eod_mask_loss, each alone and all together; empty
        documents in the prefix as Megatron's preprocessing records them."""
        docs = make_docs(50, seed=5, hi=12, empty_every=7)
        prefix = self.write_prefix("flags", docs)
        for name, fl in (("flags_none", (False, False, False)), ("flags_pos", (True, False, False)),
                         ("flags_mask", (False, True, False)), ("flags_loss", (False, False, True)),
                         ("flags_all", (True, True, True))):
            train, _, _ = self.build(blend=([prefix], None), split="90,8,2", sizes=(40, 4, 2), flags=fl)
            self.cases[name] = {"prefixes": ["flags"], "split": "90,8,2", "sizes": [40, 4, 2], "seed": 1234,
                                "reset_position_ids": fl[0], "reset_attention_mask": fl[1], "eod_mask_loss": fl[2]}
            self.store_gpt(f"{name}/train", train, 24)
            items = [train[i] for i in range(24)]
            self.arrays[f"{name}/train/loss_mask"] = np.stack([it["loss_mask"].numpy() for it in items])
            self.arrays[f"{name}/train/position_ids"] = np.stack([it["position_ids"].numpy() for it in items])
            # True = may NOT attend (Megatron's convention), one (s, s) mask per sample, bit-packed
            am = np.stack([it["attention_mask"].numpy()[0] for it in items])
            self.arrays[f"{name}/train/attention_mask_bits"] = np.packbits(am, axis=-1)

    def validation(self):
        """Validation samples as Megatron sizes them ((train_iters // eval_interval + 1) * eval_iters *
        global_batch, training.py get_train_valid_test_num_samples) and walks them with one
        MegatronPretrainingSampler iterator that every evaluation continues."""
        mg = self.mg
        docs = make_docs(80, seed=6)
        prefix = self.write_prefix("valid", docs)
        train_iters, eval_interval, eval_iters, gbs = 10, 4, 3, 4
        eval_samples = (train_iters // eval_interval + 1) * eval_iters * gbs
        _, valid, _ = self.build(blend=([prefix], None), split="90,10,0",
                                 sizes=(train_iters * gbs, eval_samples, eval_iters * gbs))
        self.store_split("validation/valid", valid, 0)
        sampler = mg.MegatronPretrainingSampler(total_samples=len(valid), consumed_samples=0,
                                                micro_batch_size=gbs, data_parallel_rank=0, data_parallel_size=1)
        it = iter(sampler)
        # evaluation points: every eval_interval iterations and once more after training
        walk = [[next(it) for _ in range(eval_iters)] for _ in range(train_iters // eval_interval + 1)]
        self.arrays["validation/walk"] = np.array(walk, np.int64)
        self.cases["validation"] = {"prefixes": ["valid"], "split": "90,10,0", "train_iters": train_iters,
                                    "eval_interval": eval_interval, "eval_iters": eval_iters,
                                    "global_batch_size": gbs, "eval_samples": eval_samples, "seed": 1234}

    def preprocess(self, megatron_root):
        """tools/preprocess_data.py with a tokenizer.json (built here with the tokenizers library) on JSONL
        with an empty document: default flags (the tokenizer's own special tokens: BOS), --append-eod, and
        --append-eod without special tokens (the empty text is then an empty document)."""
        from megatron_stubs import build_tokenizer_dir
        tok_dir = os.path.join(OUT, "tokenizer")
        build_tokenizer_dir(tok_dir)
        texts = ["Hello world, this is a test.", "", "The quick brown fox jumps over the lazy dog.",
                 "résumé naïve café — ünïcödé", "hello hello hello world", " ", "a\nb\n\nc",
                 "Megatron and jaxtron read the same files."]
        src = os.path.join(OUT, "preprocess_input.jsonl")
        with open(src, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        for name, extra in (("default", []), ("append_eod", ["--append-eod"]),
                            ("no_special_append_eod", ["--append-eod", "--tokenizer-hf-no-include-special-tokens"])):
            out_prefix = os.path.join(self.tmp, f"pp_{name}")
            cmd = [sys.executable, os.path.join(HERE, "megatron_stubs.py"), "preprocess", megatron_root,
                   "--input", src, "--output-prefix", out_prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                   "--tokenizer-model", tok_dir, "--workers", "1", *extra]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
            for ext in ("bin", "idx"):
                shutil.copy(f"{out_prefix}_text_document.{ext}", os.path.join(OUT, f"preprocess_{name}.{ext}"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron", required=True, help="a Megatron-LM checkout with helpers_cpp compiled")
    p.add_argument("--commit", default=None, help="the Megatron-LM commit, recorded in cases.json (default: "
                                                  "git rev-parse HEAD in --megatron)")
    args = p.parse_args()
    import megatron_stubs
    mg = megatron_stubs.load(os.path.abspath(args.megatron))
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        g = Golden(mg, tmp)
        g.epochs()
        g.splits()
        g.blends()
        g.flags()
        g.validation()
        g.preprocess(os.path.abspath(args.megatron))
        rev = subprocess.run(["git", "-C", args.megatron, "rev-parse", "HEAD"], capture_output=True, text=True)
        g.cases["_source"] = {"megatron_commit": args.commit or rev.stdout.strip() or "unknown", "seq_length": SEQ,
                              "eod": EOD}
        np.savez_compressed(os.path.join(OUT, "golden.npz"), **g.arrays)
        with open(os.path.join(OUT, "cases.json"), "w") as f:
            json.dump(g.cases, f, indent=1, sort_keys=True)
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
