"""scripts/gpu_report.py end to end on CPU with the tiny model: the GPU parts are skipped with the reason, the
training steps and the planner's predictions for them run, and report.json and report.md say so; a call whose
time budget runs out leaves the rest to the next call with the same --out, which does not redo what is done.
The end-to-end run trains and plans one precision (each is a training run and an XLA:GPU compile); the order of
the parts over several precisions is checked on the script's plan of them, which runs nothing."""

import importlib.util
import json
import os
import subprocess
import sys

from helpers import cpu_xla_flags, xla_gpu_plugin_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_report_on_cpu_with_the_tiny_model(tmp_path):
    import jax

    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}

    def call(*extra):
        proc = subprocess.run([sys.executable, "scripts/gpu_report.py", "--out", str(tmp_path), "--tiny",
                               "--precisions", "delayed", *extra], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        return proc.stdout, json.loads((tmp_path / "report.json").read_text())

    # a budget of one second: the first training step is cut short (no tiny step compiles and runs in a
    # second), the GPU parts are recorded as skipped at no cost, and nothing else starts
    out, first = call("--budget", "1")
    parts = {p["part"]: p for p in first["parts"]}
    assert parts["train/tiny/delayed"]["cut_by_budget"] and "budget spent" in out, out
    assert "plan/tiny/delayed" not in parts and "gemm-table" not in parts
    assert all(parts[n]["status"] == "skipped" and parts[n]["call"] == 1 for n in ("attention", "kernel-check"))
    assert "| train/tiny/delayed | cut by the budget | 1 |" in (tmp_path / "report.md").read_text()
    # the next call runs what is left, and the cut part again; what the first call finished keeps its record
    out, report = call()
    assert "budget spent" not in out and len(report["calls"]) == 2, out
    parts = {p["part"]: p for p in report["parts"]}
    assert parts["attention"]["call"] == 1 and parts["train/tiny/delayed"]["call"] == 2
    assert not any(p.get("cut_by_budget") for p in report["parts"])
    assert [p["part"] for p in report["parts"]][:2] == ["train/tiny/delayed", "plan/tiny/delayed"]
    assert report["environment"]["platform"] == "cpu"
    for name in ("kernel-check", "attention", "grouped-matmul", "fp8-gemm"):
        assert parts[name]["status"] == "skipped" and "needs a GPU" in parts[name]["reason"]
    # the GEMM table's small-shape path runs; a CPU's table is not handed to the planner for a GPU
    assert parts["gemm-table"]["status"] == "ok" and parts["gemm-table"]["result"]["entries"] > 0
    assert json.loads((tmp_path / "gemm_table.json").read_text())["platform"] == "cpu"
    assert all("--gemm-table" not in p.get("command", "") for p in report["parts"] if p["part"].startswith("plan/"))
    train = parts["train/tiny/delayed"]
    assert train["status"] == "ok", train
    assert train["result"]["fp8"] == "delayed" and train["result"]["tokens_per_s"] > 0
    plan = parts["plan/tiny/delayed"]
    if xla_gpu_plugin_version() == jax.__version__:
        assert plan["status"] == "ok" and plan["result"]["compiler"] == "XLA:GPU", plan
        assert plan["result"]["roofline"]["tokens_per_s_per_gpu"] > 0
    else:
        assert plan["status"] == "skipped" and "plugin" in plan["reason"]
    md = (tmp_path / "report.md").read_text()
    assert "| train/tiny/delayed | ok |" in md and "## Training steps" in md
    row = next(line for line in md.splitlines() if line.startswith("| tiny | delayed | ok |"))
    measured = parts["train/tiny/delayed"]["result"]["tokens_per_s_per_device"]
    # the table's figures: whole numbers from 100 up, 3 significant digits below (a loaded CPU's rate)
    assert (f"{measured:,.0f}" if measured >= 100 else f"{measured:.3g}") in row


def test_gpu_report_runs_each_models_bf16_row_first_then_each_fp8_recipe():
    """The order of value over precisions and models (the run above has one of each): every model's bf16
    training step and its plan, then each FP8 recipe's; the GPU kernels, the GEMM table and the kernel check
    after them."""
    spec = importlib.util.spec_from_file_location("gpu_report", os.path.join(ROOT, "scripts", "gpu_report.py"))
    gpu_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_report)
    args = gpu_report.parse_args(["--out", "unused", "--precisions", "none", "delayed"])
    names = [name for name, _ in gpu_report.planned(args, "gpu", "NVIDIA H100 80GB HBM3")]
    rows = [f"{kind}/{model}/{fp8}" for fp8 in ("none", "delayed") for model in gpu_report.MODELS
            for kind in ("train", "plan")]
    # after the first model's bf16 pair, its step with the scan's outputs zero-filled (the default's check)
    assert names == rows[:2] + [gpu_report.ZEROED] + rows[2:] + ["attention", "grouped-matmul", "fp8-gemm",
                                                                 "gemm-table", "kernel-check"]
    tiny = gpu_report.parse_args(["--out", "unused", "--tiny", "--precisions", "none", "delayed"])
    assert [name for name, _ in gpu_report.planned(tiny, "cpu", "cpu")][:5] == [
        "train/tiny/none", "plan/tiny/none", gpu_report.ZEROED, "train/tiny/delayed", "plan/tiny/delayed"]
