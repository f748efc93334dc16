"""THE table: logical axis name -> mesh axes.

Model code names axes (``"embed"``, ``"heads"``, ``"act_batch"``...); this table is the only place that says
which mesh axes they are split over. Tensor (Megatron) and FSDP (ZeRO-3) parallelism fall out of it:

* params: ``layers`` (the stacked decoder blocks' leading axis) over ``stage`` (pipeline parallelism),
  ``embed`` over ``fsdp`` (ZeRO-3: every weight is split on its hidden dim, gathered per layer),
  ``heads``/``kv_heads``/``mlp`` over ``tensor`` (column-parallel QKV/gate/up, row-parallel out/down),
  ``vocab`` over ``tensor`` (vocab-parallel embedding and logits); MoE expert weights are named
  (``expert``, ``embed``, ``mlp``) and so split like the dense MLP, their ``expert`` axis replicated.
* activations: the batch over ``data`` and ``fsdp``; heads, MLP and vocab over ``tensor``;
  with sequence parallelism the sequence axis of the residual stream (``act_res_seq``) over ``tensor``;
  the sequence axis (``act_seq``, ``act_res_seq``) over ``context`` (context parallelism: K and V, named
  ``act_kv_seq`` where attention reads them, are gathered).
"""

from __future__ import annotations

from jaxtron.config.schema import ParallelConfig

Rules = tuple[tuple[str, object], ...]

# Parameter axes.
_PARAM_RULES: Rules = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", None),     # MoE expert stacks (router columns, expert weights, aux-free bias); expert
                          # parallelism will map it onto its own mesh axis
    ("head_dim", None),
    ("norm", None),
    ("layers", "stage"),  # stacked decoder layers: contiguous chunks per pipeline stage
)

# Activation axes.
_ACTIVATION_RULES: Rules = (
    ("act_batch", ("data", "fsdp")),
    ("act_seq", "context"),
    ("act_kv_seq", None),  # K and V attend from every context rank: gathered over 'context'

    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def logical_rules(parallel: ParallelConfig | None = None) -> Rules:
    """The rules for a parallel config; ``sequence_parallel`` maps ``act_res_seq`` onto ``tensor``."""
    sp = bool(parallel is not None and parallel.sequence_parallel)
    return _PARAM_RULES + _ACTIVATION_RULES + (("act_res_seq", ("context", "tensor") if sp else "context"),)
