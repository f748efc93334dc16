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
are stated with their source in ``DEFAULTS`` and are meant to be refreshed from ``scripts/bench_kernels.py
--fp8`` (which times Llama-3-8B's projection GEMMs in bf16 and FP8) on a GPU. The model says *why* a GEMM is
slow (:func:`gemm_time` returns the factors), which is what the step-time prediction reports.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GemmModel:
    sm_count: int = 132                 # H100/H200 SXM
    tile_m: int = 128                   # cuBLASLt's usual Hopper bf16/FP8 CTA tile: 128 x 256 (two consumer
    tile_n: int = 256                   # warpgroups of 64 rows x 256 columns)
    k_overhead: int = 256               # pipeline fill + epilogue, in contraction depth
    peak_fraction: float = 0.80         # of the data-sheet dense bf16 peak, a large GEMM at real clocks
    fp8_peak_fraction: float = 0.70     # of the data-sheet dense FP8 peak
    hbm_fraction: float = 0.90          # of the data-sheet HBM bandwidth a streaming kernel reaches


# Sources: peak_fraction: cuBLAS bf16 GEMMs of 8192^3 on H100 SXM run at about 750-800 TFLOP/s of 989 (NVIDIA's
# cuBLAS 12 blog, "New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs", and
# public benchmarks); FP8 at about 1,300-1,450 of 1,979. hbm_fraction: a device-to-device copy on an H100 SXM
# sustains about 3.1 of 3.35 TB/s. These are not measured by jaxtron yet (no GPU has run bench_kernels --fp8).
DEFAULTS = {"h100": GemmModel(), "h200": GemmModel(), "a100_80gb": GemmModel(sm_count=108, tile_n=128)}


def gemm_time(m: int, n: int, k: int, batch: int, peak_tflops: float, hbm_gbps: float, bytes_moved: float,
              model: GemmModel, fp8: bool = False) -> dict:
    """Seconds of one GEMM and the factors behind them: {"seconds", "efficiency" (of the peak), "tile",
    "wave", "depth", "bound" ('compute' or 'memory')}."""
    tm, tn = math.ceil(m / model.tile_m), math.ceil(n / model.tile_n)
    tiles = batch * tm * tn
    waves = math.ceil(tiles / model.sm_count)
    tile = (m * n) / (tm * model.tile_m * tn * model.tile_n)
    wave = tiles / (waves * model.sm_count)
    depth = k / (k + model.k_overhead)
    eff = (model.fp8_peak_fraction if fp8 else model.peak_fraction) * tile * wave * depth
    compute_s = 2.0 * batch * m * n * k / (peak_tflops * 1e12 * eff)
    memory_s = bytes_moved / (hbm_gbps * 1e9 * model.hbm_fraction)
    return {"seconds": max(compute_s, memory_s), "efficiency": eff, "tile": tile, "wave": wave, "depth": depth,
            "bound": "compute" if compute_s >= memory_s else "memory"}
