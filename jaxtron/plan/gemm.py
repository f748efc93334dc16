"""How long one GEMM takes on a GPU: a model by shape, without a global efficiency constant.

A GEMM [M, K] x [K, N] (``batch`` of them) is cut into output tiles, one thread block (CTA) each, and the tiles
run in waves of one per SM (NVIDIA's "Matrix Multiplication Background" guide: tile and wave quantization).
Its time is the larger of

* compute: FLOPs / (peak x ``peak_fraction`` x tile efficiency x wave efficiency x depth efficiency), where
  - tile efficiency = M N / (the tiles' padded area): a 200-row GEMM fills 2 tiles of 128 rows at 78%;
  - wave efficiency = tiles / (waves x SMs): 140 tiles on 132 SMs take 2 waves at 53%;
  - depth efficiency = K / (K + ``k_overhead``): each tile pays a pipeline fill and an epilogue, worth about
    ``k_overhead`` of contraction depth, so a short K (a small model's hidden size) runs below peak;
* memory: the operands' and the result's bytes / (HBM bandwidth x ``hbm_fraction``).

Every constant is a field of :class:`GemmModel`, named, documented and overridable; the defaults for H100/H200
are stated with their source in ``DEFAULTS``. The model says *why* a GEMM is slow (:func:`gemm_time` returns the
factors), which is what the step-time prediction reports.

A measured table replaces the constants where it exists: ``scripts/gemm_table.py`` times GEMMs by shape and dtype
on a GPU and writes it (``scripts/gpu_report.py`` runs it); ``python -m jaxtron.plan --gemm-table FILE`` uses one,
and ``jaxtron/plan/gemm_tables/<gpu>.json``, once committed from a GPU run, is that GPU's default. A GEMM is
then timed at the efficiency measured for the nearest shape in the table (log distance over M, N, K, same
dtype), moved by the model's tile, wave and depth factors from that shape to its own: a measured shape gets its
measurement, others are interpolated by the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_tables")


@dataclasses.dataclass(frozen=True)
class GemmModel:
    sm_count: int = 132                 # H100/H200 SXM
    tile_m: int = 128                   # cuBLASLt's usual Hopper bf16/FP8 CTA tile: 128 x 256 (two consumer
    tile_n: int = 256                   # warpgroups of 64 rows x 256 columns)
    k_overhead: int = 256               # pipeline fill + epilogue, in contraction depth
    peak_fraction: float = 0.80         # of the data-sheet dense bf16 peak, a large GEMM at real clocks
    fp8_peak_fraction: float = 0.70     # of the data-sheet dense FP8 peak
    hbm_fraction: float = 0.90          # of the data-sheet HBM bandwidth a streaming kernel reaches
    table: tuple = ()                   # measured points (m, n, k, fp8, tflops): load_table()
    table_source: str = ""              # the file they came from


# Sources: peak_fraction: cuBLAS bf16 GEMMs of 8192^3 on H100 SXM run at about 750-800 TFLOP/s of 989 (NVIDIA's
# cuBLAS 12 blog, "New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs", and
# public benchmarks); FP8 at about 1,300-1,450 of 1,979. hbm_fraction: a device-to-device copy on an H100 SXM
# sustains about 3.1 of 3.35 TB/s. These are not measured by jaxtron yet (no GPU has run bench_kernels --fp8).
DEFAULTS = {"h100": GemmModel(), "h200": GemmModel(), "a100_80gb": GemmModel(sm_count=108, tile_n=128)}


def _shape_factors(m: int, n: int, k: int, batch: int, model: GemmModel) -> tuple[float, float, float]:
    """(tile, wave, depth) efficiency of a GEMM's shape (module doc)."""
    tm, tn = math.ceil(m / model.tile_m), math.ceil(n / model.tile_n)
    tiles = batch * tm * tn
    waves = math.ceil(tiles / model.sm_count)
    tile = (m * n) / (tm * model.tile_m * tn * model.tile_n)
    return tile, tiles / (waves * model.sm_count), k / (k + model.k_overhead)


def _nearest(table: tuple, m: int, n: int, k: int, fp8: bool):
    points = [p for p in table if p[3] == fp8]
    if not points:
        return None
    return min(points, key=lambda p: sum(abs(math.log(a / b)) for a, b in zip((m, n, k), p[:3])))


def gemm_time(m: int, n: int, k: int, batch: int, peak_tflops: float, hbm_gbps: float, bytes_moved: float,
              model: GemmModel, fp8: bool = False) -> dict:
    """Seconds of one GEMM and the factors behind them: {"seconds", "efficiency" (of the peak), "tile",
    "wave", "depth", "bound" ('compute' or 'memory'), "source" ('model' or 'table')}."""
    tile, wave, depth = _shape_factors(m, n, k, batch, model)
    eff = (model.fp8_peak_fraction if fp8 else model.peak_fraction) * tile * wave * depth
    ref, source = _nearest(model.table, m, n, k, fp8), "model"
    if ref is not None:
        ref_factors = math.prod(_shape_factors(*ref[:3], 1, model))
        eff = min(1.0, ref[4] / peak_tflops * tile * wave * depth / ref_factors)
        source = "table"
    compute_s = 2.0 * batch * m * n * k / (peak_tflops * 1e12 * eff)
    memory_s = bytes_moved / (hbm_gbps * 1e9 * model.hbm_fraction)
    return {"seconds": max(compute_s, memory_s), "efficiency": eff, "tile": tile, "wave": wave, "depth": depth,
            "bound": "compute" if compute_s >= memory_s else "memory", "source": source}


def load_table(path: str) -> tuple:
    """The measured points of a GEMM table written by ``scripts/gemm_table.py``: (m, n, k, fp8, tflops) each.
    Raises ValueError naming the file and the bad entry."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--gemm-table: cannot read {path}: {err}") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--gemm-table: {path} has no 'entries' list")
    points = []
    for i, e in enumerate(entries):
        try:
            m, n, k, tflops = (e[key] for key in ("m", "n", "k", "tflops"))
            dtype = e["dtype"]
        except (KeyError, TypeError):
            raise ValueError(f"--gemm-table: {path}: entry {i} needs m, n, k, dtype and tflops") from None
        if dtype not in ("bf16", "fp8") or min(m, n, k) < 1 or not tflops > 0:
            raise ValueError(f"--gemm-table: {path}: entry {i} has dtype {dtype!r} (bf16 or fp8), sizes "
                             f"{m}x{n}x{k} and {tflops} TFLOP/s; sizes and TFLOP/s must be positive")
        points.append((int(m), int(n), int(k), dtype == "fp8", float(tflops)))
    return tuple(points)


def default_table(gpu_name: str) -> Optional[str]:
    """The committed table measured on this kind of GPU (jaxtron/plan/gemm_tables/<gpu>.json), if any."""
    path = os.path.join(TABLE_DIR, f"{gpu_name}.json")
    return path if os.path.exists(path) else None
