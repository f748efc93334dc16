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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


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
        from jaxtron import preflight
        preflight.check(cfg)  # the model's and the mesh's checks on the configured sizes, before any device
        from jaxtron.parallel.distributed import initialize
        initialize(cfg)  # before anything touches the devices
        from jaxtron.train.trainer import run  # imports jax: after the config is known to be good
        import jax
    except config_lib.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.train.callbacks import TrainingAborted
    from jaxtron.parallel.distributed import report_failure

    def fail(err, status: int) -> int:
        print(f"error: {err}", file=sys.stderr)
        report_failure(str(err))  # the other processes exit with it instead of waiting for this one
        return status

    try:
        result = run(cfg)
    except config_lib.ConfigError as err:  # mesh-dependent checks (the Layout) and data checks at start-up
        return fail(err, 2)
    except CheckpointError as err:
        return fail(err, 1)
    except TrainingAborted as err:
        return fail(err, 3)
    except jax.errors.JaxRuntimeError as err:
        if jax.process_count() == 1:
            raise
        # A collective failed under a multi-process run: a peer died or the network broke. One line, and no
        # waiting in JAX's shutdown barrier for a process that will not come.
        from jaxtron.parallel.distributed import exit_lost_peer, lost_peers
        n, lost = jax.process_count(), lost_peers()
        who = (", ".join(f"process {q} of {n}" for q in lost) + (" was" if len(lost) == 1 else " were")
               + " lost (killed or crashed: its heartbeat stopped)") if lost else "a peer process was lost?"
        exit_lost_peer(f"{who}; process {jax.process_index()}'s collective failed: {_first_line(err)}")
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
