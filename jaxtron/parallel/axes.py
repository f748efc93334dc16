"""The mesh axes by name: the one list of them, the ones that split the batch, and the data-parallel size.

Code outside ``jaxtron/parallel/`` names logical axes, never these (tests/test_mesh_axes_stay_in_parallel.py);
inside it, modules that need an axis by name (a ``shard_map`` over it) take the constant from here.
"""

from __future__ import annotations

import math
from typing import Mapping

STAGE, DATA, FSDP, EXPERT, CONTEXT, TENSOR = "stage", "data", "fsdp", "expert", "context", "tensor"
# Outermost first: stage and data span hosts; tensor (then context, expert, fsdp) stay inner, inside a node
# (expert's all-to-alls want NVLink).
AXES = (STAGE, DATA, FSDP, EXPERT, CONTEXT, TENSOR)
# Axes that split the batch (data parallelism: gradients are reduced over them). Expert parallelism is drawn
# from the data-parallel devices (Megatron's EP within DP): the expert ranks hold different tokens.
BATCH_SPLIT = (DATA, FSDP, EXPERT)
# Axes whose collectives sit on the critical path (Megatron tensor/sequence parallel activations: attention
# waits for the context axis's gathered K and V, the experts for the dispatch all-to-all); the others (FSDP
# gathers, gradient reductions) XLA overlaps with compute.
CRITICAL_PATH = (TENSOR, CONTEXT, EXPERT)


def data_parallel_size(sizes: Mapping[str, int]) -> int:
    """The ways the batch is split: the product of the :data:`BATCH_SPLIT` axes' sizes."""
    return math.prod(sizes[a] for a in BATCH_SPLIT)
