"""The Layout: how one run is laid out on its devices, worked out once from ``cfg.parallel``, the devices and
the batch config. Everything outside ``jaxtron/parallel/`` asks the Layout (the data-parallel size, stages,
micro batches, the mesh, the rules, the batch sharding) instead of doing mesh arithmetic itself.

    layout = Layout.build(cfg, devices)           # checks the parallel sizes, resolves a -1 axis, builds the mesh
    layout.dp, layout.tp, layout.stages, layout.accumulation_steps, layout.bubble
    with layout.tracing():                        # the mesh + logical rules the model's constraints follow
        ...

The Layout checks ``parallel.*`` only; the checks against the model's kernels are :mod:`jaxtron.preflight`'s,
which the entry points run on the built Layout.

Adding a mesh axis: add it to :data:`~jaxtron.parallel.axes.AXES` (and a size field to ``ParallelConfig``), map
logical names onto it in :mod:`jaxtron.parallel.rules`, check what it must divide in :func:`check_parallel`, and
put the code that needs the axis by name (a ``shard_map``) in ``jaxtron/parallel/``. See docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtron.config.schema import Config, ParallelConfig, require
from jaxtron.config.model_schema import ModelConfig
from jaxtron.parallel import collective_matmul
from jaxtron.parallel.axes import (AXES, BATCH_SPLIT, CONTEXT, CRITICAL_PATH, EXPERT, STAGE, TENSOR,
                                   data_parallel_size)
from jaxtron.parallel.context import balance, check_context
from jaxtron.parallel.expert import check_expert
from jaxtron.parallel.mesh import mesh_for
from jaxtron.parallel.pipeline_layout import PipelineSpec
from jaxtron.parallel.rules import active_overrides, logical_rules
from jaxtron.parallel.sharding import logical_to_sharding, param_shardings, use_rules

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "circular", "zb_h1", "zbv")


def configured_sizes(p: ParallelConfig) -> dict[str, int]:
    """The sizes as configured, by axis (-1: fill with the devices the others leave)."""
    return {a: getattr(p, a) for a in AXES}


def known_sizes(p: ParallelConfig) -> dict[str, int]:
    """The sizes the config fixes before the devices are known (a -1 axis left out)."""
    return {a: v for a, v in configured_sizes(p).items() if v != -1}


def resolve_sizes(p: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Fill a -1 axis and check that the mesh covers exactly ``num_devices`` devices."""
    sizes = configured_sizes(p)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    if fill:
        require(num_devices % fixed == 0, f"parallel.{fill[0]}",
               f"cannot fill: {num_devices} devices are not divisible by the other axes' product {fixed}")
        sizes[fill[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    require(total == num_devices, "parallel",
           f"mesh {'*'.join(AXES)} = {'*'.join(str(sizes[a]) for a in AXES)} = {total} does not match the "
           f"{num_devices} available devices")
    return sizes


def micro_batch_size(cfg: Config, dp: int) -> int:
    """Sequences per micro batch per data-parallel replica (resolving the default: no accumulation)."""
    t = cfg.train
    return t.micro_batch_size if t.micro_batch_size is not None else t.global_batch_size // dp


def check_parallel(cfg: Config, sizes: Optional[Mapping[str, int]] = None) -> None:
    """Every check of ``parallel.*`` against the model and batch. Without ``sizes`` (no devices known yet) the
    axes the config fixes are checked and a ``-1`` axis is skipped; :meth:`Layout.build` calls it again with the
    resolved sizes."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for axis, v in configured_sizes(p).items():
        require(v == -1 or v >= 1, f"parallel.{axis}", f"must be >= 1 (or -1 to fill), got {v}")
    require(sum(v == -1 for v in configured_sizes(p).values()) <= 1, "parallel",
           f"at most one of {'/'.join(AXES)} may be -1")
    require(p.pipeline_schedule in PIPELINE_SCHEDULES, "parallel.pipeline_schedule",
           f"{p.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}")
    require(p.virtual_stages >= 1, "parallel.virtual_stages", f"must be >= 1, got {p.virtual_stages}")
    require(not (p.pipeline_recompute and p.pipeline_schedule in ("zb_h1", "zbv")), "parallel.pipeline_recompute",
            f"{p.pipeline_schedule} keeps the residuals its W reads: set parallel.pipeline_recompute=false")
    require(p.virtual_stages == 1 or p.pipeline_schedule == "circular", "parallel.virtual_stages",
           f"{p.virtual_stages} virtual stages need parallel.pipeline_schedule=circular "
           f"(got {p.pipeline_schedule!r})")
    known = dict(sizes) if sizes is not None else known_sizes(p)
    stages, tensor = known.get(STAGE), known.get(TENSOR)
    if stages is not None:
        per_device = 2 if p.pipeline_schedule == "zbv" else p.virtual_stages   # zbv: two chunks in a V
        chunks = stages * per_device
        split = (f"parallel.stage ({stages}) x 2 (zbv's V)" if p.pipeline_schedule == "zbv" else
                 f"parallel.stage ({stages}) x parallel.virtual_stages ({p.virtual_stages})")
        require(m.moe.num_experts or m.num_layers % chunks == 0, "model.num_layers",
               f"{m.num_layers} layers cannot be split into {split} = {chunks} equal chunks")
        if m.moe.num_experts:  # the stages split the scanned MoE units; the leading dense layers run before
            units = (m.num_layers - m.moe.first_dense_layers) // m.moe.layer_freq
            require(units % chunks == 0, "parallel.stage", f"the {units} scanned MoE units (model.num_layers - "
                   f"model.moe.first_dense_layers, in groups of model.moe.layer_freq) cannot be split into "
                   f"{split} = {chunks} chunks")
    if tensor is not None:
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            require(getattr(m, name) % tensor == 0, "parallel.tensor",
                   f"model.{name}={getattr(m, name)} is not divisible by tensor={tensor}")
        if p.sequence_parallel:
            require(cfg.data.seq_len % tensor == 0, "data.seq_len",
                   f"{cfg.data.seq_len} is not divisible by parallel.tensor={tensor} (sequence_parallel)")
    check_context(cfg, known.get(CONTEXT), tensor)
    check_expert(cfg, known.get(EXPERT))
    if all(a in known for a in BATCH_SPLIT):
        dp = data_parallel_size(known)
        split = "*".join(BATCH_SPLIT)
        if t.micro_batch_size is None:
            require(t.global_batch_size % dp == 0, "train.global_batch_size",
                   f"{t.global_batch_size} is not divisible by the data-parallel size ({split} = {dp})")
        else:
            require(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size",
                   f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) x "
                   f"data-parallel size ({split} = {dp})")
        if stages is not None and stages > 1 and p.pipeline_schedule == "circular":
            mb = t.global_batch_size // (micro_batch_size(cfg, dp) * dp)
            require(mb >= stages, "train.micro_batch_size",
                   f"the circular schedule needs at least parallel.stage={stages} micro batches per step; "
                   f"global_batch_size / (micro_batch_size x {' x '.join(BATCH_SPLIT)}) = {mb}")


@dataclass(frozen=True)
class Layout:
    """Mesh sizes (resolved), the mesh (``None`` for a layout planned without devices), the logical-axis rules
    and the batch and pipeline arithmetic of one run. Build it with :meth:`build` (or :meth:`planned`)."""

    sizes: Mapping[str, int]
    global_batch_size: int
    micro_batch_size: int
    parallel: ParallelConfig
    mesh: Optional[Mesh] = None
    platform: Optional[str] = None
    # ((logical name, mesh axes), ...) replacing the rules table's, as rules.overriding() gave them at build
    rule_overrides: tuple = ()

    # ---------------------------------------------------------------------------------------- building
    @classmethod
    def build(cls, cfg: Config, devices: Optional[Sequence[jax.Device]] = None) -> "Layout":
        """The layout of ``cfg`` on ``devices`` (default: all): the parallel checks made on the resolved sizes,
        a ``-1`` axis resolved, the mesh built. Raises :class:`ConfigError`. The checks against the model's
        kernels on these devices are :func:`jaxtron.preflight.check`'s."""
        devices = list(devices if devices is not None else jax.devices())
        layout = cls.planned(cfg, len(devices), devices[0].platform)
        return dataclasses.replace(layout, mesh=mesh_for(layout.shape, AXES, devices))

    @classmethod
    def planned(cls, cfg: Config, num_devices: int, platform: Optional[str] = None) -> "Layout":
        """The layout of ``cfg`` on ``num_devices`` devices of ``platform`` without building a mesh (for the
        planner's estimates and for checking before devices are set up)."""
        sizes = resolve_sizes(cfg.parallel, num_devices)
        check_parallel(cfg, sizes)
        if platform is not None:
            check_expert(cfg, sizes[EXPERT], platform)
        dp = data_parallel_size(sizes)
        return cls(sizes, cfg.train.global_batch_size, micro_batch_size(cfg, dp), cfg.parallel, None, platform,
                   active_overrides())

    @classmethod
    def for_inference(cls, model_cfg: ModelConfig, parallel: ParallelConfig,
                      devices: Optional[Sequence[jax.Device]] = None) -> "Layout":
        """The layout of generation or evaluation of a model ``model_cfg`` laid out as ``parallel``: the mesh
        spans as many of ``devices`` (default: all) as the sizes multiply to (all of them when one size is -1),
        and the batch (the prompts) is one row per data-parallel replica."""
        sizes = configured_sizes(parallel)
        devices = list(devices if devices is not None else jax.devices())
        if -1 not in sizes.values():
            devices = devices[:math.prod(sizes.values())]
        dp = data_parallel_size(resolve_sizes(parallel, len(devices)))
        train = dataclasses.replace(Config().train, global_batch_size=dp, micro_batch_size=None)
        return cls.build(dataclasses.replace(Config(), model=model_cfg, parallel=parallel, train=train), devices)

    def place(self, module):
        """``module`` (an NNX module whose parameters carry logical names) with its parameters put in their
        shards on this layout's mesh."""
        graphdef, state = nnx.split(module)
        shardings = param_shardings(state, self._mesh(), self.rules)
        placed = jax.tree.map(jax.device_put, state.to_pure_dict(), shardings)
        return nnx.merge(graphdef, placed)

    # ------------------------------------------------------------------------------------------- sizes
    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh sizes in :data:`AXES` order."""
        return tuple(self.sizes[a] for a in AXES)

    @property
    def dp(self) -> int:
        """Data-parallel size: the ways the batch is split (data x fsdp x expert)."""
        return data_parallel_size(self.sizes)

    @property
    def tp(self) -> int:
        return self.sizes["tensor"]

    @property
    def fsdp(self) -> int:
        return self.sizes["fsdp"]

    @property
    def expert(self) -> int:
        """The ways the MoE experts are split (expert parallelism; part of the data-parallel size)."""
        return self.sizes["expert"]

    @property
    def context(self) -> int:
        """The ways each sequence is split (context parallelism)."""
        return self.sizes["context"]

    @property
    def zero_shards(self) -> int:
        """The ways each weight and its optimizer state are split by ZeRO-3: fsdp x context (see rules.py)."""
        return self.sizes["fsdp"] * self.sizes["context"]

    @property
    def stages(self) -> int:
        return self.sizes["stage"]

    @property
    def accumulation_steps(self) -> int:
        """Micro batches per optimizer step (gradient accumulation steps, or the pipeline's micro batches)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def bubble(self) -> float:
        """Idle fraction of the pipeline schedule (:attr:`PipelineSpec.bubble`): (S-1)/(M+S-1), (S-1)/(V*M+S-1)
        for the circular one, (S-1)/(3M+S-1) for zb_h1, zbv's from its tick table."""
        s = self.stages
        if s <= 1:
            return 0.0
        return self.pipeline().bubble

    def describe(self) -> str:
        """``data=2 fsdp=2 tensor=2 stage=1`` (and ``expert=2``, ``context=4 (ring)`` where there are such)."""
        text = " ".join(f"{a}={self.sizes[a]}" for a in ("data", "fsdp", "tensor", "stage"))
        if self.sizes["expert"] > 1:
            text += f" expert={self.sizes['expert']}"
        if self.sizes["context"] > 1:
            text += f" context={self.sizes['context']} ({self.parallel.context_impl})"
        return text

    # --------------------------------------------------------------------------------- rules, shardings
    @property
    def rules(self):
        return logical_rules(self.parallel, dict(self.rule_overrides))

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """The logical rules and this layout's mesh, for tracing the model (``constrain``, ``per_shard``)."""
        with use_rules(self.rules, self._mesh()), collective_matmul.overlapping(self.parallel.tp_comm_overlap):
            yield

    def sharding(self, names: Sequence[Optional[str]]) -> NamedSharding:
        """The sharding of an array whose axes have these logical names."""
        return logical_to_sharding(names, self._mesh(), self.rules)

    def _mesh(self) -> Mesh:
        if self.mesh is None:
            raise ValueError("this Layout was planned without devices (Layout.planned); use Layout.build")
        return self.mesh

    @property
    def reorders_sequences(self) -> bool:
        """Whether :meth:`balance` changes the order of the tokens (attention must then mask by position)."""
        return self.sizes["context"] > 1

    def balance(self, batch: dict) -> dict:
        """The batch's sequences in the context-parallel load-balanced order (as is without context
        parallelism); see :mod:`jaxtron.parallel.context`."""
        return balance(batch, self.sizes[CONTEXT])

    def pipeline(self, for_eval: bool = False):
        """The :class:`~jaxtron.parallel.pipeline_layout.PipelineSpec`, or None without pipeline stages. Evaluation
        (forward only) runs the 1f1b, zb_h1 and zbv configurations through the gpipe loop."""
        if self.stages == 1:
            return None
        p = self.parallel
        schedule = "gpipe" if for_eval and p.pipeline_schedule in ("1f1b", "zb_h1", "zbv") else p.pipeline_schedule
        return PipelineSpec(self.stages, self.accumulation_steps, schedule, p.virtual_stages,
                            p.pipeline_fsdp_gather_once, p.pipeline_recompute)

    # ------------------------------------------------------------------------ collectives (the planner)
    def axes_of_group(self, logical_ids: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes a replica group of logical device ids (positions in the mesh) spans."""
        ids = [i for i in logical_ids if 0 <= i < self.num_devices]
        if not ids:
            return ()
        coords = np.array(np.unravel_index(ids, self.shape)).T
        return tuple(a for i, a in enumerate(AXES) if len(set(coords[:, i])) > 1)

    def axes_of_pairs(self, pairs: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """The mesh axes a collective-permute's source/target pairs move along."""
        axes = set()
        for a, b in pairs:
            if a < self.num_devices and b < self.num_devices:
                ca, cb = np.unravel_index(a, self.shape), np.unravel_index(b, self.shape)
                axes |= {AXES[i] for i in range(len(AXES)) if ca[i] != cb[i]}
        return tuple(a for a in AXES if a in axes)

    @staticmethod
    def on_critical_path(axes: Sequence[str]) -> bool:
        """Whether collectives over these axes wait on compute (tensor/sequence parallel activations) rather
        than overlapping with it (FSDP gathers, gradient reductions)."""
        return bool(axes) and set(axes) <= set(CRITICAL_PATH)
