"""Plan a program jaxtron did not compile: ``python -m jaxtron.plan --hlo FILE``. The optimized XLA:GPU module's
text (``compiled.as_text()``, plain or gzip-compressed) is read and judged by the same analysis as jaxtron's own
train step (:mod:`jaxtron.plan.analysis`): dot FLOPs, collectives, kernels, the roofline and the step model with
XLA's schedule replayed. Nothing is compiled. A ``Config`` describes the program: its model (model FLOPs, the
attention time model), global batch and sequence (tokens per step) and mesh (which axes a replica group spans,
by :meth:`Layout.planned`; logical device i sits on node i // gpus_per_node). Peak memory comes only from the
compile's own memory analysis, when it is given."""

from __future__ import annotations

import gzip
import json
import os
import re
from typing import Optional

import numpy as np

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.plan import steptime
from jaxtron.plan import model as pm
from jaxtron.plan.analysis import analyze
from jaxtron.plan.gpus import GpuSpec
from jaxtron.plan.report import (ANALYSIS_KEYS, PIPELINE_NOTE, USABLE_NOTE, check_moe_gemm, hardware,
                                 layout_overrides, peak_and_fit)

# XLA's CompiledMemoryStats fields (jax's ``compiled.memory_analysis()``) a --memory-json file gives
MEMORY_SIZES = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
NO_MEMORY_NOTE = ("peak memory unknown: no memory analysis of the compile was given (--memory-json: XLA's "
                  "argument, output, alias and temp sizes); the module's text does not say it")


class BadModule(ValueError):
    """A module file (or its memory analysis) that cannot be planned; the message is one line."""


def read_module(path: str) -> str:
    """The text of an optimized HLO module file, ``.txt`` or gzip-compressed (by its content, not its name)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise BadModule(f"--hlo {path}: {err.strerror or err}") from None
    try:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode()
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise BadModule(f"--hlo {path}: not an HLO module's text ({str(err).splitlines()[0][:120]})") from None
    if not re.match(r"\s*HloModule\s", text) or "ENTRY" not in text:
        raise BadModule(f"--hlo {path}: not an HLO module's text (it should begin with 'HloModule' and have an "
                        "ENTRY computation: an optimized module from compiled.as_text())")
    return text


def read_memory(path: str) -> dict:
    """A --memory-json file: XLA's memory-analysis sizes in bytes, e.g. {"argument_size_in_bytes": ..., ...}."""
    try:
        with open(path) as f:
            sizes = json.load(f)
    except OSError as err:
        raise BadModule(f"--memory-json {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise BadModule(f"--memory-json {path}: not JSON ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(sizes, dict):
        raise BadModule(f"--memory-json {path}: expected an object of sizes in bytes ({', '.join(MEMORY_SIZES)})")
    return sizes


def module_devices(text: str) -> int:
    """How many devices the module runs on: its header's partitions x replicas, or more if a replica group or a
    collective-permute names a device beyond them."""
    header = text.split("\n", 1)[0]
    sizes = [int(m.group(1)) if m else 1 for m in (re.search(r"\bnum_partitions=(\d+)", header),
                                                  re.search(r"\breplica_count=(\d+)", header))]
    n = sizes[0] * sizes[1]
    for m in re.finditer(r"replica_groups=(\{\{[\d,{}\s]*\}\}|\[[\d,]+\]<=\[([\d,]+)\]|mesh\[([^\]]*)\])", text):
        if m.group(2):
            n = max(n, int(np.prod([int(x) for x in m.group(2).split(",")])))
        elif m.group(3):
            n = max(n, int(np.prod([int(x) for x in re.findall(r"=\s*(\d+)", m.group(3))])))
        else:
            n = max([n] + [1 + int(x) for x in re.findall(r"\d+", m.group(1))])
    for m in re.finditer(r"source_target_pairs=(\{[\d,{}\s]*\})", text):
        n = max([n] + [1 + int(x) for x in re.findall(r"\d+", m.group(1))])
    return n


def memory_from_sizes(sizes: dict, gpu: GpuSpec) -> dict:
    """Per-device memory from XLA's memory-analysis sizes: the peak and whether it fits. The state's share
    (parameters, optimizer, gradients) is not in them: those keys of :func:`jaxtron.plan.plan`'s memory are
    absent."""
    missing = [k for k in MEMORY_SIZES if not isinstance(sizes.get(k), (int, float))]
    if missing:
        raise BadModule(f"memory analysis: missing or not a number: {', '.join(missing)}")
    arg, out, alias, temp = (float(sizes[k]) for k in MEMORY_SIZES)
    return {"temp": temp, "arguments": arg, "outputs": out, "aliased": alias,
            "generated_code": float(sizes.get("generated_code_size_in_bytes") or 0),
            **peak_and_fit(arg, out, alias, temp, float(sizes.get("peak_memory_in_bytes") or 0), gpu)}


def _attention_note(cfg: Config, impl: str) -> Optional[str]:
    said = cfg.model.attention_impl
    if said == impl:
        return None
    runs = "no attention kernel (attention as dots)" if impl == "xla" else f"{impl} attention kernels"
    return (f"attention: the module calls {runs} where the config says model.attention_impl={said}; the step "
            "model times attention as the module runs it")


def _recompute_note(cfg: Config, kernels: dict) -> Optional[str]:
    """Where the module's attention kernels say the forward is (or is not) recomputed, unlike ``model.remat``."""
    recomputed = steptime.recomputes_attention(kernels)
    if recomputed is None or recomputed == (cfg.model.remat == "full"):
        return None
    passes = steptime.attention_passes(kernels)
    return (f"attention: the module runs {passes['fwd']:.0f} forward and {passes['bwd']:.0f} backward passes per "
            f"step, so its forward is {'' if recomputed else 'not '}recomputed in the backward "
            f"(model.remat={cfg.model.remat} says otherwise); the attention model counts it as the module runs it")


def plan_hlo(cfg: Config, gpu: GpuSpec, num_gpus: int, text: str, memory: Optional[dict] = None,
             source_name: Optional[str] = None, moe_gemm: str = "as_compiled") -> dict:
    """The planner's report on an optimized XLA:GPU module's ``text`` (module doc): the keys of
    :func:`jaxtron.plan.plan` that a module's text gives (``memory`` None without ``memory``: XLA's memory
    analysis sizes, :data:`MEMORY_SIZES`), and ``source`` "hlo" with ``hlo_file`` ``source_name``; ``params``
    are the config's closed form. MoE: ``moe_gemm`` as in :func:`jaxtron.plan.plan`. Raises
    :class:`BadModule` for a module on more devices than ``num_gpus`` (or on fewer, by its header) and
    ``ConfigError`` where ``cfg``'s mesh does not cover ``num_gpus``."""
    devices = module_devices(text)
    if devices != num_gpus:
        raise BadModule(f"the module runs on {devices} device(s) (its num_partitions and replica groups), "
                        f"--num-gpus is {num_gpus}")
    check_moe_gemm(moe_gemm)
    mem = memory_from_sizes(memory, gpu) if memory is not None else None
    layout = Layout.planned(cfg, num_gpus)
    node_of = np.arange(num_gpus) // gpu.gpus_per_node
    impl = steptime.attention_impl_of(text) or "xla"
    a = analyze(cfg, layout, gpu, text, node_of, moe_gemm, impl)
    notes = [f"module read from {source_name or 'text'}, not compiled here: model FLOPs, tokens per step, the "
             "attention model and the mesh axes of its replica groups come from the config given with it "
             f"({layout.describe()}), every other figure from the module; the roofline is the config's closed "
             "form with the module's collectives"]
    notes += [n for n in [_attention_note(cfg, impl), _recompute_note(cfg, a["step_model"]["attention_kernels"])] if n]
    notes += a["notes"] + ([USABLE_NOTE.format(gpu.mem_fraction)] if mem else [NO_MEMORY_NOTE])
    notes += [PIPELINE_NOTE] if cfg.parallel.stage > 1 else []
    return {
        "source": "hlo", "hlo_file": source_name,
        "gpu": gpu.name, "gpu_description": gpu.description, "num_gpus": num_gpus,
        "nodes": max(1, num_gpus // gpu.gpus_per_node), "compiler": "XLA:GPU, compiled elsewhere",
        "compile_s": None, "mesh": dict(layout.sizes), "layout": layout.describe(),
        "overrides": layout_overrides(cfg),
        "micro_batch_size": layout.micro_batch_size, "accumulation_steps": layout.accumulation_steps,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.data.seq_len,
        "attention_impl": impl, "remat": cfg.model.remat,
        "memory": mem,
        "closed_form_memory": pm.closed_form_memory(cfg, layout),
        "params": {"total": pm.param_count(cfg.model), "closed_form": pm.param_count(cfg.model),
                   "active_per_token": pm.param_count(cfg.model, active=True)},
        **{k: a[k] for k in ANALYSIS_KEYS},
        "hardware": hardware(gpu),
        "notes": notes,
    }


def plan_hlo_file(cfg: Config, gpu: GpuSpec, num_gpus: int, path: str, memory_path: Optional[str] = None,
                  moe_gemm: str = "as_compiled") -> dict:
    """:func:`plan_hlo` on a module file (and its memory-analysis JSON)."""
    text = read_module(path)
    memory = read_memory(memory_path) if memory_path else None
    return plan_hlo(cfg, gpu, num_gpus, text, memory, os.path.basename(path), moe_gemm)
