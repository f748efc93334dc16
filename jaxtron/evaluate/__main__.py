"""``python -m jaxtron.evaluate --checkpoint CKPT --data PREFIX_OR_TEXT``: loss and perplexity.

    python -m jaxtron.evaluate --checkpoint runs/tiny/checkpoints --data ~/.cache/jaxtron/builtin-.../valid
    python -m jaxtron.evaluate --checkpoint hf/Llama-3.2-1B --data wiki.txt --seq-len 1024 --json

CKPT is a jaxtron checkpoint or a Hugging Face folder (see ``python -m jaxtron.generate``). DATA is a
Megatron ``.bin/.idx`` prefix (token ids as stored; a warning when its ``.meta.json`` names another
tokenizer than the checkpoint's) or a plain text file, tokenized whole (``--tokenizer``; default: the one the
checkpoint records, the folder's tokenizer.json for Hugging Face folders). The stream is cut into
non-overlapping windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (every token but the first
is predicted once; a trailing partial window is dropped); ``--seq-len`` defaults to the sequence length the
checkpoint was trained with (HF folders: 512, at most max_position_embeddings). Progress goes to stderr: a bar
on a terminal, else a plain line every ``--log-every`` batches (default: a tenth of them). Prints the mean
token loss and the perplexity exp(loss). The windows of a batch are split over every device (data parallel;
``parallel.*`` arguments choose another mesh, e.g. ``parallel.tensor=2`` for a model one device cannot hold).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtron.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a jaxtron checkpoint or a Hugging Face folder")
    p.add_argument("--data", required=True, help="a .bin/.idx prefix or a plain text file")
    p.add_argument("--seq-len", type=int, default=None, help="tokens the model reads per window [default: the "
                                                              "checkpoint's training sequence length; HF: 512]")
    p.add_argument("--log-every", type=int, default=None, help="without a terminal: a progress line every N "
                                                             "batches [default: a tenth of them]")
    p.add_argument("--batch-size", type=int, default=8, help="windows per batch [default: 8]")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches [default: all]")
    p.add_argument("--tokenizer", default=None, help="for text files: byte, a tokenizer.json or a SentencePiece "
                                                     ".model [default: see above]")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype [default: the checkpoint's]")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("overrides", nargs="*", help="parallel.* sizes of the mesh, e.g. parallel.tensor=2 [default: "
                                                "data parallel over all devices, parallel.data=-1]")
    return p


def _progress(total: int, every: int):
    """A progress callback for :func:`jaxtron.evaluate.evaluate`: tqdm on a terminal, else a plain line every
    ``every`` batches (carriage-return frames would pile up in a log file)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="batch", desc="evaluating", file=sys.stderr)

        def update(n, tokens, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if n >= total:
                bar.close()
        return update
    t0 = time.perf_counter()
    every = every or max(1, total // 10)

    def line(n, tokens, loss):
        if n % every == 0 or n == total:
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            print(f"evaluate: batch {n}/{total}, {tokens} tokens, loss so far {loss:.4f}, {rate:.0f} tokens/s",
                  file=sys.stderr, flush=True)
    return line


def _seq_len(args, loaded) -> int:
    if args.seq_len is not None:
        if loaded.max_positions and args.seq_len > loaded.max_positions:
            print(f"warning: --seq-len {args.seq_len} is longer than the model's {loaded.max_positions} positions",
                  file=sys.stderr)
        return args.seq_len
    if loaded.seq_len:
        return loaded.seq_len
    return min(512, loaded.max_positions or 512)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.config import ConfigError
    from jaxtron import evaluate as ev
    from jaxtron.convert.loading import check_tokenizer_fits, checkpoint_tokenizer, load_for_inference
    from jaxtron.data import tokenizer_record

    try:
        for name in ("seq_len", "batch_size", "log_every"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
        if args.max_batches is not None and args.max_batches < 1:
            raise ValueError(f"--max-batches: must be >= 1, got {args.max_batches}")
        kind, source = ev.data_kind(args.data)
        loaded = load_for_inference(args.checkpoint, args.dtype)
        cfg = loaded.cfg
        seq_len = _seq_len(args, loaded)
        if kind == "indexed":
            data_rec, ckpt_rec = tokenizer_record.read_data_record(source), loaded.meta.get("tokenizer")
            if data_rec and ckpt_rec and not tokenizer_record.same(data_rec, ckpt_rec):
                print(f"warning: --data: {source} was prepared with {tokenizer_record.describe(data_rec)} but the "
                      f"checkpoint was trained with {tokenizer_record.describe(ckpt_rec)}", file=sys.stderr)
            tokens = ev.indexed_tokens(source)
            from jaxtron.data.indexed import IndexedDataset
            total_tokens = IndexedDataset(source).num_tokens
        else:
            tok, note = checkpoint_tokenizer(args.checkpoint, loaded.kind, loaded.meta, loaded.directory,
                                             args.tokenizer)
            if note:
                print(f"warning: {note}", file=sys.stderr)
            check_tokenizer_fits(tok, cfg.vocab_size)
            tokens = ev.text_tokens(source, tok)
            total_tokens = len(tokens)
        total = ev.num_batches(total_tokens, seq_len, args.batch_size, args.max_batches)
        from jaxtron import preflight

        # every device, as training uses them: one device alone scored a 405k-token split at ~1,100 tokens/s
        layout = preflight.inference_layout(cfg, args.overrides or ["parallel.data=-1"])
        result = ev.evaluate(layout.place(loaded.model), ev.windows_from_tokens(tokens, seq_len, args.batch_size,
                                                                                args.max_batches),
                             progress=_progress(total, args.log_every) if total else None, layout=layout)
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    result = {**result, "data": args.data, "seq_len": seq_len}
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"loss: {result['loss']:.6f}")
        print(f"perplexity: {result['perplexity']:.6f}")
        print(f"tokens: {result['tokens']} in {result['batches']} batches of up to {args.batch_size} windows "
              f"of {seq_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
