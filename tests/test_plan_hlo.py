"""python -m jaxtron.plan --hlo: the planner's analysis of a module compiled elsewhere is the one plan() runs on
its own compile (same step model, FLOPs, collectives, kernels), the CLI reads a committed XLA:GPU module (no
compile, no CUDA plugin needed), and a bad file is a one-line error with status 2.

tests/data/tiny_fsdp2_h100.hlo.txt.gz and .memory.json: the default config (configs/tiny.yaml) with
:data:`TINY_FSDP2` compiled for 2 H100s by plan(); ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu python
tests/test_plan_hlo.py`` writes them again."""

import gzip
import json
import os
import subprocess
import sys

import jax
import pytest

from helpers import xla_gpu_plugin_version
from jaxtron import config as config_lib
from jaxtron.plan import get_gpu, hlo_counts, plan, steptime
from jaxtron.plan.__main__ import main
from jaxtron.plan.hlo_report import BadModule, module_devices, plan_hlo, plan_hlo_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
HLO = os.path.join(DATA, "tiny_fsdp2_h100.hlo.txt.gz")
MEMORY = os.path.join(DATA, "tiny_fsdp2_h100.memory.json")
TINY_FSDP2 = ["parallel.data=1", "parallel.fsdp=2", "data.seq_len=128"]
H100 = get_gpu("h100")

PLUGIN = xla_gpu_plugin_version()
needs_xla_gpu = pytest.mark.skipif(PLUGIN != jax.__version__,
                                   reason=f"jax-cuda12-plugin {PLUGIN} does not match jax {jax.__version__}: "
                                          "no XLA:GPU cross-compile")


def _cfg():
    return config_lib.load(None, TINY_FSDP2)


def memory_sizes(memory: dict) -> dict:
    """XLA's memory-analysis sizes as plan() reports them (what --memory-json holds)."""
    sizes = {"argument_size_in_bytes": memory["arguments"], "output_size_in_bytes": memory["outputs"],
             "alias_size_in_bytes": memory["aliased"], "temp_size_in_bytes": memory["temp"]}
    if memory["peak_from"] == "memory_analysis.peak_memory_in_bytes":
        sizes["peak_memory_in_bytes"] = memory["peak"]
    return {k: int(v) for k, v in sizes.items()}


@pytest.fixture(scope="module")
def compiled_plan():
    """One XLA:GPU compile for the module: plan() with the module text it analysed."""
    return plan(_cfg(), H100, 2, "gpu", keep_hlo=True)


@needs_xla_gpu
def test_plan_hlo_on_plans_own_module_gives_plans_figures(compiled_plan):
    r = compiled_plan
    h = plan_hlo(_cfg(), H100, 2, r["_hlo"], memory_sizes(r["memory"]), "compiled")
    for key in ("step_model", "flops", "collectives", "kernels", "async_overlap", "roofline", "dots", "layout"):
        assert h[key] == r[key], key
    assert h["source"] == "hlo" and h["memory"]["peak"] == r["memory"]["peak"]
    assert h["memory"]["fits"] == r["memory"]["fits"]


def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxtron.plan", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_reads_the_committed_module():
    rc, out, err = _cli("--hlo", HLO, "--memory-json", MEMORY, "--gpu", "h100", "--num-gpus", "2", *TINY_FSDP2,
                        "--json")
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["source"] == "hlo" and r["hlo_file"] == "tiny_fsdp2_h100.hlo.txt.gz" and r["compile_s"] is None
    # FSDP over 2 devices: weights all-gathered in the layer scan (forward and backward), gradients
    # reduce-scattered; no tensor, expert or context parallelism
    c = r["collectives"]
    assert c["all-gather"]["executions"] > 0 and c["reduce-scatter"]["executions"] > 0
    assert c["all-to-all"]["ops"] == c["collective-permute"]["ops"] == 0
    sm = r["step_model"]
    assert sm["step_time_s"] > 0 and sm["tokens_per_s_per_gpu"] > 0 and sm["gemm"]["count"] > 0
    assert sm["kernels_per_step"]["fusions"] > 0
    assert sm["kernels_per_step"]["total"] == sum(sm["kernels_per_step"][k] for k in ("fusions", "custom_calls",
                                                                                      "other"))
    assert sm["attention_s"] == 0 and r["attention_impl"] == "xla"  # attention as dots, timed as GEMMs
    assert 0 < sm["gemm"]["batched_seconds"] < sm["gemm_s"]  # its dots: the GEMMs with batch dimensions
    # attention runs as dots over the full score matrix (the model's 'full' count): about 1x the model's
    assert 0.9 < r["flops"]["dot_over_model_flops"] < 1.5
    assert 0 < r["memory"]["peak"] < r["memory"]["usable"] and r["memory"]["fits"]
    # the JSON is plan_hlo's own figures on the same file
    again = plan_hlo_file(_cfg(), H100, 2, HLO, MEMORY)
    assert r["step_model"]["step_time_s"] == again["step_model"]["step_time_s"]


def test_without_memory_the_peak_is_unknown(capsys):
    assert main(["--hlo", HLO, "--num-gpus", "2", *TINY_FSDP2]) == 0
    out = capsys.readouterr().out
    assert "peak                unknown" in out and "kernels per step" in out
    assert plan_hlo_file(_cfg(), H100, 2, HLO)["memory"] is None


def _error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_files_are_one_line_errors(capsys, tmp_path):
    missing = str(tmp_path / "nothing.txt.gz")
    assert "No such file" in _error(capsys, "--hlo", missing, "--num-gpus", "2", *TINY_FSDP2)
    text = tmp_path / "notes.txt"
    text.write_text("this is not a module\n")
    assert "not an HLO module" in _error(capsys, "--hlo", str(text), "--num-gpus", "2", *TINY_FSDP2)
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(gzip.compress(b"HloModule m\n")[:12])
    assert "not an HLO module" in _error(capsys, "--hlo", str(broken), "--num-gpus", "2", *TINY_FSDP2)
    bad_memory = tmp_path / "memory.json"
    bad_memory.write_text('{"temp_size_in_bytes": 1}')
    assert "argument_size_in_bytes" in _error(capsys, "--hlo", HLO, "--memory-json", str(bad_memory),
                                              "--num-gpus", "2", *TINY_FSDP2)


def test_a_module_on_more_devices_than_gpus_is_refused(capsys):
    err = _error(capsys, "--hlo", HLO, "--num-gpus", "1", "parallel.data=1", "parallel.fsdp=1",
                 "data.seq_len=128")
    assert "runs on 2 device(s)" in err
    # a mesh that does not cover the GPUs is the config's one-line error
    assert "does not match" in _error(capsys, "--hlo", HLO, "--num-gpus", "2", "parallel.data=1",
                                      "parallel.fsdp=4")
    assert "--search" in _error(capsys, "--hlo", HLO, "--search")


def test_module_devices_reads_every_replica_group_format():
    head = "HloModule m, num_partitions=4\n"
    assert module_devices(head) == 4
    assert module_devices(head + "x = f32[2] all-gather(y), replica_groups={{0,1},{6,7}}") == 8
    assert module_devices(head + "x = f32[2] all-gather(y), replica_groups=[2,8]<=[16]") == 16
    assert module_devices(head + "x = f32[2] all-gather(y), replica_groups=mesh['a'=2,'b'=4] {'a'}") == 8
    assert module_devices(head + "x = f32[2] collective-permute(y), source_target_pairs={{0,9},{9,0}}") == 10
    with pytest.raises(BadModule, match="runs on 4 device"):
        plan_hlo(_cfg(), H100, 2, head + "ENTRY e {\n}\n")


GEMM_MODULE = """HloModule m, is_scheduled=true

ENTRY %main (p0: bf16[256,512], p1: bf16[512,128]) -> bf16[256,128] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[512,128]{1,0} parameter(1)
  GEMM
}
"""
CUBLAS = ('%g = (bf16[256,128]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul", '
          'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],'
          '"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}\n'
          '  ROOT %r = bf16[256,128]{1,0} get-tuple-element(%g), index=0')
DOT = "ROOT %g = bf16[256,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def test_a_cublas_gemm_call_is_a_dot():
    """A module compiled with --xla_gpu_enable_triton_gemm=false (MaxText's GPU flags) calls cuBLAS instead of
    a dot: its FLOPs and its GEMM time are the dot's, its launch a custom call."""
    cfg = config_lib.load(None, ["parallel.data=1"])
    cublas, dot = (GEMM_MODULE.replace("GEMM", g) for g in (CUBLAS, DOT))
    assert hlo_counts.dot_flops(cublas)["total"] == hlo_counts.dot_flops(dot)["total"] == 2.0 * 256 * 128 * 512
    assert hlo_counts.dot_operand_types(cublas) == hlo_counts.dot_operand_types(dot)
    a, b = (steptime.predict(cfg, t, H100, {}, 1, 1.0) for t in (cublas, dot))
    assert a["gemm"]["count"] == b["gemm"]["count"] == 1 and a["gemm_s"] == b["gemm_s"] > 0
    assert a["kernels_per_step"]["custom_calls"] == 1 and b["kernels_per_step"]["other"] == 1
    assert a["custom_calls"] == {"__cublas$lt$matmul": 1.0} and a["gemm"]["batched_seconds"] == 0


TUPLE_OPERANDS = """HloModule m, is_scheduled=true

ENTRY %main (p: (bf16[256,512], bf16[512,128])) -> bf16[256,128] {
  %p = (bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  ROOT %g = bf16[256,128]{1,0} dot(%p#0, %p#1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_operands_named_as_tuple_elements_have_their_shapes():
    """Newer XLA (jax 0.12, MaxText's module) names a tuple's element ``%p#1`` instead of a get-tuple-element:
    the GEMM's dimensions and bytes come from the element's shape."""
    cfg = config_lib.load(None, ["parallel.data=1"])
    dot = GEMM_MODULE.replace("GEMM", DOT)
    assert hlo_counts.dot_flops(TUPLE_OPERANDS)["total"] == 2.0 * 256 * 128 * 512
    a, b = (steptime.predict(cfg, t, H100, {}, 1, 1.0) for t in (TUPLE_OPERANDS, dot))
    assert a["gemm"]["flops"] == b["gemm"]["flops"] and a["gemm_s"] == b["gemm_s"]


ASYNC_MODULE = """HloModule m, is_scheduled=true

%fused_update (b: f32[64,1024], u: f32[1,1024], i: s32[]) -> f32[64,1024] {
  %b = f32[64,1024]{1,0} parameter(0)
  %u = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%b, %u, %i, %z)
}

%wrapped (b.1: f32[64,1024], u.1: f32[1,1024], i.1: s32[]) -> f32[64,1024] {
  %b.1 = f32[64,1024]{1,0} parameter(0)
  %u.1 = f32[1,1024]{1,0} parameter(1)
  %i.1 = s32[] parameter(2)
  ROOT %f.1 = f32[64,1024]{1,0} fusion(%b.1, %u.1, %i.1), kind=kLoop, calls=%fused_update
}

ENTRY %main (p0: f32[64,1024], p1: f32[1,1024], p2: s32[]) -> f32[64,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  UPDATE
}
"""
SYNC = "ROOT %f = f32[64,1024]{1,0} fusion(%p0, %p1, %p2), kind=kLoop, calls=%fused_update"
FUSION_START = ("%st = ((f32[64,1024]{1,0}, f32[1,1024]{1,0}, s32[]), f32[64,1024]{1,0}, u32[]) fusion-start(%p0, %p1, "
                "%p2), kind=kLoop, calls=%fused_update\n  ROOT %d = f32[64,1024]{1,0} fusion-done(%st)")
ASYNC_START = ("%st = ((f32[64,1024]{1,0}, f32[1,1024]{1,0}, s32[]), f32[64,1024]{1,0}, u32[]) async-start(%p0, %p1, "
               "%p2), calls=%wrapped\n  ROOT %d = f32[64,1024]{1,0} async-done(%st)")


def test_async_compute_is_timed_as_its_fusion():
    """Newer XLA:GPU (jax 0.12, MaxText's module) runs the layer scan's dynamic-update-slices as async fusions
    (fusion-start, or async-start around a computation): each is timed as the same fusion run synchronously,
    its in-place update's bytes (not the whole buffer's), one launch."""
    cfg = config_lib.load(None, ["parallel.data=1"])
    runs = [steptime.predict(cfg, ASYNC_MODULE.replace("UPDATE", u), H100, {}, 1, 1.0)
            for u in (SYNC, FUSION_START, ASYNC_START)]
    for r in runs:
        assert r["memory_bound"]["bytes"] == 2 * 4 * 1024 + 4  # the update read and written, the index
        assert r["step_time_s"] == runs[0]["step_time_s"] > 0
        assert r["kernels_per_step"]["fusions"] == 1


def test_a_recomputed_attention_forward_is_read_from_the_kernel_calls():
    """Forward passes against backward passes, a pass calling each of its kernels once: MaxText's cuDNN module
    (llama3_8b.yml, remat minimal_with_context: 32 layers, one peeled call) recomputes the forward; jaxtron's
    Pallas backward is two kernels a pass."""
    maxtext = {"fwd __cudnn$fmhaSoftmax": 63.0, "bwd __cudnn$fmhaSoftmaxBackward": 32.0}
    assert steptime.attention_passes(maxtext) == {"fwd": 63.0, "bwd": 32.0}
    assert steptime.recomputes_attention(maxtext)
    pallas = {"fwd flash_attention_fwd": 4.0, "bwd flash_attention_bwd_dkv": 4.0, "bwd flash_attention_bwd_dq": 4.0}
    assert steptime.recomputes_attention(pallas) is False
    assert steptime.recomputes_attention({**pallas, "fwd flash_attention_fwd": 8.0})
    assert steptime.recomputes_attention({"fwd flash_attention_fwd": 4.0}) is None  # no backward: inference
    cfg = config_lib.load(None, ["model.attention_impl=cudnn", "model.remat=none"])
    once, again = (steptime.attention_seconds(cfg, 1, recompute=r) for r in (False, True))
    assert once == steptime.attention_seconds(cfg, 1) and again == pytest.approx(once * 4.5 / 3.5)


if __name__ == "__main__":  # write the committed module again (needs jax-cuda12-plugin == jax; module doc)
    result = plan(_cfg(), H100, 2, "gpu", keep_hlo=True)
    with open(HLO, "wb") as f:
        f.write(gzip.compress(result["_hlo"].encode(), mtime=0))
    with open(MEMORY, "w") as f:
        json.dump(memory_sizes(result["memory"]), f, indent=1)
        f.write("\n")
    print(f"{HLO}: {os.path.getsize(HLO)} bytes; step model {result['step_model']['step_time_s'] * 1e3:.3f} ms")
