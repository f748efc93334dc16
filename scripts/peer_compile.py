#!/usr/bin/env python3
"""Compile MaxText's own GPU train step for an H100 cluster ahead of time, on a machine with no GPU.

The result is the peer program jaxtron's planner is compared against: MaxText's optimized XLA:GPU module
(sm_90a) for N H100s, its memory analysis, and what was compiled (layout, batch, remat, attention).

    python scripts/peer_compile.py --row llama3-8b-8 --out runs/peer/llama3-8b-8
    python scripts/peer_compile.py --model gpu/models/llama3_8b.yml --num-gpus 16 --out DIR ici_fsdp_parallelism=8 ...
    python scripts/peer_compile.py --check-env          # exit 0 when the pinned MaxText env is usable, 1 if not
    python scripts/peer_compile.py --list-rows

Run it with any python: MaxText 0.2.5 needs Python >= 3.12 and its own jax, so the script (re)creates a
pinned virtual environment (default ~/.cache/jaxtron/maxtext-env) and re-executes itself inside it.

How the compile works (checked recipe in /work/shared/notes/toolchain-facts.md): the CUDA PJRT plugin
describes a topology of H100s without any GPU present (jax.experimental.topologies.get_topology_desc with
the H100 target config in jaxtron/plan/gpus/h100.txtpb). MaxText's train_compile builds its GPU mesh from
jax.devices() (the CPU here), so only its topology-mesh builder is replaced; everything else is
MaxText's own code (config, model, optimizer, train_step, shardings), compiled with the XLA flags of MaxText's
own GPU run scripts. What differs from a run on H100s, and why:
  - attention: the GPU configs' cudnn_flash_te (TransformerEngine) cannot be traced without TE and a GPU;
    cudnn_flash_jax, the same cuDNN fused attention through JAX's own custom call, replaces it;
  - multi-host: XLA's Triton one-shot all-reduce kernel is turned off (XLA crashes lowering it across hosts);
  - sorts (MoE routing) use XLA's sort kernel, not CUB (CUB's scratch size is asked of a device).
The env therefore also carries the cuDNN wheel: JAX checks cuDNN's version while tracing its attention.

Outputs in --out: maxtext.hlo.txt.gz (the after-optimizations module of jit_train_step), maxtext.memory.json
(compiled.memory_analysis()), maxtext.json (what was compiled, how long it took, the published figure).
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
H100_TARGET_CONFIG = REPO / "jaxtron" / "plan" / "gpus" / "h100.txtpb"
DEFAULT_ENV = Path.home() / ".cache" / "jaxtron" / "maxtext-env"
MAXTEXT_PIN = "0.2.5"
# JAX's cuDNN attention checks the cuDNN version while tracing (it dlopens libcudnn), so the env carries
# the cuDNN wheel the CUDA plugin asks for; nothing else of CUDA is needed to compile without a GPU.
CUDNN_SPEC = "nvidia-cudnn-cu12>=9.10.2.21,<10"
ENV_RECORD = "peer_compile_env.json"  # written into the env: the versions it was made with
# Set in the re-executed child so a broken env can never loop back into another re-exec.
IN_ENV_MARK = "JAXTRON_PEER_COMPILE_IN_ENV"
GPUS_PER_HOST = 8  # MaxText's "a3" compile topology: 8 H100 per host
H100_HBM_BYTES = 80 * 2**30  # H100 SXM 80GB; a step needing more would fail to allocate on the device

# MaxText's GPU configs ask for TransformerEngine's cuDNN attention (cudnn_flash_te), which needs TE and
# a GPU at trace time. cudnn_flash_jax is the same cuDNN fused kernel reached through JAX's own SDPA
# custom call, so it is the closest swap; see ATTENTION_NOTE in maxtext.json for what compiled.
DEFAULT_ATTENTION = "cudnn_flash_jax"

# Rows: MaxText's published GPU layouts. `overrides` are MaxText key=value settings applied on top of the
# model config; a figure is tokens/s/GPU as published, with where it was published.
NGC = "https://catalog.ngc.nvidia.com/orgs/nvidia/teams/dgxc-benchmarking/resources/"
ROWS = {
    "tiny": {
        "config": "gpu/models/llama3_8b.yml",
        "num_gpus": 8,
        "overrides": [
            "override_model_config=True", "base_num_decoder_layers=2", "base_emb_dim=256",
            "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=512",
            "vocab_size=1024", "max_target_length=256", "per_device_batch_size=1",
            "ici_fsdp_parallelism=8",
        ],
        "about": "tiny Llama (2 layers, emb 256, 4 heads, vocab 1024, seq 256) on MaxText's llama3_8b GPU config",
        "published": None,
    },
    "llama3-8b-8": {
        "config": "gpu/models/llama3_8b.yml",
        "num_gpus": 8,
        # llama3_8b.yml: seq 8192, remat minimal_with_context, cudnn attention. Its batch of 12 per GPU
        # compiles to 363 GiB of temporaries per GPU at FSDP 8 (about 30 GiB per sequence), so it cannot run
        # on 80 GB H100s; 2 is the largest batch that fits, the one setting changed.
        "overrides": ["ici_fsdp_parallelism=8", "per_device_batch_size=2"],
        "about": "Llama-3-8B on llama3_8b.yml, one 8-GPU host, ICI FSDP 8, seq 8192, batch 2/GPU (the yml's 12 "
                 "needs 374 GiB/GPU)",
        "published": None,
    },
    "llama2-70b-64": {
        "config": "gpu/models/llama2_70b.yml",
        "num_gpus": 64,
        # NVIDIA's DGXC MaxText recipe: FSDP 64 (8 per host x 8 hosts), micro batch 2, GBS 128, seq 4096
        # (llama2_70b.yml itself says per_device_batch_size 6; the published figure is for 2).
        "overrides": ["ici_fsdp_parallelism=8", "dcn_fsdp_parallelism=8", "dcn_data_parallelism=1",
                      "per_device_batch_size=2", "max_target_length=4096"],
        "about": "Llama-2-70B, FSDP 64 = ICI 8 x DCN 8, micro batch 2, GBS 128, seq 4096 (DGXC recipe layout)",
        "published": {
            "tokens_per_s_per_gpu": 1170,
            "precision": "bf16",
            "source": NGC + "maxtext-llama2-70b-dgxc-benchmarking-c (Maxtext Llama2 70B 25.01.1, "
                      "table 'Throughput on 64x H100 GPUs (FSDP=64 GBS=128)'; its sample log line reads "
                      "1035.97 Tokens/s/device at 7.908 s/step)",
        },
    },
    "llama3-70b-128": {
        "config": "gpu/models/llama3_70b.yml",
        "num_gpus": 128,
        "overrides": ["ici_fsdp_parallelism=8", "dcn_fsdp_parallelism=16", "dcn_data_parallelism=1",
                      "per_device_batch_size=2", "max_target_length=8192"],
        "about": "Llama-3-70B, ICI FSDP 8 x DCN FSDP 16, micro batch 2, GBS 256, seq 8192 (DGXC recipe layout)",
        "published": {
            "tokens_per_s_per_gpu": 1052,
            "precision": "bf16",
            "source": NGC + "maxtext-llama3-70b-dgxc-benchmarking-d (Maxtext Llama3 70B 25.02: 'completed "
                      "step: 49, seconds: 15.570, TFLOP/s/device: 506.597, Tokens/s/device: 1052.266'; "
                      "layout table in ...-g: 128 GPUs, seq 8192, dcn_FSDP 16, ici_FSDP 8, MBS 2, GBS 256)",
        },
    },
    "mixtral-8x7b": {
        "config": "gpu/models/mixtral_8x7b.yml",
        "num_gpus": 64,
        # mixtral_8x7b.yml (seq 4096, dropping MoE with capacity 1.0, remat minimal_with_context) on 8 hosts
        # with the ICI 8 x DCN FSDP layout MaxText's multi-host GPU scripts use. Two settings changed to fit
        # 80 GB: the yml's unscanned layers need 136 GiB of temporaries per GPU even at batch 1 (the 32
        # layers' gathered expert weights stay live from forward to backward), so layers are scanned; scanned,
        # each sequence costs ~21 GiB, so the batch is 2 per GPU instead of the yml's 12.
        "overrides": ["ici_fsdp_parallelism=8", "dcn_fsdp_parallelism=8", "dcn_data_parallelism=1",
                      "scan_layers=true", "per_device_batch_size=2"],
        "about": "Mixtral-8x7B on mixtral_8x7b.yml, FSDP 64 = ICI 8 x DCN 8, seq 4096, batch 2/GPU and scanned "
                 "layers (the yml's batch 12 and unscanned layers do not fit 80 GB); no published GPU figure",
        "published": None,
    },
}

# MaxText's own XLA flags for its GPU runs live in shell scripts shipped with the package; the compile
# uses the same flags so the optimized module is the one those runs executed.
XLA_FLAGS_SCRIPT_ONE_HOST = "configs/gpu/a3/llama_2_7b/1vm.sh"
XLA_FLAGS_SCRIPT_MULTI_HOST = "configs/gpu/a3/llama_3.1_405b/128vm.sh"


class EnvError(RuntimeError):
    """The pinned MaxText environment cannot be made or used."""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", type=Path, default=DEFAULT_ENV, help="the pinned MaxText virtual environment")
    p.add_argument("--check-env", action="store_true", help="exit 0 if the env is usable, 1 if not; quiet")
    p.add_argument("--list-rows", action="store_true", help="print the named rows and exit")
    p.add_argument("--row", choices=sorted(ROWS), help="a named MaxText layout (see --list-rows)")
    p.add_argument("--model", help="a MaxText config: a path, or one relative to the package's configs/ "
                                   "(gpu/models/llama3_8b.yml), or a bare GPU model name (llama3_8b)")
    p.add_argument("--num-gpus", type=int, help="H100s to compile for (a multiple of 8: hosts of 8)")
    p.add_argument("--out", type=Path, help="directory for maxtext.hlo.txt.gz, maxtext.memory.json, maxtext.json")
    p.add_argument("--attention", default=DEFAULT_ATTENTION,
                   help=f"what replaces cudnn_flash_te (default {DEFAULT_ATTENTION}); 'keep' leaves the config's")
    p.add_argument("--xla-flags", default=None,
                   help="XLA flags for the compile (default: MaxText's own a3 GPU flags from its scripts)")
    p.add_argument("--extra-xla-flags", default="", help="XLA flags added after the default or --xla-flags ones")
    p.add_argument("--traceback", action="store_true", help="show MaxText's whole trace when the compile fails")
    p.add_argument("--note", default="", help="free text recorded in maxtext.json (e.g. what was reduced)")
    p.add_argument("overrides", nargs="*", help="MaxText key=value settings, applied after the row's")
    args = p.parse_args(argv)
    if args.check_env or args.list_rows:
        return args
    if bool(args.row) == bool(args.model):
        p.error("give exactly one of --row NAME or --model CONFIG")
    if args.model and not args.num_gpus:
        p.error("--model needs --num-gpus")
    if args.out is None:
        p.error("--out DIR is required")
    for o in args.overrides:
        if "=" not in o:
            p.error(f"MaxText settings are key=value, got {o!r}")
    return args


# ----------------------------------------------------------------------------------------- environment


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


_VERSION_PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "out = {'python': '%d.%d.%d' % sys.version_info[:3]}\n"
    "for p in ('maxtext', 'jax', 'jaxlib', 'jax-cuda12-plugin', 'jax-cuda12-pjrt', 'nvidia-cudnn-cu12', 'flax'):\n"
    "    try: out[p] = m.version(p)\n"
    "    except m.PackageNotFoundError: out[p] = None\n"
    "print(json.dumps(out))\n"
)


def env_versions(env: Path) -> dict | None:
    """Installed versions in the env (from package metadata, without importing jax), or None."""
    py = env_python(env)
    if not py.exists():
        return None
    try:
        r = subprocess.run([str(py), "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def env_problem(versions: dict | None) -> str | None:
    """Why the env is not usable, or None when it is."""
    if versions is None:
        return "no working python in the env"
    if versions.get("maxtext") != MAXTEXT_PIN:
        return f"maxtext is {versions.get('maxtext')}, not {MAXTEXT_PIN}"
    if not versions.get("jaxlib"):
        return "jaxlib is missing"
    for plugin in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        v = versions.get(plugin)
        if v != versions["jaxlib"]:  # jaxlib 0.12.0.1 refuses to load plugin 0.12.0
            return f"{plugin} is {v}, not matching jaxlib {versions['jaxlib']}"
    if not versions.get("nvidia-cudnn-cu12"):
        return "nvidia-cudnn-cu12 is missing"
    return None


def find_python312() -> str | None:
    """A Python >= 3.12 interpreter to build the env with (MaxText 0.2.5 needs it)."""
    if sys.version_info >= (3, 12):
        return sys.executable
    if shutil.which("pyenv"):
        for v in ("3.12.1", "3.12", "3.13"):
            r = subprocess.run(["pyenv", "which", "python"], capture_output=True, text=True,
                               env={**os.environ, "PYENV_VERSION": v})
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
    for name in ("python3.12", "python3.13"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _run_logged(cmd, log):
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise EnvError(f"`{' '.join(cmd[-3:])}` failed (exit {r.returncode}); see {log.name}")


def ensure_env(env: Path) -> dict:
    """Make env usable (creating or repairing it) and return its versions; raises EnvError."""
    versions = env_versions(env)
    if env_problem(versions) is None:
        if not (env / ENV_RECORD).exists():
            (env / ENV_RECORD).write_text(json.dumps(versions, indent=1) + "\n")
        return versions
    log_path = env.parent / (env.name + ".install.log")
    env.parent.mkdir(parents=True, exist_ok=True)
    print(f"peer_compile: preparing the MaxText env at {env} (several minutes; log {log_path})", file=sys.stderr)
    with open(log_path, "a") as log:
        if versions is None:
            base = find_python312()
            if base is None:
                raise EnvError("no Python >= 3.12 found (pyenv or python3.12) to build the MaxText env")
            _run_logged([base, "-m", "venv", str(env)], log)
        pip = [str(env_python(env)), "-m", "pip", "install", "-q"]
        _run_logged(pip + [f"maxtext[tpu]=={MAXTEXT_PIN}"], log)
        versions = env_versions(env)
        if not versions or not versions.get("jaxlib"):
            raise EnvError(f"maxtext installed but jaxlib is missing in {env}")
        # --no-deps: the plugin's own dependencies would pull CUDA wheels (GBs) that a compile without a
        # GPU does not use; the PJRT plugin alone describes the H100 topology and runs XLA:GPU's compiler.
        # jaxlib's exact version: jaxlib refuses a plugin of another (0.12.0 under jaxlib 0.12.0.1)
        want = versions["jaxlib"]
        _run_logged(pip + ["--no-deps", f"jax-cuda12-plugin=={want}", f"jax-cuda12-pjrt=={want}"], log)
        _run_logged(pip + ["--no-deps", CUDNN_SPEC], log)
    versions = env_versions(env)
    problem = env_problem(versions)
    if problem:
        raise EnvError(f"the env at {env} is still unusable after installing: {problem}")
    (env / ENV_RECORD).write_text(json.dumps(versions, indent=1) + "\n")
    return versions


def inside(env: Path) -> bool:
    try:
        return Path(sys.prefix).resolve() == env.resolve()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- compile


def maxtext_dir() -> Path:
    import maxtext  # noqa: PLC0415 (only importable inside the env)

    return Path(maxtext.__file__).resolve().parent


def resolve_config(model: str) -> Path:
    configs = maxtext_dir() / "configs"
    for cand in (Path(model), configs / model, configs / "gpu" / "models" / f"{model}.yml"):
        if cand.is_file():
            return cand.resolve()
    raise SystemExit(f"peer_compile: no MaxText config {model!r} (looked in {configs})")


def maxtext_xla_flags(num_hosts: int) -> tuple[str, str]:
    """MaxText's XLA flags for GPU runs, read from the run script it ships (without its dump flag)."""
    rel = XLA_FLAGS_SCRIPT_ONE_HOST if num_hosts == 1 else XLA_FLAGS_SCRIPT_MULTI_HOST
    text = (maxtext_dir() / rel).read_text()
    m = re.search(r'export XLA_FLAGS="([^"]*)"', text)
    if not m:
        raise SystemExit(f"peer_compile: found no XLA_FLAGS in MaxText's {rel}")
    flags = []
    for f in m.group(1).split():
        if f.startswith("--xla_dump_to"):
            continue
        flags.append(f.replace("=''", "="))  # a shell-quoted empty value; XLA wants it bare
    return " ".join(flags), rel


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_summary(text: str) -> dict:
    """What the optimized module calls out to and which collectives it runs (instruction counts per name;
    an async pair counts once, at its -start)."""
    targets: dict[str, int] = {}
    for t in re.findall(r'custom_call_target="([^"]+)"', text):
        targets[t] = targets.get(t, 0) + 1
    collectives: dict[str, int] = {}
    for op in re.findall(r"[\s}](%s)(?:-start)?\(" % "|".join(COLLECTIVES), text):
        collectives[op] = collectives.get(op, 0) + 1
    fusion_kinds: dict[str, int] = {}
    for k in re.findall(r'"kind":"([^"]+)"', text):
        fusion_kinds[k] = fusion_kinds.get(k, 0) + 1
    return {"custom_call_targets": dict(sorted(targets.items())), "collectives": dict(sorted(collectives.items())),
            "fusion_kinds": dict(sorted(fusion_kinds.items()))}


def attention_kernels(text: str) -> list[str]:
    """Custom-call targets that attention compiled to (cuDNN fused attention, Triton or Mosaic kernels),
    found by the target name or by the attention op in the instruction's metadata."""
    names = set()
    for line in text.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if not m:
            continue
        target = m.group(1)
        if "fmha" in target or re.search(r'op_name="[^"]*(attention|attn|flash)', line, re.I):
            names.add(target)
    return sorted(names)


def compile_in_env(args, versions: dict) -> int:
    """Runs inside the MaxText env: compile, then write the three outputs."""
    row = ROWS.get(args.row) if args.row else None
    num_gpus = args.num_gpus or row["num_gpus"]
    if num_gpus % GPUS_PER_HOST:
        raise SystemExit(f"peer_compile: --num-gpus {num_gpus} is not a whole number of 8-GPU hosts")
    hosts = num_gpus // GPUS_PER_HOST
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peer_compile_"))
    atexit.register(shutil.rmtree, work, True)  # the full XLA dump is large; only the train step is kept
    dump = work / "xla_dump"

    # Before jax is imported: the topology is a GPU one, described by the CUDA plugin with no GPU present.
    os.environ.pop("JAX_PLATFORMS", None)
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.xla_flags is None:
        flags, flags_source = maxtext_xla_flags(hosts)
    else:
        flags, flags_source = args.xla_flags, "--xla-flags"
    if hosts > 1:
        # XLA 0.12 crashes lowering its Triton one-shot all-reduce kernel for a group that spans hosts
        # ("size mismatch when packing elements for LLVM struct" on a scalar all-reduce over 64 GPUs); that
        # kernel is an NVLink-only path, so a real multi-host run uses NCCL there anyway.
        flags = f"{flags} --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"
    if args.extra_xla_flags:
        flags = f"{flags} {args.extra_xla_flags}"
        flags_source += " + --extra-xla-flags"
    # shard_autotuning off as MaxText's own GPU AOT path does (it can hang an ahead-of-time compile).
    # Large sorts (MoE routing) would become CUB radix sorts, whose scratch size XLA asks the device for
    # (cudaErrorInvalidDevice without one, even with --xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_WITH_FALLBACK):
    # they compile to XLA's own sort kernel instead. Dense models have no sort; this changes nothing there.
    flags += " --xla_gpu_shard_autotuning=false --xla_gpu_enable_cub_radix_sort=false"
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_train_step"

    import jax  # noqa: PLC0415
    from jax.experimental import mesh_utils, topologies  # noqa: PLC0415
    from jax.sharding import AxisType, Mesh  # noqa: PLC0415
    from maxtext.common.common_types import ShardMode  # noqa: PLC0415
    from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415
    from maxtext.utils import maxtext_utils  # noqa: PLC0415

    config_path = resolve_config(row["config"] if row else args.model)
    config_text = config_path.read_text()
    configured_attention = (re.search(r'^attention:\s*"?([\w]+)"?', config_text, re.M) or [None, None])[1]
    overrides = list(row["overrides"] if row else []) + list(args.overrides)
    user_attention = [o.split("=", 1)[1] for o in overrides if o.startswith("attention=")]
    if user_attention:
        attention = user_attention[-1]
        swapped = configured_attention if configured_attention != attention else None
    elif args.attention != "keep" and configured_attention == "cudnn_flash_te":
        attention, swapped = args.attention, "cudnn_flash_te"
        overrides.append(f"attention={attention}")
    else:
        attention, swapped = configured_attention or "autoselected", None
    argv = ["peer_compile", str(config_path), "compile_topology=a3", f"compile_topology_num_slices={hosts}",
            f"run_name=peer_{args.row or 'model'}", f"base_output_directory={work / 'out'}",
            # no persistent compilation cache: a deviceless compile cannot load its entries back anyway
            "enable_checkpointing=false", "jax_cache_dir=", *overrides]

    seen: dict = {}
    target = H100_TARGET_CONFIG.read_text()

    def h100_topology_mesh(config):
        """MaxText's mesh over H100 devices described by the CUDA plugin (MaxText uses jax.devices())."""
        devices = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{GPUS_PER_HOST}", target_config=target).devices
        jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
        # MaxText splits DCN axes by device.slice_index; topology devices all report slice 0, and a GPU
        # "slice" in MaxText's a3 topology is one host, so group by process instead.
        hybrid = mesh_utils.create_hybrid_device_mesh
        mesh_utils.create_hybrid_device_mesh = lambda *a, **k: hybrid(*a, **{**k, "process_is_granule": True})
        try:
            device_mesh = maxtext_utils.create_device_mesh(config, devices)
        finally:
            mesh_utils.create_hybrid_device_mesh = hybrid
        axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
        mesh = Mesh(device_mesh, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))
        seen["config"], seen["mesh"] = config, mesh
        return mesh

    compile_step = train_compile.jit_and_compile

    def timed_compile(*a, **k):
        t0 = time.perf_counter()
        compiled = compile_step(*a, **k)
        seen["compile_s"] = time.perf_counter() - t0
        seen["compiled"] = compiled
        return compiled

    if attention == "flash":
        # MaxText's GPU "flash" is tokamax's Pallas-Triton kernel, which refuses to trace unless the default
        # device is a GPU; tokamax's own cross-compile switch lifts that check for ahead-of-time compiles.
        from absl import flags as absl_flags  # noqa: PLC0415
        import tokamax  # noqa: F401, PLC0415 (defines the flag)

        absl_flags.FLAGS(["peer_compile", "--tokamax_cross_compile"], known_only=True)
    train_compile.get_topology_mesh = h100_topology_mesh
    train_compile.jit_and_compile = timed_compile
    t_start = time.perf_counter()
    print(f"peer_compile: compiling {config_path.name} for {num_gpus} H100 ({hosts} hosts), attention={attention}",
          file=sys.stderr, flush=True)
    try:
        train_compile.main(argv)
    except Exception as e:  # noqa: BLE001 (MaxText's config checks and XLA errors: report them in one line)
        if args.traceback:
            raise
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = " / ".join(lines[:2])  # pydantic puts the failed check on the second line
        print(f"peer_compile: MaxText's compile failed: {type(e).__name__}: {detail[:400]} "
              "(--traceback for the whole trace)", file=sys.stderr)
        return 1
    total_s = time.perf_counter() - t_start
    if "compiled" not in seen:
        raise SystemExit("peer_compile: MaxText's train_compile returned without compiling the train step")

    dumps = sorted(dump.glob("*jit_train_step*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not dumps:
        raise SystemExit(f"peer_compile: XLA wrote no jit_train_step after-optimizations module in {dump}")
    hlo_text = dumps[-1].read_text()
    with gzip.open(out / "maxtext.hlo.txt.gz", "wt", compresslevel=9) as f:
        f.write(hlo_text)

    mem = seen["compiled"].memory_analysis()
    memory = {k: int(getattr(mem, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
        "generated_code_size_in_bytes")}
    (out / "maxtext.memory.json").write_text(json.dumps(memory, indent=1) + "\n")
    # What the step holds at its peak on one GPU: inputs, outputs not aliased onto inputs, and XLA's temps.
    hbm = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"]
           + memory["temp_size_in_bytes"])

    import resource  # noqa: PLC0415

    cfg, mesh = seen["config"], seen["mesh"]
    mesh_shape = {a: int(s) for a, s in zip(mesh.axis_names, mesh.devices.shape) if s > 1}
    ici = {a: int(s) for a, s in zip(cfg.mesh_axes, cfg.ici_parallelism) if s not in (1,)}
    dcn = {a: int(s) for a, s in zip(cfg.mesh_axes, cfg.dcn_parallelism) if s not in (1,)} if hosts > 1 else {}
    record = {
        "row": args.row,
        "about": row["about"] if row else None,
        "model_config": str(config_path.relative_to(maxtext_dir())),
        "model_name": cfg.model_name,
        "num_gpus": num_gpus,
        "hosts": hosts,
        "topology": f"1x{hosts}x{GPUS_PER_HOST} NVIDIA H100 80GB HBM3 (jaxtron/plan/gpus/h100.txtpb)",
        "mesh": mesh_shape,
        "ici_parallelism": ici,
        "dcn_parallelism": dcn,
        "per_device_batch_size": float(cfg.per_device_batch_size),
        "global_batch": int(cfg.global_batch_size_to_train_on),
        "gradient_accumulation_steps": int(getattr(cfg, "gradient_accumulation_steps", 1)),
        "seq_len": int(cfg.max_target_length),
        "tokens_per_step": int(cfg.global_batch_size_to_train_on) * int(cfg.max_target_length),
        "model": {
            "layers": int(cfg.num_decoder_layers), "emb_dim": int(cfg.emb_dim), "mlp_dim": int(cfg.mlp_dim),
            "heads": int(cfg.num_query_heads), "kv_heads": int(cfg.num_kv_heads), "head_dim": int(cfg.head_dim),
            "vocab": int(cfg.vocab_size), "num_experts": int(getattr(cfg, "num_experts", 1)),
            "experts_per_token": int(getattr(cfg, "num_experts_per_tok", 1)),
            "scan_layers": bool(cfg.scan_layers),
        },
        # how MaxText runs the MoE layers (dropping with a capacity factor, or dropless via ragged matmuls)
        "moe": {"sparse_matmul": bool(cfg.sparse_matmul), "megablox": bool(cfg.megablox),
                "capacity_factor": float(cfg.capacity_factor)} if int(getattr(cfg, "num_experts", 1)) > 1 else None,
        "dtype": str(cfg.dtype), "weight_dtype": str(cfg.weight_dtype),
        "matmul_precision": str(cfg.matmul_precision),
        "quantization": str(cfg.quantization) if cfg.quantization else None,
        "remat_policy": str(cfg.remat_policy),
        "attention": attention,
        "attention_swapped_from": swapped,
        "attention_kernels_in_hlo": attention_kernels(hlo_text),
        "overrides": overrides,
        "note": args.note or None,
        "xla_flags": flags, "xla_flags_source": flags_source,
        "hlo_module_file": dumps[-1].name,
        "hlo_summary": hlo_summary(hlo_text),
        "hbm_gib_per_gpu": round(hbm / 2**30, 2),
        "fits_h100_80gb": hbm <= H100_HBM_BYTES,
        "compile_s": round(seen["compile_s"], 1),
        "total_s": round(total_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "versions": {**versions, "jax_runtime": jax.__version__},
        "published": row["published"] if row else None,
    }
    (out / "maxtext.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"peer_compile: wrote {out}/maxtext.{{hlo.txt.gz,memory.json,json}}; compile {record['compile_s']} s, "
          f"temp {memory['temp_size_in_bytes'] / 2**30:.2f} GiB/GPU, attention kernels "
          f"{record['attention_kernels_in_hlo'] or 'none (plain fusions)'}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list_rows:
        for name, row in ROWS.items():
            fig = row["published"]["tokens_per_s_per_gpu"] if row["published"] else None
            print(f"{name:16s} {row['num_gpus']:4d} GPUs  published {fig}  {row['about']}")
        return 0
    env = args.env.expanduser()
    if args.check_env:
        return 0 if env_problem(env_versions(env)) is None else 1
    if not inside(env):
        if os.environ.get(IN_ENV_MARK):
            print(f"peer_compile: re-executed but not running inside {env}", file=sys.stderr)
            return 2
        try:
            ensure_env(env)
        except (EnvError, OSError) as e:
            print(f"peer_compile: cannot make the MaxText env: {e}", file=sys.stderr)
            return 2
        py = str(env_python(env))
        os.environ[IN_ENV_MARK] = "1"
        os.execv(py, [py, str(Path(__file__).resolve()), *argv])
    versions = env_versions(env) or {}
    problem = env_problem(versions)
    if problem:
        print(f"peer_compile: the MaxText env at {env} is unusable: {problem}", file=sys.stderr)
        return 2
    return compile_in_env(args, versions)


if __name__ == "__main__":
    sys.exit(main())
