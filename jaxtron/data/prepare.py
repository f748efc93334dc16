"""Tokenize text into a Megatron-LM-compatible ``.bin``/``.idx`` dataset (see ``jaxtron.data.indexed``).

    python -m jaxtron.data.prepare --input a.jsonl b.jsonl.gz notes.txt --output-prefix data/corpus \\
        --tokenizer path/to/tokenizer.json --append-eod --workers 8
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from jaxtron.data.indexed import IndexedDatasetWriter, best_dtype, bin_path, idx_path
from jaxtron.data.tokenizers import TokenizerError, load_tokenizer
from jaxtron.data.tokenizer_record import record_of, write_data_record

_CHUNK_BYTES = 1 << 20  # raw input bytes per task sent to a worker

DESCRIPTION = """\
Tokenize documents into <output-prefix>.bin / <output-prefix>.idx (Megatron-LM MMapIndexedDataset layout,
token dtype uint16 when the vocabulary has fewer than 65500 ids, else int32).

Inputs, by file name:
  *.jsonl, *.json, *.jsonl.gz, *.json.gz   one JSON object per line; the document text is under --json-key
                                           (blank lines are skipped)
  anything else (e.g. *.txt, *.txt.gz)     plain UTF-8 text: each file is ONE document
A document whose text tokenizes to nothing is kept as an empty document (as Megatron-LM's preprocess_data.py
keeps it: in the .idx document list, with no sequence). With a tokenizer.json the tokenizer's own special
tokens are added (e.g. a BOS from its post-processor), as Megatron's HuggingFace tokenizer does; the
end-of-document id is its eos_token (tokenizer_config.json) unless --eod-token names another."""


class InputError(ValueError):
    """Bad input (the message names the file and line); the CLI reports it as one ``error: ...`` line and exit
    status 2."""


def _is_jsonl(path: str) -> bool:
    p = path[:-3] if path.endswith(".gz") else path
    return p.endswith(".jsonl") or p.endswith(".json")


def _open_text(path: str):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _tasks(paths: list[str]) -> Iterator[tuple]:
    """Work items: ("jsonl", path, first_lineno, [lines]) or ("text", path, 0, [text])."""
    for path in paths:
        try:
            if _is_jsonl(path):
                with _open_text(path) as f:
                    lines, size, first = [], 0, 1
                    for lineno, line in enumerate(f, 1):
                        if not lines:
                            first = lineno
                        lines.append(line)
                        size += len(line)
                        if size >= _CHUNK_BYTES:
                            yield ("jsonl", path, first, lines)
                            lines, size = [], 0
                    if lines:
                        yield ("jsonl", path, first, lines)
            else:
                with _open_text(path) as f:
                    yield ("text", path, 0, [f.read()])
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise InputError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from e


_TOK = None
_OPTS: dict = {}


def _load(tokenizer_spec: str, eod_token, special_tokens: bool):
    tok = load_tokenizer(tokenizer_spec, eod_token)
    if hasattr(tok, "add_special_tokens"):
        tok.add_special_tokens = special_tokens
    return tok


def _init_worker(tokenizer_spec: str, json_key: str, append_eod: bool, dtype_name: str, eod_token=None,
                 special_tokens: bool = True, add_bos: bool = False) -> None:
    global _TOK, _OPTS
    _TOK = _load(tokenizer_spec, eod_token, special_tokens)
    _OPTS = {"json_key": json_key, "append_eod": append_eod, "dtype": np.dtype(dtype_name), "add_bos": add_bos}


def _finish(ids: np.ndarray) -> np.ndarray:
    """BOS (--add-bos, where the tokenizer did not put one) and EOD (--append-eod) around a non-empty document;
    an empty one stays empty, as in Megatron's preprocess_data.py."""
    if not ids.size:
        return ids
    if _OPTS["add_bos"] and ids[0] != _TOK.bos:
        ids = np.concatenate([np.asarray([_TOK.bos], ids.dtype), ids])
    if _OPTS["append_eod"]:
        ids = np.append(ids, np.asarray(_TOK.eod, dtype=ids.dtype))
    return ids


def _encode(text: str) -> np.ndarray:
    dtype = _OPTS["dtype"]
    if hasattr(_TOK, "encode_bytes"):
        ids = np.frombuffer(_TOK.encode_bytes(text), dtype=np.uint8).astype(dtype)
    else:
        ids = np.asarray(_TOK.encode(text), dtype=dtype)
    return _finish(ids)


def _process(task: tuple):
    """-> (docs: list[np.ndarray], raw_bytes, error_message_or_None)."""
    kind, path, first, items = task
    nbytes = sum(len(s) for s in items)
    docs = []
    if kind == "text":
        docs.append(_encode(items[0]))
        return docs, nbytes, None
    key = _OPTS["json_key"]
    texts = []
    for k, line in enumerate(items):
        lineno = first + k
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return None, nbytes, f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
        if not isinstance(obj, dict):
            return None, nbytes, f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
        if key not in obj:
            return None, nbytes, f"{path}:{lineno}: missing key {key!r} (keys: {', '.join(map(str, obj)) or 'none'})"
        text = obj[key]
        if not isinstance(text, str):
            return None, nbytes, f"{path}:{lineno}: key {key!r} holds {type(text).__name__}, expected a string"
        texts.append(text)
    if hasattr(_TOK, "encode_batch") and not hasattr(_TOK, "encode_bytes"):
        dtype = _OPTS["dtype"]
        for ids in _TOK.encode_batch(texts):
            docs.append(_finish(np.asarray(ids, dtype=dtype)))
    else:
        docs.extend(_encode(t) for t in texts)
    return docs, nbytes, None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtron.data.prepare", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="JSONL(.gz) or plain text files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", required=True,
                   help="'byte' (UTF-8 bytes, end-of-document id 0), a Hugging Face tokenizer.json, "
                        "or a SentencePiece .model")
    p.add_argument("--json-key", default="text", help="JSON field holding the document text (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's end-of-document id to "
                                                               "every non-empty document")
    p.add_argument("--eod-token", default=None, metavar="TOKEN",
                   help="tokenizer.json: the end-of-document token (default: its eos_token)")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="tokenizer.json: leave out the tokenizer's own special tokens (Megatron's "
                        "--tokenizer-hf-no-include-special-tokens)")
    p.add_argument("--add-bos", action="store_true",
                   help="start every non-empty document with the tokenizer's BOS where it does not already")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none when stderr is not a terminal)")
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def prepare(inputs: Sequence[str], output_prefix: str, tokenizer: str = "byte", *, json_key: str = "text",
            append_eod: bool = False, workers: int = 1, progress: bool = False, eod_token: str | None = None,
            special_tokens: bool = True, add_bos: bool = False) -> dict:
    """Tokenize ``inputs`` (JSONL(.gz) files with the text under ``json_key``, or plain text files, one
    document each) into ``<output_prefix>.bin`` / ``.idx`` (Megatron-LM's layout; see ``DESCRIPTION``).

    ``tokenizer``: ``byte``, a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``;
    ``append_eod`` adds its end-of-document id (``eod_token``, default its eos_token) after every non-empty
    document; ``special_tokens``: the tokenizer's own (e.g. a BOS from a tokenizer.json's post-processor), as
    Megatron's HuggingFace tokenizer; ``add_bos`` puts its BOS first where it is not; ``workers`` processes.
    Also writes ``<output_prefix>.meta.json``, the tokenizer's record (``jaxtron.data.tokenizer_record``).
    Returns ``{"bin", "idx", "documents", "tokens", "dtype", "input_bytes", "seconds"}``. Raises
    :class:`InputError` (a ValueError) naming the file (and line) on bad input; nothing is left behind then."""
    inputs = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    output_prefix = os.fspath(output_prefix)
    if not inputs:
        raise InputError("--input: no input files")
    if workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    for path in inputs:
        if not os.path.isfile(path):
            raise InputError(f"{path}: input file not found")
    try:
        tok = _load(tokenizer, eod_token, special_tokens)
    except TokenizerError as e:
        raise InputError(str(e)) from None
    if add_bos and getattr(tok, "bos", None) is None:
        raise InputError(f"--add-bos: the tokenizer {tokenizer} has no BOS token")
    dtype = np.dtype(best_dtype(tok.vocab_size))
    total_in = sum(os.path.getsize(p) for p in inputs)

    t0 = time.perf_counter()
    writer = IndexedDatasetWriter(output_prefix, dtype)
    init_args = (tokenizer, json_key, append_eod, dtype.name, eod_token, special_tokens, add_bos)
    pool = None
    n_docs = n_tokens = n_bytes = 0
    bar = None
    try:
        if workers > 1:
            # spawn: safe even when the caller has threads running (e.g. JAX imported in the same process)
            pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_process, _tasks(inputs), chunksize=1)
        else:
            _init_worker(*init_args)
            results = map(_process, _tasks(inputs))
        if progress and sys.stderr.isatty():  # no carriage-return frames in a redirected log
            from tqdm import tqdm
            total = None if any(p.endswith(".gz") for p in inputs) else total_in  # .gz: sizes differ
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)
        for docs, nbytes, err in results:
            if err:
                raise InputError(err)
            for ids in docs:
                if ids.size:
                    writer.add_document(ids)
                else:  # kept, as Megatron's preprocessing keeps it: a document with no sequence
                    writer.add_empty_document()
                n_docs += 1
                n_tokens += int(ids.size)
            n_bytes += nbytes
            if bar is not None:
                bar.update(nbytes)
        if n_docs == 0:
            raise InputError(f"no documents found in {', '.join(inputs)} (empty input)")
        writer.finalize()
        # the tokenizer travels with the ids: training refuses data prepared with another one
        write_data_record(output_prefix, record_of(tok), append_eod=bool(append_eod))
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return {"bin": bin_path(output_prefix), "idx": idx_path(output_prefix), "documents": n_docs,
            "tokens": n_tokens, "dtype": dtype.name, "input_bytes": total_in,
            "seconds": max(time.perf_counter() - t0, 1e-9)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = prepare(args.input, args.output_prefix, args.tokenizer, json_key=args.json_key,
                      append_eod=args.append_eod, workers=args.workers, progress=not args.no_progress,
                      eod_token=args.eod_token, special_tokens=not args.no_special_tokens, add_bos=args.add_bos)
    except InputError as e:
        return _fail(str(e))
    mb = out["input_bytes"] / 1e6
    print(f"wrote {out['bin']} and {out['idx']}: {out['documents']} documents, "
          f"{out['tokens']} tokens ({out['dtype']}), {mb:.1f} MB input in {out['seconds']:.1f} s = "
          f"{mb / out['seconds']:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
