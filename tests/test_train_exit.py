"""``train.exit_after_steps`` stops with a checkpoint without touching the schedule: the resumed run ends with
the losses of an uninterrupted one; a resume from an older checkpoint (a rollback) leaves no duplicate rows in
``metrics.jsonl``."""

import json
import shutil

import jax
import numpy as np
import pytest

from helpers import tiny_config
from jaxtron.train.trainer import Trainer

STEPS = 6


def _train(out, *overrides):
    cfg = tiny_config(f"train.steps={STEPS}", "logging.log_every=1", "train.eval_every=0", "train.eval_batches=1",
                      "checkpoint.async_save=false", f"train.output_dir={out}", *overrides)
    return Trainer(cfg, jax.devices()[:1]).train()


@pytest.mark.slow  # three short runs: ~35 s on 2 cores, mostly compiling
def test_exit_after_steps_resumes_to_the_uninterrupted_losses(tmp_path):
    whole = _train(tmp_path / "whole", "checkpoint.enabled=false")
    assert whole.stopped_by is None and whole.final_step == STEPS

    out = tmp_path / "split"
    first = _train(out, "train.exit_after_steps=4", "checkpoint.every_steps=2")
    assert first.stopped_by == "train.exit_after_steps=4" and first.final_step == 4
    assert (out / "checkpoints" / "4").is_dir() and (out / "checkpoints" / "2").is_dir()
    shutil.rmtree(out / "checkpoints" / "4")  # roll back to step 2, as a checkpoint fallback would
    second = _train(out, "train.exit_after_steps=4", "checkpoint.every_steps=2")
    assert second.start_step == 2 and second.stopped_by is None and second.final_step == STEPS

    losses = dict(first.losses) | dict(second.losses)
    expected = dict(whole.losses)
    assert sorted(losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in expected], list(expected.values()), rtol=1e-6)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == list(range(1, STEPS + 1))  # steps 3 and 4 are not there twice
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, STEPS]
