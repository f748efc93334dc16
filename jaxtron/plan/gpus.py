"""The GPUs ``python -m jaxtron.plan`` knows: memory, peak compute and bandwidths for the roofline model, and
the ``GpuTargetConfigProto`` text (``gpus/<name>.txtpb``) the XLA:GPU compiler targets.

Numbers (vendor data sheets, SXM parts, dense bf16 and FP8 without sparsity; bandwidths per GPU, one direction):

============  =======  ========  =========  =========  ===============  =====================================
GPU           memory   bf16      FP8        HBM        NVLink (intra)   network (inter node, per GPU)
============  =======  ========  =========  =========  ===============  =====================================
h100          80 GB    989 TF/s  1979 TF/s  3.35 TB/s  450 GB/s (NVL4)  50 GB/s (one 400 Gb/s NIC per GPU)
h200          141 GB   989 TF/s  1979 TF/s  4.8 TB/s   450 GB/s (NVL4)  50 GB/s (one 400 Gb/s NIC per GPU)
a100_80gb     80 GB    312 TF/s  none       2.04 TB/s  300 GB/s (NVL3)  25 GB/s (one 200 Gb/s NIC per GPU)
============  =======  ========  =========  =========  ===============  =====================================

NVLink "900 GB/s" (H100) and "600 GB/s" (A100) on the data sheets are both directions together; a ring
collective is limited by one direction. The efficiency factors say how much of a peak a real step reaches:
``compute_efficiency`` (0.6: large bf16 GEMMs reach ~65-75% of the data-sheet peak on H100 at its real clocks,
flash attention forward+backward ~50-60%; the memory-bound kernels are timed separately from HBM bytes) and
``comm_efficiency`` (NCCL bus bandwidth ~80% of link speed intra node, less over the network). All of them can
be overridden on the command line (``--peak-tflops``, ``--fp8-peak-tflops``, ``--hbm-gbps``, ``--nvlink-gbps``,
``--net-gbps``, ``--compute-efficiency``, ``--comm-efficiency``, ``--gpus-per-node``, ``--mem-fraction``).
The step model's constants (jaxtron/plan/gemm.py, steptime.py) have their own flags, kept here as optional
fields: ``--gemm-peak-fraction``, ``--gemm-fp8-peak-fraction``, ``--hbm-fraction``, ``--attention-tflops``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

GPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpus")


@dataclass
class GpuSpec:
    name: str
    description: str
    memory_bytes: int            # device memory (the target config's device_memory_size)
    peak_tflops: float           # dense bf16 TFLOP/s
    hbm_gbps: float              # HBM bandwidth, GB/s
    nvlink_gbps: float           # per GPU, one direction, inside a node
    net_gbps: float              # per GPU, one direction, between nodes
    fp8_peak_tflops: float = 0.0  # dense FP8 TFLOP/s (0: no FP8 GEMMs; model.fp8 runs at the bf16 peak)
    gpus_per_node: int = 8
    compute_efficiency: float = 0.6
    comm_efficiency: float = 0.8
    collective_latency_us: float = 0.0    # launch overhead per collective on top of NCCL's own latency model
    #                                       (jaxtron/plan/nccl.py); not measured, so 0
    mem_fraction: float = 0.95   # of device memory usable by XLA (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)
    # step model overrides (None: jaxtron/plan/gemm.py's per-GPU defaults, steptime.ATTENTION_TFLOPS)
    gemm_peak_fraction: Optional[float] = None
    gemm_fp8_peak_fraction: Optional[float] = None
    hbm_fraction: Optional[float] = None
    attention_tflops: Optional[float] = None
    gemm_table: Optional[str] = None   # a measured GEMM table (scripts/gemm_table.py) instead of the GEMM model's

    @property
    def target_config_path(self) -> str:
        return os.path.join(GPU_DIR, f"{self.name}.txtpb")

    def target_config(self) -> str:
        with open(self.target_config_path) as f:
            return f.read()

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.mem_fraction

    def replace(self, **kw) -> "GpuSpec":
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


GPUS = {
    "h100": GpuSpec("h100", "NVIDIA H100 80GB HBM3 (SXM)", 84942979072, 989.0, 3350.0, 450.0, 50.0, 1979.0),
    "h200": GpuSpec("h200", "NVIDIA H200 141GB HBM3e (SXM)", 150754820096, 989.0, 4800.0, 450.0, 50.0, 1979.0),
    "a100_80gb": GpuSpec("a100_80gb", "NVIDIA A100 80GB (SXM4)", 85899345920, 312.0, 2039.0, 300.0, 25.0),
}
ALIASES = {"a100": "a100_80gb", "h100_sxm": "h100", "h100-sxm": "h100", "a100-80gb": "a100_80gb"}


def get_gpu(name: str) -> GpuSpec:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
