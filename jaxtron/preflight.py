"""The checks of a run that need more than its config: the model's kernels, the mesh sizes and the devices.

``jaxtron.config`` checks each field on its own (``config.load`` runs :func:`jaxtron.config.validate`);
``jaxtron.parallel.layout`` checks the parallel sizes against the model's shapes and the batch; this module,
above config, model and parallel, composes them with the model's own requirements. Entry points call
:func:`check` twice: on the config alone as soon as it is loaded (the sizes it fixes; a ``-1`` axis is
skipped), so a bad value is one line before anything compiles, and again on the built :class:`Layout` (the
resolved sizes and the devices' platform)::

    cfg = jaxtron.config.load(path, overrides)
    preflight.check(cfg)
    layout = Layout.build(cfg, devices)
    preflight.check(cfg, layout)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from jaxtron.config.loading import inference_parallel
from jaxtron.config.schema import Config, require
from jaxtron.config.model_schema import ModelConfig, head_dim
from jaxtron.model import kernels
from jaxtron.parallel.axes import CONTEXT, EXPERT, STAGE, TENSOR
from jaxtron.parallel.expert import check_expert
from jaxtron.parallel.layout import Layout, check_parallel, known_sizes


def check(cfg: Config, layout: Optional[Layout] = None) -> None:
    """Raise :class:`~jaxtron.config.ConfigError` (one line naming the field) if ``cfg`` cannot run: on the
    sizes it fixes when ``layout`` is None, else on ``layout``'s resolved sizes and its devices' platform."""
    sizes = known_sizes(cfg.parallel) if layout is None else dict(layout.sizes)
    check_parallel(cfg, sizes)
    platform = None if layout is None else layout.platform
    if layout is not None:
        check_expert(cfg, sizes[EXPERT], platform)
        kernels.check(cfg, platform, num_devices=layout.num_devices, micro_batch_size=layout.micro_batch_size,
                      tensor=layout.tp)
    else:
        kernels.check(cfg)
    check_fp8(cfg, sizes)


def check_fp8(cfg: Config, sizes: Mapping[str, int]) -> None:
    """The FP8 recipes' needs of the mesh (``sizes`` by axis; an axis missing from them is not checked)."""
    m, p = cfg.model, cfg.parallel
    require(not (m.fp8 == "delayed" and sizes.get(STAGE, 1) > 1 and p.pipeline_schedule != "1f1b"), "model.fp8",
            f"delayed scaling under parallel.pipeline_schedule={p.pipeline_schedule!r} is not built "
            "(differentiating its loop sums the micro batches' amaxes instead of taking their max); use "
            "parallel.pipeline_schedule=1f1b or model.fp8=current")
    check_blockwise(cfg, sizes)


def check_blockwise(cfg: Config, sizes: Mapping[str, int]) -> None:
    """model.fp8=blockwise: every tile lies inside one device's shard (the tiles, and so the numbers, are those
    of one device), which needs each split width over the mesh to be a multiple of the block. ``sizes``: the
    mesh sizes by axis; a width split over an axis missing from them (a ``-1`` not resolved yet) is skipped."""
    m = cfg.model
    if m.fp8 != "blockwise":
        return
    moe, b = m.moe, m.fp8_block
    shared = (moe.shared_expert_intermediate_size or moe.expert_intermediate_size) * moe.num_shared_experts
    widths = {"model.hidden_size": (m.hidden_size, None), "model.num_heads": (m.num_heads * head_dim(m), TENSOR),
              "model.num_kv_heads": (m.num_kv_heads * head_dim(m), TENSOR),
              "model.intermediate_size": (m.intermediate_size, TENSOR),
              "model.moe.num_shared_experts": (shared, TENSOR), "data.seq_len": (cfg.data.seq_len, CONTEXT)}
    for field, (width, axis) in widths.items():
        if axis is not None and axis not in sizes:
            continue
        split = 1 if axis is None else sizes[axis]
        local = width // split if width % split == 0 else width / split
        require(local % b == 0, field, f"model.fp8=blockwise needs {width} / {split} (split over the mesh) to be a "
                                       f"multiple of model.fp8_block={b}")


def inference_layout(model_cfg: ModelConfig, overrides: Sequence[str] = (), devices=None) -> Layout:
    """The checked layout of generation or evaluation of ``model_cfg`` with ``parallel.*`` ``overrides`` (e.g.
    ``["parallel.tensor=2"]``; data parallelism 1 unless set) on ``devices`` (default: all; see
    :meth:`Layout.for_inference`)."""
    layout = Layout.for_inference(model_cfg, inference_parallel(overrides), devices)
    train = dataclasses.replace(Config().train, global_batch_size=layout.global_batch_size,
                                micro_batch_size=layout.micro_batch_size)
    check(dataclasses.replace(Config(), model=model_cfg, parallel=layout.parallel, train=train), layout)
    return layout
