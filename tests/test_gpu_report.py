"""scripts/gpu_report.py end to end on CPU with the tiny model: the GPU parts are skipped with the reason, the
training steps and the planner's predictions for them run, and report.json and report.md say so; a call whose
time budget runs out leaves the rest to the next call with the same --out, which does not redo what is done."""

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
                               "--precisions", "none", "delayed", *extra], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        return proc.stdout, json.loads((tmp_path / "report.json").read_text())

    # a budget of one second: the first training step is cut short (no tiny step compiles and runs in a
    # second), the GPU parts are recorded as skipped at no cost, and nothing else starts
    out, first = call("--budget", "1")
    parts = {p["part"]: p for p in first["parts"]}
    assert parts["train/tiny/none"]["cut_by_budget"] and "budget spent" in out, out
    assert "plan/tiny/none" not in parts and "gemm-table" not in parts
    assert all(parts[n]["status"] == "skipped" and parts[n]["call"] == 1 for n in ("attention", "kernel-check"))
    assert "| train/tiny/none | cut by the budget | 1 |" in (tmp_path / "report.md").read_text()
    # the next call runs what is left, and the cut part again; what the first call finished keeps its record
    out, report = call()
    assert "budget spent" not in out and len(report["calls"]) == 2, out
    parts = {p["part"]: p for p in report["parts"]}
    assert parts["attention"]["call"] == 1 and parts["train/tiny/none"]["call"] == 2
    assert not any(p.get("cut_by_budget") for p in report["parts"])
    assert [p["part"] for p in report["parts"]][:4] == ["train/tiny/none", "plan/tiny/none", "train/tiny/delayed",
                                                        "plan/tiny/delayed"]
    assert report["environment"]["platform"] == "cpu"
    for name in ("kernel-check", "attention", "grouped-matmul", "fp8-gemm"):
        assert parts[name]["status"] == "skipped" and "needs a GPU" in parts[name]["reason"]
    # the GEMM table's small-shape path runs; a CPU's table is not handed to the planner for a GPU
    assert parts["gemm-table"]["status"] == "ok" and parts["gemm-table"]["result"]["entries"] > 0
    assert json.loads((tmp_path / "gemm_table.json").read_text())["platform"] == "cpu"
    assert all("--gemm-table" not in p.get("command", "") for p in report["parts"] if p["part"].startswith("plan/"))
    for fp8 in ("none", "delayed"):
        train = parts[f"train/tiny/{fp8}"]
        assert train["status"] == "ok", train
        assert train["result"]["fp8"] == fp8 and train["result"]["tokens_per_s"] > 0
        plan = parts[f"plan/tiny/{fp8}"]
        if xla_gpu_plugin_version() == jax.__version__:
            assert plan["status"] == "ok" and plan["result"]["compiler"] == "XLA:GPU", plan
            assert plan["result"]["roofline"]["tokens_per_s_per_gpu"] > 0
        else:
            assert plan["status"] == "skipped" and "plugin" in plan["reason"]
    md = (tmp_path / "report.md").read_text()
    assert "| train/tiny/delayed | ok |" in md and "## Training steps" in md
    row = next(line for line in md.splitlines() if line.startswith("| tiny | delayed | ok |"))
    assert f"{parts['train/tiny/delayed']['result']['tokens_per_s_per_device']:,.0f}" in row
