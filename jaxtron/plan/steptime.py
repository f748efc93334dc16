"""A step-time prediction from the optimized HLO, op by op (``python -m jaxtron.plan``'s ``step_model``).

Unlike the roofline (:mod:`jaxtron.plan.model`, all FLOPs at one ``compute_efficiency`` of the peak), every
executed instruction of the compiled step is timed on its own, times how often it runs (loop trip counts):

* GEMMs (every ``dot``, inside XLA's GEMM fusions or not, and cuBLAS GEMM calls):
  :func:`jaxtron.plan.gemm.gemm_time` from its M, N, K, batch and operand types (FP8 operands at the FP8 peak):
  tile, wave and depth efficiency, or its bytes over HBM when that is longer;
* attention kernels (``model.attention_impl`` cudnn, pallas, mosaic: custom calls whose FLOPs the HLO does not
  carry): the closed-form causal attention FLOPs (forward 2 matmuls over the causal half, the backward 2.5
  times that, the forward again under ``remat=full``) at the kernel's rate measured on an H100
  (``ATTENTION_TFLOPS``, docs/performance.md);
* everything else that runs (fusions without a dot, copies, transposes, reductions, the other custom calls):
  its operands' and result's bytes over HBM bandwidth (``hbm_fraction`` of it);
* collectives: each transfer's link time (:func:`jaxtron.plan.model.collective_timing`), hidden or exposed as
  XLA's schedule places it (:mod:`jaxtron.plan.schedule`: a replay of the scheduled module on a compute and a
  communication stream).

step = the replay's compute-stream time = GEMMs + attention + memory-bound ops + the waits at collectives.
The attention kernels' closed-form time is shared among their calls in the HLO (forward calls their share,
backward calls theirs), so the replay places it where the kernels run.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Optional

import numpy as np

from jaxtron.config import Config, head_dim
from jaxtron.plan import hlo
from jaxtron.plan.gemm import DEFAULTS, GemmModel, default_table, gemm_time, load_table
from jaxtron.plan.schedule import Schedule

# Flash attention forward+backward TFLOP/s (causal half counted, forward + backward = 3.5 x the forward), one
# H100, heads 32 / kv 8 / head_dim 128, batch 2, seq 8192 (docs/performance.md, "Attention kernels"). Mosaic
# has not been timed: it takes the Triton kernel's rate.
ATTENTION_TFLOPS = {"cudnn": 503.5, "pallas": 343.2, "mosaic": 343.2}

_SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_COLLECTIVE = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|send|recv|"
                         r"async-start|async-update|async-done|copy-start|copy-done")
# Pallas GEMM kernels, by the name their pallas_call carries in op_name: the grouped matmul's forward
# (gmm), its dgrad (gmm_t, the experts read transposed), its wgrad (tgmm), and the block-scaled FP8 GEMM
_KERNEL_GEMM = re.compile(r"/(gmm|gmm_t|tgmm|fp8_blockwise_matmul)/pallas_call")


def _dot_dims(rest: str, lhs: list[int], rhs: list[int]) -> tuple[int, int, int, int]:
    get = hlo.dot_dimensions(rest)
    batch = int(np.prod([lhs[i] for i in get["lhs_batch_dims"]])) if lhs else 1
    k = int(np.prod([lhs[i] for i in get["lhs_contracting_dims"]])) if lhs else 1
    m = int(np.prod([d for i, d in enumerate(lhs) if i not in get["lhs_batch_dims"] + get["lhs_contracting_dims"]]))
    n = int(np.prod([d for i, d in enumerate(rhs) if i not in get["rhs_batch_dims"] + get["rhs_contracting_dims"]]))
    return m, n, k, batch


def _callee(mod, rest: str) -> list:
    callee = hlo.CALLEE_RE.search(rest)
    return mod.computations.get(callee.group(2), []) if callee else []


_SLICES = ("dynamic-slice", "slice", "gather")


def _fusion_reads(body: list, sizes: list[float]) -> list[float]:
    """Bytes a fusion reads of each operand: a parameter that the fused computation only slices (a layer's
    weights out of the scan's stacked ones) is read for the slices alone, not whole."""
    params = {}
    for name, _shape, opcode, rest in body:
        m = re.match(r"parameter\((\d+)\)", rest) if opcode == "parameter" else None
        if m:
            params[name] = int(m.group(1))
    users: dict = defaultdict(list)
    for name, shape, opcode, rest in body:
        for position, o in enumerate(hlo.operand_names(rest)):
            users[o].append((name, opcode, shape, position))

    def sliced(name: str, depth: int = 0):
        """Bytes read of ``name`` if every use of it slices it (through bitcasts and reshapes, which are views
        of the same bytes), else None."""
        if not users[name] or depth > 4:
            return None
        total = 0.0
        for user, opcode, shape, position in users[name]:  # a slice's index operands are read whole
            part = hlo.shape_bytes(shape) if opcode in _SLICES and position == 0 else (
                sliced(user, depth + 1) if opcode in ("bitcast", "reshape") else None)
            if part is None:
                return None
            total += part
        return total

    reads = list(sizes)
    for name, i in params.items():
        part = sliced(name) if i < len(reads) else None
        if part is not None:
            reads[i] = part
    return reads


def _moved_bytes(mod, opcode: str, rest: str, shape: str, shapes: dict) -> float:
    """HBM bytes an instruction reads and writes. A dynamic-update-slice writes its update into the buffer in
    place (the layer scan's stacked residuals, or its stacked gradients through a bitcast of the buffer): the
    update's bytes, not the buffer's; a (dynamic-)slice reads only the slice it returns, inside a fusion too."""
    body = _callee(mod, rest) if opcode == "fusion" else []
    sizes = [hlo.shape_bytes(hlo.operand_shape(shapes, o)) for o in hlo.operand_names(rest)]
    if not body:
        if opcode == "dynamic-update-slice" and len(sizes) > 1:
            return 2.0 * sizes[1]
        return 2.0 * hlo.shape_bytes(shape) if opcode in _SLICES else sum(sizes) + hlo.shape_bytes(shape)
    reads = _fusion_reads(body, sizes)
    _n, _s, root, root_rest = body[-1]
    if root in _SLICES:
        return 2.0 * hlo.shape_bytes(shape)
    if root != "dynamic-update-slice":
        return sum(reads) + hlo.shape_bytes(shape)
    body_shapes = {n: sh for n, sh, _op, _r in body}
    buffer, update = (hlo.operand_names(root_rest) + ["", ""])[:2]
    made_by = {n: (op, r) for n, _sh, op, r in body}
    while made_by.get(buffer, ("",))[0] == "bitcast":  # a bitcast of the buffer is the same bytes, updated in place
        buffer = (hlo.operand_names(made_by[buffer][1]) + [""])[0]
    param = re.match(r"parameter\((\d+)\)", made_by[buffer][1] if made_by.get(buffer, ("",))[0] == "parameter" else "")
    if param and int(param.group(1)) < len(reads):
        reads[int(param.group(1))] = 0.0  # the buffer is written in place, not read
    return sum(reads) + hlo.shape_bytes(hlo.operand_shape(body_shapes, update))


def _recomputed(cfg: Config, recompute: Optional[bool]) -> bool:
    return cfg.model.remat == "full" if recompute is None else recompute


def attention_seconds(cfg: Config, num_devices: int, tflops: Optional[float] = None,
                      impl: Optional[str] = None, recompute: Optional[bool] = None) -> float:
    """The attention kernels' time per device per step, when they are custom calls (module doc); ``tflops``
    overrides the measured rate; ``recompute``: whether the backward runs the forward again (None: under
    ``model.remat=full``)."""
    m, impl = cfg.model, impl or cfg.model.attention_impl
    if impl not in ATTENTION_TFLOPS:
        return 0.0
    s = cfg.data.seq_len
    forward = 2 * 2 * s * m.num_heads * head_dim(m) * 0.5 * cfg.train.global_batch_size * s * m.num_layers
    factor = 3.5 + (1.0 if _recomputed(cfg, recompute) else 0.0)
    return forward * factor / num_devices / ((tflops or ATTENTION_TFLOPS[impl]) * 1e12)


def _add(acc: dict, other: dict, factor: float = 1.0) -> None:
    for k, v in other.items():
        if isinstance(v, dict):
            _add(acc.setdefault(k, {}), v, factor)
        elif k == "efficiency" or isinstance(v, str):
            acc[k] = v
        else:
            acc[k] = acc.get(k, 0.0) + factor * v


class _Walk:
    """Sums the executed instructions of a module from its entry: a ``while`` body times its trip count, the
    slowest branch of a ``conditional`` (an SPMD program's branches are what different devices run: the
    pipeline's stages, its bubble ticks), a fusion as one memory-bound op or, if it holds a ``dot``, as its
    GEMMs."""

    def __init__(self, mod, gpu, model: GemmModel):
        self.mod, self.gpu, self.model, self.memo = mod, gpu, model, {}
        self.instr_memo: dict = {}  # the stats walk and the schedule's replay both time every instruction
        self.bw = gpu.hbm_gbps * 1e9 * model.hbm_fraction

    def seconds(self, st: dict) -> float:
        return st.get("gemm_s", 0.0) + st.get("mem_bytes", 0.0) / self.bw

    def dot(self, shape: str, rest: str, shapes: dict) -> dict:
        """A ``dot`` or a cuBLAS GEMM call (whose result comes with a workspace: the first array is the
        product)."""
        gpu, ops, shape = self.gpu, hlo.operand_names(rest), hlo.first_array(shape)
        m, n, k, batch = _dot_dims(rest, *(hlo.shape_dims(hlo.operand_shape(shapes, o)) for o in ops[:2]))
        fp8 = any(hlo.operand_shape(shapes, o).startswith("f8") for o in ops[:2]) and bool(gpu.fp8_peak_tflops)
        moved = sum(hlo.shape_bytes(hlo.operand_shape(shapes, o)) for o in ops[:2]) + hlo.shape_bytes(shape)
        t = gemm_time(m, n, k, batch, gpu.fp8_peak_tflops if fp8 else gpu.peak_tflops, gpu.hbm_gbps, moved,
                      self.model, fp8=fp8)
        key = f"{batch}x{m}x{n}x{k}" + (" fp8" if fp8 else "")
        # batch dimensions: in a dense model only attention run as dots has them (scores and their product
        # with V over batch x heads; a projection's weights have none)
        batched = float(batch > 1)
        return {"gemm_count": 1.0, "gemm_s": t["seconds"], "gemm_flops": 2.0 * batch * m * n * k,
                "batched_gemm_s": batched * t["seconds"], "batched_gemm_flops": batched * 2.0 * batch * m * n * k,
                "fp8_gemm_s": t["seconds"] if fp8 else 0.0, "gemm_memory_bound": float(t["bound"] == "memory"),
                "by_shape": {key: {"count": 1.0, "seconds": t["seconds"], "efficiency": t["efficiency"],
                                 "source": t["source"]}}}

    def kernel(self, shape: str, rest: str, shapes: dict):
        """A Pallas GEMM kernel's stats as a GEMM of its (m, n, k), or None for any other custom call."""
        kind = _KERNEL_GEMM.search(rest)
        if not kind:
            return None
        ops = [hlo.shape_dims(hlo.operand_shape(shapes, o)) for o in hlo.operand_names(rest)]
        out = hlo.shape_dims(shape)
        if kind.group(1) == "fp8_blockwise_matmul":
            m, n, k, fp8 = out[0], out[1], ops[0][-1], True
        elif kind.group(1) == "tgmm":   # [G, K, N] from rows [M, K] and [M, N]: K x N over the M rows
            m, n, k, fp8 = out[1], out[2], ops[1][0], False
        else:                           # [M, N] from rows [M, K] and the experts
            m, n, k, fp8 = out[0], out[1], ops[1][-1], False
        fp8 = fp8 and bool(self.gpu.fp8_peak_tflops)
        moved = (sum(hlo.shape_bytes(hlo.operand_shape(shapes, o)) for o in hlo.operand_names(rest))
                 + hlo.shape_bytes(shape))
        t = gemm_time(m, n, k, 1, self.gpu.fp8_peak_tflops if fp8 else self.gpu.peak_tflops, self.gpu.hbm_gbps,
                      moved, self.model, fp8=fp8)
        key = f"kernel {kind.group(1)} {m}x{n}x{k}"
        return {"gemm_count": 1.0, "gemm_s": t["seconds"], "gemm_flops": 2.0 * m * n * k, "kernel_gemm_flops":
                2.0 * m * n * k, "fp8_gemm_s": t["seconds"] if fp8 else 0.0,
                "gemm_memory_bound": float(t["bound"] == "memory"),
                "by_shape": {key: {"count": 1.0, "seconds": t["seconds"], "efficiency": t["efficiency"],
                                 "source": t["source"]}}}

    def instr(self, shape: str, opcode: str, rest: str, shapes: dict) -> dict:
        """One executed instruction that is neither control flow nor a collective: a dot, a fusion (its GEMMs,
        or one memory-bound op), a Pallas GEMM kernel or a memory-bound op. Compute XLA runs asynchronously
        (``fusion-start``, or ``async-start`` around a computation that is not a collective: newer XLA:GPU
        does so with the layer scan's dynamic-update-slices) is timed where it starts, as if it ran on the
        compute stream; its ``*-done`` is free."""
        key = (shape, rest)  # the operand names in ``rest`` make it one instruction's
        if key not in self.instr_memo:
            if opcode == "async-start":  # the wrapped computation's instructions, launches included
                st = self.comp(dict(hlo.CALLEE_RE.findall(rest)).get("calls", ""))
            elif opcode == "fusion-done":
                st = {}
            else:
                if opcode == "fusion-start":  # ((operands), result, context): the fusion's result
                    shape, opcode = hlo.tuple_element(shape, 1), "fusion"
                # each executed instruction here is one kernel launch (a GEMM fusion, a fused elementwise or
                # reduction kernel, a custom call, an unfused copy or sort)
                launch = {"fusion": "fusions", "custom-call": "custom_calls"}.get(opcode, "other")
                st = {**self._instr(shape, opcode, rest, shapes), "launches": {launch: 1.0}}
            self.instr_memo[key] = st
        return self.instr_memo[key]

    def _instr(self, shape: str, opcode: str, rest: str, shapes: dict) -> dict:
        if opcode == "dot":
            return self.dot(shape, rest, shapes)
        if opcode == "fusion":
            inner = self.comp(dict(hlo.CALLEE_RE.findall(rest)).get("calls", ""), fused=True)
            if inner.get("gemm_count"):
                return inner
            return {"mem_ops": 1.0, "mem_bytes": _moved_bytes(self.mod, opcode, rest, shape, shapes)}
        st: dict = {}
        gemm = self.kernel(shape, rest, shapes) if opcode == "custom-call" else None
        if hlo.is_gemm_call(opcode, rest):
            gemm = self.dot(shape, rest, shapes)
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            _add(st, {"custom_calls": {target.group(1) if target else "?": 1.0}})
            kernel = attention_kernel(rest)
            if kernel:
                _add(st, {"attention_calls": {kernel[0]: 1.0}, "attention_kernels": {" ".join(kernel): 1.0}})
        _add(st, gemm or {"mem_ops": 1.0, "mem_bytes": _moved_bytes(self.mod, opcode, rest, shape, shapes)})
        return st

    def comp(self, name: str, fused: bool = False) -> dict:
        if (name, fused) in self.memo:
            return self.memo[(name, fused)]
        st: dict = {}
        instrs = self.mod.computations.get(name, [])
        shapes = {n: sh for n, sh, _op, _r in instrs}
        for _n, shape, opcode, rest in instrs:
            callees = dict(hlo.CALLEE_RE.findall(rest))
            if fused:   # inside a fusion only its GEMMs count: the fusion's bytes are counted at its call
                if opcode == "fusion":
                    _add(st, self.comp(callees.get("calls", ""), fused=True))
                elif opcode == "dot" or hlo.is_gemm_call(opcode, rest):
                    _add(st, self.dot(shape, rest, shapes))
                continue
            if opcode == "while":
                trip = hlo.while_trip_count(self.mod, name, rest)
                _add(st, self.comp(callees.get("body", "")), trip)
                _add(st, self.comp(callees.get("condition", "")), trip + 1)
            elif opcode == "conditional":
                runs = [self.comp(b) for b in hlo.branch_computations(rest)]
                if runs:
                    _add(st, max(runs, key=self.seconds))
            elif opcode == "call":
                _add(st, self.comp(callees.get("to_apply", callees.get("calls", ""))))
            elif opcode in _SKIP or (_COLLECTIVE.search(opcode) and opcode != "async-start"):
                continue
            else:
                _add(st, self.instr(shape, opcode, rest, shapes))
        self.memo[(name, fused)] = st
        return st


def attention_kernel(rest: str) -> Optional[tuple[str, str]]:
    """('fwd' or 'bwd', kernel name) for a custom call that is an attention kernel (Pallas Triton or Mosaic
    flash attention by its kernel name, cuDNN's fused attention by its target), else None."""
    target = re.search(r'custom_call_target="([^"]*)"', rest)
    if target and target.group(1).startswith("__cudnn$fmha"):
        return ("bwd" if "Backward" in target.group(1) else "fwd"), target.group(1)
    name = re.search(r"flash_attention\w*", rest)
    if not name:
        return None
    return ("bwd" if re.search(r"bwd|dkv|_dq", name.group(0)) else "fwd"), name.group(0)


def attention_call(rest: str) -> Optional[str]:
    """'fwd' or 'bwd' for a custom call that is an attention kernel (:func:`attention_kernel`), else None."""
    kernel = attention_kernel(rest)
    return kernel[0] if kernel else None


def attention_impl_of(text: str) -> Optional[str]:
    """The attention kernel an optimized module calls, from the custom calls :func:`attention_call` recognises:
    'cudnn' (cuDNN's fused attention), 'mosaic' (a Mosaic GPU kernel) or 'pallas' (a Pallas Triton kernel);
    None where attention runs as dots (timed as GEMMs and memory-bound ops)."""
    for instrs in hlo.parse_module(text).computations.values():
        for _n, _s, opcode, rest in instrs:
            if opcode != "custom-call" or not attention_call(rest):
                continue
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            target = target.group(1) if target else ""
            return "cudnn" if target.startswith("__cudnn$fmha") else (
                "mosaic" if target.startswith("mosaic_gpu") else "pallas")
    return None


def ops_time(walk: "_Walk", entry: str) -> dict:
    """GEMM and memory-bound seconds of the executed instructions of an optimized module (module doc)."""
    st, gpu = walk.comp(entry), walk.gpu
    gemm_s = st.get("gemm_s", 0.0)
    gemms = {"count": st.get("gemm_count", 0.0), "seconds": gemm_s, "flops": st.get("gemm_flops", 0.0),
             "memory_bound": st.get("gemm_memory_bound", 0.0), "fp8_seconds": st.get("fp8_gemm_s", 0.0),
             "kernel_flops": st.get("kernel_gemm_flops", 0.0), "batched_seconds": st.get("batched_gemm_s", 0.0),
             "batched_flops": st.get("batched_gemm_flops", 0.0),
             "efficiency": st.get("gemm_flops", 0.0) / max(gemm_s, 1e-30) / (gpu.peak_tflops * 1e12)}
    memory = {"ops": st.get("mem_ops", 0.0), "bytes": st.get("mem_bytes", 0.0),
              "seconds": st.get("mem_bytes", 0.0) / walk.bw}
    top = sorted(st.get("by_shape", {}).items(), key=lambda kv: -kv[1]["seconds"])[:8]
    launches = {k: st.get("launches", {}).get(k, 0.0) for k in ("fusions", "custom_calls", "other")}
    return {"gemm": gemms, "gemm_top_shapes": dict(top), "memory_bound": memory,
            "custom_calls": st.get("custom_calls", {}), "attention_calls": st.get("attention_calls", {}),
            "attention_kernels": st.get("attention_kernels", {}),
            "kernels_per_step": {**launches, "total": sum(launches.values())}}


def attention_per_call(cfg: Config, total_s: float, calls: dict, recompute: Optional[bool] = None) -> dict:
    """Seconds of one attention kernel call by 'fwd'/'bwd': the forward passes' share of ``total_s`` (1, or 2
    when recomputed, :func:`attention_seconds`, of 3.5 or 4.5) over the forward calls, the backward's over the
    backward calls."""
    full = 1.0 if _recomputed(cfg, recompute) else 0.0
    fwd, bwd = calls.get("fwd", 0.0), calls.get("bwd", 0.0)
    if not fwd or not bwd:
        return {k: total_s / (fwd + bwd) for k in ("fwd", "bwd")} if fwd + bwd else {}
    share = (1.0 + full) / (3.5 + full)
    return {"fwd": total_s * share / fwd, "bwd": total_s * (1 - share) / bwd}


def gemm_model(gpu) -> GemmModel:
    """The GPU's GEMM model (jaxtron/plan/gemm.py) with the command line's overrides."""
    model = DEFAULTS.get(gpu.name, GemmModel())
    over = {"peak_fraction": gpu.gemm_peak_fraction, "fp8_peak_fraction": gpu.gemm_fp8_peak_fraction,
            "hbm_fraction": gpu.hbm_fraction}
    table = gpu.gemm_table or default_table(gpu.name)
    if table:
        over.update(table=load_table(table), table_source=table)
    return dataclasses.replace(model, **{k: v for k, v in over.items() if v is not None})


def attention_passes(kernels: dict) -> dict:
    """Forward and backward attention passes per step from the kernels' calls (``attention_kernels``: 'fwd
    NAME' or 'bwd NAME' -> calls): a pass calls each of its kernels once (jaxtron's Pallas backward is a dK/dV
    and a dQ kernel, cuDNN's one call), so a kind's passes are its most called kernel's calls."""
    out = {"fwd": 0.0, "bwd": 0.0}
    for key, n in kernels.items():
        kind = key.split(" ", 1)[0]
        out[kind] = max(out.get(kind, 0.0), n)
    return out


def recomputes_attention(kernels: dict) -> Optional[bool]:
    """Whether a module's attention kernels (``attention_kernels``) run the forward again in the backward:
    twice as many forward passes as backward ones, within rounding (a peeled loop iteration); None without
    backward passes."""
    passes = attention_passes(kernels)
    return passes["fwd"] >= 1.5 * passes["bwd"] if passes["bwd"] else None


def _named_waits(mod, waits: list[dict]) -> list[dict]:
    """The waits with an ``async-start``'s collective named by the kind it wraps (XLA:GPU wraps collectives in
    generic async pairs as well as in their own ``*-start``), not as 'async'."""
    starts = {name: rest for instrs in mod.computations.values() for name, _s, opcode, rest in instrs
              if opcode == "async-start"}
    for w in waits:
        callee = dict(hlo.CALLEE_RE.findall(starts.get(w["instruction"], ""))).get("calls", "")
        kinds = [op for _n, _s, op, _r in mod.computations.get(callee, []) if op in hlo.KINDS]
        if w["collective"] == "async" and kinds:
            w["collective"] = kinds[0]
    return waits


def _timed(cfg: Config, text: str, gpu, num_devices: int, attention_impl: Optional[str]):
    """What :func:`predict` and :func:`latency_costs` time a module with: (GEMM model, module, instruction
    timer, ops' totals, attention kernel, attention seconds per step and per call)."""
    model = gemm_model(gpu)
    mod = hlo.parse_module(text)
    walk = _Walk(mod, gpu, model)
    ops = ops_time(walk, mod.entry)
    impl = attention_impl or cfg.model.attention_impl
    recompute = recomputes_attention(ops["attention_kernels"])
    attention_s = attention_seconds(cfg, num_devices, gpu.attention_tflops, impl, recompute)
    return model, mod, walk, ops, impl, attention_s, attention_per_call(cfg, attention_s, ops["attention_calls"],
                                                                        recompute)


def latency_costs(cfg: Config, text: str, gpu, collective_s: dict, num_devices: int,
                  attention_impl: Optional[str] = None) -> dict:
    """The step model's seconds for each scheduled instruction of the module (``Schedule.instruction_costs``;
    arguments as :func:`predict`'s)."""
    _model, _mod, walk, _ops, _impl, _att, per_call = _timed(cfg, text, gpu, num_devices, attention_impl)
    return Schedule(walk, collective_s, per_call).instruction_costs()


def predict(cfg: Config, text: str, gpu, collective_s: dict, num_devices: int, model_flops_full: float,
            attention_impl: Optional[str] = None) -> dict:
    """The step-time prediction (module doc); ``collective_s``: seconds per execution of each collective, keyed
    by (computation, instruction name); ``attention_impl``: the kernel the cluster runs, when the compile had to
    put another in its place (cuDNN is compiled as Pallas flash attention without cuDNN's libraries): its
    measured rate times the attention calls. Whether attention's forward is recomputed is read from the
    module's calls (:func:`recomputes_attention`: a flash kernel's output is no dot, so ``save_dots`` recomputes
    it, and a module compiled elsewhere runs a remat policy ``cfg`` may not name); ``model.remat`` decides only
    for a module without backward attention calls."""
    model, mod, walk, ops, impl, attention_s, per_call = _timed(cfg, text, gpu, num_devices, attention_impl)
    schedule = Schedule(walk, collective_s, per_call)
    replay = schedule.run(mod.entry)
    # attention time that no call in the HLO carries (a kernel the replay does not recognise) runs serially
    unplaced = 0.0 if per_call else attention_s
    compute = ops["gemm"]["seconds"] + attention_s + ops["memory_bound"]["seconds"]
    step = replay["time"] + unplaced
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {
        "step_time_s": step, "tokens_per_s_per_gpu": tokens / step / num_devices,
        "mfu": model_flops_full / (num_devices * gpu.peak_tflops * 1e12 * step),
        "gemm_s": ops["gemm"]["seconds"], "attention_s": attention_s, "memory_bound_s": ops["memory_bound"]["seconds"],
        "compute_s": compute, "comm_s": replay["comm"], "exposed_comm_s": replay["exposed"],
        "overlapped_comm_s": replay["comm"] - replay["exposed"],
        "longest_waits": _named_waits(mod, schedule.top_waits()),
        "gemm_efficiency": ops["gemm"]["efficiency"], **ops,
        "constants": {**{k: v for k, v in model.__dict__.items() if k != "table"}, "table_points": len(model.table),
                      "attention_impl": impl, "attention_tflops": gpu.attention_tflops or ATTENTION_TFLOPS.get(impl)},
    }
