"""Context parallelism (parallel.context > 1) equals the single-device run.

Each context_impl (all_gather, ring, ulysses) on context 2 x data 2 x tensor 2, and on a second layout
(all_gather and ring on context 4 x fsdp 2 with the flash kernel, model.attention_impl=pallas; ulysses on
context 8, its K/V heads repeated per query group), over plain causal batches and batches of three packed
documents per row with restarting positions; ulysses also under 1F1B stages. Compared: the fp32 gradient of the
whole batch leaf by leaf, its norm, and the losses and gradient norms of 3 steps with a non-zero learning rate
from step 0, to 1e-5 relative, against one device's xla attention. Also: what each impl's compiled step
exchanges, the sequence really is split (compiled activation memory per device falls), the load balance and
its reported imbalance, and the config errors.
"""

import re

import jax
import numpy as np
import pytest

from helpers import NONZERO_LR, assert_same_training, synthetic_batch, tiny_config, training_record
from jaxtron.config import ConfigError
from jaxtron.parallel.context import balance_order, imbalance
from jaxtron.parallel.layout import Layout
from jaxtron.train.step import make_train_step
from jaxtron.train.trainer import Trainer, put_batch

C2_D2_T2 = ("parallel.context=2", "parallel.data=2", "parallel.tensor=2")
C4_F2 = ("parallel.context=4", "parallel.fsdp=2", "parallel.data=1")
C8 = ("parallel.context=8", "parallel.data=1")
LAYOUTS = {"context2-data2-tensor2": C2_D2_T2, "context4-fsdp2": C4_F2, "context8": C8}
BATCHES = {"causal": 1, "packed3": 3}
_REFERENCES = {}


def _config(*overrides):
    # seq 32: 2 x context 8 chunks of 2 tokens; width 128: head_dim 16, the flash kernel's smallest; packed
    # batches need data.reset_at_eod for the segment ids
    return tiny_config("data.seq_len=32", "train.global_batch_size=8", "model.hidden_size=128", *NONZERO_LR,
                       *overrides)


def _reference(documents: int):
    if documents not in _REFERENCES:
        cfg = _config("parallel.data=1", f"data.reset_at_eod={documents > 1}")
        _REFERENCES[documents] = training_record(cfg, jax.devices()[:1], documents=documents)
    return _REFERENCES[documents]


def _collectives(cfg, documents: int) -> dict:
    """Counts of the compiled train step's sequence all-gathers (an activation [batch 4 per data x fsdp
    replica, seq 32, ...] gathered), all-to-alls and collective-permutes. The step is the one
    helpers.training_record runs (returning the gradients), so its compile is a cache hit."""
    trainer = Trainer(cfg, jax.devices())
    p = trainer.program
    step = make_train_step(cfg, p.spec, p.tx, p.schedule, p.layout, return_grads=True)
    batch = put_batch(synthetic_batch(cfg, 0, documents), trainer.batch_sharding)
    text = step.lower(trainer.state, batch).compile().as_text()
    sequence = re.findall(r"= \(?[a-z0-9]+\[4,32[\],][^ ]* all-gather(?:-start)?\(", text)
    return {"all-gather": len(sequence), "all-to-all": len(re.findall(r"\ball-to-all(?:-start)?\(", text)),
            "collective-permute": len(re.findall(r"\bcollective-permute(?:-start)?\(", text))}


# What travels on context 2 x data 2 x tensor 2 (weights are all-gathered in every impl: ZeRO-3 spans fsdp x
# context): all_gather gathers K/V along the sequence (K and V, and positions); ring passes blocks with
# collective-permutes and gathers no sequence; ulysses exchanges sequence for heads with all-to-alls (q, k, v
# there and the output back, per layer)
EXCHANGES = {
    "all_gather": lambda ops: ops["all-gather"] >= 2 and ops["all-to-all"] == 0,
    "ring": lambda ops: ops["all-gather"] == ops["all-to-all"] == 0 and ops["collective-permute"] > 0,
    "ulysses": lambda ops: ops["all-to-all"] >= 4,
}

# each impl on context2-data2-tensor2 (and its exchanges checked there) and on a second layout, each batch kind
# and the flash kernel on two impls, not the whole product (CI time)
CASES = [("all_gather", "context2-data2-tensor2", "packed3", "xla"),
         ("all_gather", "context4-fsdp2", "causal", "pallas"),
         ("ring", "context2-data2-tensor2", "causal", "xla"),
         ("ring", "context4-fsdp2", "packed3", "pallas"),
         ("ulysses", "context2-data2-tensor2", "packed3", "xla"),
         ("ulysses", "context8", "causal", "xla")]


@pytest.mark.parametrize("impl,layout,batch,attention", CASES)
def test_context_parallel_equals_single_device(impl, layout, batch, attention):
    # the flash kernel runs interpreted on CPU, against the one-device xla run
    documents = BATCHES[batch]
    cfg = _config(*LAYOUTS[layout], f"parallel.context_impl={impl}", f"data.reset_at_eod={documents > 1}",
                  f"model.attention_impl={attention}")
    assert_same_training(training_record(cfg, jax.devices(), documents=documents), _reference(documents))
    if layout == "context2-data2-tensor2":
        ops = _collectives(cfg, documents)
        assert EXCHANGES[impl](ops), (impl, ops)


@pytest.mark.parametrize("impl", ["ulysses"])  # all_gather under stages was checked the same way (CI time)
def test_context_with_pipeline_equals_single_device(impl):
    cfg = _config("parallel.context=2", "parallel.stage=2", "parallel.fsdp=2", "parallel.data=1",
                  f"parallel.context_impl={impl}", "data.reset_at_eod=true")
    assert_same_training(training_record(cfg, jax.devices(), documents=3), _reference(3))


def test_sequence_is_split_over_context():
    """Compiled temp memory per device of the train step: context 8 holds an eighth of each sequence's
    activations (plus the gathered K and V), so it needs far less than one device with the whole batch."""
    def temp_bytes(overrides, devices):
        cfg = _config(*overrides, "data.seq_len=256", "model.num_layers=2")
        run = Trainer(cfg, devices)
        batch = put_batch(synthetic_batch(cfg, 0), run.batch_sharding)
        return run.train_step.lower(run.state, batch).compile().memory_analysis().temp_size_in_bytes

    one = temp_bytes(("parallel.data=1",), jax.devices()[:1])
    split = temp_bytes(C8, jax.devices())
    assert split < one / 4, (split, one)


def test_balance_order_gives_rank_r_chunks_r_and_mirror():
    order = balance_order(16, 4)  # 8 chunks of 2
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert sorted(order.tolist()) == list(range(16))


def test_load_balance_evens_the_causal_work():
    # seq 8, context 2, one document: query i attends to i + 1 keys; chunks of 2 hold 3, 7, 11, 15 pairs
    one_doc = np.ones((1, 8), np.int32)
    assert imbalance(one_doc, 2, balanced=False) == pytest.approx(26 / 18)  # ranks: 3 + 7, 11 + 15
    assert imbalance(one_doc, 2) == pytest.approx(1.0)                      # ranks: 3 + 15, 7 + 11
    # two documents of 4: every chunk pair is already even, in either order
    two_docs = np.repeat([[1, 2]], 4, axis=1)
    assert imbalance(two_docs, 2, balanced=False) == pytest.approx(1.0) == imbalance(two_docs, 2)


@pytest.mark.parametrize("overrides,field", [
    (("parallel.context=2", "parallel.context_impl=nope"), "parallel.context_impl"),
    (("parallel.context=8", "parallel.context_impl=ulysses", "model.num_heads=4", "model.num_kv_heads=4"),
     "parallel.context_impl"),
    (("parallel.context=2", "parallel.stage=2", "parallel.context_impl=ring"), "parallel.context_impl"),
    (("parallel.context=4", "data.seq_len=12"), "data.seq_len"),
    (("parallel.context=2", "model.hidden_size=128", "model.attention_impl=cudnn"), "model.attention_impl"),
])
def test_context_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*(implementation|divisible|context|pipeline)"):
        sizes = [int(o.split("=")[1]) for o in overrides if o.split("=")[0] in ("parallel.context", "parallel.stage")]
        Layout.build(tiny_config("parallel.data=1", *overrides), jax.devices()[:int(np.prod(sizes))])


def test_ring_round_in_query_tiles_equals_one_block(monkeypatch):
    """A long round attends query tile by query tile (TILE_SCORE_BYTES): the same output, row max and row sum
    and the same gradients as the whole block at once, with a packed second document."""
    import jax.numpy as jnp

    from jaxtron.parallel import ring_attention as ra

    b, s, h, kvh, d = 2, 64, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k, v = (jax.random.normal(x, (b, s, kvh, d)) for x in keys[1:])
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    seg = jnp.ones((b, s), jnp.int32).at[:, 40:].set(2)

    def run():
        def loss(q, k, v):
            o, m, l = ra._block(q, k, v, pos, seg, pos, seg, 0.3)
            return (o / l[..., None]).sum(), (o, m, l)
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    whole = run()
    monkeypatch.setattr(ra, "TILE_SCORE_BYTES", b * h * 16 * s * 4)
    assert ra._query_tile(b, s, h, s) == 16
    tiled = run()
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(tiled)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
