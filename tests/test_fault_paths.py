"""Fault paths a new user meets, each ending in one line that names the file or the value (issue 37):
incomplete checkpoint steps (verify and restore), an unreadable Orbax step record, a garbled meta, a tokenizer
smaller than the model's vocabulary."""

import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

from jaxtron.checkpoint import CheckpointError, Checkpointer
from jaxtron.checkpoint.__main__ import main as checkpoint_cli

STEP, WEIGHTS = 3, 4


def _state():
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones((4,))}
    return {"step": jnp.asarray(STEP), "params": params,
            "opt_state": {"mu": jax.tree.map(jnp.zeros_like, params), "count": jnp.asarray(STEP)}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training step (params, opt_state, meta) and a weights-only step (params, meta), saved for real."""
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ckpt = Checkpointer(str(directory), async_save=False)
    try:
        assert ckpt.save(STEP, _state(), {"data": {"next_step": STEP}})
        ckpt.save_params(WEIGHTS, _state()["params"], {"source": "hf"})  # as import-hf writes them
    finally:
        ckpt.close()
    return directory


@pytest.fixture
def ckpt_dir(saved, tmp_path):
    out = tmp_path / "checkpoints"
    shutil.copytree(saved, out)
    return out


def _verify(path, capsys):
    rc = checkpoint_cli(["verify", str(path)])
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def _restore(directory, step=STEP):
    ckpt = Checkpointer(str(directory), read_only=True)
    try:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state())
        return ckpt.restore(step, abstract)
    finally:
        ckpt.close()


def test_complete_and_weights_only_steps_pass_verify(ckpt_dir, capsys):
    rc, out, errors = _verify(ckpt_dir, capsys)
    assert rc == 0 and not errors, errors
    notes = [line for line in out.splitlines() if "weights only" in line]
    assert notes == [f"note: {ckpt_dir / str(WEIGHTS)}: weights only (no optimizer state): it loads with "
                     "checkpoint.load_weights but cannot resume a training run"], out
    state, meta = _restore(ckpt_dir)
    assert meta["step"] == STEP and float(state["params"]["w"][2, 3]) == 11.0


@pytest.mark.parametrize("item", ["params", "opt_state", "meta"])
def test_a_missing_item_fails_verify_and_restore_naming_it(ckpt_dir, capsys, item):
    shutil.rmtree(ckpt_dir / str(STEP) / item)
    rc, _, errors = _verify(ckpt_dir / str(STEP), capsys)
    missing = ckpt_dir / str(STEP) / item
    assert rc == 1 and errors == [f"error: {missing}: missing (step {STEP} was saved with it; resuming needs it)"], \
        errors
    with pytest.raises(CheckpointError, match=f"^{missing}: missing \\(checkpoint step {STEP}\\)$"):
        _restore(ckpt_dir)


def test_without_orbax_step_records_the_meta_decides_what_a_step_needs(ckpt_dir, capsys):
    for step in (STEP, WEIGHTS):
        os.remove(ckpt_dir / str(step) / "_CHECKPOINT_METADATA")
    rc, out, errors = _verify(ckpt_dir, capsys)
    assert rc == 0 and not errors and "weights only" in out, (out, errors)
    shutil.rmtree(ckpt_dir / str(STEP) / "opt_state")
    rc, _, errors = _verify(ckpt_dir, capsys)
    assert rc == 1 and errors == [f"error: {ckpt_dir / str(STEP) / 'opt_state'}: missing (step {STEP} is a "
                                  "training step; resuming needs it)"], errors


def test_a_weights_only_step_does_not_resume(ckpt_dir):
    with pytest.raises(CheckpointError, match=f"{ckpt_dir / str(WEIGHTS) / 'opt_state'}: missing .*load_weights"):
        _restore(ckpt_dir, WEIGHTS)


def test_a_garbled_meta_is_named(ckpt_dir, capsys):
    path = ckpt_dir / str(STEP) / "meta" / "metadata"
    path.write_text('{"step": 3, "data": ')
    rc, _, errors = _verify(ckpt_dir, capsys)
    assert rc == 1 and len(errors) == 1 and errors[0].startswith(f"error: {path}: unreadable meta (step {STEP}; "
                                                                  "JSONDecodeError"), errors
    with pytest.raises(CheckpointError, match=f"^{path}: unreadable meta"):
        _restore(ckpt_dir)


def test_a_garbled_orbax_step_record_fails_verify_and_is_said_once(ckpt_dir, capsys, caplog):
    path = ckpt_dir / str(STEP) / "_CHECKPOINT_METADATA"
    path.write_text("garbage{")
    rc, _, errors = _verify(ckpt_dir, capsys)
    assert rc == 1 and len(errors) == 1 and errors[0].startswith(
        f"error: {path}: unreadable step metadata (step {STEP}; JSONDecodeError"), errors
    caplog.set_level(logging.INFO)
    for _ in range(2):  # Orbax reads the record at every look at the step, and ignores a bad one
        state, _ = _restore(ckpt_dir)
    assert float(state["params"]["b"][0]) == 1.0
    said = [r for r in caplog.records if str(path) in r.getMessage()]
    assert [(r.name, r.levelname) for r in said] == [("jaxtron", "WARNING")], [r.getMessage() for r in said]
    json.loads((ckpt_dir / str(WEIGHTS) / "_CHECKPOINT_METADATA").read_text())  # the other step is untouched
    assert os.path.isdir(ckpt_dir / str(WEIGHTS) / "params")


def test_orbax_save_waits_are_said_once_at_info(caplog):
    import jaxtron.checkpoint.manager  # noqa: F401  (installs the filter on absl's logger)

    caplog.set_level(logging.DEBUG)
    for seconds in (1.8, 2.5, 0.9):  # what Orbax logs before each save that waited for the previous one
        logging.getLogger("absl").warning("Waiting for previous save to complete took %f seconds. If this number "
                                          "is high, consider checkpointing less frequently.", seconds)
    said = [(r.name, r.levelname, r.getMessage()[:24]) for r in caplog.records]
    # the first wait of the process is said at info level (an earlier test may have had it), the rest at debug
    assert said[-2:] == [("jaxtron", "DEBUG", "checkpoint: waited 2.5 s"), ("jaxtron", "DEBUG", "checkpoint: waited 0.9 s")]
    assert said[:-2] in ([("jaxtron", level, "checkpoint: waited 1.8 s")] for level in ("INFO", "DEBUG")), said


@pytest.fixture(scope="module")
def bpe_sized_import(tmp_path_factory):
    """A weights-only checkpoint imported from a random HF Llama whose vocabulary (400) is larger than the byte
    tokenizer's, from a folder without a tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from jaxtron.convert import checkpoint_io

    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    src = str(tmp_path_factory.mktemp("hf"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    out = str(tmp_path_factory.mktemp("imported") / "ckpt")
    checkpoint_io.import_hf(src, out)
    return out


def test_generate_with_a_tokenizer_smaller_than_the_model_decodes_what_it_can(bpe_sized_import, capsys):
    from jaxtron.generate import __main__ as generate_cli

    # near-uniform logits over 400 ids, sampled: ids >= 256 come out (the byte tokenizer cannot decode them)
    argv = ["--checkpoint", bpe_sized_import, "--prompt", "ab", "--max-new-tokens", "16", "--temperature", "1"]
    assert generate_cli.main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ab") and "\ufffd" in out.out, out
    warnings = out.err.strip().splitlines()
    assert "Traceback" not in out.err and all(w.startswith("warning: ") for w in warnings), warnings
    assert warnings[0] == (f"warning: {bpe_sized_import} records no tokenizer (the Hugging Face folder it was "
                           "imported from had no tokenizer.json): using the byte tokenizer; pass --tokenizer if it "
                           "was trained with another")
    assert re.fullmatch(r"warning: \d+ generated ids are outside the tokenizer's 256 ids \(the model has 400\), "
                        "shown as \ufffd: pass the tokenizer the model was trained with", warnings[1]), warnings


def test_decode_known_counts_what_the_tokenizer_lacks():
    from jaxtron.data.tokenizers import ByteLevelTokenizer
    from jaxtron.generate import decode_known

    tok = ByteLevelTokenizer()
    assert decode_known(tok, list(b"hi")) == ("hi", 0)
    assert decode_known(tok, [104, 300, 105, 399, 399]) == ("h\ufffdi\ufffd\ufffd", 3)


def test_export_writes_weights_readable_like_the_other_files(bpe_sized_import, tmp_path, capsys):
    from jaxtron.convert.__main__ import main as convert_cli

    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert convert_cli(["export-hf", "--checkpoint", bpe_sized_import, "--out", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {f: oct(os.stat(out / f).st_mode & 0o777) for f in os.listdir(out)}
    assert modes["model.safetensors"] == modes["config.json"] == oct(0o644), modes


def test_convert_help_and_deepseek_export_say_what_is_true(capsys):
    import dataclasses

    from jaxtron import config as config_lib
    from jaxtron.config.model_schema import MLAConfig, MTPConfig
    from jaxtron.convert import hf
    from jaxtron.convert.__main__ import main as convert_cli

    with pytest.raises(SystemExit):
        convert_cli(["import-hf", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Qwen3MoeForCausalLM or DeepseekV3ForCausalLM folder" in text, text
    cfg = config_lib.load("deepseek_v3_small", [])
    assert hf.config_to_hf(cfg.model)["architectures"] == ["DeepseekV3ForCausalLM"]
    gqa = dataclasses.replace(cfg.model, mla=MLAConfig(), mtp=MTPConfig())  # DeepSeek's MoE without its attention
    with pytest.raises(ValueError, match=r"^model\.moe: a DeepSeek-V3-style MoE \(num_shared_experts=1, "
                                         r"score_func=sigmoid, .*\) saves as DeepseekV3ForCausalLM, which needs "
                                         r"Multi-head Latent Attention \(model\.mla\)$"):
        hf.config_to_hf(gqa)


@pytest.mark.parametrize("lr", ["1e39", "inf", "50"])
def test_a_learning_rate_past_any_sane_range_is_refused(lr):
    from jaxtron import config as config_lib

    with pytest.raises(config_lib.ConfigError, match=r"^optim\.lr: must be a finite learning rate <= 10, got "):
        config_lib.load(None, [f"optim.lr={lr}"])


def test_prepare_writes_no_progress_frames_into_a_redirected_log(tmp_path, capsys):
    from jaxtron.data.prepare import main as prepare_cli

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(20)))
    assert prepare_cli(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer", "byte"]) == 0
    out = capsys.readouterr()  # stderr is not a terminal here, as in `... 2> prepare.log`
    assert "\r" not in out.err and "\r" not in out.out, repr(out.err[:300])
    assert out.out.startswith(f"wrote {tmp_path / 'out'}.bin")


def test_import_jaxtron_then_jax_is_quiet_without_a_gpu():
    """With the CUDA plugin installed (the test extra) and no NVIDIA driver, ``import jaxtron, jax`` printed the
    driver probe's lines and, at the first device use, a 'Jax plugin configuration error' traceback."""
    import importlib.util
    import subprocess
    import sys

    from jaxtron.jax_startup import nvidia_driver_present

    if importlib.util.find_spec("jax_plugins") is None or nvidia_driver_present():
        pytest.skip("needs the CUDA plugin installed on a machine without an NVIDIA driver")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import sys, jaxtron; assert 'jax' not in sys.modules; import jax; print(jax.devices()[0].platform)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def test_evaluate_splits_the_windows_over_every_device(bpe_sized_import):
    import numpy as np

    from jaxtron import evaluate as ev
    from jaxtron import preflight
    from jaxtron.convert.loading import load_for_inference

    model = load_for_inference(bpe_sized_import, "float32").model
    tokens = np.random.default_rng(0).integers(0, 400, 16 * 11 + 1)
    alone = ev.evaluate(model, ev.windows_from_tokens(tokens, 16, 3))
    layout = preflight.inference_layout(model.cfg, ["parallel.data=-1"])
    assert layout.dp == len(jax.devices()) == 8
    seen = []
    spread = ev.evaluate(layout.place(model), ev.windows_from_tokens(tokens, 16, 3), layout=layout,
                         progress=lambda *a: seen.append(a))
    assert spread["tokens"] == alone["tokens"] == 16 * 11 and spread["batches"] == 4  # 3 + 3 + 3 + 2 windows
    np.testing.assert_allclose(spread["loss"], alone["loss"], rtol=1e-5)
    assert [a[0] for a in seen] == [1, 2, 3, 4]


def test_a_killed_peer_on_this_machine_is_named_at_the_next_beat(capfd):
    """Its collective may not fail at once (a survivor waited the whole collective timeout in 2 of 3 tries): the
    watchdog sees the peer's process gone, or a zombie its parent has not reaped, within a beat."""
    import signal
    import subprocess
    import sys
    import time

    import threading

    from jaxtron.parallel.watchdog import EXIT_PEER_LOST, PeerWatchdog, machine_id
    from test_watchdog import Store, _wait

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store = Store()
        store.kv["jaxtron/pid/1"] = f"{machine_id()} {peer.pid}"
        store.kv["jaxtron/alive/1"] = "1"
        exits = []
        dog = PeerWatchdog(store, 0, 2, timeout=30, interval=0.05, exit_fn=exits.append)
        dog._set("alive", "0")
        threading.Thread(target=dog._run, daemon=True).start()
        time.sleep(0.3)
        assert exits == []  # alive: nothing said
        peer.send_signal(signal.SIGKILL)  # not reaped: a zombie
        t0 = time.time()
        _wait(lambda: exits)
        assert exits == [EXIT_PEER_LOST] and time.time() - t0 < 2
    finally:
        peer.kill()
        peer.wait()
    assert capfd.readouterr().err.splitlines()[-1] == (
        "error: process 1 of 2 was killed or crashed (its process on this machine is gone); exiting")
