"""Collective traffic read from the optimized HLO text of a compiled step (``compiled.as_text()``).

Every all-gather, reduce-scatter, all-reduce, all-to-all (and ragged) and collective-permute is found (sync or async:
``*-start``/``*-done`` pairs are counted once, at the op that carries the replica groups), its result shape and
replica groups are parsed, and it is multiplied by how many times it runs: an op inside a ``while`` body (the
scan over layers, the gradient-accumulation loop) runs ``known_trip_count`` times, nested loops multiply.

Bytes are per device. Two numbers per op:

* ``result_bytes``: the size of the op's result on one device (what the closed forms in the tests count).
* ``wire_bytes``: what one device sends over its links with the bandwidth-optimal (ring) algorithm, n = group
  size: all-gather ``R (n-1)/n`` (R = gathered result), reduce-scatter ``R (n-1)`` (R = scattered result, so
  the input is ``n R``), all-reduce ``2 R (n-1)/n``, all-to-all ``R (n-1)/n`` (ragged: at most that, R being its worst-case buffer),
  collective-permute ``R``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5, "token": 0,
}

_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_RE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                        r"async_execution_thread_computation)=%?([\w.\-]+)")
_LIST_CALLEE_RE = re.compile(r"\b(?:called_computations|branch_computations|calls)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_DOT_LHS_RE = re.compile(r"dot\(\s*([a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?\s+)?%?([\w.\-]+)")
_LHS_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (arrays and tuples; layouts and comments ignored)."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += DTYPE_BYTES[dtype] * n
    return total


def _split_shape(rest: str) -> tuple[str, str]:
    """'SHAPE opcode(...)...' -> (SHAPE, 'opcode(...)...'); SHAPE may be a parenthesised tuple."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].strip()
    i = rest.find(" ")
    return rest[:i], rest[i + 1:].strip()


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape string."""
    s = re.sub(r"/\*.*?\*/", "", shape.strip())
    if not s.startswith("("):
        return [s]
    s = s[1:-1]
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _balanced(text: str, start: int, open_ch: str = "{", close_ch: str = "}") -> str:
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == open_ch
        depth -= text[i] == close_ch
        if depth == 0:
            return text[start: i + 1]
    return text[start:]


def parse_replica_groups(attrs: str, num_devices: int) -> Optional[np.ndarray]:
    """The replica groups of an op as a [groups, group_size] array of logical device ids, or None."""
    i = attrs.find("replica_groups=")
    if i < 0:
        return None
    s = attrs[i + len("replica_groups="):]
    if s.startswith("{"):
        body = _balanced(s, 0)
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        groups = [g for g in groups if g]
        if not groups:  # {} = all devices in one group
            return np.arange(num_devices)[None]
        if len({len(g) for g in groups}) == 1:
            return np.array(groups)
        return np.array([groups[0]])
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
    if m:
        gshape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(gshape[0], -1) if len(gshape) > 1 else ids.reshape(1, -1)
    m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", s)
    if m:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(n) for _, n in axes]
        listed = re.findall(r"'([^']+)'", m.group(2))
        if int(np.prod(sizes)) != num_devices or any(a not in names for a in listed):
            return None
        ids = np.arange(num_devices).reshape(sizes)
        inner = [names.index(a) for a in listed]
        outer = [k for k in range(len(names)) if k not in inner]
        ids = ids.transpose(outer + inner)
        return ids.reshape(-1, int(np.prod([sizes[k] for k in inner])) if inner else 1)
    return None


def _source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    i = attrs.find("source_target_pairs=")
    if i < 0:
        return []
    body = _balanced(attrs, i + len("source_target_pairs="))
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)]


@dataclass
class CollectiveOp:
    name: str
    kind: str
    computation: str
    result_bytes: float      # per device, one execution
    group_size: int
    count: float             # executions per step (trip counts multiplied)
    groups: Optional[np.ndarray] = None
    pairs: list = field(default_factory=list)
    op_name: str = ""        # the JAX operation it was inserted for (metadata), e.g. ".../ragged_dot_general"

    @property
    def wire_bytes(self) -> float:
        n, r = self.group_size, self.result_bytes
        if n <= 1 and self.kind != "collective-permute":
            return 0.0
        if self.kind == "all-gather":
            return r * (n - 1) / n
        if self.kind == "reduce-scatter":
            return r * (n - 1)
        if self.kind == "all-reduce":
            return 2 * r * (n - 1) / n
        if self.kind in ("all-to-all", "ragged-all-to-all"):  # ragged: at most (its buffer is the worst case)
            return r * (n - 1) / n
        return r


@dataclass
class HloModule:
    computations: dict        # name -> list of (instr name, shape, opcode, rest)
    entry: str
    calls: dict               # caller -> list of (callee, factor)

    def multipliers(self) -> dict[str, float]:
        """How many times each computation runs per execution of the entry computation."""
        mult: dict[str, float] = defaultdict(float)
        order = []
        seen = set()

        def visit(c):  # topological order from the entry (the call graph is a DAG)
            if c in seen or c not in self.computations:
                return
            seen.add(c)
            for callee, _ in self.calls.get(c, ()):
                visit(callee)
            order.append(c)
        visit(self.entry)
        mult[self.entry] = 1.0
        for c in reversed(order):
            for callee, factor in self.calls.get(c, ()):
                mult[callee] += mult[c] * factor
        return mult


def parse_module(text: str) -> HloModule:
    comps: dict[str, list] = {}
    calls: dict[str, list] = defaultdict(list)
    entry, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = _COMP_RE.match(line)
            if m and not line.startswith(" ") and "=" not in line.split("(")[0]:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        shape, op_rest = _split_shape(rest)
        opcode = op_rest.split("(", 1)[0].strip()
        comps[cur].append((name, shape, opcode, op_rest))
        trip = 1.0
        if opcode == "while":
            t = _TRIP_RE.search(op_rest)
            trip = float(t.group(1)) if t else 1.0
        for key, callee in _CALLEE_RE.findall(op_rest):
            factor = 1.0
            if opcode == "while":
                factor = trip if key == "body" else trip + 1
            calls[cur].append((callee, factor))
        for lst in _LIST_CALLEE_RE.findall(op_rest):
            for callee in re.findall(r"%?([\w.\-]+)", lst):
                calls[cur].append((callee, 1.0))
    if entry is None and comps:
        entry = list(comps)[-1]
    return HloModule(comps, entry, dict(calls))


def collectives(text: str, num_devices: int) -> list[CollectiveOp]:
    """Every collective of the module with its per-step execution count."""
    mod = parse_module(text)
    mult = mod.multipliers()
    ops = []
    for comp, instrs in mod.computations.items():
        count = mult.get(comp, 0.0)
        if count == 0:
            continue
        for name, shape, opcode, rest in instrs:
            kind = opcode[:-6] if opcode.endswith("-start") else opcode
            if kind not in KINDS:
                continue
            if opcode.endswith("-start"):
                elems = _tuple_elements(shape)
                if kind in ("all-gather", "reduce-scatter") and shape.startswith("((") or (
                        kind in ("all-gather", "reduce-scatter", "all-to-all") and len(elems) == 2
                        and shape.startswith("(") and _tuple_elements(elems[0]) != [elems[0]]):
                    res = elems[-1]
                elif kind == "collective-permute" and len(elems) >= 2:
                    res = elems[1]
                elif kind in ("all-gather", "reduce-scatter", "all-to-all") and len(elems) == 2:
                    res = elems[1]  # (operand, result)
                else:
                    res = shape
            else:
                res = shape
            groups = parse_replica_groups(rest, num_devices)
            pairs = _source_target_pairs(rest) if kind == "collective-permute" else []
            if kind == "collective-permute":
                gsize = 2
            elif groups is not None:
                gsize = groups.shape[1]
            else:
                gsize = num_devices
            op_name = _OP_NAME_RE.search(rest)
            ops.append(CollectiveOp(name, kind, comp, shape_bytes(res), gsize, count, groups, pairs,
                                    op_name.group(1) if op_name else ""))
    return ops


def _dims(shape: str) -> list[int]:
    m = _SHAPE_RE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def dot_flops(text: str, marker: str = "ragged_dot") -> dict[str, float]:
    """Matmul FLOPs per device per step of an optimized module: every ``dot`` counts 2 x its result elements x
    its contracted size, times how often its computation runs (loop trip counts and fusion calls multiplied).
    ``marked``: the part whose op_name matches the regular expression ``marker`` (by default the MoE experts'
    ragged_dot, whatever XLA lowered it to). Custom calls (Pallas kernels such as flash attention, cuBLAS calls) are not counted."""
    mod = parse_module(text)
    mult = mod.multipliers()
    total = marked = 0.0
    for comp, instrs in mod.computations.items():
        count = mult.get(comp, 0.0)
        shapes = {name: shape for name, shape, _op, _rest in instrs}
        for _name, shape, opcode, rest in instrs:
            lhs = _DOT_LHS_RE.match(rest) if opcode == "dot" and count else None
            if lhs is None:
                continue
            lhs_dims = _dims(lhs.group(1) or shapes.get(lhs.group(2), ""))
            contracting = _LHS_CONTRACTING_RE.search(rest)
            k = np.prod([lhs_dims[int(i)] for i in contracting.group(1).split(",") if i]) if contracting else 1
            flops = 2.0 * float(np.prod(_dims(shape))) * float(k) * count
            total += flops
            op_name = _OP_NAME_RE.search(rest)
            marked += flops if op_name and re.search(marker, op_name.group(1)) else 0.0
    return {"total": total, "marked": marked}


def summarize(ops: Sequence[CollectiveOp]) -> dict[str, dict]:
    """Per kind: ops (static count), executions per step, result bytes and wire bytes per device per step."""
    out = {k: {"ops": 0, "executions": 0.0, "result_bytes": 0.0, "wire_bytes": 0.0} for k in KINDS}
    for op in ops:
        d = out[op.kind]
        d["ops"] += 1
        d["executions"] += op.count
        d["result_bytes"] += op.result_bytes * op.count
        d["wire_bytes"] += op.wire_bytes * op.count
    return out


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
            m = re.match(r"dot\(([^)]*)\)", rest) if opcode == "dot" else None
            op_name = _OP_NAME_RE.search(rest) if m and marker else None
            if m is None or (marker and not (op_name and re.search(marker, op_name.group(1)))):
                continue
            names = [x.strip().lstrip("%") for x in m.group(1).split(",")]
            key = " x ".join(shapes.get(x, "?").split("[")[0] for x in names)
            contracting = _LHS_CONTRACTING_RE.search(rest)
            lhs = _dims(shapes.get(names[0], ""))
            k = np.prod([lhs[int(i)] for i in contracting.group(1).split(",") if i]) if contracting and lhs else 1
            entry = out.setdefault(key, {"dots": 0, "flops": 0.0})
            entry["dots"] += 1
            entry["flops"] += 2.0 * float(np.prod(_dims(shape))) * float(k)
    return out


def kernel_calls(text: str) -> dict[str, int]:
    """Pallas kernels in an optimized module (loop bodies counted once): ``triton_calls`` (Pallas Triton custom
    calls: their FLOPs are not among the HLO dots) and ``mosaic_calls`` (Mosaic GPU)."""
    calls = [line for line in text.splitlines() if " custom-call(" in line]
    return {"triton_calls": sum('custom_call_target="__gpu$xla.gpu.triton"' in line for line in calls),
            "mosaic_calls": sum('custom_call_target="mosaic_gpu' in line for line in calls)}
