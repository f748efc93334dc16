"""What an optimized HLO module computes, beside its collectives (jaxtron/plan/hlo.py): dot FLOPs and operand
types, Pallas kernel calls, and which compute the schedule places inside async start/done pairs."""

from __future__ import annotations

import re

import numpy as np

from jaxtron.plan.hlo import (DOT_LHS_RE, OP_NAME_RE, dot_dimensions, first_array, is_gemm_call, operand_names,
                              operand_shape, parse_module, shape_dims)


def dot_flops(text: str, marker: str = "ragged_dot") -> dict[str, float]:
    """Matmul FLOPs per device per step of an optimized module: every ``dot`` counts 2 x its result elements x
    its contracted size, times how often its computation runs (loop trip counts and fusion calls multiplied).
    ``marked``: the part whose op_name matches the regular expression ``marker`` (by default the MoE experts'
    ragged_dot, whatever XLA lowered it to). cuBLAS GEMM calls count as dots; other custom calls (Pallas kernels
    such as flash attention, cuDNN attention) are not counted."""
    mod = parse_module(text)
    mult = mod.multipliers()
    total = marked = 0.0
    for comp, instrs in mod.computations.items():
        count = mult.get(comp, 0.0)
        shapes = {name: shape for name, shape, _op, _rest in instrs}
        for _name, shape, opcode, rest in instrs:
            if not count or not (opcode == "dot" or is_gemm_call(opcode, rest)):
                continue
            flops = _gemm_flops(shape, rest, shapes) * count
            total += flops
            op_name = OP_NAME_RE.search(rest)
            marked += flops if op_name and re.search(marker, op_name.group(1)) else 0.0
    return {"total": total, "marked": marked}


def _gemm_flops(shape: str, rest: str, shapes: dict) -> float:
    """2 x result elements x contracted size of a ``dot`` or a cuBLAS GEMM call (operand shapes inline or
    from ``shapes``)."""
    lhs = DOT_LHS_RE.match(rest) if rest.startswith("dot(") else None
    lhs_dims = shape_dims(lhs.group(1) or operand_shape(shapes, lhs.group(2))) if lhs else shape_dims(
        operand_shape(shapes, (operand_names(rest) or [""])[0]))
    k = np.prod([lhs_dims[i] for i in dot_dimensions(rest)["lhs_contracting_dims"] if i < len(lhs_dims)])
    return 2.0 * float(np.prod(shape_dims(first_array(shape)))) * float(k)


COMPUTE_OPCODES = ("fusion", "custom-call", "convolution", "dot")


def async_overlap(text: str, kind: str = "collective-permute", marker: str = "") -> list[dict]:
    """Each async ``<kind>-start``/``-done`` pair of a scheduled module (``is_scheduled=true``: instruction
    order is execution order) with the compute ops the schedule places between them: those run while the
    transfer is in flight. A pair with none between is exposed (the stream waits for the transfer).
    ``marker``: a regular expression; ``marked_between`` lists the compute ops between whose text (op_name
    metadata included) matches it."""
    mod = parse_module(text)
    pairs = []
    for comp, instrs in mod.computations.items():
        open_at = {}
        for i, (name, _shape, opcode, rest) in enumerate(instrs):
            if opcode == f"{kind}-start":
                open_at[name] = i
            elif opcode == f"{kind}-done":
                operand = re.match(r"[\w\-]+\(\s*%?([\w.\-]+)", rest)
                start = operand and operand.group(1)
                if start in open_at:
                    between = instrs[open_at.pop(start) + 1:i]
                    compute = [(n, r) for n, _s, op, r in between if op in COMPUTE_OPCODES]
                    marked = [n for n, r in compute if marker and re.search(marker, r)]
                    pairs.append({"computation": comp, "start": start, "compute_between": [n for n, _ in compute],
                                  "marked_between": marked})
    return pairs


def dot_operand_types(text: str, marker: str = "") -> dict[str, dict]:
    """The ``dot`` instructions of an optimized module by their operands' element types, each instruction once
    (loop bodies not multiplied): {"bf16 x bf16": {"dots": 12, "flops": ...}, "f8e4m3fn x f8e4m3fn": ...}. An FP8
    GEMM is a dot on FP8 operands (XLA:GPU runs it as a cuBLASLt or Triton FP8 GEMM). XLA may merge dots that
    share an operand (q, k and v), so FLOPs, not counts, say which share of the matmuls is FP8. ``marker``: only
    the dots whose op_name matches that regular expression (e.g. the MoE experts' scope)."""
    out: dict[str, dict] = {}
    for instrs in parse_module(text).computations.values():
        shapes = {name: shape for name, shape, _op, _rest in instrs}
        for _name, shape, opcode, rest in instrs:
            if not (opcode == "dot" or is_gemm_call(opcode, rest)):
                continue
            op_name = OP_NAME_RE.search(rest) if marker else None
            if marker and not (op_name and re.search(marker, op_name.group(1))):
                continue
            key = " x ".join(operand_shape(shapes, x, "?").split("[")[0] for x in operand_names(rest)[:2])
            entry = out.setdefault(key, {"dots": 0, "flops": 0.0})
            entry["dots"] += 1
            entry["flops"] += _gemm_flops(shape, rest, shapes)
    return out


def kernel_calls(text: str) -> dict[str, int]:
    """Pallas kernels in an optimized module (loop bodies counted once): ``triton_calls`` (Pallas Triton custom
    calls: their FLOPs are not among the HLO dots) and ``mosaic_calls`` (Mosaic GPU)."""
    calls = [line for line in text.splitlines() if " custom-call(" in line]
    return {"triton_calls": sum('custom_call_target="__gpu$xla.gpu.triton"' in line for line in calls),
            "mosaic_calls": sum('custom_call_target="mosaic_gpu' in line for line in calls)}
