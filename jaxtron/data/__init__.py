"""Training data. ``builtin``: the standard library's Python sources, byte-tokenized (no download)."""

from jaxtron.data.builtin import BuiltinCorpus, ByteTokenizer

__all__ = ["BuiltinCorpus", "ByteTokenizer"]
