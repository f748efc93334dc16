"""Context parallelism (parallel.context > 1) equals the single-device run.

Per context_impl (all_gather, ring, ulysses), on layouts (context with data and tensor, with fsdp, alone) and
batches (plain causal; three packed documents per row with restarting positions): the fp32 gradient of the
whole batch leaf by leaf, its norm, and the losses and gradient norms of 3 steps with a non-zero learning rate
from step 0, to 1e-5 relative. The flash kernel (model.attention_impl=pallas) on each impl. Also: the sequence
really is split (compiled activation memory per device falls), the load balance and its reported imbalance,
and the config errors.
"""

import jax
import numpy as np
import pytest

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron.config import ConfigError
from jaxtron.parallel.context import balance_order, imbalance
from jaxtron.parallel.layout import Layout

C2_D2_T2 = ("parallel.context=2", "parallel.data=2", "parallel.tensor=2")
C4_F2 = ("parallel.context=4", "parallel.fsdp=2", "parallel.data=1")
C8 = ("parallel.context=8", "parallel.data=1")
LAYOUTS = {"context2-data2-tensor2": C2_D2_T2, "context4-fsdp2": C4_F2, "context8": C8}
BATCHES = {"causal": 1, "packed3": 3}
_REFERENCES = {}


def _config(*overrides):
    # seq 32: 2 x context 8 chunks of 2 tokens; packed batches need data.reset_at_eod for the segment ids
    return tiny_config("data.seq_len=32", "train.global_batch_size=8", *NONZERO_LR, *overrides)


def _reference(documents: int):
    if documents not in _REFERENCES:
        cfg = _config("parallel.data=1", f"data.reset_at_eod={documents > 1}")
        _REFERENCES[documents] = training_record(cfg, jax.devices()[:1], documents=documents)
    return _REFERENCES[documents]


# each impl on each layout and on each batch kind at least once, not the whole product (CI time)
CASES = [("all_gather", "context2-data2-tensor2", "packed3"), ("all_gather", "context4-fsdp2", "causal"),
         ("all_gather", "context8", "packed3"), ("ring", "context2-data2-tensor2", "causal"),
         ("ring", "context4-fsdp2", "packed3"), ("ring", "context8", "packed3"),
         ("ulysses", "context2-data2-tensor2", "packed3"), ("ulysses", "context8", "causal")]


@pytest.mark.parametrize("impl,layout,batch", CASES)
def test_context_parallel_equals_single_device(impl, layout, batch):
    # ulysses on context8: 4 kv heads over 8 ranks, so K/V heads are repeated per query group
    documents = BATCHES[batch]
    cfg = _config(*LAYOUTS[layout], f"parallel.context_impl={impl}", f"data.reset_at_eod={documents > 1}")
    assert_same_training(training_record(cfg, jax.devices(), documents=documents), _reference(documents))


# the flash kernel (interpret mode) on every impl: head_dim 16, the kernel's smallest; against the xla one-device run
PALLAS_CASES = [("all_gather", "context2-data2-tensor2", "packed3"), ("ring", "context4-fsdp2", "packed3"),
                ("ulysses", "context8", "causal")]


@pytest.mark.parametrize("impl,layout,batch", PALLAS_CASES)
def test_context_parallel_with_the_flash_kernel_equals_single_device(impl, layout, batch):
    documents = BATCHES[batch]
    wide = ("model.hidden_size=128", f"data.reset_at_eod={documents > 1}")
    key = ("wide", documents)
    if key not in _REFERENCES:
        _REFERENCES[key] = training_record(_config("parallel.data=1", *wide), jax.devices()[:1],
                                           documents=documents)
    cfg = _config(*LAYOUTS[layout], f"parallel.context_impl={impl}", "model.attention_impl=pallas", *wide)
    assert_same_training(training_record(cfg, jax.devices(), documents=documents), _REFERENCES[key])


@pytest.mark.parametrize("impl", ["ulysses"])  # all_gather under stages was checked the same way (CI time)
def test_context_with_pipeline_equals_single_device(impl):
    cfg = _config("parallel.context=2", "parallel.stage=2", "parallel.fsdp=2", "parallel.data=1",
                  f"parallel.context_impl={impl}", "data.reset_at_eod=true")
    assert_same_training(training_record(cfg, jax.devices(), documents=3), _reference(3))


def test_collectives_of_each_impl():
    """What travels: all_gather gathers K/V along the sequence; ring passes blocks with collective-permutes and
    gathers no sequence; ulysses exchanges sequence for heads with all-to-alls. (Weights are all-gathered in
    every impl: ZeRO-3 spans fsdp x context.)"""
    import re

    from helpers import synthetic_batch
    from jaxtron.train.trainer import Trainer, put_batch

    def ops(impl):
        cfg = _config(*C2_D2_T2, f"parallel.context_impl={impl}", "data.reset_at_eod=true", "model.num_layers=1")
        run = Trainer(cfg, jax.devices())
        batch = put_batch(synthetic_batch(cfg, 0, documents=3), run.batch_sharding)
        text = run.train_step.lower(run.state, batch).compile().as_text()
        # an activation gathered over the sequence: [batch 4 per data x fsdp replica, seq 32, ...]
        sequence = re.findall(r"= \(?[a-z0-9]+\[4,32[\],][^ ]* all-gather(?:-start)?\(", text)
        return {"all-gather": len(sequence), "all-to-all": len(re.findall(r"\ball-to-all(?:-start)?\(", text)),
                "collective-permute": len(re.findall(r"\bcollective-permute(?:-start)?\(", text))}

    gathered, ringed, exchanged = ops("all_gather"), ops("ring"), ops("ulysses")
    assert gathered["all-gather"] >= 2 and gathered["all-to-all"] == 0, gathered  # K and V (and positions)
    assert ringed["all-gather"] == ringed["all-to-all"] == 0 and ringed["collective-permute"] > 0, ringed
    assert exchanged["all-to-all"] >= 4, exchanged  # q, k, v there and the output back, per layer


def test_sequence_is_split_over_context():
    """Compiled temp memory per device of the train step: context 8 holds an eighth of each sequence's
    activations (plus the gathered K and V), so it needs far less than one device with the whole batch."""
    from helpers import synthetic_batch
    from jaxtron.train.trainer import Trainer, put_batch

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
