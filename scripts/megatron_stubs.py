"""Import Megatron-LM's data code without its model stack, for scripts/megatron_golden.py.

``megatron/core/__init__.py`` and ``megatron/training/__init__.py`` import the whole trainer (parallel state,
Transformer Engine probes, triton); the data code needs none of it. So the packages are registered without
running their ``__init__``, and the few names the data modules import from elsewhere get stand-ins:
``megatron.core.utils.log_single_rank`` and ``accepts_parameter`` (same behaviour), ``safe_globals.safe_numpy_load`` (``numpy.load``),
``mpu``/``get_args`` for the sampler module, and the tokenizer flags of
``megatron.training.arguments._add_tokenizer_args`` for tools/preprocess_data.py (its real version builds
them from the trainer's whole config dataclass tree).

    python scripts/megatron_stubs.py preprocess MEGATRON_ROOT [preprocess_data.py arguments]
"""

from __future__ import annotations

import inspect
import logging
import os
import runpy
import sys
import types

import numpy


def _module(name, path=None, **attrs):
    m = types.ModuleType(name)
    if path is not None:
        m.__path__ = [path]
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def install(root: str) -> None:
    sys.path.insert(0, root)
    _module("megatron", os.path.join(root, "megatron"))
    core = _module("megatron.core", os.path.join(root, "megatron", "core"))
    _module("megatron.training", os.path.join(root, "megatron", "training"), get_args=lambda: None)

    def log_single_rank(logger, *args, rank=0, **kwargs):
        logger.log(*args, **kwargs)

    def accepts_parameter(func, name):
        params = inspect.signature(func).parameters.values()
        return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    _module("megatron.core.utils", log_single_rank=log_single_rank, accepts_parameter=accepts_parameter)
    _module("megatron.core.safe_globals", safe_numpy_load=numpy.load)

    core.mpu = _module("megatron.core.mpu")
    _module("megatron.training.dist_signal_handler", DistributedSignalHandler=object)

    def _add_tokenizer_args(parser):
        # the flags of megatron.training.config.TokenizerConfig that build_tokenizer reads, same defaults
        g = parser.add_argument_group(title="tokenizer")
        g.add_argument("--tokenizer-type", type=str, default=None)
        g.add_argument("--tokenizer-model", type=str, default=None)
        g.add_argument("--tokenizer-metadata", dest="metadata_path", default=None)
        g.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", default=None)
        g.add_argument("--vocab-file", default=None)
        g.add_argument("--merge-file", default=None)
        g.add_argument("--vocab-size", type=int, default=None)
        g.add_argument("--tokenizer-hf-no-use-fast", action="store_true")
        g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true")
        g.add_argument("--trust-remote-code", action="store_true")
        g.add_argument("--chat-template", default=None)
        g.add_argument("--use-gigatoken", action="store_true")
        parser.set_defaults(pad_vocab_size=True, tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
                            tokenizer_sentencepiece_legacy=False,
                            tokenizer_sentencepiece_ignore_extra_whitespaces=True)
        return parser

    _module("megatron.training.arguments", _add_tokenizer_args=_add_tokenizer_args)


class Tok:
    """The tokenizer GPTDatasetConfig asks for: only ``eod`` and ``vocab_size`` matter to GPTDataset (no
    ``pad``: Megatron then pads with -1, which never occurs in data, as with a tokenizer without one)."""

    eod = 0
    vocab_size = 500
    unique_identifiers = {"class": "Tok", "eod": 0}


def load(root: str) -> types.SimpleNamespace:
    install(root)
    logging.basicConfig(level=logging.WARNING)
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.datasets.megatron_dataset import MegatronDataset
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    class SplitProbe(MegatronDataset):
        """A mid-level dataset that only records the document range the builder gives it: the builder's
        split rounding for any document count, without building indices (a low-level dataset of
        ``int(path)`` documents)."""

        def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
            super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
            self.beg = int(indices[0]) if len(indices) else -2
            self.end = int(indices[-1]) + 1 if len(indices) else -2
            if not len(indices):  # an empty range: keep where it is from the split matrix
                self.beg = self.end = -3

        @staticmethod
        def numel_low_level_dataset(low_level_dataset):
            return int(low_level_dataset)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return int(dataset_path)

        def __len__(self):
            return 0

        def __getitem__(self, idx):
            raise IndexError(idx)

    return types.SimpleNamespace(BlendedDataset=BlendedDataset,
                                 BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder,
                                 GPTDataset=GPTDataset, GPTDatasetConfig=GPTDatasetConfig,
                                 IndexedDatasetBuilder=IndexedDatasetBuilder, Tok=Tok, SplitProbe=SplitProbe,
                                 MegatronPretrainingSampler=MegatronPretrainingSampler)


def build_tokenizer_dir(path: str) -> None:
    """A small BPE tokenizer.json (trained here with the ``tokenizers`` library, deterministic) whose
    post-processor adds BOS, with ``</s>`` as eos in tokenizer_config.json and ``<|endoftext|>`` also in the
    vocabulary (so a tool that guesses the end-of-document token by name picks the wrong one)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog.",
              "Megatron and jaxtron read the same files.", "résumé naïve café"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "preprocess":
        sys.exit(__doc__)
    megatron_root = os.path.abspath(sys.argv[2])
    install(megatron_root)
    sys.argv = [os.path.join(megatron_root, "tools", "preprocess_data.py")] + sys.argv[3:]
    runpy.run_path(sys.argv[0], run_name="__main__")
