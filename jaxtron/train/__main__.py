"""``python -m jaxtron.train [--config PRESET_OR_YAML] [section.field=value ...]``"""

from __future__ import annotations

import argparse
import sys

from jaxtron import config as config_lib


def _help_epilog() -> str:
    rows = config_lib.fields_help()
    width = max(len(n) for n, _, _ in rows)
    lines = ["config fields (override as section.field=value):"]
    for name, default, doc in rows:
        lines.append(f"  {name:<{width}}  {doc} [default: {default}]")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtron.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Llama-family model. With no arguments: the tiny preset on the built-in corpus.",
        epilog=_help_epilog())
    parser.add_argument("--config", default=None, help="a preset name (tiny, llama3_8b, ...) or a YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=8 train.steps=100")
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    try:
        cfg = config_lib.load(args.config, args.overrides)
        from jaxtron.jax_startup import import_jax
        import_jax()  # quiet on a machine without a GPU
        from jaxtron.parallel.distributed import initialize
        initialize(cfg)  # before anything touches the devices
        from jaxtron.train.loop import run  # imports jax: after the config is known to be good
        import jax
    except config_lib.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.train.loop import TrainingAborted
    try:
        result = run(cfg)
    except config_lib.ConfigError as err:  # mesh-dependent checks (the Layout) and data checks at start-up
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except TrainingAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    if jax.process_index() != 0:
        return 0
    if result.stopped_by:
        print(f"stopped by {result.stopped_by} at step {result.final_step} of {cfg.train.steps}; the next start "
              f"resumes from there")
        return 0
    if result.eval_losses:
        first = (f"{result.initial_eval_loss:.4f} at step 0" if result.initial_eval_loss is not None
                 else f"resumed at step {result.start_step}")
        print(f"held-out loss: {first} -> {result.eval_losses[-1][1]:.4f} at step {result.eval_losses[-1][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
