#!/usr/bin/env python3
"""jaxtron's train step beside MaxText's, both compiled ahead of time for H100 clusters by the same XLA:GPU and
judged by the same planner step model (issue 38; docs/planner.md).

    python scripts/peer_compare.py --out runs/peer                        # every row (hours on a 2-core CPU)
    python scripts/peer_compare.py --out runs/peer --rows llama3-8b-8 tiny
    python scripts/peer_compare.py --out /tmp/peer --tiny                 # CI: the tiny row, no MaxText env needed

Per row, in DIR/<row>/ (each part cached there; a rerun skips what was made by the same command, jax and jaxtron
code; --force redoes it, --keep-stale reuses plans of other jaxtron code):

1. MaxText's program: ``scripts/peer_compile.py --row <row> --out DIR/<row>`` (maxtext.hlo.txt.gz,
   maxtext.memory.json, maxtext.json: what was compiled) when its outputs are missing;
2. jaxtron's program: ``python -m jaxtron.plan --json`` compiling jaxtron's train step for the same model, global
   batch, micro batch, sequence, bf16 compute with fp32 master weights, layout and recompute -> jaxtron.json;
3. MaxText's module through the same analysis: ``python -m jaxtron.plan --hlo maxtext.hlo.txt.gz --memory-json
   maxtext.memory.json --json`` with the same describing config -> maxtext_plan.json.

Both planner runs use the MaxText environment's Python (``--maxtext-env``, jax 0.12 + its CUDA plugin, jaxtron
from this checkout on PYTHONPATH), so both programs come from the same XLA. The batch, sequence and recompute
come from maxtext.json (what MaxText compiled) where it exists, else from the row's defaults below. ``--tiny``
runs only the tiny row with this Python (CI's jax) and MaxText's committed tiny module
(tests/data/maxtext_tiny_fsdp8_h100.*), compiling nothing of MaxText.

DIR/table.md and DIR/table.json: one line per (row, program) with the step model's step time and tokens/s/GPU,
HLO dot FLOPs over model FLOPs, bytes of memory-bound ops, collective wire bytes by kind, exposed collective
time and the three longest waits (XLA's schedule replayed), kernels per step, peak memory, the published
measured tokens/s/GPU and the prediction's error; per row the jaxtron / MaxText step-time ratio. A row (or a
part of it) that fails is recorded with its one-line error; the other rows still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
PEER_COMPILE = REPO / "scripts" / "peer_compile.py"
DEFAULT_ENV = Path.home() / ".cache" / "jaxtron" / "maxtext-env"
TINY_DATA = REPO / "tests" / "data" / "maxtext_tiny_fsdp8_h100"  # + .hlo.txt.gz, .memory.json, .json
MAXTEXT_FILES = ("maxtext.hlo.txt.gz", "maxtext.memory.json", "maxtext.json")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# MaxText remat_policy -> the jaxtron model.remat that recomputes the same work. minimal_with_context saves every
# projection's output (q, k, v, out, the MLP's wi_0, wi_1, wo) and attention's context; jaxtron's save_dots
# saves every projection's output but recomputes the attention kernel's forward in the backward (its output is
# not a dot): the closest of jaxtron's policies (save_named recomputes the gate and up GEMMs, more FLOPs).
REMAT = {"full": "full", "minimal_with_context": "save_dots", "minimal_flash": "save_dots", "minimal": "save_dots",
         "save_dot_except_mlp": "save_qkv_attention", "none": "none"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One comparison: the jaxtron config and model overrides for MaxText's model, the layout, and the
    defaults for what maxtext.json says once MaxText is compiled (global batch, per-device micro batch, seq,
    MaxText's remat_policy)."""
    num_gpus: int
    config: str
    model: tuple[str, ...]
    layout: tuple[str, ...]
    global_batch: int
    micro_batch: int
    seq_len: int
    maxtext_remat: str
    about: str


DENSE_LAYOUT = ("parallel.data=1", "parallel.tensor=1", "parallel.stage=1", "parallel.sequence_parallel=false")
ROWS = {
    # MaxText's llama3_8b.yml model cut to 2 layers of width 256 (peer_compile's tiny row)
    "tiny": Row(8, "tiny", ("model.num_layers=2", "model.hidden_size=256", "model.num_heads=4",
                            "model.num_kv_heads=4", "model.head_dim=64", "model.intermediate_size=512",
                            "model.vocab_size=1024", "model.rope_theta=500000.0", "model.rms_norm_eps=1e-5",
                            "model.tie_embeddings=false"),
                DENSE_LAYOUT + ("parallel.fsdp=8",), 8, 1, 256, "minimal_with_context",
                "tiny Llama, 8 H100, fsdp 8"),
    "llama3-8b-8": Row(8, "llama3_8b", (), DENSE_LAYOUT + ("parallel.fsdp=8",), 16, 2, 8192,
                       "minimal_with_context", "Llama-3-8B, 8 H100, fsdp 8"),
    # Llama-2-70B has no jaxtron preset: Llama-3-70B's shape with Llama-2's vocabulary and RoPE base (MaxText's
    # models/llama2-70b.yml: vocab 32000, rope_max_timescale 10000 from base.yml; the rest equals llama3-70b)
    "llama2-70b-64": Row(64, "llama3_70b", ("model.vocab_size=32000", "model.rope_theta=10000.0"),
                         DENSE_LAYOUT + ("parallel.fsdp=64",), 128, 2, 4096, "full",
                         "Llama-2-70B, 64 H100, fsdp 64"),
    "llama3-70b-128": Row(128, "llama3_70b", (), DENSE_LAYOUT + ("parallel.fsdp=128",), 256, 2, 8192, "full",
                          "Llama-3-70B, 128 H100, fsdp 8 x 16"),
    # MaxText's mixtral_8x7b.yml runs sparse_matmul without megablox: tokens sorted by expert and
    # jax.lax.ragged_dot, no dropping (its capacity_factor applies to the dense path only), which is jaxtron's
    # dropless dispatch with gmm_impl=ragged_dot (the preset's); moe_overrides() reads maxtext.json's "moe"
    "mixtral-8x7b": Row(64, "mixtral_8x7b", ("model.moe.dispatch=dropless", "model.moe.gmm_impl=ragged_dot"),
                        DENSE_LAYOUT + ("parallel.fsdp=64", "parallel.expert=1"), 128, 2, 4096,
                        "minimal_with_context", "Mixtral-8x7B, 64 H100, fsdp 64"),
}
# what maxtext.json's "model" block must say for the jaxtron config to be the same model
MODEL_KEYS = {"layers": "num_layers", "emb_dim": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
              "head_dim": "head_dim", "vocab": "vocab_size"}


class RowError(RuntimeError):
    """A part of a row failed; the message is one line."""


# ------------------------------------------------------------------------------------------ settings


def settings(name: str, row: Row, maxtext: Optional[dict]) -> dict:
    """What both programs compile: global batch, micro batch per data-parallel replica, seq, remat. From
    MaxText's record where there is one (with accumulation split out), else the row's defaults."""
    s = {"global_batch": row.global_batch, "micro_batch": row.micro_batch, "seq_len": row.seq_len,
         "maxtext_remat": row.maxtext_remat, "from": "row defaults (no maxtext.json)"}
    if maxtext:
        gbs, acc = int(maxtext["global_batch"]), int(maxtext.get("gradient_accumulation_steps") or 1)
        s.update(global_batch=gbs, micro_batch=gbs // (row.num_gpus * acc), seq_len=int(maxtext["seq_len"]),
                 maxtext_remat=str(maxtext["remat_policy"]), moe=maxtext.get("moe"), **{"from": "maxtext.json"})
        if int(maxtext.get("num_gpus", row.num_gpus)) != row.num_gpus:
            raise RowError(f"maxtext.json was compiled for {maxtext['num_gpus']} GPUs, the row has {row.num_gpus}")
    if s["maxtext_remat"] not in REMAT:
        raise RowError(f"MaxText remat_policy {s['maxtext_remat']!r} has no jaxtron counterpart in REMAT")
    s["jaxtron_remat"] = REMAT[s["maxtext_remat"]]
    return s


def moe_overrides(moe: Optional[dict]) -> list[str]:
    """jaxtron's MoE dispatch for how MaxText ran its MoE layers (maxtext.json's "moe"): sparse_matmul sorts
    tokens by expert and runs grouped matmuls without dropping (megablox's Pallas GMM, else
    jax.lax.ragged_dot); otherwise dense einsums over capacity slots (capacity_factor > 0)."""
    if not moe:
        return []
    if moe.get("sparse_matmul"):
        return ["model.moe.dispatch=dropless", f"model.moe.gmm_impl={'pallas' if moe.get('megablox') else 'ragged_dot'}"]
    factor = float(moe.get("capacity_factor") or -1)
    if factor <= 0:
        raise RowError("MaxText's dense MoE path without a capacity factor has no jaxtron counterpart")
    return ["model.moe.dispatch=capacity", f"model.moe.capacity_factor={factor}"]


def describing_args(row: Row, s: dict, extra: list[str]) -> list[str]:
    """The planner arguments that give jaxtron's program, and describe MaxText's module, for one row (the MoE
    dispatch MaxText's record says replaces the row's default)."""
    model = {o.split("=", 1)[0]: o for o in row.model}
    model.update({o.split("=", 1)[0]: o for o in moe_overrides(s.get("moe"))})
    return ["--gpu", "h100", "--num-gpus", str(row.num_gpus), "--config", row.config, *model.values(), *row.layout,
            f"train.global_batch_size={s['global_batch']}", f"train.micro_batch_size={s['micro_batch']}",
            f"data.seq_len={s['seq_len']}", f"model.remat={s['jaxtron_remat']}", "model.attention_impl=cudnn",
            "model.dtype=bfloat16", "model.param_dtype=float32", *extra]


def model_mismatch(row: Row, maxtext: dict, python: str) -> Optional[str]:
    """A one-line difference between MaxText's compiled model (maxtext.json) and the jaxtron config, or None."""
    code = ("import json, sys; from jaxtron import config as c; m = c.load(sys.argv[1], sys.argv[2:]).model; "
            "print(json.dumps({k: getattr(m, k) for k in %r} | {'head_dim': m.head_dim or m.hidden_size // "
            "m.num_heads, 'num_experts': m.moe.num_experts, 'mlp': (m.moe.expert_intermediate_size or "
            "m.intermediate_size) if m.moe.num_experts else m.intermediate_size}))" % (sorted(MODEL_KEYS.values()),))
    r = subprocess.run([python, "-c", code, row.config, *row.model], capture_output=True, text=True,
                       env=planner_env(), timeout=300)
    if r.returncode:
        return f"cannot read the jaxtron config: {last_line(r.stderr)}"
    ours, theirs = json.loads(r.stdout.strip().splitlines()[-1]), maxtext.get("model") or {}
    diff = [f"{k} {theirs[k]} vs {ours[v]}" for k, v in MODEL_KEYS.items() if k in theirs and theirs[k] != ours[v]]
    if "mlp_dim" in theirs and theirs["mlp_dim"] != ours["mlp"]:
        diff.append(f"mlp {theirs['mlp_dim']} vs {ours['mlp']}")
    experts = int(theirs.get("num_experts", 1))
    if (experts if experts > 1 else 0) != ours["num_experts"]:
        diff.append(f"experts {experts} vs {ours['num_experts']}")
    return f"model differs (MaxText vs jaxtron): {', '.join(diff)}" if diff else None


# ---------------------------------------------------------------------------------------- subprocesses


def planner_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # the XLA:GPU compile uses a topology description, no GPU client; cpu keeps libtpu (MaxText's env has it)
    # from probing for TPUs
    env["JAX_PLATFORMS"] = "cpu"
    return env


def last_line(text: str) -> str:
    """The one line that says why a command failed: its last 'error:' line, else its last line."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.startswith(("WARNING: Location", "$ "))]  # "$ ": run_logged's command line
    errors = [ln for ln in lines if ln.startswith(("error:", "peer_compile:")) or "Error:" in ln
              or "Fatal Error" in ln]
    # a process that dies inside XLA may leave no line at all (the planner filters its stderr)
    return (errors or lines or ["no error line: a crash inside XLA? the command is the log's first line"])[-1][:400]


def run_logged(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None) -> str:
    """Run ``cmd``, stderr to ``log``; its stdout, or :class:`RowError` with the one line that says why."""
    t0 = time.time()
    try:
        with open(log, "w") as err:
            err.write("$ " + " ".join(cmd) + "\n")
            err.flush()
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, env=env,
                               cwd=REPO)
    except subprocess.TimeoutExpired:
        raise RowError(f"{Path(cmd[1]).name if cmd[1] != '-m' else cmd[2]} ran past {timeout:.0f} s "
                       f"(log {log})") from None
    if r.returncode:
        raise RowError(f"{last_line(log.read_text())} (exit {r.returncode}, {time.time() - t0:.0f} s; log {log})")
    return r.stdout


def python_versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json, sys; v = {}\n"
            "for p in ('jax', 'jaxlib', 'jax-cuda12-plugin', 'flax'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: v[p] = None\n"
            "v['python'] = '%d.%d.%d' % sys.version_info[:3]; print(json.dumps(v))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise SystemExit(f"error: {python} does not run: {last_line(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def code_fingerprint() -> str:
    """A hash of jaxtron's code (its Python files and GPU descriptions): a plan made by other code is stale."""
    h = hashlib.sha256()
    for f in sorted((REPO / "jaxtron").rglob("*")):
        if f.is_file() and f.suffix in (".py", ".txtpb", ".json") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cached(path: Path, made_by: dict, force: bool, keep_stale: bool,
           newer_than: Optional[Path] = None) -> Optional[dict]:
    """The cached result at ``path`` if it was made by the same command under the same jax and jaxtron code
    (``keep_stale``: whatever the code) and after ``newer_than``."""
    if force or not path.exists():
        return None
    try:
        out = json.loads(path.read_text())
    except ValueError:
        return None
    made = out.get("peer_compare", {})
    keys = ("command", "versions") if keep_stale else ("command", "versions", "code")
    if any(made.get(k) != made_by[k] for k in keys):
        return None
    if newer_than is not None and newer_than.exists() and newer_than.stat().st_mtime > path.stat().st_mtime:
        return None
    return out


def plan_part(path: Path, python: str, argv: list[str], args, versions: dict,
              newer_than: Optional[Path] = None) -> dict:
    """``python -m jaxtron.plan --json <argv>`` -> ``path`` (the report with how it was made), cached."""
    command = ["-m", "jaxtron.plan", "--json", *argv]
    made_by = {"command": command, "versions": versions, "code": args.code}
    hit = cached(path, made_by, args.force, args.keep_stale, newer_than)
    if hit is not None:
        return hit
    path.with_suffix(".error.txt").unlink(missing_ok=True)
    t0 = time.time()
    try:
        out = run_logged([python, *command], path.with_suffix(".log"), args.timeout, planner_env())
        report = json.loads(out.strip().splitlines()[-1])
    except RowError as err:
        path.with_suffix(".error.txt").write_text(str(err) + "\n")
        raise
    except (ValueError, IndexError):
        msg = f"the planner printed no JSON (log {path.with_suffix('.log')})"
        path.with_suffix(".error.txt").write_text(msg + "\n")
        raise RowError(msg) from None
    report["peer_compare"] = {**made_by, "python": python, "wall_s": round(time.time() - t0, 1)}
    path.write_text(json.dumps(report, default=float) + "\n")
    return report


def maxtext_part(name: str, rowdir: Path, args) -> None:
    """MaxText's compiled module in ``rowdir``: the committed tiny one (--tiny), else peer_compile's, run when
    any of its files is missing (or --force)."""
    missing = [f for f in MAXTEXT_FILES if not (rowdir / f).exists()]
    if args.tiny:
        for f, suffix in zip(MAXTEXT_FILES, (".hlo.txt.gz", ".memory.json", ".json")):
            src = args.tiny_data.with_name(args.tiny_data.name + suffix)
            if not src.exists():
                raise RowError(f"MaxText's tiny module is missing: {src}")
            if args.force or f in missing:
                shutil.copyfile(src, rowdir / f)
        return
    if not missing and not args.force:
        return
    err = rowdir / "maxtext_compile.error.txt"
    err.unlink(missing_ok=True)
    try:
        run_logged([sys.executable, str(PEER_COMPILE), "--env", str(args.maxtext_env), "--row", name, "--out",
                    str(rowdir)], rowdir / "maxtext_compile.log", args.timeout)
    except RowError as e:
        err.write_text(str(e) + "\n")
        raise
    missing = [f for f in MAXTEXT_FILES if not (rowdir / f).exists()]
    if missing:
        raise RowError(f"peer_compile wrote no {', '.join(missing)} in {rowdir}")


# ----------------------------------------------------------------------------------------------- a row


def compare_row(name: str, args, python: str, versions: dict) -> dict:
    """Both programs of one row (each part independent: one failing leaves the others' results)."""
    row = ROWS[name]
    rowdir = args.out / name
    rowdir.mkdir(parents=True, exist_ok=True)
    out: dict = {"row": name, "about": row.about, "num_gpus": row.num_gpus, "errors": {}, "notes": []}
    maxtext = None
    try:
        maxtext_part(name, rowdir, args)
        maxtext = json.loads((rowdir / "maxtext.json").read_text())
    except (RowError, OSError, ValueError) as err:
        out["errors"]["maxtext_compile"] = str(err).splitlines()[0]
    try:
        s = settings(name, row, maxtext)
    except RowError as err:  # MaxText's record unusable: jaxtron's program still compiles with the defaults
        out["errors"]["settings"] = str(err)
        s = settings(name, row, None)
    out["settings"] = s
    argv = describing_args(row, s, args.jaxtron_overrides)
    out["jaxtron_args"] = argv
    if maxtext:
        out["maxtext_record"] = {k: maxtext.get(k) for k in ("model_config", "mesh", "ici_parallelism",
                                                            "dcn_parallelism", "per_device_batch_size",
                                                            "global_batch", "seq_len", "remat_policy", "attention",
                                                            "attention_swapped_from", "overrides", "versions",
                                                            "published", "note")}
        mismatch = model_mismatch(row, maxtext, python)
        if mismatch:
            out["notes"].append(mismatch)
        dtypes = (str(maxtext.get("dtype")), str(maxtext.get("weight_dtype")))
        if dtypes != ("bfloat16", "float32"):
            out["notes"].append(f"precision differs: MaxText dtype {dtypes[0]}, weights {dtypes[1]}; jaxtron bfloat16 "
                                "compute, float32 weights")
        if s["maxtext_remat"] != s["jaxtron_remat"]:
            out["notes"].append(f"recompute: MaxText remat_policy={s['maxtext_remat']}, jaxtron "
                                f"model.remat={s['jaxtron_remat']} (scripts/peer_compare.py REMAT says why)")
        mt_jax = (maxtext.get("versions") or {}).get("jax")
        if mt_jax and mt_jax != versions.get("jax"):
            out["notes"].append(f"not the same XLA: MaxText compiled with jax {mt_jax}, jaxtron with jax "
                                f"{versions.get('jax')}")
    hlo = ["--hlo", str(rowdir / "maxtext.hlo.txt.gz"), "--memory-json", str(rowdir / "maxtext.memory.json")]
    for program, path, plan_argv in (("jaxtron", rowdir / "jaxtron.json", argv),
                                     ("maxtext", rowdir / "maxtext_plan.json", hlo + argv)):
        if program == "maxtext" and not maxtext:
            continue
        if program not in args.programs:  # not asked for: an earlier plan, as it is, keeps the table whole
            try:
                out[program] = json.loads(path.read_text())
                out["notes"].append(f"{program}: the plan of an earlier run ({path.name}; --programs)")
            except (OSError, ValueError):
                out["errors"][program] = "not planned (--programs) and no earlier plan"
            continue
        try:
            out[program] = plan_part(path, python, plan_argv, args, versions,
                                     newer_than=rowdir / "maxtext.hlo.txt.gz" if program == "maxtext" else None)
        except RowError as err:
            out["errors"][program] = str(err)
    return out


# --------------------------------------------------------------------------------------------- the table


def _get(d: Optional[dict], *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d or d[k] is None:
            return default
        d = d[k]
    return d


FIGURES = ("jax", "step_time_s", "tokens_per_s_per_gpu", "mfu", "dot_flops_per_device", "model_flops_per_device",
           "dot_over_model_flops", "timed_over_dot_flops", "gemm_s", "attention_s", "memory_bound_s", "memory_bound_bytes",
           "collective_wire_bytes", "comm_s", "exposed_comm_s", "longest_waits", "kernels_per_step", "peak_bytes",
           "fits", "prediction_error")


def program_line(result: dict, program: str) -> dict:
    """The table's figures of one program of a row (None where its plan failed)."""
    r = result.get("jaxtron" if program == "jaxtron" else "maxtext")
    line = {"row": result["row"], "program": program, "num_gpus": result["num_gpus"],
            "error": result["errors"].get(program) or result["errors"].get("row")
            or (result["errors"].get("maxtext_compile") if program == "maxtext" else None)}
    published = _get(result, "maxtext_record", "published", "tokens_per_s_per_gpu")
    line["measured_tokens_per_s_per_gpu"] = published if program == "maxtext" else None
    line["measured_source"] = _get(result, "maxtext_record", "published", "source") if program == "maxtext" else None
    line.update(dict.fromkeys(FIGURES))  # every line has every column; a failed part's stay None
    if r is None:
        return line
    sm, fl, mem = r["step_model"], r["flops"], r.get("memory")
    kernels = sm.get("kernels_per_step")
    dots = fl["matmul_flops_per_device_hlo"]
    line.update({
        "jax": _get(r, "peer_compare", "versions", "jax"),
        "step_time_s": sm["step_time_s"], "tokens_per_s_per_gpu": sm["tokens_per_s_per_gpu"], "mfu": sm["mfu"],
        "dot_flops_per_device": dots, "model_flops_per_device": fl["model_flops_per_device"],
        "dot_over_model_flops": dots / fl["model_flops_per_device"] if fl["model_flops_per_device"] else None,
        # the GEMM FLOPs the step model timed over the HLO's dot FLOPs: 1 when it timed every GEMM it counted
        # (Pallas GEMM kernels are timed but are not dots)
        "timed_over_dot_flops": (sm["gemm"]["flops"] - sm["gemm"].get("kernel_flops", 0.0)) / dots if dots else None,
        "gemm_s": sm["gemm_s"], "attention_s": sm["attention_s"], "memory_bound_s": sm["memory_bound_s"],
        "memory_bound_bytes": sm["memory_bound"]["bytes"],
        "collective_wire_bytes": {k: r["collectives"].get(k, {}).get("wire_bytes", 0.0)
                                  + (r["collectives"].get("ragged-all-to-all", {}).get("wire_bytes", 0.0)
                                     if k == "all-to-all" else 0.0) for k in KINDS},
        "comm_s": sm["comm_s"], "exposed_comm_s": sm["exposed_comm_s"],
        "longest_waits": [{"seconds": w["seconds"], "collective": w["collective"], "op": w["op"]}
                          for w in sm.get("longest_waits", [])[:3]],
        # executed kernels per step (loop bodies x trip count): fusions and custom calls (GEMMs, attention); the
        # step model's count where it gives one, else its GEMM and memory-bound runs
        "kernels_per_step": kernels["fusions"] + kernels["custom_calls"] if kernels
        else sm["gemm"]["count"] + sm["memory_bound"]["ops"],
    })
    if mem:
        # one formula for both programs (XLA's own peak is only in jaxtron's compile): arguments + temp +
        # outputs not aliased to arguments
        line["peak_bytes"] = mem["arguments"] + mem["temp"] + max(0.0, mem["outputs"] - mem["aliased"])
        line["fits"] = line["peak_bytes"] <= mem["usable"]
    if published and program == "maxtext":  # the published figure is MaxText's own measurement
        line["prediction_error"] = sm["tokens_per_s_per_gpu"] / published - 1.0
    return line


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, spec)


def _g(x: float) -> str:
    """Three significant digits, no exponent for the sizes a table row has."""
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _waits(ws: list) -> str:
    """'12.3 ms all-gather (transpose(jvp(bsd,dh->bsh)))': each wait, its collective and the op it serves (the
    last two parts of its op_name)."""
    def served(op: str) -> str:
        return f" ({'/'.join(op.split('/')[-2:])[:48]})" if op else ""
    def secs(x: float) -> str:
        return f"{x:.3g} s" if x >= 1 else f"{_g(x * 1e3)} ms"
    return "; ".join(f"{secs(w['seconds'])} {w['collective']}{served(w['op'])}" for w in ws) or "—"


COLUMNS = ("row", "program", "step s", "tok/s/GPU", "MFU", "dots / model FLOPs", "GEMM FLOPs timed / dots",
           "GEMM + attention + mem-bound s", "mem-bound GB", "AG GB",
           "RS GB", "AR GB", "A2A GB", "CP GB", "comm s", "exposed comm s", "three longest waits",
           "kernels/step", "peak GiB", "measured tok/s/GPU", "error vs measured")


def table_md(lines: list[dict], results: list[dict], header: list[str]) -> str:
    out = header + ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for ln in lines:
        if ln.get("step_time_s") is None:
            cells = [ln["row"], ln["program"]] + ["—"] * (len(COLUMNS) - 4) + [
                _fmt(ln["measured_tokens_per_s_per_gpu"], ",.0f"), "failed: " + (ln["error"] or "no result")]
        else:
            c = ln["collective_wire_bytes"]
            peak = ("—" if ln["peak_bytes"] is None else _g(ln["peak_bytes"] / 2 ** 30)) + ("" if ln["fits"] in (None, True) else " (does not fit)")
            cells = [ln["row"], ln["program"], _g(ln["step_time_s"]), f"{ln['tokens_per_s_per_gpu']:,.0f}",
                     f"{ln['mfu']:.1%}", _fmt(ln["dot_over_model_flops"], ".2f"), _fmt(ln["timed_over_dot_flops"], ".3f"),
                     f"{_g(ln['gemm_s'])} + {_g(ln['attention_s'])} + {_g(ln['memory_bound_s'])}",
                     _g(ln["memory_bound_bytes"] / 1e9), *(_g(c[k] / 1e9) for k in KINDS),
                     _g(ln["comm_s"]), _g(ln["exposed_comm_s"]), _waits(ln["longest_waits"]),
                     f"{ln['kernels_per_step']:,.0f}", peak, _fmt(ln["measured_tokens_per_s_per_gpu"], ",.0f"),
                     _fmt(ln["prediction_error"], "+.0%")]
        out.append("| " + " | ".join(str(x).replace("|", "/") for x in cells) + " |")
    out += ["", "jaxtron / MaxText predicted step time per row:", ""]
    for res in results:
        ratio = res.get("step_time_ratio")
        out.append(f"- {res['row']}: " + (f"{ratio:.3f}" if ratio else "—"))
    out += ["", "Per row: what both programs compiled, the jaxtron arguments, notes and errors:", ""]
    for res in results:
        s = res.get("settings", {})
        out.append(f"- **{res['row']}** ({res['about']}): global batch {s.get('global_batch')} x seq "
                   f"{s.get('seq_len')}, micro batch {s.get('micro_batch')} per replica, MaxText remat "
                   f"{s.get('maxtext_remat')} / jaxtron {s.get('jaxtron_remat')} (settings from {s.get('from')}); "
                   f"jaxtron: `python -m jaxtron.plan {' '.join(res.get('jaxtron_args', []))}`")
        for n in res["notes"]:
            out.append(f"  - note: {n}")
        for part, e in res["errors"].items():
            out.append(f"  - failed ({part}): {e}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------- main


def earlier_rows(args) -> list[dict]:
    """The rows of an earlier table in DIR that this run does not redo, with their plans read back from
    DIR/<row>/ (so their lines are drawn by this version of the table): a run of some rows keeps the others."""
    if args.tiny:  # CI's own table
        return []
    try:
        prev = json.loads((args.out / "table.json").read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    rows = []
    for res in prev:
        if not isinstance(res, dict) or res.get("row") in args.rows or res.get("row") not in ROWS:
            continue
        res = dict(res, errors=res.get("errors", {}), notes=res.get("notes", []))
        for program, name in (("jaxtron", "jaxtron.json"), ("maxtext", "maxtext_plan.json")):
            if program not in res["errors"]:
                try:
                    res[program] = json.loads((args.out / res["row"] / name).read_text())
                except (OSError, ValueError):
                    res["errors"][program] = f"{name} of the earlier run is gone"
                    continue
                stale = f"{program}: {name} was made by other jaxtron code (not redone by this run: --rows)"
                if _get(res[program], "peer_compare", "code") != args.code and stale not in res["notes"]:
                    res["notes"] = res["notes"] + [stale]
        rows.append(res)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results directory (DIR/<row>/, DIR/table.md|json)")
    p.add_argument("--rows", nargs="+", choices=sorted(ROWS), help="rows to run (default: all but tiny)")
    p.add_argument("--tiny", action="store_true", help="the tiny row only, with this Python and the committed "
                                                       "MaxText tiny module (CI; no MaxText env)")
    p.add_argument("--tiny-data", type=Path, default=TINY_DATA, metavar="PREFIX",
                   help="--tiny: MaxText's module as PREFIX.hlo.txt.gz, PREFIX.memory.json, PREFIX.json (default: "
                        "the committed tests/data/maxtext_tiny_fsdp8_h100)")
    p.add_argument("--programs", nargs="+", choices=("jaxtron", "maxtext"), default=["jaxtron", "maxtext"],
                   help="plan only these (default both; MaxText's compile runs for either: it gives the settings)")
    p.add_argument("--force", action="store_true", help="redo every part, cached or not")
    p.add_argument("--keep-stale", action="store_true", help="reuse cached plans made by other jaxtron code (the "
                                                             "same command and jax)")
    p.add_argument("--maxtext-env", type=Path, default=DEFAULT_ENV, help="MaxText's venv (peer_compile's --env)")
    p.add_argument("--python", help="the Python of both planner runs (default: the MaxText env's; --tiny: this "
                                    "one)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per compile or plan (default 7200)")
    p.add_argument("--jaxtron-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more jaxtron overrides for every row, e.g. parallel.collective_pipelining=true")
    args = p.parse_args(argv)
    if args.tiny and args.rows and args.rows != ["tiny"]:
        p.error("--tiny runs the tiny row only")
    args.rows = ["tiny"] if args.tiny else (args.rows or [r for r in ROWS if r != "tiny"])
    for o in args.jaxtron_overrides:
        if "=" not in o:
            p.error(f"jaxtron overrides are key=value, got {o!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out = args.out.resolve()
    args.maxtext_env = args.maxtext_env.expanduser()
    if args.python:
        python = args.python
    elif args.tiny:
        python = sys.executable
    else:
        python = str(args.maxtext_env / "bin" / "python")
        check = subprocess.run([sys.executable, str(PEER_COMPILE), "--env", str(args.maxtext_env), "--check-env"],
                               capture_output=True)
        if check.returncode:
            print(f"error: the MaxText env at {args.maxtext_env} is not usable (scripts/peer_compile.py --check-env): "
                  "run scripts/peer_compile.py --row tiny --out DIR once to build it, or pass --python",
                  file=sys.stderr)
            return 2
    versions = python_versions(python)
    args.code = code_fingerprint()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.rows:
        t0 = time.time()
        print(f"peer_compare: {name} ...", file=sys.stderr, flush=True)
        try:
            res = compare_row(name, args, python, versions)
        except Exception as err:  # noqa: BLE001 - a row's unexpected failure is its one-line error, not the run's
            res = {"row": name, "about": ROWS[name].about, "num_gpus": ROWS[name].num_gpus, "notes": [],
                   "errors": {"row": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}}
        jx, mt = _get(res, "jaxtron", "step_model", "step_time_s"), _get(res, "maxtext", "step_model", "step_time_s")
        res["step_time_ratio"] = jx / mt if jx and mt else None
        results.append(res)
        failed = "; ".join(f"{k}: {v}" for k, v in res["errors"].items())
        print(f"peer_compare: {name} done in {time.time() - t0:.0f} s" + (f" (failed: {failed})" if failed else ""),
              file=sys.stderr, flush=True)
    status = 0 if all(not r["errors"] for r in results) else 1  # of the rows this run was asked for
    order = list(ROWS)
    results = sorted(earlier_rows(args) + results, key=lambda r: order.index(r["row"]))
    lines = [program_line(res, p) for res in results for p in ("jaxtron", "maxtext")]
    header = [f"# jaxtron vs MaxText train steps, compiled for H100 by XLA:GPU (jax {versions.get('jax')}, Python "
              f"{versions.get('python')}), judged by jaxtron's step model",
              "",
              "Predicted figures per GPU per step (python -m jaxtron.plan; --hlo for MaxText's module). Collective "
              "bytes are wire bytes; waits are XLA's schedule replayed; kernels count fusions and custom calls run "
              "per step (loop trip counts applied); peak = arguments + temp + unaliased outputs of XLA's memory "
              "analysis; dots / model FLOPs: HLO dot FLOPs (cuBLAS GEMM calls included; attention kernels' matmuls "
              "are not dots) over Megatron's model FLOPs with full attention; GEMM FLOPs timed / dots: the share of "
              "those FLOPs the step model timed as GEMMs (1.000 when it read every GEMM's shape)."]
    table = {"versions": versions, "python": python, "lines": lines,
             "rows": [{k: v for k, v in res.items() if k not in ("jaxtron", "maxtext")} for res in results]}
    (args.out / "table.json").write_text(json.dumps(table, indent=1, default=float) + "\n")
    (args.out / "table.md").write_text(table_md(table["lines"], results, header))
    print((args.out / "table.md").read_text())
    return status


if __name__ == "__main__":
    sys.exit(main())
