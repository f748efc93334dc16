"""Tokens per second the training batch stream delivers (grain, prefetching), for a config.

    python scripts/bench_loader.py [--config PRESET_OR_YAML] [--batches 200] [overrides...]

Compare with the train step's tokens/s from scripts/bench_train.py or metrics.jsonl."""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    from jaxtron import config as config_lib
    from jaxtron.data.corpus import make_corpus
    from jaxtron.data.loader import batch_stream

    cfg = config_lib.load(args.config, args.overrides + [f"train.steps={args.batches + 1}"])
    t0 = time.perf_counter()
    corpus = make_corpus(cfg)
    setup = time.perf_counter() - t0
    stream = batch_stream(corpus, cfg.train.global_batch_size, 0, args.batches + 1)
    next(stream)  # start the prefetch threads
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.batches):
        tokens += next(stream)["inputs"].size
    seconds = time.perf_counter() - t0
    print(f"source={cfg.data.source} setup {setup:.2f} s; {args.batches} batches of "
          f"{cfg.train.global_batch_size}x{cfg.data.seq_len} in {seconds:.3f} s: {tokens / seconds:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
