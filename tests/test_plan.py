"""python -m jaxtron.plan: per-device state bytes and FSDP collective bytes against closed forms, the fit verdict
against the compiled memory analysis, and --search only recommending layouts that fit. CPU-compiler tests run
in-process on the 8 virtual CPU devices; XLA:GPU tests run the CLI in a subprocess (skipped when
jax-cuda12-plugin does not match jax). Without the plugin the CLI says so in one line (no silent CPU fallback),
as it does for bad arguments."""

import atexit
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

from conftest import FAST_COMPILE
from helpers import xla_gpu_plugin_version
from jaxtron.parallel.layout import Layout
from jaxtron import config as config_lib
from jaxtron.plan import get_gpu, hlo, hlo_counts, plan, search
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4",
         "model.intermediate_size=1024", "model.vocab_size=256", "model.dtype=bfloat16", "data.seq_len=128",
         "train.global_batch_size=16"]



PLUGIN = xla_gpu_plugin_version()
needs_xla_gpu = pytest.mark.skipif(PLUGIN != jax.__version__,
                                   reason=f"jax-cuda12-plugin {PLUGIN} does not match jax {jax.__version__}: "
                                          "no XLA:GPU cross-compile")


def _cfg(*overrides):
    return config_lib.load(None, SMALL + list(overrides))


def _cpu_plan(cfg, gpu=None, **kw):
    return plan(cfg, gpu or get_gpu("h100"), 8, devices=jax.devices()[:8], **kw)


_CACHE = {}


def _cached_plan(*overrides):
    """One CPU compile per layout for the whole module (compiles dominate the test time)."""
    if overrides not in _CACHE:
        _CACHE[overrides] = _cpu_plan(_cfg(*overrides))
    return _CACHE[overrides]


# ------------------------------------------------------------------------------------------- HLO parsing


def test_replica_group_formats():
    g = hlo.parse_replica_groups("replica_groups={{0,1},{2,3}}, x", 4)
    assert g.tolist() == [[0, 1], [2, 3]]
    g = hlo.parse_replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8)
    assert g.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    g = hlo.parse_replica_groups("replica_groups=[4,2]<=[8], x", 8)
    assert g.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    g = hlo.parse_replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x", 8)
    assert g.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo.parse_replica_groups("replica_groups={}, x", 4).tolist() == [[0, 1, 2, 3]]


def test_while_bodies_are_multiplied_by_trip_counts():
    text = """HloModule m

%inner (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[8]{0} all-gather(f32[4]{0} %p), replica_groups={{0,1}}, dimensions={0}
}

%outer (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  %w = f32[4]{0} while(f32[4]{0} %q), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"5"}}
  %ars = bf16[16]{0} all-reduce-start(bf16[16]{0} %x), replica_groups=[1,2]<=[2], to_apply=%add
  ROOT %ard = bf16[16]{0} all-reduce-done(bf16[16]{0} %ars)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %w2 = f32[4]{0} while(f32[4]{0} %a), condition=%c2, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    s = hlo.summarize(hlo.collectives(text, 2))
    assert s["all-gather"]["executions"] == 15 and s["all-gather"]["result_bytes"] == 15 * 32
    assert s["all-gather"]["wire_bytes"] == 15 * 16
    assert s["all-reduce"]["executions"] == 3 and s["all-reduce"]["result_bytes"] == 3 * 32


# -------------------------------------------------------------------------------------- CPU compiler


@pytest.mark.parametrize("data,fsdp,tensor", [(1, 8, 1), (2, 2, 2), (1, 2, 4)])
def test_state_bytes_match_closed_form(data, fsdp, tensor):
    overrides = (f"parallel.data={data}", f"parallel.fsdp={fsdp}", f"parallel.tensor={tensor}")
    cfg = _cfg(*overrides)
    r = _cached_plan(*overrides)
    n = pm.param_count(cfg.model)
    assert r["compiler"] == "XLA:CPU"
    assert r["memory"]["params"] == pytest.approx(4 * n / (fsdp * tensor), rel=0.01)
    assert r["memory"]["optimizer"] == pytest.approx(8 * n / (fsdp * tensor), rel=0.01)
    cf = pm.closed_form_state_bytes(cfg, Layout.planned(cfg, 8))
    assert r["memory"]["params"] == pytest.approx(cf["params"], rel=0.01)
    assert r["memory"]["arguments"] >= r["memory"]["params"] + r["memory"]["optimizer"]


def test_fsdp_collectives_match_closed_form_cpu():
    # FSDP only, no remat, no accumulation: the forward and the backward each all-gather every parameter
    # (the CPU compiler gathers the fp32 masters), the gradients are reduced once (the CPU compiler emits an
    # all-reduce where XLA:GPU emits a reduce-scatter; the XLA:GPU test below checks the reduce-scatter).
    overrides = ("parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1")
    cfg = _cfg(*overrides)
    assert cfg.model.remat == "none" and cfg.train.micro_batch_size is None
    r = _cached_plan(*overrides)
    n = pm.param_count(cfg.model)
    c = r["collectives"]
    assert c["all-gather"]["result_bytes"] == pytest.approx(2 * 4 * n, rel=0.1)
    grad_sync = c["reduce-scatter"]["result_bytes"] * 8 + c["all-reduce"]["result_bytes"]
    assert grad_sync == pytest.approx(4 * n, rel=0.1)


def test_not_fitting_plan_really_exceeds_memory():
    cfg = _cfg("parallel.data=8", "parallel.fsdp=1", "parallel.tensor=1")
    small_gpu = get_gpu("h100").replace(memory_bytes=40 * 2**20, mem_fraction=1.0)  # a 40 MiB "GPU"
    r = _cpu_plan(cfg, small_gpu)
    assert not r["memory"]["fits"]
    args = r["memory"]["arguments"]
    assert args + r["memory"]["temp"] > small_gpu.memory_bytes  # the compiler's own numbers exceed it
    assert pm.closed_form_memory(cfg, Layout.planned(cfg, 8))["total"] > small_gpu.memory_bytes
    # sharding it over fsdp (ZeRO-3) lowers the compiled peak
    r2 = _cached_plan("parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1")
    assert r2["memory"]["peak"] < r["memory"]["peak"]


@pytest.mark.slow
def test_search_tries_context_parallelism_for_long_sequences():
    from jaxtron.plan import candidate_configs

    short = candidate_configs(_cfg("data.seq_len=4096"), 8)
    assert {c.parallel.context for c in short} == {1}
    long = candidate_configs(_cfg("data.seq_len=32768"), 8)
    assert {c.parallel.context for c in long} == {1, 2, 4, 8}
    for c in long:
        assert c.parallel.data * c.parallel.fsdp * c.parallel.context * c.parallel.tensor * c.parallel.stage == 8
        if c.parallel.context > 1:
            assert (c.parallel.context_impl, c.model.attention_impl) == ("ring", "xla")
    estimate = {c.parallel.context: pm.closed_form_memory(c, Layout.planned(c, 8))["activations"]
                for c in long if c.parallel.tensor == 1 and c.model.remat == "full" and c.parallel.fsdp == 1
                and c.train.micro_batch_size == 1}
    assert estimate[8] < estimate[1] / 4  # each context rank holds 1/context of the sequence


def test_search_never_recommends_a_layout_that_does_not_fit():
    cfg = _cfg("model.num_layers=2")
    gpu = get_gpu("h100").replace(memory_bytes=40 * 2**20, mem_fraction=1.0)
    out = search(cfg, gpu, 8, devices=jax.devices()[:8], max_compiles=2, top=2)  # 1 and 2 stages' best
    assert len(out["top"]) == 2, out  # (their compiled peaks: 35 and 33 MiB)
    assert out["pruned_by_estimate"] + len(out["not_fitting_or_failed"]) > 0  # some layouts do not fit
    for r in out["top"]:
        assert r["memory"]["fits"] and r["memory"]["peak"] <= gpu.usable_bytes
    times = [r["step_model"]["step_time_s"] for r in out["top"]]  # ranked by the step model
    assert times == sorted(times)
    assert any("pipeline" in n for n in out["notes"])


def test_no_silent_cpu_fallback_without_the_plugin(monkeypatch):
    from jaxtron.plan import target as plan_target

    monkeypatch.setattr(plan_target, "cuda_plugin_matches", lambda: False)
    for backend in ("auto", "gpu"):
        with pytest.raises(plan_target.CompilerUnavailable, match=r'pip install -e "\.\[plan\]"'):
            plan_target.target_devices(get_gpu("h100"), 8, backend)
    devices, backend, notes = plan_target.target_devices(get_gpu("h100"), 8, "cpu")  # only when asked for
    assert backend == "cpu" and len(devices) == 8 and "indicative only" in notes[0]


def _main(capsys, monkeypatch, *argv):
    from jaxtron.plan.__main__ import main

    monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # main sets it; restored after the test
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_without_the_plugin_says_so_in_one_line(capsys, monkeypatch):
    from jaxtron.plan import target as plan_target

    monkeypatch.setattr(plan_target, "cuda_plugin_matches", lambda: False)
    rc, out, err = _main(capsys, monkeypatch, *SMALL[:2], "--num-gpus", "8", *SMALL[2:])  # overrides both sides
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: the planner needs the XLA:GPU compiler") and '.[plan]' in err
    assert "--backend cpu" in err


@pytest.mark.parametrize("argv,expected", [
    (["--num-gpus", "0"], "error: --num-gpus: must be >= 1, got 0"),
    (["--num-gpus", "eight"], "error: argument --num-gpus: invalid int value: 'eight'"),
    (["--mem-fraction", "1.5"], "error: --mem-fraction: must be in (0, 1], got 1.5"),
    (["--backend", "tpu"], "error: argument --backend: invalid choice"),
    (["--latency-profile-out", "costs.txt"], "error: --latency-profile-out costs.txt: must end in .pbtxt"),
    (["--latency-profile-out", "p.pbtxt", "--search"], "error: --latency-profile-out writes the profile of one "
                                                        "compile: not with --search"),
    (["--search-latency-profiles", "profiles"], "error: --search-latency-profiles goes with --search"),
])
def test_cli_argument_errors_are_one_line(capsys, monkeypatch, argv, expected):
    rc, out, err = _main(capsys, monkeypatch, *argv)
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(expected), err


def test_roofline_is_sane():
    cfg = _cfg("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")
    r = _cached_plan("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")
    roof = r["roofline"]
    assert 0 < roof["mfu"] < 1 and roof["step_time_s"] >= roof["compute_s"]
    assert roof["model_flops_per_step"] == pytest.approx(
        pm.model_flops(cfg, "full")) and roof["model_flops_per_step_causal"] < roof["model_flops_per_step"]


# -------------------------------------------------------------------------------------- XLA:GPU compiler


_CLI_RESULTS = {}

# XLA:GPU's kernel cache, one file for the run (beside the persistent compile cache the conftest made, which the
# xdist workers share): a kernel compiled before, fingerprinted by its fused computation and arguments, is
# taken from it instead of being emitted and assembled (ptxas) again. Most of a small model's cross-compile is
# that, and many of these tests compile a layout twice with a switch that leaves most kernels alone (async
# collectives, the reduce-scatter combiner, the attention kernel). XLA writes the file atomically; the HLO and
# the memory analysis, all the planner reads, come before it.
KERNEL_CACHE = os.path.join(os.environ.get("JAX_COMPILATION_CACHE_DIR") or tempfile.gettempdir(),
                            f"xla-gpu-kernels-jax-{jax.__version__}.pb")
KERNEL_CACHE_FLAGS = (f"--xla_gpu_kernel_cache_file={KERNEL_CACHE} "
                      "--xla_gpu_enable_llvm_module_compilation_parallelism=true")


def _cli(*args, timeout=400, xla_flags=""):
    """The planner's JSON for ``args``; a command line run before in this process (another test's, the same
    compile) is answered from memory: the persistent compile cache cannot serve these cross-compiles."""
    key = (args, xla_flags)
    if key not in _CLI_RESULTS:
        # (its entries for them are written, at a cost, but cannot be read back: "PjRtCompiler must be
        # constructed with a Client to call DeserializeLoadedExecutable")
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
        # the memory analysis and the HLO do not depend on LLVM's optimization
        env["XLA_FLAGS"] = f"{FAST_COMPILE} {KERNEL_CACHE_FLAGS} {xla_flags}"
        proc = subprocess.run([sys.executable, "-m", "jaxtron.plan", "--json", *args], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _CLI_RESULTS[key] = proc.stdout.strip().splitlines()[-1]
    return json.loads(_CLI_RESULTS[key])  # a fresh object: a test may not change another's


_MODULES = {}


def _cli_and_module(*args):
    """:func:`_cli` for ``args``, and the optimized module its compile made (XLA's dump): a test that asks about
    the step model's arithmetic under other constants (``--hlo MODULE`` with the same config) replans this
    module instead of compiling the same program again."""
    if args not in _MODULES:
        _MODULES[args] = tempfile.mkdtemp(prefix="jaxtron-plan-module-")
        atexit.register(shutil.rmtree, _MODULES[args], True)
    dump = _MODULES[args]
    r = _cli(*args, xla_flags=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step --xla_gpu_dump_llvmir=false")
    (module,) = glob.glob(os.path.join(dump, "*jit_step*after_optimizations.txt"))
    return r, module


@needs_xla_gpu
def test_xla_gpu_fsdp_collectives_and_memory():
    r = _cli("--gpu", "h100", "--num-gpus", "8", *SMALL, "parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1",
             "model.remat=none")
    assert r["compiler"] == "XLA:GPU" and r["memory"]["peak_from"] == "memory_analysis.peak_memory_in_bytes"
    cfg = _cfg()
    n = pm.param_count(cfg.model)
    c = r["collectives"]
    # bf16 weights gathered for the forward and again for the backward; bf16 gradients reduce-scattered
    assert c["all-gather"]["result_bytes"] == pytest.approx(2 * 2 * n, rel=0.1)
    assert c["reduce-scatter"]["result_bytes"] * 8 + c["all-reduce"]["result_bytes"] == pytest.approx(2 * n, rel=0.1)
    assert r["memory"]["params"] == pytest.approx(4 * n / 8, rel=0.01)
    # parallel.split_reduce_scatters (on by default here): one reduce-scatter per weight gradient instead of
    # XLA's merged ones; the same bytes. The other compile turns train.uninitialized_scan_outputs off too.
    merged = _cli("--gpu", "h100", "--num-gpus", "8", *SMALL, "parallel.data=1", "parallel.fsdp=8",
                  "parallel.tensor=1", "model.remat=none", "parallel.split_reduce_scatters=false",
                  "train.uninitialized_scan_outputs=false")
    m = merged["collectives"]["reduce-scatter"]
    # the layer loop's 7 projections, the embedding and the LM head; merged: 2 (the loop's 7 in one, the
    # embedding's and the head's, both bf16, in the other)
    assert (c["reduce-scatter"]["ops"], m["ops"]) == (9, 2)
    assert m["result_bytes"] == c["reduce-scatter"]["result_bytes"]
    assert merged["overrides"].endswith("parallel.split_reduce_scatters=false train.uninitialized_scan_outputs=false")
    # train.uninitialized_scan_outputs (on by default): the layer scan's residual stacks (remat none: every
    # activation the backward reads) are XLA AllocateBuffers, not zero-filled broadcasts (the step model counts
    # both as a write of the buffer, so the memory-bound bytes do not tell them apart here)
    assert r["step_model"]["custom_calls"].get("AllocateBuffer", 0) > 0
    assert merged["step_model"]["custom_calls"].get("AllocateBuffer", 0) == 0


@needs_xla_gpu
def test_xla_gpu_latency_profile_from_the_step_model(tmp_path):
    """--latency-profile-out: the step model's costs of the compile written as XLA's profile, the step compiled
    again with it (train.latency_profile) and reported, the first compile under without_latency_profile. XLA's
    scheduler reads it: the collectives are scheduled otherwise and fewer of them wait (SMALL, fsdp 8: exposed
    0.396 -> 0.388 ms; Llama-3-70B fsdp 64 on 64 H100, docs/planner.md: 2.79 -> 0.94 s)."""
    from jaxtron.plan.latency_profile import read_profile

    args = ("--gpu", "h100", "--num-gpus", "8", *SMALL, "parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1",
            "model.remat=none")
    path = str(tmp_path / "small.pbtxt")
    plain, r = _cli(*args), _cli(*args, "--latency-profile-out", path)
    before = r["without_latency_profile"]
    assert before["step_time_s"] == pytest.approx(plain["step_model"]["step_time_s"])  # the same first compile
    assert r["overrides"].endswith(f"train.latency_profile={path}")
    costs = read_profile(path)
    starts = [name for name in costs if re.search(r"-start(\.\d+)?$", name)]
    assert starts and all(costs[name] > 0 for name in starts)
    assert r["step_model"]["exposed_comm_s"] < before["exposed_comm_s"]
    assert r["step_model"]["step_time_s"] < before["step_time_s"]


@needs_xla_gpu
def test_xla_gpu_search_takes_a_latency_profile_where_it_shortens_the_step(tmp_path, monkeypatch):
    """--search-latency-profiles: a top layout planned again with its own latency profile takes that plan when
    it predicts a shorter step (SMALL fsdp 8, remat none, the one candidate here: 0.869 -> 0.860 ms); its
    overrides then name the profile, which is kept in the directory."""
    import importlib

    search_module = importlib.import_module("jaxtron.plan.search")  # the package's `search` is the function
    only = _cfg("parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1", "model.remat=none")
    monkeypatch.setattr(search_module, "candidate_configs", lambda *a, **k: [only])
    logged = []
    cached = jax.config.jax_enable_compilation_cache  # it cannot read back these cross-compiles (see _cli)
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        out = search(_cfg(), get_gpu("h100"), 8, max_compiles=1, top=1, latency_profiles=str(tmp_path),
                     log=logged.append)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    (r,) = out["top"]
    path = str(tmp_path / "layout1.pbtxt")
    assert r["latency_profile_file"] == path and os.path.isfile(path)
    assert r["overrides"].endswith(f"train.latency_profile={path}")
    assert r["step_model"]["step_time_s"] < r["without_latency_profile"]["step_time_s"]
    assert any("with a latency profile" in line and "taken" in line for line in logged), logged


@needs_xla_gpu
def test_xla_gpu_ring_attention_transfers_overlap_the_attention():
    """Context 8 ring, one layer: 7 K/V-block transfers forward and 7 back, each with the attention's compute
    scheduled between its collective-permute-start and -done (none exposed)."""
    r = _cli("--gpu", "h100", "--num-gpus", "8", *SMALL, "model.num_layers=1", "parallel.data=1",
             "parallel.context=8", "parallel.context_impl=ring")
    assert r["layout"].endswith("context=8 (ring)")
    assert r["async_overlap"]["collective-permute"] == {"pairs": 14, "exposed": 0}


def test_latency_costs_are_the_step_models_by_scheduling_name(tmp_path):
    """The latency profile's costs (jaxtron/plan/latency_profile.py): each scheduled instruction by the name
    XLA's scheduler knew it by, an asynchronous collective's transfer time on its start, a fusion's time on the
    fusion (not on what it fuses); written as text and read back."""
    from jaxtron.plan import steptime
    from jaxtron.plan.latency_profile import profile_text, read_profile, write_profile

    text = """HloModule m, is_scheduled=true

%fused (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%a, %a), metadata={scheduling_name="m.inner"}
}

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %ag-start = (f32[1024]{0}, f32[8192]{0}) all-gather-start(%p), dimensions={0}, metadata={scheduling_name="all-gather-start.3"}
  %f = f32[1024]{0} fusion(%p), kind=kLoop, calls=%fused, metadata={scheduling_name="fusion.7"}
  %ag-done = f32[8192]{0} all-gather-done(%ag-start)
  ROOT %r = f32[1024]{0} slice(%ag-done), slice={[0:1024]}
}
"""
    cfg = _cfg()
    costs = steptime.latency_costs(cfg, text, get_gpu("h100"), {("main", "ag-start"): 2.5e-4}, 8)
    assert set(costs) == {"all-gather-start.3", "fusion.7", "r"}
    assert costs["all-gather-start.3"] == 2.5e-4
    assert costs["fusion.7"] > 0 and costs["r"] > 0
    write_profile(costs, str(tmp_path / "p.pbtxt"))
    assert read_profile(str(tmp_path / "p.pbtxt")) == pytest.approx(costs, abs=1e-9)
    assert 'costs { name: "all-gather-start.3" cost_us: 250.000 }' in profile_text(costs).splitlines()


def test_async_overlap_reads_the_schedule():
    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %cp-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}
  %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (f32[4]{0}, f32[4]{0}) collective-permute-start(%f), source_target_pairs={{0,1},{1,0}}
  %cp-done.1 = f32[4]{0} collective-permute-done(%cp-start.1)
  ROOT %a = f32[4]{0} add(%cp-done, %cp-done.1)
}
"""
    pairs = hlo_counts.async_overlap(text)
    assert [(p["start"], p["compute_between"]) for p in pairs] == [("cp-start", ["f"]), ("cp-start.1", [])]


@pytest.mark.slow
@needs_xla_gpu
def test_xla_gpu_llama3_8b_replicated_does_not_fit():
    r = _cli("--config", "llama3_8b", "--gpu", "h100", "--num-gpus", "8", "parallel.data=8", "parallel.fsdp=1",
             "train.micro_batch_size=1", "train.global_batch_size=64")
    mem = r["memory"]
    assert r["compiler"] == "XLA:GPU" and not mem["fits"]
    # 16 bytes per parameter replicated (fp32 params + AdamW moments) is already more than 80 GB
    assert mem["arguments"] > mem["device_memory"] and mem["peak"] > mem["usable"]


# ------------------------------------------------------------------------------------------------- MoE

# Three layers: one dense, two MoE (4 experts of width 32, top-2, one shared expert of width 48).
MOE = ["model.hidden_size=64", "model.num_layers=3", "model.num_heads=4", "model.num_kv_heads=2",
       "model.intermediate_size=128", "model.vocab_size=256", "model.dtype=bfloat16", "data.seq_len=32",
       "train.global_batch_size=16", "model.moe.num_experts=4", "model.moe.num_experts_per_token=2",
       "model.moe.expert_intermediate_size=32", "model.moe.first_dense_layers=1",
       "model.moe.num_shared_experts=1", "model.moe.shared_expert_intermediate_size=48"]
MOE_LAYOUT = ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")


def _moe_by_hand():
    """(all parameters, active parameters, training FLOPs per token) of MOE, counted here term by term."""
    d, heads, kv, hd, ffn, vocab, seq = 64, 4, 2, 16, 128, 256, 32
    experts, k, width, shared = 4, 2, 32, 48
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d     # q, k and v, o
    norms = 2 * d
    dense_layer = attn + 3 * d * ffn + norms
    moe_layer = lambda n: attn + d * experts + n * 3 * d * width + 3 * d * shared + norms   # router, n experts
    outside = 2 * vocab * d + d                                  # untied embeddings and head, final norm
    params = outside + dense_layer + 2 * moe_layer(experts)
    active = outside + dense_layer + 2 * moe_layer(k)
    attn_flops = 2 * d * (heads + 2 * kv) * hd + 2 * 2 * seq * heads * hd + 2 * heads * hd * d
    moe_flops = 2 * d * experts + 2 * 3 * d * width * k + 2 * 3 * d * shared
    flops = 3 * (3 * attn_flops + 2 * 3 * d * ffn + 2 * moe_flops + 2 * d * vocab)
    return params, active, flops


@pytest.mark.parametrize("dispatch", ["dropless", pytest.param("capacity", marks=pytest.mark.slow)])
def test_moe_plan_counts_every_expert_in_memory_and_active_ones_in_flops(dispatch):
    # ragged_dot, as gmm_impl=auto takes on CPUs (this compile's), whose masked dense matmuls the HLO counts
    cfg = config_lib.load(None, MOE + list(MOE_LAYOUT) + [f"model.moe.dispatch={dispatch}",
                                                          "model.moe.gmm_impl=ragged_dot"])
    r = _cpu_plan(cfg)
    params, active, flops = _moe_by_hand()
    assert (params, active) == (162752, 138176) and flops == 801792
    assert r["params"] == {"total": params, "closed_form": params, "active_per_token": active}
    # fp32, every expert, split over fsdp x tensor (norms and the router's expert axis are not: 1% more)
    assert r["memory"]["params"] == pytest.approx(4 * params / 4, rel=0.02)
    assert r["flops"]["model_flops_per_token"] == flops
    assert r["roofline"]["model_flops_per_step"] == flops * 16 * 32
    # the routed experts as compiled: the closed form of jaxtron/plan/moe.py against the HLO's own dots
    layout = Layout.planned(cfg, 8)
    moe = r["moe"]
    executed = moe["expert_matmul_flops_per_device"]["as_compiled_hlo"]
    assert executed == pytest.approx(pmoe.expert_flops_per_device(cfg, layout, "as_compiled"), rel=0.01)
    grouped = moe["expert_matmul_flops_per_device"]["grouped"]
    assert grouped == 3 * 2 * (2 * 3 * 64 * 32 * 2) * 16 * 32 / 8  # 2 layers, top-2, tokens per device
    # dropless: the device's own rows, each times all 4 experts; capacity: 1.25 x the slots of both data shards
    assert executed / grouped == pytest.approx(4 if dispatch == "dropless" else 1.25 * 2, rel=0.01)
    assert moe["gemm"] == "as_compiled" and moe["alternative"]["gemm"] == "grouped"
    # (this tiny model's step is bound by weight gathers, which hide either GEMM's time)
    assert moe["alternative"]["step_time_s"] <= r["roofline"]["step_time_s"]
    assert any("masked dense matmul" in n for n in r["notes"])


def test_moe_search_splits_tensor_only_where_the_experts_divide():
    from jaxtron.plan import candidate_configs

    cfg = config_lib.load(None, MOE + ["model.num_kv_heads=4", "model.moe.expert_intermediate_size=36",
                                       "model.moe.shared_expert_intermediate_size=36"])
    assert {c.parallel.tensor for c in candidate_configs(cfg, 8)} == {1, 2, 4}  # 36 % 8 != 0


def test_moe_search_recommends_a_layout_that_fits():
    cfg = config_lib.load(None, MOE)
    out = search(cfg, get_gpu("h100"), 8, devices=jax.devices()[:8], max_compiles=1, top=1, moe_gemm="grouped")
    assert len(out["top"]) == 1 and out["top"][0]["memory"]["fits"]
    assert out["top"][0]["roofline"]["moe_gemm"] == "grouped"


def test_moe_gemm_must_be_known():
    with pytest.raises(ValueError, match=r"^--moe-gemm: must be one of as_compiled, grouped, got 'dense'$"):
        plan(_cfg(), get_gpu("h100"), 8, devices=jax.devices()[:8], moe_gemm="dense")


MIXTRAL_EP = ["parallel.expert=2", "parallel.fsdp=2", "parallel.tensor=4", "parallel.data=1",
              "parallel.sequence_parallel=true", "model.moe.ep_capacity_factor=1.25", "model.remat=save_dots",
              "train.micro_batch_size=1"]


@pytest.mark.slow
@needs_xla_gpu
def test_xla_gpu_mixtral_8x7b_fits_on_16_h100_with_expert_parallelism():
    """Issue 25's plan: expert 2 x fsdp 2 x tensor 4 on two nodes of 8 H100s fits, its state split as the
    closed form says (the routed experts over expert x fsdp x tensor, the rest over fsdp x tensor)."""
    r = _cli("--config", "mixtral_8x7b", "--gpu", "h100", "--num-gpus", "16", *MIXTRAL_EP)
    assert r["compiler"] == "XLA:GPU" and r["nodes"] == 2 and r["memory"]["fits"], r["memory"]
    assert r["mesh"]["expert"] == 2 and r["collectives"]["all-to-all"]["ops"] > 0
    cfg = config_lib.load("mixtral_8x7b", MIXTRAL_EP)
    assert r["params"]["total"] == pm.param_count(cfg.model) and 46.6e9 < r["params"]["total"] < 46.8e9
    assert 12.8e9 < r["params"]["active_per_token"] < 13.0e9
    state = pm.closed_form_state_bytes(cfg, Layout.planned(cfg, 16))
    assert r["memory"]["params"] == pytest.approx(state["params"], rel=0.01)
    assert state["params"] < 0.6 * 4 * r["params"]["total"] / 8  # well under every expert on fsdp x tensor
