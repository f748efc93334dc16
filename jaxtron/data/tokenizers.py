"""Tokenizers for data preparation behind one interface: ``encode(text) -> list[int]``, ``eod``, ``vocab_size``.

``load_tokenizer(spec)`` accepts:

* ``"byte"``: UTF-8 bytes 0..255, end-of-document id 0 (:class:`ByteLevelTokenizer`, the built-in corpus's);
* a path to a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library);
* a path to a SentencePiece ``.model`` file (the ``sentencepiece`` library).
"""

from __future__ import annotations

import json
import os

BYTE_EOD = 0  # the byte tokenizer's end of document: NUL, which text (and Python source) does not contain
# special tokens tried, in order, as the end-of-document id of a tokenizer.json
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[EOS]", "<eod>", "[SEP]")
# ... and as the beginning-of-sequence id (None when there is none: the checkpoint records it as null)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "[CLS]")


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded; the message names the file."""


class ByteLevelTokenizer:
    kind = "byte"
    name = "byte"
    bos = None
    vocab_size = 256
    eod = BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        return text.encode("utf-8")

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eod).decode("utf-8", errors="replace")


class HFTokenizer:
    kind = "tokenizer.json"

    def __init__(self, path: str, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers ships with transformers
            raise TokenizerError(f"{path}: the 'tokenizers' package is needed for tokenizer.json files "
                                 f"(pip install tokenizers)") from e
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:
            raise TokenizerError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from e
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(path, eod_token)
        self.bos = self._find_bos(path)

    def _find_bos(self, path: str):
        for name in _BOS_NAMES + (_config_token(path, "bos_token"),):
            i = self._tok.token_to_id(name) if name else None
            if i is not None:
                return int(i)
        return None

    def _find_eod(self, path: str, eod_token: str | None) -> int:
        # Megatron's HuggingFace tokenizer uses its eos_token (tokenizer_config.json) as EOD: that first, then
        # the usual names (a tokenizer.json alone declares no eos)
        names = (eod_token,) if eod_token else (_config_token(path, "eos_token"),) + _EOD_NAMES
        for name in names:
            i = self._tok.token_to_id(name) if name else None
            if i is not None:
                return int(i)
        if eod_token:
            raise TokenizerError(f"{path}: end-of-document token {eod_token!r} is not in the vocabulary")
        # fall back to the tokenizer's declared eos token in a tokenizer_config.json next to it
        cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        try:
            with open(cfg) as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos and self._tok.token_to_id(eos) is not None:
                return int(self._tok.token_to_id(eos))
        except (OSError, ValueError):
            pass
        raise TokenizerError(f"{path}: no end-of-document token found (tried {', '.join(_EOD_NAMES)}); "
                             f"add one to the vocabulary")

    # the tokenizer's own special tokens (its post-processor, e.g. a BOS); prepare turns them on by default, as
    # Megatron's HuggingFace tokenizer (``tokenizer(text).input_ids``) has them
    add_special_tokens = False

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


class SentencePieceTokenizer:
    kind = "sentencepiece"

    def __init__(self, path: str):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise TokenizerError(f"{path}: the 'sentencepiece' package is needed for .model files "
                                 f"(pip install sentencepiece)") from e
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise TokenizerError(f"{path}: not a valid SentencePiece model ({e})") from e
        self.name = path
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise TokenizerError(f"{path}: SentencePiece model has no end-of-sentence id to use as end-of-document")
        self.eod = eos
        self.bos = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def _config_token(path: str, key: str):
    """The ``key`` token (e.g. bos_token) of the tokenizer_config.json next to ``path``, or None."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    try:
        with open(cfg) as f:
            tok = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return tok.get("content") if isinstance(tok, dict) else tok if isinstance(tok, str) else None


def load_tokenizer(spec: str, eod_token: str | None = None):
    """``"byte"``, a ``tokenizer.json`` path, or a SentencePiece ``.model`` path (see the module docstring)."""
    spec = str(spec)
    if spec == "byte":
        return ByteLevelTokenizer()
    if not os.path.exists(spec):
        raise TokenizerError(f"{spec}: tokenizer file not found (give 'byte', a tokenizer.json or a "
                             f"SentencePiece .model)")
    if os.path.isdir(spec):
        cand = os.path.join(spec, "tokenizer.json")
        if os.path.isfile(cand):
            return HFTokenizer(cand, eod_token)
        models = sorted(f for f in os.listdir(spec) if f.endswith(".model"))
        if models:
            return SentencePieceTokenizer(os.path.join(spec, models[0]))
        raise TokenizerError(f"{spec}: directory holds neither tokenizer.json nor a SentencePiece .model")
    if spec.endswith(".json"):
        return HFTokenizer(spec, eod_token)
    if spec.endswith(".model"):
        return SentencePieceTokenizer(spec)
    raise TokenizerError(f"{spec}: unknown tokenizer file type (expected tokenizer.json or a SentencePiece .model)")
