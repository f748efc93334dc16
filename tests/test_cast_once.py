"""train.cast_params_once: the weights the model casts to bf16 at each use are cast once per step, before the
gradient-accumulation loop, and the step trains exactly as with the cast at every use in every micro batch
(losses, gradient norms, every gradient leaf, the parameters after 3 steps with a non-zero learning rate, the
eval loss), on one device and on fsdp 2 x tensor 2; the same compiled steps cast no weight inside their loops,
where the per-use ones cast each in each micro batch (XLA:CPU promotes bf16 collectives to fp32, so the bf16
all-gathers are read from the planner's XLA:GPU compile instead, docs/performance.md); and the leaves the model
keeps in fp32 stay fp32."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np

from helpers import (NONZERO_LR, TINY, assert_same_params, assert_same_training, synthetic_batch,
                     training_record_with_params)
from jaxtron import config as config_lib
from jaxtron.plan.hlo import operand_names, parse_module, shape_dims
from jaxtron.train import step as step_module
from jaxtron.train.param_cast import ParamCast
from jaxtron.train.program import build_program
from jaxtron.train.trainer import put_batch

# bf16 compute (the cast is a no-op in TINY's fp32); two micro batches of 4 rows per step on one device; 24
# positions, so that no activation has a weight's shape (the HLO check tells them apart by shape)
BF16 = ("model.dtype=bfloat16", "train.micro_batch_size=4", "optim.z_loss=1e-3", "data.seq_len=24") + NONZERO_LR
# the same micro batches on tensor 2 x fsdp 2 (2 rows per FSDP rank)
MESH = ("parallel.tensor=2", "parallel.fsdp=2", "parallel.data=1", "train.micro_batch_size=2")


def _config(once: bool, *overrides: str) -> config_lib.Config:
    return config_lib.load(None, TINY + list(BF16 + overrides) + [f"train.cast_params_once={str(once).lower()}"])


@functools.cache
def _record(once: bool, overrides: tuple[str, ...] = (), devices: int = 1) -> dict:
    """The training record, the eval loss after the steps, and the compiled step's weight casts inside loops
    (``_weight_casts_in_loops``: the step just run, from the compile cache)."""
    cfg = _config(once, *overrides)
    record, trainer = training_record_with_params(cfg, jax.devices()[:devices])
    batch = put_batch(synthetic_batch(cfg, seed=1), trainer.batch_sharding)
    record["eval_loss_sum"] = float(trainer.eval_step(trainer.state["params"], batch)["loss_sum"])
    record["weight_casts_in_loops"] = _weight_casts_in_loops(trainer, batch)
    return record


def _assert_same(once: dict, per_use: dict) -> None:
    assert_same_training(once, per_use, rtol=1e-5)
    assert_same_params(once["params"], per_use["params"], rtol=1e-5)
    # exactly: the same bf16 products, the same bf16 gradients converted to fp32 and summed in the same order
    np.testing.assert_array_equal(once["losses"], per_use["losses"])
    assert once["eval_loss_sum"] == per_use["eval_loss_sum"]  # the eval step casts once too
    for a, e in zip(jax.tree.leaves((once["grads"], once["params"])),
                    jax.tree.leaves((per_use["grads"], per_use["params"]))):
        np.testing.assert_array_equal(a, e)


def _assert_no_weight_cast_in_a_loop(once: dict, per_use: dict) -> None:
    """The per-use path casts every layer's weights in every micro batch (2 micro batches x 2 layers); with the
    cast once, no weight is cast inside a loop (the copy is made once, before the micro-batch loop)."""
    per_use, once = per_use["weight_casts_in_loops"], once["weight_casts_in_loops"]
    print(f"fp32 -> bf16 weight casts per step inside the loops: per use {per_use}, cast once {once}")
    assert per_use >= 2 * 2 * 7, per_use  # 7 weights a layer (wq wk wv wo, gate up down)
    assert once == 0, once


def test_one_device_trains_as_cast_per_use():
    once, per_use = _record(True), _record(False)
    _assert_same(once, per_use)
    _assert_no_weight_cast_in_a_loop(once, per_use)


def test_fsdp_tensor_trains_as_cast_per_use():
    once, per_use = _record(True, MESH, 4), _record(False, MESH, 4)
    _assert_same(once, per_use)
    _assert_no_weight_cast_in_a_loop(once, per_use)


def _cast_leaves(monkeypatch, *overrides: str) -> dict:
    """{leaf path: dtype name or None} of what the train step casts once (one device; traced, not compiled)."""
    seen = {}

    class Recording(ParamCast):
        def __init__(self, loss, params, *args):
            super().__init__(loss, params, *args)
            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
            seen.update({p: None if d is None else d.name for p, d in zip(paths, self.dtypes)})

    monkeypatch.setattr(step_module, "ParamCast", Recording)
    build_program(_config(True, *overrides), jax.devices()[:1]).lower_train_step()
    return seen


def test_the_model_rule_decides_what_is_cast(monkeypatch):
    """Cast: the projections, the embedding, an untied head. Kept fp32: norm scales (computed in fp32), FP8
    amax histories (delayed scaling), a tied embedding (two uses: its gradients add in fp32) and a chunked
    head (its custom_vjp sums the chunks' gradients in fp32)."""
    plain = _cast_leaves(monkeypatch, "model.fp8=delayed")
    assert plain["['layers']['mlp']['w_gate']"] == plain["['embed']"] == plain["['lm_head']"] == "bfloat16"
    assert plain["['layers']['attention']['wq']"] == "bfloat16"
    assert plain["['layers']['attn_norm']['scale']"] is None and plain["['final_norm']['scale']"] is None
    assert plain["['layers']['attention']['wq_amax']"] is None
    tied = _cast_leaves(monkeypatch, "model.tie_embeddings=true")
    assert tied["['embed']"] is None and tied["['layers']['mlp']['w_up']"] == "bfloat16"
    assert _cast_leaves(monkeypatch, "model.loss_chunk_tokens=16")["['lm_head']"] is None


def _weight_casts_in_loops(trainer, batch) -> int:
    """Per step, how many times the trainer's compiled step converts an fp32 array of a weight's local shape (a
    layer's slice or the whole) to bf16 in the forward inside a loop (the micro batches', the layers'): the
    per-use casts. The backward's roundings of weight gradients to bf16 are not counted."""
    shapes = set()
    for leaf in jax.tree.leaves(trainer.program.spec.abstract_state["params"]):
        local = tuple(leaf.sharding.shard_shape(leaf.shape))
        shapes |= {local, local[1:]}
    module = parse_module(trainer.train_step.lower(trainer.state, batch).compile().as_text())
    runs = module.multipliers()
    count = 0
    for comp, instrs in module.computations.items():
        types = {name: shape for name, shape, _, _ in instrs}
        for _, shape, opcode, rest in instrs:
            source = types.get(next(iter(operand_names(rest)), ""), "")
            op_name = re.search(r'op_name="([^"]*)"', rest)
            forward = op_name is not None and "transpose(" not in op_name.group(1) \
                and op_name.group(1).endswith("convert_element_type")
            dims = tuple(shape_dims(shape))
            while dims[:1] == (1,):
                dims = dims[1:]
            if opcode == "convert" and shape.startswith("bf16") and source.startswith("f32") and forward \
                    and dims in shapes and runs[comp] > 1:
                count += int(runs[comp])
    return count
