"""Compile the Mosaic GPU attention kernels to Hopper SASS without a GPU, and report registers and spills.

Mosaic GPU builds a kernel's PTX and SASS only when the kernel first runs, inside the CUDA plugin, so neither a
`cuda` lowering nor the deviceless XLA compile for an H100 shows register spills. This script calls that
compiler directly: the plugin's exported `MosaicGpuCompile`. It runs in a child process whose CUDA driver is a
stand-in (`scripts/fake_libcuda.c`, built here with gcc). The stand-in reports one sm_90 device and accepts the
module load with dummy handles. ptxas's own report (`ptxas -v`: registers, spill stores and loads, stack
frame) is the result. Nothing runs.

The kernels are lowered at Llama-3-8B shapes (32 heads, 8 KV heads, bf16): the forward alone, and forward plus
backward with the fused dq (default), with the separate dq kernel (`fuse_dq=False`), and with segment ids.

    python scripts/mosaic_sass.py                      # table, head_dim 128 and 64
    python scripts/mosaic_sass.py --head-dim 128 --json
    python scripts/mosaic_sass.py --sass out/          # also the SASS, and where its loops spill (nvdisasm)

Needs the CUDA plugin of this JAX (`jax-cuda12-plugin`, in the `test` extra on Python 3.11), gcc and nm;
`--sass` also needs nvdisasm on PATH (`pip install nvidia-cuda-nvdisasm` has one). A kernel whose report
cannot be read raises with the child's output. Exit status 1 if any kernel spills.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER_SOURCE = os.path.join(REPO, "scripts", "fake_libcuda.c")
_ENSURE_NVPTX = "_ZN6mosaic3gpu33EnsureLLVMNVPTXTargetIsRegisteredEv"   # mosaic::gpu::EnsureLLVMNVPTX...()


def plugin_library() -> str:
    """Path of the CUDA PJRT plugin that holds Mosaic GPU's compiler, or ImportError."""
    try:
        import jax_plugins.xla_cuda13 as plugin        # noqa: F401
    except ImportError:
        import jax_plugins.xla_cuda12 as plugin
    return plugin._get_library_path()


def unavailable() -> str | None:
    """Why this machine cannot run the report (None when it can)."""
    try:
        plugin_library()
    except ImportError:
        return "no JAX CUDA plugin (pip install -e '.[test]' on Python 3.11 installs jax-cuda12-plugin)"
    for tool in ("gcc", "nm"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


def build_driver(directory: str) -> str:
    """Compile the stand-in driver as `directory`/libcuda.so.1; returns the directory."""
    out = os.path.join(directory, "libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", out, DRIVER_SOURCE], check=True)
    return directory


def _symbol_offsets(path: str, names: tuple[str, ...]) -> dict[str, int]:
    table = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in table.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in names:
            found[parts[2]] = int(parts[0], 16)
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"{path} has no symbol {sorted(missing)}: this plugin version is not supported")
    return found


@functools.cache
def compiler_entry() -> tuple[str, dict[str, int]]:
    """The plugin's path and the offsets of the symbols the child calls: found once (about 3 s: the plugin's
    import and `nm` over it) and handed to every child in $MOSAIC_SASS_ENTRY."""
    path = str(plugin_library())
    return path, _symbol_offsets(path, ("MosaicGpuCompile", _ENSURE_NVPTX))


def compile_child(module_path: str) -> int:
    """In the child process (stand-in driver loaded): compile one serialized Mosaic GPU module."""
    given = os.environ.get("MOSAIC_SASS_ENTRY")
    path, offsets = json.loads(given) if given else compiler_entry()
    dll = ctypes.CDLL(path)
    compile_fn = dll.MosaicGpuCompile
    # MosaicGpuCompile asks LLVM for the sm_90a target before registering it (the plugin's own compile path
    # registers it first); call the plugin's registration function at its address.
    base = ctypes.cast(compile_fn, ctypes.c_void_p).value - offsets["MosaicGpuCompile"]
    ctypes.CFUNCTYPE(None)(base + offsets[_ENSURE_NVPTX])()
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    module = open(module_path, "rb").read()
    ok = bool(compile_fn(module, len(module)))
    sys.stdout.flush()
    return 0 if ok else 3


_REPORT = {
    "kernel": re.compile(r"Compiling entry function '(\w+)' for '(\w+)'"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
}


def parse_ptxas(text: str) -> dict:
    """ptxas -v's report for one entry function -> kernel, arch, registers, spill bytes, stack bytes, and
    `serialized`: ptxas's "Potential Performance Loss" notes (for example wgmma.mma_async serialized because its
    register operands are touched while it runs), which cost as much as spills and are only printed."""
    out = {"serialized": [line.split(":", 1)[1].strip() for line in text.splitlines()
                          if line.startswith("ptxas") and "Performance Loss" in line]}
    for key, pattern in _REPORT.items():
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"no '{key}' in the ptxas report:\n{text[-2000:]}")
        if key == "kernel":
            out["kernel"], out["arch"] = match.group(1).removesuffix("_mosaic_gpu_kernel"), match.group(2)
        else:
            out[key] = int(match.group(1))
    return out


# Mosaic names a kernel after its body function; a kernel launched through `pl.kernel` inside `pl.run_state`
# loses that name in state discharge (jax 0.10 and 0.11) and is called after the discharge's wrapper.
_DISCHARGED_NAMES = {"new_body": "flash_attention_mosaic_dkv_dq"}


def compile_module(module: bytes, driver_dir: str, workdir: str, sass: bool = False) -> tuple[dict, str]:
    """(ptxas's report, the child's output) for one serialized module, compiled in a child process with the
    stand-in driver; with sass the output also holds the SASS listing (nvdisasm, found on PATH)."""
    path = os.path.join(workdir, f"module-{hashlib.sha256(module).hexdigest()[:16]}.mlirbc")   # one per call
    with open(path, "wb") as f:
        f.write(module)
    env = dict(os.environ, LD_LIBRARY_PATH=driver_dir, MOSAIC_GPU_DUMP_PTXAS="1", JAX_PLATFORMS="cpu",
               MOSAIC_SASS_ENTRY=json.dumps(compiler_entry()))
    if sass:                            # Mosaic runs nvdisasm from $MOSAIC_GPU_CUDA_ROOT/bin
        root = os.path.join(workdir, "cuda_root")
        os.makedirs(os.path.join(root, "bin"), exist_ok=True)
        link = os.path.join(root, "bin", "nvdisasm")
        with contextlib.suppress(FileExistsError):         # another thread's compile made it
            os.symlink(shutil.which("nvdisasm"), link)
        env.update(MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_CUDA_ROOT=root)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-module", path], env=env,
                          capture_output=True, text=True, timeout=600)
    try:
        report = parse_ptxas(proc.stdout)
    except ValueError as e:
        raise RuntimeError(f"compiling a Mosaic GPU module failed (exit {proc.returncode}): {e}\n"
                           f"stderr:\n{proc.stderr[-3000:]}") from None
    report["kernel"] = _DISCHARGED_NAMES.get(report["kernel"], report["kernel"])
    report["compile_s"] = round(time.perf_counter() - t0, 1)
    return report, proc.stdout


def sass_loops(listing: str, min_instructions: int = 100) -> list[dict]:
    """The loops of a SASS listing (a conditional backward branch and the code it jumps over; the unconditional
    jumps back from out-of-line barrier-wait retries are not loops) of at least min_instructions, with their
    wgmma (HGMMA) count and spill traffic (STL / LDL): spills inside a block loop cost every iteration, spills
    around it only once."""
    label_at, code, pending = {}, [], []
    for line in listing.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if ins:
            addr = int(ins.group(1), 16)
            label_at.update((name, addr) for name in pending)
            pending = []
            code.append((addr, ins.group(2)))
    code = [(addr, ins.startswith("@"), re.sub(r"^@!?U?P\w+\s+", "", ins)) for addr, ins in code]
    loops = []
    for addr, conditional, ins in code:
        target = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", ins)
        if conditional and target and label_at.get(target.group(1), addr) < addr:
            body = [i for a, _, i in code if label_at[target.group(1)] <= a <= addr]
            if len(body) >= min_instructions:
                loops.append({"start": hex(label_at[target.group(1)]), "end": hex(addr), "instructions": len(body),
                              "hgmma": sum(i.startswith("HGMMA") for i in body),
                              "stl": sum(i.startswith("STL") for i in body),
                              "ldl": sum(i.startswith("LDL") for i in body)})
    return loops


def lowered_modules(fn, *specs) -> dict[bytes, bytes]:
    """{kernel hash: serialized module} for the Mosaic GPU kernels in fn's `cuda` lowering."""
    import jax
    from jax.experimental.mosaic.gpu import core

    before = set(core.KNOWN_KERNELS)
    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    return {h: m for h, m in core.KNOWN_KERNELS.items() if h not in before}


def attention_cases(head_dim: int, seq: int):
    """(case name, function, specs) at Llama-3-8B shapes: the forward alone, then forward plus backward three ways."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import flash_attention

    b, h, kvh = 1, 32, 8
    q = jax.ShapeDtypeStruct((b, seq, h, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, seq, kvh, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, seq), jnp.int32)

    def attn(q, k, v, seg=None, **kw):
        return flash_attention(q, k, v, causal=True, segment_ids=seg, backend="mosaic", interpret=False, **kw)

    def grad(**kw):
        def loss(q, k, v, *seg):
            return attn(q, k, v, *seg, **kw).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))

    yield "forward", attn, (q, kv, kv)
    yield "fwd+bwd", grad(), (q, kv, kv)
    yield "fwd+bwd fuse_dq=False", grad(fuse_dq=False), (q, kv, kv)
    yield "fwd+bwd segment ids", grad(), (q, kv, kv, seg)


def report(head_dims, seq: int, sass_dir: str | None = None, jobs: int | None = None) -> list[dict]:
    """One row per distinct kernel: the first case it appears in, and ptxas's report (with sass_dir, the SASS
    goes to sass_dir/<kernel>-d<head_dim>-<n>.sass and the row gets its loops). The kernels are lowered one
    after the other (JAX, in this process) and compiled by `jobs` child processes at a time (default: the CPU
    count, at most 4): each child spends seconds in ptxas alone."""
    first = {}                                         # kernel hash -> (head_dim, case, module), in lowering order
    for d in head_dims:
        for case, fn, specs in attention_cases(d, seq):
            for kernel_hash, module in lowered_modules(fn, *specs).items():
                first.setdefault(kernel_hash, (d, case, module))
    jobs = jobs or min(4, os.cpu_count() or 1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        driver = build_driver(tmp)
        done = pool.map(lambda item: compile_module(item[2], driver, tmp, sass=sass_dir is not None),
                        first.values())
        for (kernel_hash, (d, case, _)), (row, listing) in zip(first.items(), done):
            rows[kernel_hash] = {"head_dim": d, "case": case, **row}
            if sass_dir is not None:
                name = f"{row['kernel']}-d{d}-{len(rows)}.sass"
                with open(os.path.join(sass_dir, name), "w") as f:
                    f.write(listing)
                rows[kernel_hash].update(sass=name, loops=sass_loops(listing))
    return list(rows.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, nargs="+", default=[128, 64])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--sass", metavar="DIR", help="write each kernel's SASS here and list its loops (needs nvdisasm)")
    p.add_argument("--compile-module", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_module:
        return compile_child(args.compile_module)
    why = unavailable()
    if why:
        print(f"mosaic_sass: cannot compile here: {why}", file=sys.stderr)
        return 2
    if args.sass:
        if shutil.which("nvdisasm") is None:
            print("mosaic_sass: --sass needs nvdisasm on PATH (pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
            return 2
        os.makedirs(args.sass, exist_ok=True)
    sys.path.insert(0, REPO)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = report(args.head_dim, args.seq, args.sass)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'head_dim':>8}  {'first case':<22} {'kernel':<30} {'arch':<7} {'regs':>4} {'spill st':>8} "
              f"{'spill ld':>8} {'stack':>5} {'s':>5}")
        for r in rows:
            print(f"{r['head_dim']:>8}  {r['case']:<22} {r['kernel']:<30} {r['arch']:<7} {r['registers']:>4} "
                  f"{r['spill_stores']:>8} {r['spill_loads']:>8} {r['stack']:>5} {r['compile_s']:>5}")
            for note in r["serialized"]:
                print(f"{'':>10}ptxas: {note}")
            for loop in r.get("loops", ()):
                print(f"{'':>10}loop {loop['start']}-{loop['end']}: {loop['instructions']} instructions, "
                      f"{loop['hgmma']} HGMMA, {loop['stl']} STL, {loop['ldl']} LDL")
    return 1 if any(r["spill_stores"] or r["spill_loads"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
