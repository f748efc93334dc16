"""scripts/peer_compare.py: jaxtron's train step and MaxText's, through the same planner (issue 38).

``--tiny`` compiles jaxtron's tiny model for 8 H100s with this Python's jax and reads MaxText's committed tiny
module (tests/data/maxtext_tiny_fsdp8_h100.*) with ``python -m jaxtron.plan --hlo``; the table must be filled
for both programs. The real MaxText compile runs only where its pinned environment is usable
(``scripts/peer_compile.py --check-env``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtron.plan import target as plan_target

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "peer_compare.py"
TINY_DATA = ROOT / "tests" / "data" / "maxtext_tiny_fsdp8_h100"
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

needs_xla_gpu = pytest.mark.skipif(not plan_target.cuda_plugin_matches(),
                                   reason=f"jax-cuda12-plugin {plan_target.cuda_plugin_version()} is not jaxlib's "
                                          f"release ({plan_target.jaxlib_version()}): no XLA:GPU cross-compile")


def _run(*argv, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _assert_sane(line: dict, gbs: int, seq: int) -> None:
    """One program's line of the table: every column filled, each in a range it can have."""
    who = f"{line['row']}/{line['program']}"
    assert line["error"] is None, who
    assert 0 < line["step_time_s"] < 1.0, who
    assert line["tokens_per_s_per_gpu"] == pytest.approx(gbs * seq / line["step_time_s"] / line["num_gpus"]), who
    assert 0 < line["mfu"] < 1, who
    # the tiny model's matmuls, remat included, over Megatron's model FLOPs (attention in kernels is not a dot)
    assert 0.5 < line["dot_over_model_flops"] < 3, (who, line["dot_over_model_flops"])
    # the step model timed as GEMMs the FLOPs the HLO's dots (and cuBLAS calls) hold: it read every GEMM's shape
    assert line["timed_over_dot_flops"] == pytest.approx(1.0, abs=1e-3), (who, line["timed_over_dot_flops"])
    assert line["memory_bound_bytes"] > 0, who
    wire = line["collective_wire_bytes"]
    assert set(wire) == set(KINDS) and all(v >= 0 for v in wire.values()), who
    assert wire["all-gather"] > 0 and wire["reduce-scatter"] + wire["all-reduce"] > 0, who  # FSDP 8
    assert 0 <= line["exposed_comm_s"] <= line["comm_s"] + 1e-12, who
    assert 1 <= len(line["longest_waits"]) <= 3, who
    assert all(w["seconds"] > 0 and w["collective"] for w in line["longest_waits"]), who
    assert line["kernels_per_step"] >= 20, who
    assert 0 < line["peak_bytes"] < 2**30 and line["fits"], who


@needs_xla_gpu
def test_tiny_table_has_both_programs(tmp_path):
    """The CI path: both programs' columns filled with sane values, the ratio is theirs, and a rerun is served
    from the cache (nothing recompiled)."""
    r = _run("--out", str(tmp_path), "--tiny", "--tiny-data", str(TINY_DATA))
    assert r.returncode == 0, r.stderr[-2000:]
    table = json.loads((tmp_path / "table.json").read_text())
    assert [(ln["row"], ln["program"]) for ln in table["lines"]] == [("tiny", "jaxtron"), ("tiny", "maxtext")]
    record = json.loads(TINY_DATA.with_name(TINY_DATA.name + ".json").read_text())
    for line in table["lines"]:
        _assert_sane(line, record["global_batch"], record["seq_len"])
    jx, mt = table["lines"]
    (row,) = table["rows"]
    assert row["step_time_ratio"] == pytest.approx(jx["step_time_s"] / mt["step_time_s"])
    assert row["settings"]["from"] == "maxtext.json" and row["errors"] == {}
    md = (tmp_path / "table.md").read_text()
    assert "| tiny | jaxtron |" in md and "| tiny | maxtext |" in md and "- tiny: " in md

    made = {f: (tmp_path / "tiny" / f).stat().st_mtime_ns for f in ("jaxtron.json", "maxtext_plan.json")}
    again = _run("--out", str(tmp_path), "--tiny", "--tiny-data", str(TINY_DATA), timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {f: (tmp_path / "tiny" / f).stat().st_mtime_ns for f in made} == made
    assert json.loads((tmp_path / "table.json").read_text())["lines"] == table["lines"]


def test_a_failing_part_is_one_line_and_the_table_is_still_written(tmp_path):
    """A bad jaxtron override fails both planner runs of the row (they share the describing config): each is
    recorded with the planner's one-line error, the table has both lines, and the exit status is 1."""
    r = _run("--out", str(tmp_path), "--tiny", "--tiny-data", str(TINY_DATA), "--jaxtron-overrides",
             "model.no_such_field=1", timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    table = json.loads((tmp_path / "table.json").read_text())
    for line in table["lines"]:
        assert line["step_time_s"] is None
        assert "no_such_field" in line["error"] and "\n" not in line["error"], line["error"]
    assert (tmp_path / "tiny" / "jaxtron.error.txt").exists()
    assert "failed: " in (tmp_path / "table.md").read_text()


def test_bad_arguments_are_one_line(tmp_path):
    r = _run("--out", str(tmp_path), "--tiny", "--rows", "llama3-8b-8", timeout=60)
    assert r.returncode == 2 and "--tiny runs the tiny row only" in r.stderr.splitlines()[-1]
    r = _run("--out", str(tmp_path), "--rows", "gpt5", timeout=60)
    assert r.returncode == 2 and "invalid choice: 'gpt5'" in r.stderr.splitlines()[-1]


def test_plugin_check_compares_the_release_as_jaxlib_does(monkeypatch):
    """jaxlib loads the CUDA plugin only for its own numeric release: 0.12.0.1 takes plugin 0.12.0.1 and refuses
    0.12.0 (jaxlib/plugin_support.py); suffixes are not compared."""
    assert plan_target.release("0.12.0.1") == (0, 12, 0, 1)
    assert plan_target.release("0.10.2.dev20260101+cuda12") == (0, 10, 2)
    monkeypatch.setattr(plan_target, "jaxlib_version", lambda: "0.12.0.1")
    for plugin, ok in (("0.12.0.1", True), ("0.12.0", False), ("0.12.0.1+cuda12", True), (None, False)):
        monkeypatch.setattr(plan_target, "cuda_plugin_version", lambda v=plugin: v)
        assert plan_target.cuda_plugin_matches() is ok, plugin
    monkeypatch.setattr(plan_target, "cuda_plugin_version", lambda: "0.12.0")
    with pytest.raises(plan_target.CompilerUnavailable, match=r"0\.12\.0 does not match jaxlib 0\.12\.0\.1.*"
                                                              r"jax-cuda12-plugin==0\.12\.0\.1"):
        plan_target.target_devices(__import__("jaxtron.plan.gpus", fromlist=["get_gpu"]).get_gpu("h100"), 8)


def test_a_cuda13_plugin_of_jaxlib_release_is_the_compiler(monkeypatch):
    """A GPU machine's jax may carry the CUDA 13 plugin only: the planner compiles with it when it is jaxlib's
    release, and names the plugin it found when none is."""
    import importlib.metadata

    installed = {"jax-cuda13-plugin": "0.11.2"}

    def version(name):
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(plan_target.importlib.metadata, "version", version)
    monkeypatch.setattr(plan_target, "jaxlib_version", lambda: "0.11.2")
    assert plan_target.cuda_plugin() == ("jax-cuda13-plugin", "0.11.2") and plan_target.cuda_plugin_matches()
    installed["jax-cuda12-plugin"] = "0.10.2"  # the one of jaxlib's release wins
    assert plan_target.cuda_plugin() == ("jax-cuda13-plugin", "0.11.2")
    del installed["jax-cuda13-plugin"]
    assert plan_target.cuda_plugin() == ("jax-cuda12-plugin", "0.10.2") and not plan_target.cuda_plugin_matches()


def _maxtext_env_usable() -> bool:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "peer_compile.py"), "--check-env"],
                       capture_output=True, timeout=120)
    return r.returncode == 0


@pytest.mark.slow
def test_real_maxtext_compile_of_the_tiny_row(tmp_path):
    """MaxText's own train step compiled by peer_compile in its pinned env, and jaxtron's in the same env (the
    same jax), both planned: skipped where that env is absent."""
    if not _maxtext_env_usable():
        pytest.skip("the MaxText env is not usable (scripts/peer_compile.py --check-env): no MaxText compile")
    r = _run("--out", str(tmp_path), "--rows", "tiny", timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    table = json.loads((tmp_path / "table.json").read_text())
    record = json.loads((tmp_path / "tiny" / "maxtext.json").read_text())
    assert table["versions"]["jax"] == record["versions"]["jax"]  # one XLA for both programs
    for line in table["lines"]:
        _assert_sane(line, record["global_batch"], record["seq_len"])
