"""What a training run reports and how it is extended: :class:`TrainResult`, :class:`TrainingAborted` and the
:class:`Callback` hooks of :class:`~jaxtron.train.trainer.Trainer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class TrainResult:
    """What :meth:`Trainer.train` did."""

    steps: int                                        # train.steps
    losses: list = field(default_factory=list)       # (step, train loss) at every log point
    eval_losses: list = field(default_factory=list)  # (step, held-out loss)
    initial_eval_loss: Optional[float] = None         # held-out loss before the first step (fresh runs)
    compile_seconds: float = 0.0
    state: Optional[dict] = None                      # the final train state {"step", "params", "opt_state"}
    start_step: int = 0                               # > 0 when resumed from a checkpoint
    final_step: int = 0
    skipped_steps: int = 0
    stopped_by: Optional[str] = None                  # "SIGTERM"/"SIGINT"/a request_stop reason, when stopped early



class TrainingAborted(RuntimeError):
    """The run stopped before train.steps for a reason the user must look at (the state is saved)."""


class Callback:
    """Hooks into :class:`Trainer`. Subclass it and override the hooks you need (all default to doing nothing);
    pass instances as ``Trainer(cfg, callbacks=[...])``. A plain function ``fn(step, metrics, trainer)`` given
    as a callback is called as :meth:`on_log`.

    ``step`` is always the number of optimizer steps done (1 after the first step). Callbacks run on every
    process of a multi-process run. To end training early, call ``trainer.request_stop(reason)``: the loop
    saves a checkpoint after the current step and returns (the next ``train()`` resumes from there)."""

    def on_train_begin(self, step: int, trainer: "Trainer") -> None:
        """Before the first step of :meth:`Trainer.train`; ``step`` > 0 when it resumed from a checkpoint."""

    def on_step(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """After every optimizer step (in ``train()`` and in ``step()``). ``metrics`` holds device scalars:
        reading one (``float(metrics["loss"])``) waits for the step to finish, so read sparingly."""

    def on_log(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """Every ``logging.log_every`` steps (and at the last) in ``train()``: ``metrics`` is the record about to
        be written to ``metrics.jsonl`` and TensorBoard (host floats: loss, grad_norm, lr, throughput, MFU,
        aux entries of a custom loss). Entries a callback adds to it are written too."""

    def on_eval(self, step: int, metrics: dict, trainer: "Trainer") -> None:
        """After each held-out evaluation in ``train()``: ``metrics == {"eval_loss": float}``."""

    def on_train_end(self, step: int, result: TrainResult, trainer: "Trainer") -> None:
        """When ``train()`` returns (done, or stopped by a signal or ``request_stop``); not when it raises."""


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable):
        self.fn = fn

    def on_log(self, step, metrics, trainer):
        self.fn(step, metrics, trainer)



def as_callback(cb) -> Callback:
    if isinstance(cb, Callback):
        return cb
    if callable(cb):
        return _FunctionCallback(cb)
    raise TypeError(f"Trainer: callbacks must be Callback instances or functions fn(step, metrics, trainer), "
                    f"got {type(cb).__name__}")
