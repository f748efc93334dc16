"""``python -m jaxtron.evaluate --checkpoint CKPT --data PREFIX_OR_TEXT``: loss and perplexity.

    python -m jaxtron.evaluate --checkpoint runs/tiny/checkpoints --data ~/.cache/jaxtron/builtin-.../valid
    python -m jaxtron.evaluate --checkpoint hf/Llama-3.2-1B --data wiki.txt --seq-len 1024 --json

CKPT is a jaxtron checkpoint or a Hugging Face folder (see ``python -m jaxtron.generate``). DATA is a
Megatron ``.bin/.idx`` prefix (token ids as stored; no tokenizer involved) or a plain text file, tokenized
whole (``--tokenizer``; default ``byte`` for jaxtron checkpoints, the folder's tokenizer.json for Hugging Face
folders). The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens starting every ``seq_len``
tokens (every token but the first is predicted once; a trailing partial window is dropped). Prints the mean
token loss and the perplexity exp(loss).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtron.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a jaxtron checkpoint or a Hugging Face folder")
    p.add_argument("--data", required=True, help="a .bin/.idx prefix or a plain text file")
    p.add_argument("--seq-len", type=int, default=512, help="tokens the model reads per window [default: 512]")
    p.add_argument("--batch-size", type=int, default=8, help="windows per batch [default: 8]")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches [default: all]")
    p.add_argument("--tokenizer", default=None, help="for text files: byte, a tokenizer.json or a SentencePiece "
                                                     ".model [default: see above]")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype [default: the checkpoint's]")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.config import ConfigError
    from jaxtron import evaluate as ev
    from jaxtron import generate as gen
    from jaxtron.convert.loading import load_model

    try:
        if args.seq_len < 1:
            raise ValueError(f"--seq-len: must be >= 1, got {args.seq_len}")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size: must be >= 1, got {args.batch_size}")
        if args.max_batches is not None and args.max_batches < 1:
            raise ValueError(f"--max-batches: must be >= 1, got {args.max_batches}")
        kind, source = ev.data_kind(args.data)
        cfg, model, ckpt_kind = load_model(args.checkpoint, args.dtype)
        if kind == "indexed":
            tokens = ev.indexed_tokens(source)
        else:
            tok = gen.default_tokenizer(args.checkpoint, ckpt_kind, args.tokenizer)
            gen.check_tokenizer_fits(tok, cfg.vocab_size)
            tokens = ev.text_tokens(source, tok)
        result = ev.evaluate(model, ev.windows_from_tokens(tokens, args.seq_len, args.batch_size,
                                                           args.max_batches))
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    result = {**result, "data": args.data, "seq_len": args.seq_len}
    if args.json:
        print(gen.to_json(result))
    else:
        print(f"loss: {result['loss']:.6f}")
        print(f"perplexity: {result['perplexity']:.6f}")
        print(f"tokens: {result['tokens']} in {result['batches']} batches of up to {args.batch_size} windows "
              f"of {args.seq_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
