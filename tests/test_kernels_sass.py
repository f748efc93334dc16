"""The Mosaic GPU attention kernels compiled to Hopper SASS on this CPU-only machine (scripts/mosaic_sass.py):
ptxas's register report at Llama-3-8B shapes, so a change that makes a kernel spill fails here, not on a GPU."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import mosaic_sass  # noqa: E402

# Spill bytes (stores and loads) allowed per (kernel, head_dim); every other kernel must not spill at all.
# The fused dk/dv+dq kernel at head_dim 128 keeps a few loop bounds in local memory, mostly around its block
# loops (`--sass`: none in the unmasked loop, 2 reloads per masked iteration); it spilled 484 bytes before its
# K/V tiles went through `opaque_zero`. The forward at head_dim 128 keeps one or two values there (one reload per
# diagonal-block iteration, none in its unmasked loop).
SPILL_BUDGET = {("flash_attention_mosaic_dkv_dq", 128): 64, ("flash_attention_mosaic_fwd", 128): 16}
EXPECTED = {"flash_attention_mosaic_fwd", "flash_attention_mosaic_dkv_dq", "flash_attention_mosaic_dq",
            "flash_attention_mosaic_dkv"}

pytestmark = pytest.mark.skipif(mosaic_sass.unavailable() is not None,
                                reason=f"Mosaic SASS report unavailable: {mosaic_sass.unavailable()}")


def _report() -> list[dict]:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "mosaic_sass.py"), "--json"],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]          # 1: something spilled (checked below)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_mosaic_kernel_compiles_for_sm90a_without_spills_or_serialized_wgmma():
    """One test for the one report (a module fixture would be built once per xdist worker that runs a test of
    it: twice the 30 s compile): every kernel at both head dims, for sm_90a, within the register share of its
    three warpgroups, spilling at most its budget, and no wgmma serialized."""
    rows = _report()
    assert {(r["kernel"], r["head_dim"]) for r in rows} == {(k, d) for k in EXPECTED for d in (128, 64)}
    for r in rows:
        assert r["arch"] == "sm_90a", r
        # three warpgroups of 128 threads share the 65,536 registers; setmaxnreg moves them to the compute ones
        assert 0 < r["registers"] <= 65536 // 384, r
    over = [(r["kernel"], r["head_dim"], r["case"], r["spill_stores"], r["spill_loads"]) for r in rows
            if max(r["spill_stores"], r["spill_loads"]) > SPILL_BUDGET.get((r["kernel"], r["head_dim"]), 0)]
    assert not over, f"kernels spilling beyond their budget (kernel, head_dim, case, stores, loads): {over}"
    assert not [(r["kernel"], r["head_dim"], r["serialized"]) for r in rows if r["serialized"]]


def test_parse_ptxas_keeps_performance_loss_notes():
    text = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to the presence of Extern calls in the function 'k'.\n"
            "ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'\n"
            "    0 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 16 barriers\n")
    report = mosaic_sass.parse_ptxas(text)
    assert report["kernel"] == "k" and report["registers"] == 168 and report["spill_loads"] == 16
    assert len(report["serialized"]) == 1 and "wgmma.mma_async" in report["serialized"][0]


def test_sass_loops_parses_a_listing():
    listing = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "    .L_x_1:",
        "        /*0010*/                   HGMMA.64x64x16.F32 R24, gdesc[UR8], RZ, !UPT ;",
        "        /*0020*/                   LDL.64 R4, [R1+0x8] ;",
        "        /*0030*/                   STL [R1], R2 ;",
        "        /*0040*/              @P0 BRA `(.L_x_1) ;",
        "    .L_x_2:",
        "        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3 ;",
        "        /*0060*/                   BRA `(.L_x_1) ;",       # unconditional: a wait's way back, not a loop
    ])
    assert mosaic_sass.sass_loops(listing, min_instructions=1) == [
        {"start": "0x10", "end": "0x40", "instructions": 4, "hgmma": 1, "stl": 1, "ldl": 1}]


def test_parse_ptxas_names_the_missing_field():
    with pytest.raises(ValueError, match="registers"):
        mosaic_sass.parse_ptxas("ptxas info    : Compiling entry function 'x_mosaic_gpu_kernel' for 'sm_90a'\n"
                                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
