"""Loading a model to run it (generation, evaluation): a Hugging Face folder or a jaxtron checkpoint, as a
:class:`~jaxtron.model.Llama` on the default device (put it on a mesh with ``Layout.place``), and the tokenizer
it runs with."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxtron.convert import hf
from jaxtron.convert.checkpoint_io import read_checkpoint
from jaxtron.convert.model_tree import model_from_params
from jaxtron.data import tokenizer_record
from jaxtron.data.tokenizers import TokenizerError, load_tokenizer


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _host_friendly(cfg):
    """On CPU, run the xla reference kernels (cudnn cannot run there, pallas would be interpreted)."""
    if jax.default_backend() != "cpu":
        return cfg
    return dataclasses.replace(cfg, attention_impl="xla", rope_impl="xla", mlp_impl="xla", remat="none")


class Loaded(NamedTuple):
    """A model to run and what its checkpoint says about running it."""
    cfg: Any             # ModelConfig
    model: Any           # Llama
    kind: str            # "hf" or "jaxtron"
    meta: dict           # the checkpoint's meta (HF folders: {})
    directory: str       # the checkpoint directory (where its tokenizer copy lives) or the HF folder
    seq_len: Optional[int]        # the sequence length it was trained with (HF folders: None)
    max_positions: Optional[int]  # the longest sequence it is known to handle (None: unknown)


def load_model(path: str, dtype: Optional[str] = None):
    """(ModelConfig, Llama, kind) of a Hugging Face folder (has config.json: ``kind="hf"``) or a jaxtron
    checkpoint (training or weights-only, a checkpoint directory or one step directory: ``kind="jaxtron"``).
    ``dtype`` overrides the compute dtype. Raises ValueError/CheckpointError/ConfigError with one-line
    messages."""
    loaded = load_for_inference(path, dtype)
    return loaded.cfg, loaded.model, loaded.kind


def load_for_inference(path: str, dtype: Optional[str] = None) -> Loaded:
    """:func:`load_model` plus the checkpoint's meta, directory, training sequence length and maximum
    positions (meta ``max_positions``; else the training ``data.seq_len``; HF: ``max_position_embeddings``)."""
    if not os.path.exists(path):
        raise ValueError(f"--checkpoint: {os.path.abspath(path)} does not exist")
    if is_hf_folder(path):
        cfg, model = hf.load(path, dtype=dtype)  # HF configs always get the xla reference kernels
        hf_config, _ = hf.read_config(path)
        maxpos = hf_config.get("max_position_embeddings")
        return Loaded(cfg, model, "hf", {}, os.path.abspath(path), None, int(maxpos) if maxpos else None)
    full_cfg, params, meta, where = read_checkpoint(path)
    cfg = full_cfg.model
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
    cfg = _host_friendly(cfg)
    # an import records its HF max_position_embeddings; a checkpoint of an older jaxtron only its seq_len,
    # which for an import is the default config's and says nothing about the model (None: no limit known)
    maxpos = meta.get("max_positions") or (None if meta.get("source") == "hf" else full_cfg.data.seq_len)
    return Loaded(cfg, model_from_params(cfg, params), "jaxtron", meta, os.path.dirname(where),
                  full_cfg.data.seq_len, maxpos)


def checkpoint_tokenizer(path: str, kind: str, meta: dict, directory: str, spec: Optional[str] = None):
    """``(tokenizer, warning or None)``: ``spec`` when given (a warning when the checkpoint records another);
    else the tokenizer the checkpoint's meta records (its copy in ``directory``, with the recorded
    end-of-document id); else, for a checkpoint saved before jaxtron recorded tokenizers, ``byte`` with a
    warning; for Hugging Face folders, the folder's tokenizer.json (or SentencePiece tokenizer.model)."""
    rec = meta.get("tokenizer")
    if spec is not None:
        tok = load_tokenizer(spec)
        if rec and not tokenizer_record.same(tokenizer_record.record_of(tok), rec):
            return tok, (f"--tokenizer {spec}: the checkpoint was trained with {tokenizer_record.describe(rec)}; "
                         f"using --tokenizer as asked")
        return tok, None
    if kind == "hf":
        for name in ("tokenizer.json", "tokenizer.model"):
            cand = os.path.join(path, name)
            if os.path.isfile(cand):
                return load_tokenizer(cand), None
        raise TokenizerError(f"{os.path.abspath(path)}: no tokenizer.json in the Hugging Face folder; "
                             f"pass --tokenizer (byte, a tokenizer.json or a SentencePiece .model)")
    if rec:
        return tokenizer_record.load_recorded(directory, rec, os.path.abspath(path)), None
    why = ("the Hugging Face folder it was imported from had no tokenizer.json" if meta.get("source") == "hf"
           else "saved by an older jaxtron")
    return load_tokenizer("byte"), (f"{os.path.abspath(path)} records no tokenizer ({why}): using the byte "
                                    f"tokenizer; pass --tokenizer if it was trained with another")


def check_tokenizer_fits(tok, vocab_size: int, what: str = "--tokenizer") -> None:
    tv = getattr(tok, "vocab_size", None)
    if tv is not None and tv > vocab_size:
        raise ValueError(f"{what}: the tokenizer has {tv} ids but the model's vocabulary has {vocab_size}")
