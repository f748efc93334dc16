"""DeepSeek-V3 multi-token prediction (docs/mtp.md): the loss against a re-implementation written here, an MoE
model's MTP modules on fsdp 2 x context 2 x tensor 2 and on 1F1B stages (stage 2 x data 2 x tensor 2) against
one device, the config checks, and the CLI logging mtp_loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import NONZERO_LR, assert_same_training, cpu_xla_flags, synthetic_batch, tiny_config
from jaxtron.config import ConfigError
from jaxtron.train.step import make_train_step
from jaxtron.train.trainer import Trainer, put_batch

MTP_SMALL = ("model.remat=none", "model.attention_impl=xla")


def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _reference_objective(model, batch, depth: int, coef: float):
    """(main CE + coef * mean_k CE_k) per main-loss token, and mean_k CE_k, written out: the MTP modules' norms,
    concatenation, projection, shifts and masks by hand; the decoder blocks (tested on their own elsewhere) and
    the main model's layers are the model's."""
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    inputs, targets, mask = (jnp.asarray(batch[k]) for k in ("inputs", "targets", "loss_mask"))
    positions = jnp.asarray(batch["positions"])
    seq = inputs.shape[1]
    table = model.embed[...]
    head = table.T if cfg.tie_embeddings else model.lm_head[...]

    def ce_sum(hidden, tgt, msk):
        logits = hidden @ head
        lp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0] * msk)

    h, _ = model.run_layers_with_stats(model.embed_tokens(inputs), positions, None)
    n = jnp.sum(mask)
    main = ce_sum(_rms(h, model.final_norm.scale[...], eps), targets, mask)
    p = nnx.to_pure_dict(nnx.state(model.mtp, nnx.Param))
    block_def, block_state = nnx.split(model.mtp.block)
    per_depth = []
    for k in range(1, depth + 1):
        # token t+k at position t; target t+k+1; nothing past the end of the row
        tok = jnp.concatenate([inputs[:, k:], jnp.zeros_like(inputs[:, :k])], axis=1)
        tgt = jnp.concatenate([targets[:, k:], jnp.zeros_like(targets[:, :k])], axis=1)
        msk = jnp.concatenate([mask[:, k:], jnp.zeros_like(mask[:, :k])], axis=1)
        assert tok.shape[1] == seq
        e = _rms(table[tok], p["enorm"]["scale"][k - 1], eps)
        hn = _rms(h, p["hnorm"]["scale"][k - 1], eps)
        x = jnp.concatenate([e, hn], axis=-1) @ p["eh_proj"][k - 1]
        block = nnx.merge(block_def, jax.tree.map(lambda a: a[k - 1], block_state))
        h = block(x, model.rope(positions), None)
        per_depth.append(ce_sum(_rms(h, p["norm"]["scale"][k - 1], eps), tgt, msk))
    mtp = sum(per_depth) / depth
    return (main + coef * mtp) / n, mtp / n


@pytest.mark.parametrize("depth,chunk", [(2, 0), pytest.param(2, 8, marks=pytest.mark.slow)])
def test_mtp_loss_and_gradients_equal_a_reimplementation(depth, chunk):
    """mtp_loss (the train step's metric, at the initial parameters) and every gradient leaf (main layers,
    embedding, head and the MTP modules) equal the re-implementation's, with a non-zero loss mask hole so the
    shifted masks matter; whole heads and heads a chunk of 8 tokens at a time (model.loss_chunk_tokens)."""
    coef = 0.3
    cfg = tiny_config(*MTP_SMALL, f"model.mtp.num_layers={depth}", f"model.mtp.loss_coef={coef}",
                      "train.global_batch_size=2", "model.num_layers=1", f"model.loss_chunk_tokens={chunk}")
    trainer = Trainer(cfg, jax.devices()[:1])
    batch = synthetic_batch(cfg, 0)
    batch["loss_mask"][:, 5] = 0.0
    model = trainer.model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(p):
        return _reference_objective(nnx.merge(graphdef, p, rest), batch, depth, coef)

    # jitted: run op by op, the reference's forward and backward took a fifth of this test's CPU time
    (_, ref_mtp), ref_grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    # the train step's own gradient (the one it hands the optimizer) and mtp_loss from one compiled step
    p = trainer.program
    trainer.train_step = make_train_step(cfg, p.spec, p.tx, p.schedule, p.layout, return_grads=True)
    m = trainer.step(put_batch(batch, trainer.batch_sharding))
    grads = m.pop("grads")
    ref_grads = nnx.to_pure_dict(ref_grads)
    flat = jax.tree_util.tree_leaves_with_path(ref_grads)
    assert any("mtp" in jax.tree_util.keystr(path) for path, _ in flat)
    for (path, e), a in zip(flat, jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(float(m["mtp_loss"]), float(ref_mtp), rtol=1e-5)
    assert float(m["mtp_loss"]) > 0


# An MoE model (sigmoid router, aux-free biases, a load-balancing loss) with 2 MTP modules: the MTP block is a
# decoder block of the last layer's kind, so an MoE block whose router losses reach the gradients and whose
# aux-free bias moves by its own expert load (not the main layers')
LAYOUT = (*MTP_SMALL, "model.mtp.num_layers=2", "model.mtp.loss_coef=0.5", "model.moe.num_experts=4",
          "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32", "model.moe.score_func=sigmoid",
          "model.moe.aux_free_bias=true", "model.moe.bias_update_rate=0.05", "model.moe.aux_loss_coef=0.1",
          *NONZERO_LR)


def _record(cfg, devices):
    """:func:`training_record_with_params` (3 steps) with the aux-free biases' gradients (zero: they move by the
    load) taken out of the compared gradients."""
    from helpers import training_record_with_params

    record, _ = training_record_with_params(cfg, devices)
    for tree in (record["grads"]["layers"]["mlp"], record["grads"]["mtp"]["block"]["mlp"]):
        assert not np.any(tree.pop("expert_bias"))
    return record


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def one_device():
    """One device accumulating 2 micro batches of 4; every layout runs 2 micro batches too (the load-balancing
    loss is per micro batch)."""
    return _record(tiny_config(*LAYOUT, "train.micro_batch_size=4"), jax.devices()[:1])


def _assert_same_as_one_device(eight, one):
    """Losses over 3 steps, gradient norms, every gradient leaf (the MTP modules' and their block's router
    included) and every parameter after the steps (the aux-free biases included), relative 1e-5 in fp32."""
    from helpers import assert_same_params

    assert_same_training(eight, one)
    assert_same_params(eight["params"], one["params"], rtol=1e-5)
    bias = one["params"]["mtp"]["block"]["mlp"]["expert_bias"]
    assert bias.shape == (2, 4) and np.any(bias != 0)
    assert "router" in one["grads"]["mtp"]["block"]["mlp"]


@pytest.mark.slow
def test_mtp_on_fsdp2_context2_tensor2_equals_one_device(one_device):
    """fsdp 2 x context 2 x tensor 2: the sequences reach the devices reordered (the context load balance), so
    the shifted tokens and targets must be made before it."""
    eight = _record(tiny_config(*LAYOUT, "parallel.data=1", "parallel.fsdp=2", "parallel.context=2",
                                "parallel.tensor=2", "train.micro_batch_size=2"), jax.devices())
    _assert_same_as_one_device(eight, one_device)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b"])  # gpipe's loss runs the same last-stage callback
def test_mtp_on_pipeline_stages_equals_one_device(one_device, schedule):
    """stage 2 x data 2 x tensor 2 (the MTP modules on the last stage, after the main layers), 2 micro
    batches."""
    eight = _record(tiny_config(*LAYOUT, "parallel.stage=2", "parallel.data=2", "parallel.tensor=2",
                                "train.micro_batch_size=2", f"parallel.pipeline_schedule={schedule}"), jax.devices())
    _assert_same_as_one_device(eight, one_device)


@pytest.mark.parametrize("override,field", [("model.mtp.num_layers=-1", "model.mtp.num_layers"),
                                            ("model.mtp.loss_coef=-0.1", "model.mtp.loss_coef")])
def test_bad_mtp_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(override)


def test_cli_logs_mtp_loss_and_it_falls(tmp_path):
    """``python -m jaxtron.train`` on the tiny config with one MTP module: metrics.jsonl and the log line carry
    mtp_loss, and it falls over the run."""
    from helpers import TINY

    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}
    args = [a for a in TINY if not a.startswith("train.steps")] + [
        *MTP_SMALL, "model.mtp.num_layers=1", "train.steps=12", "logging.log_every=1", "optim.lr=3e-3",
        f"train.output_dir={tmp_path}"]
    out = subprocess.run([sys.executable, "-m", "jaxtron.train", *args], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mtp loss" in out.stderr + out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    mtp = [r["mtp_loss"] for r in rows if "mtp_loss" in r]
    assert len(mtp) == 12, rows[-1]
    assert mtp[-1] < mtp[0], mtp


def test_hf_mtp_names_round_trip():
    """convert/hf/mtp.py: with L main layers and D modules the MTP tensors are HF layers L..L+D-1, eh_proj in
    torch Linear layout [d, 2d] (jaxtron's [2d, d] transposed), the block's rows (given by the caller) under
    mtp.block; export then import gives back every MTP parameter, and a wrong shape names the tensor."""
    from jaxtron.convert.hf.mtp import mtp_from_hf, mtp_shared_copy_names, mtp_to_hf, mtp_weights
    from jaxtron.convert.model_tree import abstract_model

    cfg = tiny_config("model.mtp.num_layers=2").model
    d = cfg.hidden_size
    _, abstract = abstract_model(cfg)
    shapes = nnx.to_pure_dict(abstract)
    rng = np.random.default_rng(0)
    params = {"mtp": jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes["mtp"])}
    linear_in = lambda x: x.reshape(x.shape[0], -1).T  # noqa: E731
    block_rows = [("input_layernorm.weight", ("attn_norm", "scale"), lambda x: x, 0),
                  ("self_attn.q_proj.weight", ("attention", "wq"), linear_in, 0),
                  ("self_attn.k_proj.weight", ("attention", "wk"), linear_in, 0),
                  ("self_attn.v_proj.weight", ("attention", "wv"), linear_in, 0),
                  ("self_attn.o_proj.weight", ("attention", "wo"), lambda x: x.reshape(-1, x.shape[-1]).T, 0),
                  ("post_attention_layernorm.weight", ("mlp_norm", "scale"), lambda x: x, 0),
                  ("mlp.gate_proj.weight", ("mlp", "w_gate"), lambda x: x.T, 0),
                  ("mlp.up_proj.weight", ("mlp", "w_up"), lambda x: x.T, 0),
                  ("mlp.down_proj.weight", ("mlp", "w_down"), lambda x: x.T, 0)]
    weights = mtp_weights(cfg.num_layers, 2, block_rows)
    hf = mtp_to_hf(params, weights)
    assert set(hf) == {f"model.layers.{i}.{n}" for i in (2, 3) for n in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", *(r[0] for r in block_rows))}
    assert hf["model.layers.3.eh_proj.weight"].shape == (d, 2 * d)
    np.testing.assert_array_equal(hf["model.layers.3.eh_proj.weight"], params["mtp"]["eh_proj"][1].T)
    np.testing.assert_array_equal(hf["model.layers.2.shared_head.norm.weight"], params["mtp"]["norm"]["scale"][0])
    assert mtp_shared_copy_names(cfg.num_layers, 2) == [
        "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight",
        "model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
    back = mtp_from_hf(hf, weights, shapes, np.float32)
    flat = jax.tree_util.tree_leaves_with_path(params)
    assert len(back) == len(flat)
    for path, leaf in flat:
        np.testing.assert_array_equal(back[tuple(k.key for k in path)], leaf)
    bad = dict(hf, **{"model.layers.2.enorm.weight": np.zeros((d + 1,), np.float32)})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.enorm\.weight"):
        mtp_from_hf(bad, weights, shapes, np.float32)
    assert mtp_weights(cfg.num_layers, 0, block_rows) == []


@pytest.mark.parametrize("preset", ["tiny", "deepseek_v3_small"])
def test_flops_count_each_mtp_module(preset):
    """Each MTP module adds eh_proj (2 * 2d * d), one decoder layer of the last layer's kind (MoE and MLA in
    deepseek_v3_small: the same attention and FFN FLOPs as a main MoE layer) and one more LM head pass, x3 for
    training."""
    import dataclasses

    from jaxtron import config as config_lib
    from jaxtron.train.flops import flops_per_token

    m = config_lib.load(preset).model
    at = lambda depth: dataclasses.replace(m, mtp=dataclasses.replace(m.mtp, num_layers=depth))  # noqa: E731
    d, v, s = m.hidden_size, m.vocab_size, 4096
    base = flops_per_token(at(0), s)
    # one main layer of the last kind: the whole model without its head, over its layers, for a model of
    # uniform layers; deepseek_v3_small's first layer is dense, so take the difference of two depths instead
    deeper = dataclasses.replace(at(0), num_layers=m.num_layers + 1)
    layer = flops_per_token(deeper, s) - base
    expected = base + 2 * (3 * (2 * 2 * d * d + 2 * d * v) + layer)
    assert flops_per_token(at(2), s) == pytest.approx(expected, rel=1e-12)
