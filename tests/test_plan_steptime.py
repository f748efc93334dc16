"""The planner's op-by-op step model (jaxtron/plan/steptime.py, gemm.py): its prediction changes with the model
and the layout for reasons it names (GEMM tile, wave and depth efficiency; collectives on the critical path),
and no single efficiency constant sets it."""

import dataclasses

import pytest

from jaxtron.plan import get_gpu, steptime
from jaxtron.plan.gemm import GemmModel, gemm_time
from test_plan import SMALL, _cli, _cli_and_module, needs_xla_gpu

H100 = get_gpu("h100")


def _gemm(m, n, k, batch=1, model=GemmModel(), fp8=False):
    return gemm_time(m, n, k, batch, H100.fp8_peak_tflops if fp8 else H100.peak_tflops, H100.hbm_gbps,
                     2.0 * (m * k + k * n + m * n), model, fp8=fp8)


def test_gemm_efficiency_by_shape_and_its_reasons():
    big = _gemm(8192, 14336, 4096)                 # Llama-3-8B's gate/up projection, one micro batch
    assert big["bound"] == "compute" and big["efficiency"] > 0.7
    # a hidden size of 256: a short contraction pays the tiles' fill and epilogue on little work
    small = _gemm(8192, 256, 256)
    assert small["depth"] == pytest.approx(0.5) and small["efficiency"] < 0.5 * big["efficiency"]
    # 133 tiles of 128 x 256 on 132 SMs: a second wave for one tile
    waves = _gemm(133 * 128, 256, 4096)
    assert waves["wave"] == pytest.approx(133 / 264) and waves["efficiency"] < 0.55 * big["efficiency"]
    # 200 rows fill two 128-row tiles to 78%
    assert _gemm(200, 256 * 132, 4096)["tile"] == pytest.approx(200 / 256)
    # FP8 runs at the FP8 peak: faster, at its own fraction of it
    fp8 = _gemm(8192, 14336, 4096, fp8=True)
    assert fp8["seconds"] < 0.6 * big["seconds"] and fp8["efficiency"] < big["efficiency"]


def test_one_constant_does_not_set_the_ratio_between_shapes():
    """Scaling the peak fraction moves every GEMM alike, but the shapes' factors differ: the 8B GEMM's lead
    over the small one comes from tile, wave and depth efficiency, which no constant sets."""
    for fraction in (0.6, 0.8):
        model = GemmModel(peak_fraction=fraction)
        ratio = _gemm(8192, 14336, 4096, model=model)["efficiency"] / _gemm(8192, 256, 256, model=model)["efficiency"]
        assert ratio == pytest.approx(_gemm(8192, 14336, 4096)["efficiency"] / _gemm(8192, 256, 256)["efficiency"])
        assert ratio > 2.0


@needs_xla_gpu
def test_step_model_of_a_small_and_a_wider_model_and_its_independence_from_compute_efficiency():
    """XLA:GPU compiles for 1 H100: a hidden-256 model's GEMMs predict lower efficiency than a hidden-2048 one's
    (depth and tiles), so its predicted MFU is lower; the roofline's compute_efficiency does not enter it (the
    small model's module planned again with another compute_efficiency)."""
    args = ("--gpu", "h100", "--num-gpus", "1", *SMALL, "parallel.fsdp=1", "parallel.data=1")
    small, module = _cli_and_module(*args)
    wide = _cli("--gpu", "h100", "--num-gpus", "1", *SMALL, "parallel.fsdp=1", "parallel.data=1",
                "model.hidden_size=2048", "model.intermediate_size=8192", "model.num_heads=16",
                "model.num_kv_heads=8")
    s, w = small["step_model"], wide["step_model"]
    assert s["gemm"]["count"] > 0 and w["gemm"]["count"] > 0
    assert s["gemm_efficiency"] < 0.5 * w["gemm_efficiency"] and s["mfu"] < w["mfu"]
    assert s["exposed_comm_s"] == 0 and s["attention_s"] == 0  # one GPU; xla attention is GEMMs in the HLO
    # the same prediction with another compute_efficiency; the roofline's moves
    other = _cli("--hlo", module, "--compute-efficiency", "0.3", *args)
    assert other["source"] == "hlo" and other["step_model"]["gemm"] == s["gemm"]
    assert other["step_model"]["step_time_s"] == pytest.approx(s["step_time_s"])
    assert other["roofline"]["step_time_s"] > 1.3 * small["roofline"]["step_time_s"]


@needs_xla_gpu
def test_collectives_are_exposed_as_far_as_xlas_schedule_leaves_them_in_the_open():
    """FSDP on 2 H100s: with XLA's asynchronous collectives part of the transfers run under compute; with them
    made synchronous (--xla_gpu_disable_async_collectives) every transfer is exposed and the step is compute +
    communication. The same wire time both ways: only the schedule differs."""
    args = ("--gpu", "h100", "--num-gpus", "2", *SMALL, "parallel.fsdp=2", "parallel.data=1")
    overlapped = _cli(*args)["step_model"]
    sync = _cli(*args, xla_flags="--xla_gpu_disable_async_collectives=ALLGATHER,REDUCESCATTER,ALLREDUCE")["step_model"]
    for sm in (overlapped, sync):
        assert sm["comm_s"] > 0
        assert sm["step_time_s"] == pytest.approx(sm["compute_s"] + sm["exposed_comm_s"])
    assert sync["comm_s"] == pytest.approx(overlapped["comm_s"])
    # (a copy the schedule leaves between a start and its done hides a few nanoseconds)
    assert sync["exposed_comm_s"] == pytest.approx(sync["comm_s"], rel=1e-3)
    assert 0 < overlapped["exposed_comm_s"] < 0.8 * overlapped["comm_s"]
    assert overlapped["step_time_s"] < sync["step_time_s"]
    assert overlapped["longest_waits"] and overlapped["longest_waits"][0]["seconds"] > 0


def test_attention_kernels_are_timed_at_their_measured_rate():
    from helpers import tiny_config

    cfg = tiny_config("model.attention_impl=cudnn", "model.dtype=bfloat16")
    s = cfg.data.seq_len
    m = cfg.model
    forward = 2 * 2 * s * m.num_heads * (m.hidden_size // m.num_heads) * 0.5 * cfg.train.global_batch_size * s
    expected = forward * m.num_layers * 3.5 / 2 / (steptime.ATTENTION_TFLOPS["cudnn"] * 1e12)
    assert steptime.attention_seconds(cfg, 2) == pytest.approx(expected)
    full = dataclasses.replace(cfg, model=dataclasses.replace(m, remat="full"))
    assert steptime.attention_seconds(full, 2) == pytest.approx(expected * 4.5 / 3.5)
    xla = dataclasses.replace(cfg, model=dataclasses.replace(m, attention_impl="xla"))
    assert steptime.attention_seconds(xla, 2) == 0.0


@needs_xla_gpu
def test_cudnn_attention_and_pipeline_stages_are_timed_as_compiled():
    """Two H100s, micro batches of 2 sequences (4 of them a step under data 2). cuDNN attention: without cuDNN's libraries the
    compile puts jaxtron's Pallas flash attention in cuDNN's place; the step model still times the attention
    calls at the rate of the kernel the cluster runs. Under ``save_dots`` the backward runs each attention forward
    again (a kernel's output is no dot); ``save_dots_attention`` keeps the kernel's residuals, so the compiled
    step calls each forward kernel once, and the attention takes 3.5 of the 4.5 forward passes' time.
    parallel.stage=2 (1f1b) of the Pallas program: the stages run the Triton flash kernel, not its interpreter
    (the platform is the compile target's inside the pipeline's shard_map too), and the step model counts the
    schedule: more GEMM runs per token than without stages (each stage's forward recomputed in its backward,
    idle ticks)."""
    args = ("--gpu", "h100", "--num-gpus", "2", *SMALL, "data.seq_len=256", "parallel.fsdp=1",
            "train.micro_batch_size=2")
    pallas_args = (*args, "model.attention_impl=pallas", "model.remat=save_dots_attention")
    cudnn = _cli(*args, "parallel.data=2", "model.attention_impl=cudnn", "model.remat=save_dots")["step_model"]
    flat = _cli(*pallas_args, "parallel.data=2")
    pallas = flat["step_model"]
    assert cudnn["constants"]["attention_impl"] == "cudnn" and pallas["constants"]["attention_impl"] == "pallas"
    assert cudnn["gemm_s"] == pytest.approx(pallas["gemm_s"])  # the same matmuls
    passes = 4 * 4  # a backward pass per layer and micro batch
    assert steptime.attention_passes(cudnn["attention_kernels"]) == {"fwd": 2 * passes, "bwd": passes}
    assert steptime.attention_passes(pallas["attention_kernels"]) == {"fwd": passes, "bwd": passes}
    ratio = steptime.ATTENTION_TFLOPS["pallas"] / steptime.ATTENTION_TFLOPS["cudnn"]
    assert cudnn["attention_s"] == pytest.approx(pallas["attention_s"] * ratio * 4.5 / 3.5)

    piped = _cli(*pallas_args, "parallel.data=1", "parallel.stage=2")
    assert piped["mesh"]["stage"] == 2 and piped["memory"]["fits"]
    assert piped["kernels"]["triton_calls"] > 0 and flat["kernels"]["triton_calls"] > 0
    assert piped["step_model"]["gemm"]["count"] > 1.3 * pallas["gemm"]["count"]
    assert piped["step_model"]["step_time_s"] > pallas["step_time_s"]


@needs_xla_gpu
def test_search_proposes_a_pipeline_first_when_the_step_model_predicts_it_fastest():
    """16 H100s in 2 nodes joined by a 0.05 GB/s network, a model whose weights outweigh its activations
    (hidden 1024, seq 64): any layout with a batch axis across the nodes reduces gradients over that network,
    while stages across the nodes send only activations. --search compiles each stage count's best candidate
    (1 and 2 stages of the 2 layers: 2 compiles), ranks by the step model, and proposes a pipelined layout
    first, ahead of the best stage-1 layout it also compiled; every proposed layout fits."""
    wide = ["model.hidden_size=1024", "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=4",
            "model.intermediate_size=4096", "model.vocab_size=256", "model.dtype=bfloat16", "data.seq_len=64",
            "train.global_batch_size=64"]
    r = _cli("--gpu", "h100", "--num-gpus", "16", "--net-gbps", "0.05", "--search", "--max-compiles", "2",
             "--top", "2", *wide, timeout=600)
    assert len(r["top"]) == 2 and all(t["memory"]["fits"] for t in r["top"]), r
    times = [t["step_model"]["step_time_s"] for t in r["top"]]
    assert times == sorted(times)
    assert r["top"][0]["mesh"]["stage"] > 1, [t["overrides"] for t in r["top"]]
    flat = [t for t in r["top"] if t["mesh"]["stage"] == 1]
    assert flat and flat[0]["step_model"]["step_time_s"] > 1.2 * times[0]


def test_search_candidates_try_fp8_recipes_only_when_asked_and_drop_invalid_ones():
    """--search-fp8: the recipes become a search axis; blockwise candidates whose tensor split cuts a 128-wide
    tile are invalid and dropped before ranking; without it every candidate keeps the config's recipe."""
    from jaxtron.plan import candidate_configs
    from jaxtron.plan.search import passes_checks
    from test_plan import _cfg

    cfg = _cfg()
    assert {c.model.fp8 for c in candidate_configs(cfg, 8)} == {"none"}
    cands = [c for c in candidate_configs(cfg, 8, fp8_recipes=["none", "current", "blockwise"]) if passes_checks(c, 8)]
    assert {c.model.fp8 for c in cands} == {"none", "current", "blockwise"}
    blockwise = [c for c in cands if c.model.fp8 == "blockwise"]
    # kv heads x head_dim = 4 x 32 = 128: one tile, so blockwise never splits it over tensor
    assert blockwise and all(c.parallel.tensor == 1 for c in blockwise)
    assert any(c.parallel.tensor > 1 for c in cands if c.model.fp8 == "current")
    # pipelines: 1f1b, gpipe, circular with the virtual stage counts that split 4 layers into equal chunks, and
    # zbv where they split into 2 x stage chunks
    piped = {(c.parallel.stage, c.parallel.pipeline_schedule, c.parallel.virtual_stages) for c in cands
             if c.parallel.stage > 1}
    assert piped == {(2, "1f1b", 1), (2, "gpipe", 1), (2, "circular", 2), (2, "zbv", 1), (4, "1f1b", 1),
                     (4, "gpipe", 1)}, piped


def test_search_schedules_cover_gpipe_and_every_even_virtual_split():
    from jaxtron.plan.search import _schedules

    assert _schedules(80, 1) == [("1f1b", 1)]
    # Llama-3-70B on 4 stages: 20 layers each, split into 2, 4 or 5 virtual chunks; on 8 stages: 2 or 5
    assert _schedules(80, 4) == [("1f1b", 1), ("gpipe", 1), ("circular", 2), ("circular", 4), ("circular", 5),
                                 ("zbv", 1)]
    assert _schedules(80, 8) == [("1f1b", 1), ("gpipe", 1), ("circular", 2), ("circular", 5), ("zbv", 1)]
    assert ("zbv", 1) not in _schedules(20, 8)   # 20 layers are not 16 equal chunks


def test_the_step_models_constants_are_overridable():
    from jaxtron.plan.steptime import gemm_model

    model = gemm_model(H100.replace(gemm_peak_fraction=0.4, hbm_fraction=0.5))
    assert (model.peak_fraction, model.hbm_fraction, model.fp8_peak_fraction) == (0.4, 0.5, 0.7)
    assert _gemm(8192, 14336, 4096, model=model)["seconds"] == pytest.approx(2 * _gemm(8192, 14336, 4096)["seconds"])
    from helpers import tiny_config

    cfg = tiny_config("model.attention_impl=cudnn", "model.dtype=bfloat16")
    assert steptime.attention_seconds(cfg, 1, 100.0) == pytest.approx(
        steptime.attention_seconds(cfg, 1) * steptime.ATTENTION_TFLOPS["cudnn"] / 100.0)


def test_an_out_of_range_step_model_constant_is_a_one_line_error():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "jaxtron.plan", "--gemm-peak-fraction", "1.5"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: --gemm-peak-fraction: must be in (0, 1], got 1.5"


def test_search_compiles_the_best_of_each_stage_count_before_the_rest():
    """The closed form cannot see a schedule's recomputation and idle ticks, so --search compiles each stage
    count's best candidate before filling its budget in the closed form's order."""
    from types import SimpleNamespace

    from jaxtron.plan.search import to_compile

    cands = [SimpleNamespace(name=n, parallel=SimpleNamespace(stage=s))
             for n, s in (("a", 1), ("b", 1), ("c", 1), ("d", 2), ("e", 1), ("f", 4), ("g", 2))]
    scored = [(float(i), c) for i, c in enumerate(cands)]
    assert [c.name for c in to_compile(scored, 5)] == ["a", "d", "f", "b", "c"]
    assert [c.name for c in to_compile(scored, 2)] == ["a", "d"]
    assert [c.name for c in to_compile(scored, 10)] == ["a", "d", "f", "b", "c", "e", "g"]
