"""``python -m jaxtron.generate --checkpoint CKPT --prompt TEXT [--prompt TEXT ...]``: sample continuations.

    python -m jaxtron.generate --checkpoint runs/tiny/checkpoints --prompt "def main(" --max-new-tokens 64
    python -m jaxtron.generate --checkpoint hf/Llama-3.2-1B --prompt "The capital of France is" \\
        --temperature 0.7 --top-p 0.9 --seed 1
    python -m jaxtron.generate --checkpoint runs/tiny/checkpoints --prompt "def" parallel.tensor=2

CKPT is a jaxtron checkpoint (training run's ``checkpoints`` directory, one step directory of it, or the
output of ``python -m jaxtron.convert import-hf``) or a Hugging Face folder (has ``config.json``). The
tokenizer defaults to the one the checkpoint records (its copy in the checkpoint directory; ``byte``, with
a warning, for checkpoints saved before jaxtron recorded tokenizers or imported from a folder without one) and
to the folder's ``tokenizer.json`` for Hugging Face folders. Generated ids the tokenizer does not have (a model
vocabulary larger than the tokenizer's) print as U+FFFD, with a warning counting them. Generation stops at the tokenizer's end-of-document token, and at the model's
maximum positions (the longest sequence it was trained on; HF: ``max_position_embeddings``): a longer
``--max-new-tokens`` is cut with a warning. Prints each prompt followed by its continuation (``--json``:
one JSON object per prompt).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtron.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a jaxtron checkpoint or a Hugging Face folder")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch of prompts)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt [default: 64]")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy [default: 0]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1] [default: 1]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    p.add_argument("--tokenizer", default=None,
                   help="byte, a tokenizer.json or a SentencePiece .model [default: the one the checkpoint "
                        "records; the folder's tokenizer.json for Hugging Face folders]")
    p.add_argument("--max-positions", type=int, default=None,
                   help="prompt + generated tokens allowed [default: the model's maximum positions]; larger "
                        "runs RoPE past what the model was trained on")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype [default: the checkpoint's]")
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward every step (slow)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("overrides", nargs="*", help="parallel.* sizes for a mesh, e.g. parallel.tensor=2 (default: "
                                                "one device)")
    return p


def _within_positions(args, loaded, prompt_len: int) -> int:
    """``--max-new-tokens``, cut so that prompt + continuation fit the model's maximum positions (a warning
    says so); a prompt that fills them is an error. Without the cut, a 100000-token request on a 256-position
    model would allocate a 100000-slot cache and run for minutes producing noise."""
    limit = args.max_positions or loaded.max_positions
    if limit is None:
        return args.max_new_tokens
    what = "--max-positions" if args.max_positions else (
        "the longest sequence it was trained on" if loaded.kind == "jaxtron" else "max_position_embeddings")
    if prompt_len >= limit:
        raise ValueError(f"--prompt: {prompt_len} tokens already fill the model's {limit} positions ({what}); "
                         f"shorten it or pass --max-positions")
    if prompt_len + args.max_new_tokens <= limit:
        return args.max_new_tokens
    allowed = limit - prompt_len
    print(f"warning: --max-new-tokens {args.max_new_tokens}: the model has {limit} positions ({what}); generation "
          f"stops after {allowed} new tokens (the longest prompt has {prompt_len}); --max-positions raises the "
          f"limit", file=sys.stderr)
    return allowed


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.config import ConfigError
    from jaxtron import generate as gen
    from jaxtron.convert.loading import check_tokenizer_fits, checkpoint_tokenizer, load_for_inference

    try:
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
        if not args.temperature >= 0:
            raise ValueError(f"--temperature: must be >= 0, got {args.temperature}")
        if not 0 < args.top_p <= 1:
            raise ValueError(f"--top-p: must be in (0, 1], got {args.top_p}")
        if args.max_positions is not None and args.max_positions < 2:
            raise ValueError(f"--max-positions: must be >= 2, got {args.max_positions}")
        loaded = load_for_inference(args.checkpoint, args.dtype)
        cfg, model = loaded.cfg, loaded.model
        tok, note = checkpoint_tokenizer(args.checkpoint, loaded.kind, loaded.meta, loaded.directory,
                                         args.tokenizer)
        if note:
            print(f"warning: {note}", file=sys.stderr)
        check_tokenizer_fits(tok, cfg.vocab_size)
        prompts = [list(tok.encode(p)) for p in args.prompt]
        for text, ids in zip(args.prompt, prompts):
            if not ids:
                raise ValueError(f"--prompt: {text!r} encodes to no tokens")
        new_tokens = _within_positions(args, loaded, max(len(p) for p in prompts))
        layout = None
        if args.overrides:
            from jaxtron import preflight

            layout = preflight.inference_layout(cfg, args.overrides)
            model = layout.place(model)
        out = gen.generate(model, prompts, max_new_tokens=new_tokens, temperature=args.temperature,
                           top_p=args.top_p, eos_id=tok.eod, seed=args.seed, use_cache=not args.no_cache,
                           layout=layout)
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    unknown = 0
    for text, row in zip(args.prompt, out.rows()):
        body = row[:-1] if row and row[-1] == tok.eod else row
        completion, n = gen.decode_known(tok, body)
        unknown += n
        if args.json:
            print(gen.to_json({"prompt": text, "completion": completion, "tokens": row,
                               "stopped_at_eos": bool(row) and row[-1] == tok.eod}))
        else:
            print(text + completion)
    if unknown:
        print(f"warning: {unknown} generated ids are outside the tokenizer's {tok.vocab_size} ids (the model has "
              f"{cfg.vocab_size}), shown as \ufffd: pass the tokenizer the model was trained with", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
