"""The tokenizer across ``import-hf`` / ``export-hf``: which file of a Hugging Face folder is the tokenizer,
its record (with the folder's bos/eos ids, which win over the names the tokenizer file suggests), and the
files an exported folder gets (``tokenizer.json`` or ``tokenizer.model``, ``tokenizer_config.json``,
``generation_config.json``)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from jaxtron.data import tokenizer_record
from jaxtron.data.tokenizers import load_tokenizer

# the file names transformers looks for, in the order jaxtron prefers them
HF_TOKENIZER_FILES = {"tokenizer.json": "tokenizer.json", "sentencepiece": "tokenizer.model"}
GENERATION_CONFIG = "generation_config.json"


def _first_int(value) -> Optional[int]:
    if isinstance(value, list):  # generation_config may list several eos ids (Llama 3: end_of_text, eot_id)
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


def record_from_folder(hf_dir: str, hf_config: dict) -> Optional[dict]:
    """The record of the folder's tokenizer (tokenizer.json, else tokenizer.model), or None when it has none.
    The end-of-document and BOS ids come from generation_config.json / config.json when they say."""
    path = next((os.path.join(hf_dir, f) for f in HF_TOKENIZER_FILES.values()
                 if os.path.isfile(os.path.join(hf_dir, f))), None)
    if path is None:
        return None
    rec = tokenizer_record.record_of(load_tokenizer(path))
    gen_cfg = {}
    try:
        with open(os.path.join(hf_dir, GENERATION_CONFIG)) as f:
            gen_cfg = json.load(f)
    except (OSError, ValueError):
        pass
    for key, field in (("eos_token_id", "eod_id"), ("bos_token_id", "bos_id")):
        value = _first_int(gen_cfg.get(key, hf_config.get(key)))
        if value is not None and 0 <= value < rec["vocab_size"]:
            rec[field] = value
    return rec


def write_to_folder(rec: Optional[dict], checkpoint_dir: str, out: str, where: str) -> list[str]:
    """Write the tokenizer a checkpoint records into the HF folder ``out`` (the main file under its HF name,
    the companions copied with it, a minimal tokenizer_config.json when there was none) and
    generation_config.json. Returns the names written; a byte-level or unrecorded tokenizer writes only
    generation_config.json (transformers has no byte-level tokenizer with jaxtron's ids)."""
    written = []
    if rec and rec.get("kind") != "byte":
        src = tokenizer_record.locate(checkpoint_dir, rec)
        if src is None:
            raise ValueError(f"{where}: the checkpoint records the tokenizer {tokenizer_record.describe(rec)} but "
                             f"its copy is missing; cannot write the tokenizer files")
        name = HF_TOKENIZER_FILES[rec["kind"]]
        shutil.copyfile(src, os.path.join(out, name))
        written.append(name)
        for comp in tokenizer_record.COMPANIONS:
            path = os.path.join(os.path.dirname(src), comp)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(out, comp))
                written.append(comp)
        if "tokenizer_config.json" not in written:
            tok = load_tokenizer(src)
            config = {"tokenizer_class": "PreTrainedTokenizerFast" if rec["kind"] == "tokenizer.json"
                      else "LlamaTokenizer", "eos_token": _token(tok, rec["eod_id"]),
                      "bos_token": _token(tok, rec.get("bos_id")), "add_bos_token": False}
            with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
                json.dump(config, f, indent=2)
            written.append("tokenizer_config.json")
    ids = special_ids(rec)
    if ids:
        with open(os.path.join(out, GENERATION_CONFIG), "w") as f:
            json.dump(ids, f, indent=2)
        written.append(GENERATION_CONFIG)
    return written


def special_ids(rec: Optional[dict]) -> dict:
    """``{"bos_token_id", "eos_token_id"}`` of a record, for config.json and generation_config.json."""
    if not rec:
        return {}
    return {"bos_token_id": rec.get("bos_id"), "eos_token_id": rec.get("eod_id")}


def _token(tok, i: Optional[int]) -> Optional[str]:
    if i is None:
        return None
    if hasattr(tok, "_tok"):
        return tok._tok.id_to_token(int(i))
    return tok._sp.id_to_piece(int(i))
