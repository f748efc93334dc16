"""Context parallelism (parallel.context > 1, context_impl=all_gather) equals the single-device run.

Per layout (context with data and tensor, with fsdp, alone) and batch (plain causal; three packed documents per
row with restarting positions): the fp32 gradient of the whole batch leaf by leaf, its norm, and the losses
and gradient norms of 3 steps with a non-zero learning rate from step 0, to 1e-5 relative. Also: the sequence
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


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_single_device(layout, batch):
    documents = BATCHES[batch]
    cfg = _config(*LAYOUTS[layout], f"data.reset_at_eod={documents > 1}")
    assert_same_training(training_record(cfg, jax.devices(), documents=documents), _reference(documents))


def test_sequence_is_split_over_context():
    """Compiled temp memory per device of the train step: context 8 holds an eighth of each sequence's
    activations (plus the gathered K and V), so it needs far less than one device with the whole batch."""
    from helpers import synthetic_batch
    from jaxtron.train.loop import Trainer, put_batch

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
    (("parallel.context=2", "parallel.context_impl=ring"), "parallel.context_impl"),
    (("parallel.context=2", "parallel.context_impl=nope"), "parallel.context_impl"),
    (("parallel.context=4", "data.seq_len=12"), "data.seq_len"),
    (("parallel.context=2", "model.hidden_size=128", "model.attention_impl=pallas"), "model.attention_impl"),
])
def test_context_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*(built|implementation|divisible|context)"):
        Layout.build(tiny_config("parallel.data=1", *overrides), jax.devices()[:int(overrides[0].split("=")[1])])
