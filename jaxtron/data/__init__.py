"""Training data: the built-in corpus, Megatron-compatible indexed datasets, tokenizers.

``python -m jaxtron.data.prepare`` turns JSONL or text into ``.bin/.idx`` files."""

from jaxtron.data.corpus import BuiltinCorpus
from jaxtron.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype, merge
from jaxtron.data.blending import BlendedDataset, parse_data_paths
from jaxtron.data.gpt_dataset import GPTDataset, build_sample_index, split_documents
from jaxtron.data.tokenizers import ByteLevelTokenizer, TokenizerError, load_tokenizer

__all__ = ["BuiltinCorpus", "ByteLevelTokenizer", "IndexedDataset", "IndexedDatasetError", "IndexedDatasetWriter",
           "best_dtype", "merge", "TokenizerError", "load_tokenizer", "BlendedDataset", "parse_data_paths",
           "GPTDataset", "build_sample_index", "split_documents"]
