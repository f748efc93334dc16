"""What ``python -m jaxtron.plan`` tells a user (issue 37): a search where nothing fits says why and what to try
instead of an empty list; the ranked list gives tokens/s/GPU; a plan without pipeline stages has no pipeline
note; XLA's involuntary-rematerialization warnings are counted in one note, not printed. Small models on the CPU
compiler: at most one compile."""

import os
import re

import pytest

from jaxtron import config as config_lib
from jaxtron.plan import get_gpu
from jaxtron.plan.search import why_nothing_fits

SMALL = ["model.hidden_size=256", "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=4",
         "model.intermediate_size=1024", "model.vocab_size=256", "model.dtype=bfloat16", "data.seq_len=128",
         "train.global_batch_size=16"]


def _main(capsys, monkeypatch, *argv):
    from jaxtron.plan.__main__ import main

    monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # main sets it; restored after the test
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_search_where_nothing_fits_says_why_and_what_to_try(capsys, monkeypatch):
    # 4 MB usable per "GPU": every layout's closed-form estimate is above it, so nothing is compiled
    rc, out, _ = _main(capsys, monkeypatch, "--search", "--backend", "cpu", "--num-gpus", "8",
                       "--mem-fraction", "0.00005", *SMALL)
    assert rc == 0, out
    assert "top 0" not in out and "\nnothing fits:\n" in out, out
    lines = out[out.index("nothing fits:"):].splitlines()[1:3]
    assert re.fullmatch(r"  every layout's closed-form memory estimate is above 1\.15 x the 4\.1 MiB usable per "
                        r"GPU \(the smallest, [0-9.]+ MiB: .*parallel\.fsdp=.*\), so none was compiled", lines[0]), lines
    assert re.match(r"  tensor, fsdp and pipeline sizes and model\.remat none/save_dots/full were all tried; try more "
                    r"GPUs \(--num-gpus (16|32|64|128): optimizer state and weights shard over them\)", lines[1]), lines


def test_nothing_fits_names_the_smallest_compiled_peak_and_the_gpus_it_needs():
    cfg = config_lib.load(None, SMALL + ["model.moe.num_experts=4", "model.moe.expert_intermediate_size=256"])
    gpu = get_gpu("h100").replace(memory_bytes=10 * 2**30, mem_fraction=1.0)
    out = {"candidates": 3, "pruned_by_estimate": 1, "compiled": 2,
           "not_fitting_or_failed": [{"overrides": "parallel.fsdp=8", "peak": 35 * 2**30},
                                     {"overrides": "parallel.tensor=8", "peak": 70 * 2**30}]}
    lines = why_nothing_fits(out, cfg, gpu, 16, 1.15)
    assert lines[0] == "the smallest compiled peak is 35.0 GiB per GPU against 10.0 GiB usable (parallel.fsdp=8)"
    assert "--num-gpus 64:" in lines[1] and lines[1].startswith("tensor, fsdp, expert and pipeline sizes"), lines


@pytest.mark.slow
def test_search_lists_tokens_per_gpu_and_says_pipeline_only_for_pipelines(capsys, monkeypatch):
    rc, out, err = _main(capsys, monkeypatch, "--search", "--backend", "cpu", "--num-gpus", "8", "--max-compiles",
                         "1", "--top", "1", *SMALL)
    assert rc == 0, err[-3000:]
    ranked = re.search(r"\n1\. step [0-9.]+ s  ([0-9]+) tokens/s/GPU  MFU ", out)
    assert ranked and int(ranked.group(1)) > 0, out
    layout = out[ranked.end():].splitlines()[1]
    stage = int(re.search(r"parallel\.stage=(\d+)", layout).group(1))
    assert ("note: pipeline stages" in out) == (stage > 1), out
    assert "Involuntary full rematerialization" not in err


def test_xla_warnings_are_counted_not_printed(capfd):
    from jaxtron.jax_startup import stderr_filtered

    with stderr_filtered((b"[SPMD] Involuntary full rematerialization",)) as err_out:
        for _ in range(3):  # what XLA's partitioner writes from C++, straight to file descriptor 2
            os.write(2, b"W0000 spmd_partitioner.cc:652] [SPMD] Involuntary full rematerialization. The compiler "
                        b"was not able to go from sharding {replicated} to {devices=[2,1]0,1}\n")
        os.write(2, b"something else\n")
        err_out.say("progress: shown at once")
        assert capfd.readouterr().err == "progress: shown at once\n"  # the rest waits for the end
    assert err_out.dropped == {b"[SPMD] Involuntary full rematerialization": 3}
    assert capfd.readouterr().err == "something else\n"
