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

import functools
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
CALLEE_RE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                        r"async_execution_thread_computation)=%?([\w.\-]+)")
_LIST_CALLEE_RE = re.compile(r"\b(?:called_computations|branch_computations|calls)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
SCHEDULING_NAME_RE = re.compile(r'scheduling_name="([^"]*)"')
DOT_LHS_RE = re.compile(r"dot\(\s*([a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?\s+)?%?([\w.\-]+(?:#\d+)*)")


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


@functools.lru_cache(maxsize=2)
def parse_module(text: str) -> HloModule:
    """The module's computations and call graph. Cached: the planner reads one compiled module many ways (its
    collectives, dots, kernels, schedule); callers must not modify what it returns."""
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
    if entry is None and comps:
        entry = list(comps)[-1]
    mod = HloModule(comps, entry, {})
    for comp, instrs in comps.items():
        for _name, _shape, opcode, op_rest in instrs:
            trip = while_trip_count(mod, comp, op_rest) if opcode == "while" else 1.0
            for key, callee in CALLEE_RE.findall(op_rest):
                factor = 1.0
                if opcode == "while":
                    factor = trip if key == "body" else trip + 1
                calls[comp].append((callee, factor))
            for lst in _LIST_CALLEE_RE.findall(op_rest):
                for callee in re.findall(r"%?([\w.\-]+)", lst):
                    calls[comp].append((callee, 1.0))
    mod.calls = dict(calls)
    return mod


def _constant(instrs: list, name: str) -> Optional[int]:
    """The integer a scalar instruction holds when it is a constant, through copies and bitcasts."""
    by_name = {n: (op, r) for n, _s, op, r in instrs}
    for _ in range(8):
        if name not in by_name:
            return None
        opcode, rest = by_name[name]
        if opcode == "constant":
            m = re.match(r"constant\((-?\d+)\)", rest)
            return int(m.group(1)) if m else None
        if opcode not in ("copy", "bitcast", "convert"):
            return None
        name = (re.match(r"[\w\-]+\(\s*%?([\w.\-]+)", rest) or [None, None])[1]
    return None


def while_trip_count(mod: HloModule, comp: str, rest: str) -> float:
    """How many times a ``while`` runs its body: XLA's ``known_trip_count`` when it is annotated; otherwise
    (a loop the collective pipeliner peeled loses it) from its condition, ``induction variable < limit`` with the
    limit a constant, and the variable's start from ``known_init_step`` or the init tuple's constant (else 0).
    1 when neither can be read (:func:`unknown_trip_counts` lists those)."""
    known = _TRIP_RE.search(rest)
    if known:
        return float(known.group(1))
    trips = _trip_from_condition(mod, comp, rest)
    return 1.0 if trips is None else trips


def unknown_trip_counts(mod: HloModule) -> list[str]:
    """The ``while`` loops whose trip count neither XLA's annotation nor their condition gives (counted once)."""
    return [name for comp, instrs in mod.computations.items() for name, _s, opcode, rest in instrs
            if opcode == "while" and not _TRIP_RE.search(rest) and _trip_from_condition(mod, comp, rest) is None]


def _trip_from_condition(mod: HloModule, comp: str, rest: str) -> Optional[float]:
    cond = dict(CALLEE_RE.findall(rest)).get("condition", "")
    body = mod.computations.get(cond, [])
    if body and body[-1][2] == "fusion":
        body = mod.computations.get(dict(CALLEE_RE.findall(body[-1][3])).get("calls", ""), [])
    if not body or body[-1][2] != "compare":
        return None
    root = body[-1][3]
    operands = re.findall(r"%([\w.\-]+)", root.split(")", 1)[0])
    direction = re.search(r"direction=(\w+)", root)
    limit = _constant(body, operands[1]) if len(operands) == 2 else None
    if limit is None or not direction or direction.group(1) not in ("LT", "LE"):
        return None
    init_step = re.search(r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"(-?\d+)"\s*,\s*"step"\s*:\s*"(\d+)"', rest)
    if init_step:
        init, step = int(init_step.group(1)), int(init_step.group(2))
    else:
        tup = re.match(r"while\(\s*%?([\w.\-]+)", rest)
        caller = mod.computations.get(comp, [])
        tup_rest = next((r for n, _s, op, r in caller if tup and n == tup.group(1) and op == "tuple"), "")
        first = re.match(r"tuple\(\s*%?([\w.\-]+)", tup_rest)
        init = (_constant(caller, first.group(1)) if first else None) or 0
        step = 1
    span = limit - init + (1 if direction.group(1) == "LE" else 0)
    return float(max(0, -(-span // max(step, 1))))


def branch_computations(rest: str) -> list[str]:
    """A ``conditional``'s branch computations, from its text after the opcode."""
    callees = dict(CALLEE_RE.findall(rest))
    out = [c for lst in _LIST_CALLEE_RE.findall(rest) for c in re.findall(r"%?([\w.\-]+)", lst)]
    return out + [c for k, c in callees.items() if k in ("true_computation", "false_computation")]


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
            op_name = OP_NAME_RE.search(rest)
            ops.append(CollectiveOp(name, kind, comp, shape_bytes(res), gsize, count, groups, pairs,
                                    op_name.group(1) if op_name else ""))
    return ops


def shape_dims(shape: str) -> list[int]:
    m = _SHAPE_RE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def tuple_element(shape: str, index: int) -> str:
    """Element ``index`` of a tuple shape ("" when there is none)."""
    elems = _tuple_elements(shape)
    return elems[index] if index < len(elems) else ""


def operand_shape(shapes: dict, name: str, default: str = "") -> str:
    """The shape of operand ``name`` from a computation's {instruction: shape}: newer XLA prints a tuple's
    element as ``name#i`` instead of a get-tuple-element instruction."""
    if name in shapes:
        return shapes[name]
    base, sep, index = name.rpartition("#")
    if sep and index.isdigit():
        return tuple_element(operand_shape(shapes, base), int(index)) or default
    return default


def first_array(shape: str) -> str:
    """The first array of a shape: a cuBLAS call's result is (result, workspace bytes)."""
    m = _SHAPE_RE.search(shape)
    return m.group(0) if m else ""


def operand_names(rest: str) -> list[str]:
    """The operand names of an instruction's text after its opcode: ``op(a, b, ...)`` (inline shapes dropped)."""
    m = re.match(r"[\w\-$.]+\((.*?)\)(,|$)", rest)
    if not m:
        return []
    return [a.split()[-1].lstrip("%") for a in m.group(1).split(",") if a.strip()]


# cuBLAS GEMMs XLA:GPU calls instead of a dot (in place of a Triton GEMM fusion, e.g. under
# --xla_gpu_enable_triton_gemm=false): their dimension numbers are in the gemm_backend_config
_CUBLAS_GEMM_RE = re.compile(r'custom_call_target="__cublas\$(gemm|lt\$matmul(\$f8)?)"')
_DOT_DIMS = ("lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims")
_DOT_DIM_RES = {key: re.compile(key + r"=\{([\d,]*)\}") for key in _DOT_DIMS}
_GEMM_DIM_RES = {key: re.compile(r'"%s_%s_dimensions":\[([^\]]*)\]' % tuple(key.split("_")[:2]))
                 for key in _DOT_DIMS}


def is_gemm_call(opcode: str, rest: str) -> bool:
    """Whether an instruction is a cuBLAS GEMM custom call (a dot by another name)."""
    return opcode == "custom-call" and bool(_CUBLAS_GEMM_RE.search(rest))


def dot_dimensions(rest: str) -> dict[str, list[int]]:
    """A dot's batch and contracting dimensions (``lhs_batch_dims``, ``lhs_contracting_dims``, ``rhs_...``),
    from a ``dot``'s attributes or a cuBLAS GEMM call's backend config."""
    res = _GEMM_DIM_RES if rest.startswith("custom-call") else _DOT_DIM_RES
    out = {}
    for key, r in res.items():
        m = r.search(rest)
        out[key] = [int(i) for i in re.findall(r"\d+", m.group(1))] if m else []
    return out


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

