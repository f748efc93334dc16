"""What a tokenizer *is*, recorded where token ids are stored, so that ids are never read with another one.

A record is a small JSON dict::

    {"kind": "byte" | "tokenizer.json" | "sentencepiece", "file": "tokenizer.json", "path": "/abs/tokenizer.json",
     "sha256": "...", "vocab_size": 2000, "eod_id": 0, "bos_id": 1, "copy": "tokenizer-<sha12>/tokenizer.json"}

Two records name the same tokenizer when their kind and file hash agree (``byte``: the kind alone), so a copy
of a file in another place is the same tokenizer and an edited file is not. Records are written

- by ``python -m jaxtron.data.prepare`` next to the data, as ``<prefix>.meta.json`` (Megatron reads only
  ``.bin``/``.idx``, so the extra file does no harm there);
- into every checkpoint's meta by training and ``import-hf``, with a copy of the tokenizer files in the
  checkpoint directory (``tokenizer-<sha12>/``, shared by all steps and never touched by retention), which
  ``generate``, ``evaluate`` and ``export-hf`` use by default.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from typing import Optional

from jaxtron.config import ConfigError
from jaxtron.data.tokenizers import BYTE_EOD, TokenizerError, load_tokenizer

log = logging.getLogger("jaxtron")

DATA_META_SUFFIX = ".meta.json"
# files of a Hugging Face tokenizer folder that travel with the main file (special tokens, chat template)
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
BYTE_RECORD = {"kind": "byte", "file": None, "path": None, "sha256": None, "vocab_size": 256, "eod_id": BYTE_EOD,
               "bos_id": None}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_of(tok) -> dict:
    """The record of a loaded tokenizer (:func:`jaxtron.data.tokenizers.load_tokenizer`)."""
    if tok.kind == "byte":
        return dict(BYTE_RECORD)
    path = os.path.abspath(tok.name)
    return {"kind": tok.kind, "file": os.path.basename(path), "path": path, "sha256": _sha256(path),
            "vocab_size": int(tok.vocab_size), "eod_id": int(tok.eod),
            "bos_id": None if tok.bos is None else int(tok.bos)}


@functools.lru_cache(maxsize=8)
def _record_cached(spec: str, mtime_ns: int) -> tuple:
    return tuple(sorted(record_of(load_tokenizer(spec)).items()))


def record_for(spec: str) -> dict:
    """The record of ``data.tokenizer`` (``byte``, a tokenizer.json, a SentencePiece .model or a folder);
    :class:`TokenizerError` naming the file when it cannot be loaded."""
    if spec == "byte":
        return dict(BYTE_RECORD)
    mtime = os.stat(spec).st_mtime_ns if os.path.exists(spec) else 0
    return dict(_record_cached(str(spec), mtime))


def same(a: Optional[dict], b: Optional[dict]) -> bool:
    if not a or not b or a.get("kind") != b.get("kind"):
        return False
    return a["kind"] == "byte" or (a.get("sha256") is not None and a.get("sha256") == b.get("sha256"))


def describe(rec: Optional[dict]) -> str:
    """One phrase naming a record, e.g. ``tokenizer.json /data/tok.json (sha256 1a2b3c4d, vocab 2000)``."""
    if not rec:
        return "no recorded tokenizer"
    if rec.get("kind") == "byte":
        return "byte (vocab 256)"
    return (f"{rec.get('kind')} {rec.get('path') or rec.get('file')} (sha256 {str(rec.get('sha256'))[:8]}, "
            f"vocab {rec.get('vocab_size')})")


# ================================================================================================ data


def data_meta_path(prefix: str) -> str:
    return prefix + DATA_META_SUFFIX


def write_data_record(prefix: str, rec: dict, **extra) -> str:
    """Write ``<prefix>.meta.json`` (atomically: a reader never sees half a file)."""
    path = data_meta_path(prefix)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"tokenizer": rec, **extra}, f, indent=1)
    os.replace(tmp, path)
    return path


def read_data_record(prefix: str) -> Optional[dict]:
    """The tokenizer record of a prepared prefix; None when it has no ``.meta.json`` (Megatron's own
    preprocessing, or a jaxtron before 0.2). A file that is not a record is a one-line ValueError."""
    path = data_meta_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            rec = json.load(f)["tokenizer"]
        if not isinstance(rec, dict) or "kind" not in rec:
            raise ValueError("no tokenizer kind")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a jaxtron data record ({err})") from None
    return rec


# ========================================================================================= checkpoints


def copy_into(directory: str, rec: dict) -> dict:
    """Copy the tokenizer's files into ``directory/tokenizer-<sha12>/`` (once; the name is the content's, so
    every step of a run shares one copy) and return the record with ``copy`` set, relative to ``directory``."""
    if rec.get("kind") == "byte" or not rec.get("path"):
        return rec
    src = rec["path"]
    sub = f"tokenizer-{rec['sha256'][:12]}"
    dest_dir = os.path.join(directory, sub)
    dest = os.path.join(dest_dir, rec["file"])
    if not os.path.isfile(dest):
        if not os.path.isfile(src) or _sha256(src) != rec["sha256"]:
            raise TokenizerError(f"{src}: the tokenizer file changed or vanished since the run started")
        tmp = dest_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        shutil.copy2(src, os.path.join(tmp, rec["file"]))
        for name in COMPANIONS:
            comp = os.path.join(os.path.dirname(src), name)
            if os.path.isfile(comp):
                shutil.copy2(comp, os.path.join(tmp, name))
        try:
            os.replace(tmp, dest_dir)  # atomic: a half-copied folder is never taken for the tokenizer
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(dest):
                raise
    return {**rec, "copy": os.path.join(sub, rec["file"])}


def locate(directory: str, rec: dict) -> Optional[str]:
    """The file of a checkpoint's tokenizer record: its copy in the checkpoint ``directory``, else the
    original path when its hash still matches; None when neither is there."""
    if rec.get("copy"):
        cand = os.path.join(directory, rec["copy"])
        if os.path.isfile(cand):
            return cand
    path = rec.get("path")
    if path and os.path.isfile(path) and _sha256(path) == rec.get("sha256"):
        return path
    return None


def load_recorded(directory: str, rec: dict, where: str):
    """The tokenizer a checkpoint records, with the recorded end-of-document/BOS ids."""
    if rec.get("kind") == "byte":
        return load_tokenizer("byte")
    path = locate(directory, rec)
    if path is None:
        raise TokenizerError(f"{where}: the checkpoint records the tokenizer {describe(rec)}, but neither its copy "
                             f"{os.path.join(directory, rec.get('copy') or '?')} nor the original file is there; "
                             f"pass --tokenizer")
    tok = load_tokenizer(path)
    tok.eod = int(rec.get("eod_id", tok.eod))
    tok.bos = rec.get("bos_id", tok.bos)
    return tok


# ============================================================================================== checks


def run_record(data_cfg, vocab_size: Optional[int] = None) -> dict:
    """The record of a run's ``data.tokenizer``; ConfigError naming the field when it cannot be loaded or has
    more ids than ``model.vocab_size``."""
    try:
        rec = record_for(data_cfg.tokenizer)
    except (TokenizerError, OSError) as err:
        raise ConfigError("data.tokenizer", " ".join(str(err).split())) from None
    if vocab_size is not None and rec["vocab_size"] > vocab_size:
        raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than data.tokenizer's vocabulary "
                                              f"({describe(rec)})")
    return rec


def check_match(run: dict, other: Optional[dict], what: str, allow: bool, field: str = "data.tokenizer") -> None:
    """Raise a one-line ConfigError naming ``field`` and both tokenizers when ``other`` (the record of ``what``:
    the data, a checkpoint) is another tokenizer than ``run`` (``data.tokenizer``); with ``allow``
    (``data.allow_tokenizer_mismatch``) only warn. A missing record (old data or checkpoint) warns and
    assumes ``run``."""
    if other is None:
        log.warning("%s records no tokenizer (made by Megatron or an older jaxtron); assuming data.tokenizer=%s",
                    what, describe(run))
        return
    if same(run, other):
        return
    message = (f"{what} was made with {describe(other)} but data.tokenizer is {describe(run)}; use one tokenizer "
               f"for both (python -m jaxtron.data.prepare --tokenizer ...), or set data.allow_tokenizer_mismatch=true")
    if not allow:
        raise ConfigError(field, message)
    log.warning("%s: %s (data.allow_tokenizer_mismatch=true: training anyway)", field, message)
