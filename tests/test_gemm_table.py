"""The planner's measured GEMM table: scripts/gemm_table.py measures and writes one (its small-shape CPU path
here), jaxtron/plan/gemm.py times a measured shape at its measurement and moves other shapes from the nearest
measured one by the model's tile, wave and depth factors (the step model of a committed XLA:GPU module planned
with a table), and a bad table is a one-line error."""

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import cpu_xla_flags
from jaxtron.plan import get_gpu
from jaxtron.plan.gemm import GemmModel, gemm_time, load_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = get_gpu("h100")


def _time(m, n, k, model, fp8=False, batch=1):
    return gemm_time(m, n, k, batch, H100.fp8_peak_tflops if fp8 else H100.peak_tflops, H100.hbm_gbps,
                     2.0 * (m * k + k * n + m * n), model, fp8=fp8)


def test_the_script_measures_and_writes_a_table_the_planner_loads(tmp_path):
    out = tmp_path / "table.json"
    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "scripts/gemm_table.py", "--out", str(out), "--tiny", "--iters", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    table = json.loads(out.read_text())
    assert summary["entries"] == len(table["entries"]) == 2 * 3 and table["platform"] == "cpu"
    for e in table["entries"]:
        assert e["dtype"] == "bf16" and e["seconds"] > 0
        assert e["tflops"] == pytest.approx(2 * e["m"] * e["n"] * e["k"] / e["seconds"] / 1e12)
    points = load_table(str(out))
    assert {(p[0], p[1], p[2]) for p in points} == {(m, n, k) for m in (64, 256)
                                                     for k, n in ((64, 64), (256, 128), (128, 512))}


def test_a_measured_shape_takes_its_measurement_and_others_move_by_the_models_factors():
    table = ((8192, 14336, 4096, False, 600.0), (8192, 14336, 4096, True, 1100.0))
    model = GemmModel(table=table)
    # the measured shape: exactly its measurement, whatever the model's constants say
    t = _time(8192, 14336, 4096, model)
    assert t["source"] == "table" and t["seconds"] == pytest.approx(2 * 8192 * 14336 * 4096 / 600e12)
    assert _time(8192, 14336, 4096, model, fp8=True)["seconds"] == pytest.approx(2 * 8192 * 14336 * 4096 / 1100e12)
    # a short contraction near it: the measured efficiency times the model's depth ratio
    short = _time(8192, 14336, 256, model)
    ratio = (256 / (256 + 256)) / (4096 / (4096 + 256))
    assert short["efficiency"] == pytest.approx(600 / H100.peak_tflops * ratio)
    # no FP8 point: FP8 GEMMs keep the model
    bf16_only = GemmModel(table=table[:1])
    assert _time(8192, 14336, 4096, bf16_only, fp8=True)["source"] == "model"
    assert _time(8192, 14336, 4096, GemmModel())["source"] == "model"


@pytest.mark.parametrize("content, says", [
    ("{", "cannot read"),
    ('{"entries": []}', "has no 'entries' list"),
    ('{"entries": [{"m": 1, "n": 2, "k": 3}]}', "entry 0 needs m, n, k, dtype and tflops"),
    ('{"entries": [{"m": 1, "n": 2, "k": 3, "dtype": "fp16", "tflops": 1}]}', "dtype 'fp16'"),
    ('{"entries": [{"m": 1, "n": 2, "k": 3, "dtype": "bf16", "tflops": 0}]}', "must be positive"),
])
def test_a_bad_table_is_a_one_line_error_naming_it(tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=says) as err:
        load_table(str(bad))
    assert str(bad) in str(err.value)
    if says == "cannot read":  # the command line says it once, before compiling anything
        proc = subprocess.run([sys.executable, "-m", "jaxtron.plan", "--gemm-table", str(bad)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: --gemm-table: cannot read {bad}") and "Traceback" not in proc.stderr


def test_the_step_model_takes_the_table_for_the_gemms_it_covers(tmp_path, capsys):
    """The committed XLA:GPU module of the tiny model on 2 H100s (tests/test_plan_hlo.py) planned with and without
    a table of one bf16 point at 100 TFLOP/s: with it every GEMM is timed from that point (efficiency 100/989 at
    that shape, moved by the shape factors) and the GEMM time grows accordingly (the table changes the
    arithmetic, not the program)."""
    from jaxtron.plan.__main__ import main
    from test_plan_hlo import HLO, MEMORY, TINY_FSDP2

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"entries": [{"m": 2048, "n": 1024, "k": 256, "dtype": "bf16", "tflops": 100.0}]}))

    def step_model(*extra):
        assert main(["--hlo", HLO, "--memory-json", MEMORY, "--gpu", "h100", "--num-gpus", "2", "--json",
                     *TINY_FSDP2, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_model"]

    base, measured = step_model(), step_model("--gemm-table", str(table))
    assert {s["source"] for s in measured["gemm_top_shapes"].values()} == {"table"}
    assert {s["source"] for s in base["gemm_top_shapes"].values()} == {"model"}
    assert measured["constants"]["table_points"] == 1 and measured["constants"]["table_source"] == str(table)
    assert base["gemm"]["count"] == measured["gemm"]["count"] > 0
    # the model's own efficiency at that shape against the measured 100/989: the GEMMs slow by about that ratio
    model_eff = _time(2048, 1024, 256, GemmModel())["efficiency"]
    assert measured["gemm_s"] > base["gemm_s"] * 0.5 * model_eff / (100 / 989)
    assert not math.isclose(measured["gemm_s"], base["gemm_s"], rel_tol=0.05)
