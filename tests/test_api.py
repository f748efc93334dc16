"""The public Python API (``import jaxtron``): exports and docstrings, a Trainer extended with a custom loss and
callbacks without touching the loop, driving it step by step, checkpoints from the API, the sharded model
helper, dict overrides and data preparation."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtron
from helpers import synthetic_batch, tiny_config
from jaxtron.train.loss import cross_entropy_sums

SMALL_DATA = ("data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1")
Z = 1e-2


def test_public_names_resolve_and_have_docstrings():
    for name in jaxtron.__all__:
        obj = getattr(jaxtron, name)
        assert (obj.__doc__ or "").strip(), f"jaxtron.{name} has no docstring"
    assert jaxtron.Trainer.step.__doc__ and jaxtron.Callback.on_log.__doc__
    # generate/evaluate are the functions (callable) and still the modules
    assert callable(jaxtron.generate) and callable(jaxtron.generate.sample_logits)
    assert callable(jaxtron.evaluate) and callable(jaxtron.evaluate.windows_from_tokens)
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        jaxtron.Trainr  # noqa: B018


def test_import_jaxtron_does_not_import_jax():
    code = "import sys, jaxtron; jaxtron.load_config(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_load_config_takes_dict_or_dotted_overrides():
    cfg = jaxtron.load_config("tiny", {"train.steps": 7, "checkpoint.async_save": False, "checkpoint.dir": None,
                                       "optim.lr": 3e-4})
    assert cfg.train.steps == 7 and cfg.checkpoint.async_save is False and cfg.optim.lr == 3e-4
    assert cfg == jaxtron.load_config(None, ["train.steps=7", "checkpoint.async_save=false", "optim.lr=0.0003"])
    with pytest.raises(jaxtron.ConfigError, match="^train.stpes"):
        jaxtron.load_config(None, {"train.stpes": 1})
    with pytest.raises(jaxtron.ConfigError, match="^model.num_kv_heads"):
        jaxtron.load_config(None, {"model.num_kv_heads": 3})


# ------------------------------------------------------------------------------ custom loss and callbacks


def z_loss(model, batch):
    """Cross entropy plus an auxiliary z-loss (Z * logsumexp^2), written here, outside jaxtron."""
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    ce, _, _ = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    z = jnp.sum(Z * jnp.square(lse) * batch["loss_mask"].astype(jnp.float32))
    return ce + z, {"ce": ce, "z_loss": z}


# 4 devices: fsdp 2 x tensor 2, micro batch 2 per replica -> 2 accumulation steps
LAYOUT = ("parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2", "train.micro_batch_size=2")


def _run_steps(trainer, batches):
    return [jax.device_get(trainer.step(b)) for b in batches]


def test_custom_loss_runs_inside_the_jitted_step_with_accumulation_and_sharding():
    """A z-loss written in the test gives the same updates as jaxtron's built-in optim.z_loss (not those of
    plain cross entropy: the z term's gradient is not zero), on an fsdp x tensor mesh with gradient
    accumulation; its aux terms come back as metrics, summed over the micro batches."""
    cfg = tiny_config(*LAYOUT)
    batches = [synthetic_batch(cfg, i) for i in range(3)]
    custom = jaxtron.Trainer(cfg, jax.devices()[:4], loss_fn=z_loss)
    builtin = jaxtron.Trainer(tiny_config(*LAYOUT, f"optim.z_loss={Z}"), jax.devices()[:4])
    m_custom, m_builtin = (_run_steps(t, batches) for t in (custom, builtin))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 custom.state["params"], builtin.state["params"])
    for mc, mb in zip(m_custom, m_builtin):
        np.testing.assert_allclose(mc["ce"], mb["loss"], rtol=1e-5)  # built-in reports plain cross entropy
        np.testing.assert_allclose(mc["loss"], mc["ce"] + mc["z_loss"], rtol=1e-5)
        assert mc["z_loss"] > 0.1 and not mc["skipped"] and mc["tokens"] == mb["tokens"] == 8 * 16
    assert int(custom.state["step"]) == 3 and custom.step_count == 3


class Recorder(jaxtron.Callback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_train_begin(self, step, trainer):
        self.events.append(("begin", step))

    def on_step(self, step, metrics, trainer):
        self.events.append(("step", step))
        if step == self.stop_at:
            trainer.request_stop("enough")

    def on_log(self, step, metrics, trainer):
        self.events.append(("log", step, sorted(metrics)))
        metrics["z_share"] = metrics["z_loss"] / metrics["loss"]  # written to metrics.jsonl as well

    def on_eval(self, step, metrics, trainer):
        self.events.append(("eval", step, metrics["eval_loss"]))

    def on_train_end(self, step, result, trainer):
        self.events.append(("end", step, result.stopped_by))


def test_trainer_loop_with_custom_loss_and_callbacks(tmp_path):
    """train() runs the custom loss and calls every hook; a callback adds a metric and stops the run early
    (checkpointed); a plain function works as a log callback; the next train() resumes."""
    overrides = (*SMALL_DATA, "train.steps=6", "train.eval_every=2", "logging.log_every=2",
                 f"train.output_dir={tmp_path}")
    cfg = tiny_config(*overrides)
    rec, seen = Recorder(stop_at=4), []
    trainer = jaxtron.Trainer(cfg, jax.devices()[:2], loss_fn=z_loss,
                              callbacks=[rec, lambda step, metrics, trainer: seen.append((step, metrics["loss"]))])
    result = trainer.train()
    assert result.stopped_by == "enough" and result.final_step == 4
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]
    kinds = [e[:2] for e in rec.events]
    assert kinds == [("begin", 0), ("step", 1), ("step", 2), ("log", 2), ("eval", 2), ("step", 3), ("step", 4),
                     ("log", 4), ("eval", 4), ("end", 4)]
    logged = rec.events[3][2]
    assert {"loss", "ce", "z_loss", "grad_norm", "lr", "tokens_per_s"} <= set(logged)
    assert [s for s, _ in seen] == [2, 4] and [loss for _, loss in seen] == [loss for _, loss in result.losses]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert r["z_share"] == pytest.approx(r["z_loss"] / r["loss"]) and r["loss"] == pytest.approx(r["ce"] + r["z_loss"])
    # train() again continues from the trainer's own state to the end
    again = trainer.train()
    assert again.start_step == 4 and again.final_step == 6 and again.stopped_by is None
    assert rec.events[10] == ("begin", 4) and rec.events[-1] == ("end", 6, None)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "6"]


def test_bad_loss_and_callback_are_named():
    cfg = tiny_config("parallel.data=1")
    with pytest.raises(TypeError, match="callbacks must be Callback instances"):
        jaxtron.Trainer(cfg, jax.devices()[:1], callbacks=[42])
    bad = jaxtron.Trainer(cfg, jax.devices()[:1], loss_fn=lambda model, batch: (jnp.zeros(3), None))
    with pytest.raises(TypeError, match="loss_sum must be a float scalar"):
        bad.step(synthetic_batch(cfg, 0))
    reserved = jaxtron.Trainer(cfg, jax.devices()[:1], loss_fn=lambda m, b: z_loss(m, b)[:1] + ({"lr": 0.0},))
    with pytest.raises(ValueError, match="aux key 'lr' is reserved"):
        reserved.step(synthetic_batch(cfg, 0))


# ------------------------------------------------------------------------------ step by step, checkpoints


def test_step_by_step_defaults_errors_save_restore_generate(tmp_path):
    cfg = tiny_config("parallel.data=2", f"train.output_dir={tmp_path}")
    full = synthetic_batch(cfg, 0)
    a = jaxtron.Trainer(cfg, jax.devices()[:2])
    filled = a._device_batch({"inputs": full["inputs"], "targets": full["targets"]})  # the other keys default
    for k, v in a._device_batch(full).items():
        np.testing.assert_array_equal(np.asarray(filled[k]), np.asarray(v))
        assert filled[k].sharding == a.batch_sharding
    with pytest.raises(ValueError, match=r"batch\['targets'\]: missing"):
        a.step({"inputs": full["inputs"]})
    with pytest.raises(ValueError, match=r"batch\['inputs'\]: shape \[8, 15\], expected .* \[8, 16\]"):
        a.step({"inputs": full["inputs"][:, 1:], "targets": full["targets"][:, 1:]})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['labels'\]"):
        a.step({**full, "labels": full["targets"]})
    a.step(full)
    a.step(synthetic_batch(cfg, 1))
    path = a.save()
    assert path == str(tmp_path / "checkpoints" / "2") and os.path.isdir(path)
    tokens = jnp.asarray(full["inputs"][:2])
    logits_at_2 = np.asarray(a.model(tokens))

    # restore onto another layout and continue: the same loss as the original trainer
    c = jaxtron.Trainer(tiny_config("parallel.data=1", "parallel.tensor=2", f"train.output_dir={tmp_path}"),
                        jax.devices()[:2])
    assert c.restore() == 2 and c.step_count == 2
    nxt = synthetic_batch(cfg, 2)
    np.testing.assert_allclose(float(c.step(nxt)["loss"]), float(a.step(nxt)["loss"]), rtol=1e-5)
    with pytest.raises(jaxtron.CheckpointError, match="no checkpoint of step 7"):
        c.restore(step=7)
    with pytest.raises(jaxtron.CheckpointError, match="no such checkpoint directory"):
        c.restore(str(tmp_path / "nowhere"))

    # the trained model generates, and the checkpoint loads back as a model with the same logits
    out = jaxtron.generate(a.model, [[1, 2, 3]], max_new_tokens=4)
    assert out.tokens.shape == (1, 4)
    _, loaded, kind = jaxtron.load_model(path)
    assert kind == "jaxtron"
    np.testing.assert_allclose(np.asarray(loaded(tokens)), logits_at_2, rtol=1e-5, atol=1e-5)


def test_create_model_is_sharded_and_equals_the_training_init():
    cfg = tiny_config("parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2")
    mesh = jaxtron.Layout.build(cfg, jax.devices()[:4]).mesh
    model = jaxtron.create_model(cfg, mesh)
    wq = model.layers.attention.wq[...]
    assert wq.sharding.mesh == mesh and wq.sharding.spec != jax.sharding.PartitionSpec()
    reference = jaxtron.Llama(cfg.model, rngs=nnx.Rngs(cfg.train.seed))  # what a training run starts from
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(reference, nnx.Param)))
    tokens = jnp.asarray(synthetic_batch(cfg, 0)["inputs"])
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(reference(tokens)), rtol=1e-5, atol=1e-5)


def test_prepare_data_api(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in ["hello world", "second doc", ""]) + "\n")
    out = jaxtron.prepare_data([str(docs)], str(tmp_path / "corpus"), "byte", append_eod=True)
    # the empty document is kept as a document of no sequences, as Megatron's preprocess_data.py records it
    assert out["documents"] == 3 and out["tokens"] == len("hello world") + len("second doc") + 2
    ds = jaxtron.IndexedDataset(str(tmp_path / "corpus"))
    assert len(ds) == 2
    assert ds.get(0)[:-1].astype(np.uint8).tobytes() == b"hello world" and ds.get(0)[-1] == 0
    from jaxtron.data.prepare import InputError
    with pytest.raises(InputError, match="missing.jsonl: input file not found"):
        jaxtron.prepare_data([str(tmp_path / "missing.jsonl")], str(tmp_path / "x"), "byte")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: missing key 'text'"):
        jaxtron.prepare_data([str(bad)], str(tmp_path / "y"), "byte")
    assert not (tmp_path / "y.bin").exists() and not (tmp_path / "y.idx").exists()
