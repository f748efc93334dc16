"""examples/quickstart.ipynb runs top to bottom on the CPU (as a user runs it: one device) and does what it says:
the loss falls, samples come out, the HF-imported model fine-tunes and exports back to transformers."""

import json
import os
import sys
import time

import pytest

from conftest import FAST_COMPILE

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "examples", "quickstart.ipynb")


def _kernelspec(tmp_path) -> str:
    """A kernel on this very interpreter (not whatever 'python3' a Jupyter installation might point at)."""
    kdir = tmp_path / "jupyter" / "kernels" / "jaxtron-test"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxtron test", "language": "python"}))
    return str(tmp_path / "jupyter")


@pytest.mark.slow
def test_quickstart_notebook_runs_on_cpu(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", _kernelspec(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)  # one CPU device, as on a user's machine (conftest asks for 8)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as on a user's machine: jaxtron picks the CPU
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, kernel_name="jaxtron-test", timeout=300,
                            resources={"metadata": {"path": str(work)}}).execute()
    seconds = time.perf_counter() - t0
    print(f"notebook executed in {seconds:.1f} s")
    nbformat.write(nb, str(tmp_path / "executed.ipynb"))  # for a look when something fails
    assert seconds < 600, "the notebook must run within 10 minutes on a CPU"

    out = work / "quickstart"
    summary = json.loads((out / "summary.json").read_text())
    train = [loss for _, loss in summary["train_losses"]]
    assert len(train) == 6 and train[-1] < train[0] - 1.0, train  # byte-level: ~5.5 nats at init
    evals = [loss for _, loss in summary["eval_losses"]]
    assert [s for s, _ in summary["eval_losses"]] == [0, 10, 20, 30] and evals[-1] < evals[0] - 1.0
    assert all(isinstance(s, str) for s in summary["samples"]) and len(summary["samples"]) == 2
    assert summary["text_loss"] < 5.0
    ft = [loss for _, loss in summary["finetune_losses"]]
    assert summary["finetune_eval"][1] < summary["finetune_eval"][0] - 0.5 and ft[-1] < ft[0]
    assert summary["hf_max_logit_diff"] < 1e-3  # fp32 on CPU: transformers reads the fine-tuned weights
    for path in ("run/metrics.jsonl", "run/checkpoints/30", "loss.png", "hf_tiny/config.json",
                 "hf_tiny_jaxtron/config.yaml", "finetune/checkpoints/20", "hf_finetuned/model.safetensors"):
        assert (out / path).exists(), path

    # the plot is displayed in the notebook, and no cell printed an error
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert not any(o.get("output_type") == "error" for o in outputs)
    printed = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "Traceback" not in printed and "cuda" not in printed.lower(), printed[-2000:]
