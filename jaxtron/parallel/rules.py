"""THE table: logical axis name -> mesh axes.

Model code names axes (``"embed"``, ``"heads"``, ``"act_batch"``...); this table is the only place that says
which mesh axes they are split over. Tensor (Megatron) and FSDP (ZeRO-3) parallelism fall out of it:

* params: ``layers`` (the stacked decoder blocks' leading axis) over ``stage`` (pipeline parallelism),
  ``embed`` over ``fsdp`` and ``context`` (ZeRO-3: every weight is split on its hidden dim, gathered per layer),
  ``heads``/``kv_heads``/``mlp`` over ``tensor`` (column-parallel QKV/gate/up, row-parallel out/down),
  ``vocab`` over ``tensor`` (vocab-parallel embedding and logits); MoE expert weights are named
  (``experts``, ``embed``, ``mlp``) and so split like the dense MLP, and their ``experts`` axis over
  ``expert`` (expert parallelism); the router's columns and the aux-free bias (``router_experts``) are small
  and replicated.
* activations: the batch over ``data``, ``fsdp`` and ``expert`` (Megatron's EP within data parallelism: the
  expert ranks hold different tokens; :mod:`jaxtron.parallel.expert` sends them to their experts' ranks);
  heads, MLP and vocab over ``tensor``;
  with sequence parallelism the sequence axis of the residual stream (``act_res_seq``) over ``tensor``;
  the sequence axis (``act_seq``, ``act_res_seq``) over ``context`` (context parallelism; inside attention
  the names of ``_ATTENTION_RULES`` say, per ``parallel.context_impl``, whether K and V are gathered, passed
  round a ring or exchanged for heads).

A parameter axis and the activation axis it becomes in a matmul's output share a name, ``act_`` in front
(``embed``/``act_embed``, ``heads``/``act_heads``, ``mlp``/``act_mlp``, ``vocab``/``act_vocab``):
:func:`jaxtron.parallel.sharding.matmul_weight` reads the pairs.

The table is a layout choice, never a numerical one: moving a name onto another mesh axis (or to replicated)
moves no loss or gradient beyond fp32 reassociation. :func:`overriding` tries such a move without editing
the table (``tests/test_sharding_invariance.py`` moves every name so)::

    with rules.overriding({"act_embed": "tensor"}):   # the residual stream's hidden dim split over tensor
        trainer = jaxtron.Trainer(cfg)                # its Layout keeps the override for its whole life
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, Optional

from jaxtron.config.schema import ParallelConfig
from jaxtron.parallel.axes import AXES, BATCH_SPLIT

Rules = tuple[tuple[str, object], ...]

# Parameter axes.
_PARAM_RULES: Rules = (
    ("vocab", "tensor"),
    # ZeRO-3 spans fsdp x context, as Megatron's distributed optimizer spans DP x CP: context ranks hold the
    # same weights, so splitting them there too divides the model state by the context size at the cost of
    # the same per-layer gathers FSDP already makes
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),     # MoE expert stacks' leading axis: expert parallelism
    ("router_experts", None),  # the router's columns and the aux-free bias: [hidden, E] and [E], replicated
    ("head_dim", None),
    # MLA's latent widths (jaxtron/model/mla.py): never split over tensor (every head reads the whole latent);
    # ZeRO-3 splits them as it splits embed where a weight has no embed axis (wq_b, wk_b, wv_b)
    ("q_lora", ("fsdp", "context")),
    ("kv_lora", ("fsdp", "context")),
    ("norm", None),
    ("layers", "stage"),  # stacked decoder layers: contiguous chunks per pipeline stage
    ("dense_layers", None),  # an MoE model's leading dense blocks: run with the embedding, before the stages
    ("mtp_layers", None),  # the MTP modules' stack (docs/mtp.md): run on the last stage, after the layers
    ("mtp_in", None),      # MTP eh_proj's input rows: the concatenated [embedding; hidden state]
)

# Activation axes.
_ACTIVATION_RULES: Rules = (
    ("act_batch", BATCH_SPLIT),  # the Layout's data-parallel size is these axes' product
    ("act_seq", "context"),

    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_q_lora", None),
    ("act_kv_lora", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


# Inside attention (q: act_attn_seq/act_attn_heads; k, v: act_kv_seq/act_attn_kv_heads), per context_impl:
# all_gather: queries stay split, K/V gathered; ring: K/V stay split too and ring_attention.py passes them
# round; ulysses: ring_attention.py trades the sequence split for a head split (all-to-all) over the axes of
# act_attn_head_exchange.
_SPLIT_KV = (("act_attn_seq", "context"), ("act_kv_seq", "context"),
             ("act_attn_heads", "tensor"), ("act_attn_kv_heads", "tensor"))
_ATTENTION_RULES: dict[str, Rules] = {
    "all_gather": (("act_attn_seq", "context"), ("act_kv_seq", None), ("act_attn_heads", "tensor"),
                   ("act_attn_kv_heads", "tensor"), ("act_attn_head_exchange", None)),
    "ring": _SPLIT_KV + (("act_attn_head_exchange", None),),
    "ulysses": _SPLIT_KV + (("act_attn_head_exchange", "context"),),
}


def logical_rules(parallel: ParallelConfig | None = None,
                  overrides: Optional[Mapping[str, Any]] = None) -> Rules:
    """The rules for a parallel config; ``sequence_parallel`` maps ``act_res_seq`` onto ``tensor``;
    ``context_impl`` picks how attention reads a sequence split over ``context``. ``overrides`` maps logical
    names onto other mesh axes (an axis, a tuple of axes, or None: replicated) in place of the table's."""
    sp = bool(parallel is not None and parallel.sequence_parallel)
    impl = parallel.context_impl if parallel is not None else "all_gather"
    rules = (_PARAM_RULES + _ACTIVATION_RULES + _ATTENTION_RULES.get(impl, _ATTENTION_RULES["all_gather"])
             + (("act_res_seq", ("context", "tensor") if sp else "context"),))
    overrides = _checked(overrides or {})
    return tuple((name, overrides.get(name, axes)) for name, axes in rules)


def logical_names() -> tuple[str, ...]:
    """Every logical axis name the table maps (for any ``sequence_parallel`` and ``context_impl``)."""
    names = [n for n, _ in _PARAM_RULES + _ACTIVATION_RULES]
    for rules in _ATTENTION_RULES.values():
        names += [n for n, _ in rules if n not in names]
    return tuple(names) + ("act_res_seq",)


def _checked(overrides: Mapping[str, Any]) -> dict:
    for name, axes in overrides.items():
        if name not in logical_names():
            raise ValueError(f"rule override: {name!r} is not a logical axis name of jaxtron/parallel/rules.py")
        entries = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        bad = [a for a in entries if a not in AXES]
        if bad or len(set(entries)) < len(entries):
            raise ValueError(f"rule override {name}={axes!r}: mesh axes must be distinct names among {AXES}")
    return dict(overrides)


_OVERRIDES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxtron_rule_overrides", default=())


@contextlib.contextmanager
def overriding(overrides: Mapping[str, Any]) -> Iterator[None]:
    """Layouts built inside this block (``Layout.build``/``planned``: so every Trainer, program and plan made
    here) map the names of ``overrides`` onto its mesh axes instead of the table's, for their whole life."""
    token = _OVERRIDES.set(tuple(_checked(overrides).items()))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def active_overrides() -> tuple[tuple[str, Any], ...]:
    """The overrides of the enclosing :func:`overriding` block (empty outside one)."""
    return _OVERRIDES.get()
