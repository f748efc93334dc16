"""The ZB-H1 tick table (jaxtron/parallel/zero_bubble.py) against tables worked by hand, and the rules every
table keeps: each stage runs F, B and W of each micro batch once, in dependency order, and is done by the
last tick; the arrays the compiled loop reads, the bubble the planner predicts, and the config check. The
schedule itself equals one device in tests/test_pipeline.py (zb_h1 case)."""

import numpy as np
import pytest

from jaxtron.config import ConfigError, load
from jaxtron.parallel.layout import Layout
from jaxtron.parallel.zero_bubble import one_f_one_b_bubble, tick_arrays, zb_h1_table

# Worked by hand from the rules in the module docstring: F of m on stage s at tick m + s, B at m + 2S - 2 - s;
# stage 0 runs W with B; the others fill each tick's spare time with their oldest W's.
S2_M4 = [
    ["F0", "F1", "F2 B0 W0", "F3 B1 W1", "B2 W2", "B3 W3"],
    ["-", "F0 B0", "F1 B1 W0", "F2 B2 W1", "F3 B3", "W2 W3"],
]
S4_M8 = [
    ["F0", "F1", "F2", "F3", "F4", "F5", "F6 B0 W0", "F7 B1 W1", "B2 W2", "B3 W3", "B4 W4", "B5 W5", "B6 W6",
     "B7 W7"],
    ["-", "F0", "F1", "F2", "F3", "F4 B0", "F5 B1 W0", "F6 B2 W1", "F7 B3", "B4 W2", "B5 W3", "B6 W4", "B7 W5",
     "W6 W7"],
    ["-", "-", "F0", "F1", "F2 B0", "F3 B1", "F4 B2 W0", "F5 B3 W1", "F6 B4", "F7 B5", "B6 W2", "B7 W3", "W4 W5",
     "W6 W7"],
    ["-", "-", "-", "F0 B0", "F1 B1", "F2 B2", "F3 B3 W0", "F4 B4 W1", "F5 B5", "F6 B6", "F7 B7", "W2 W3", "W4 W5",
     "W6 W7"],
]


@pytest.mark.parametrize("stages,micro_batches,expected,lengths,peak", [
    (2, 4, S2_M4, (1, 2, 3, 3, 2, 2), (3, 2)),
    (4, 8, S4_M8, (1, 1, 1, 2, 2, 2, 3, 3, 2, 2, 2, 2, 2, 2), (7, 6, 6, 6)),
])
def test_table_matches_the_hand_worked_one(stages, micro_batches, expected, lengths, peak):
    table = zb_h1_table(stages, micro_batches)
    assert [table.describe(s) for s in range(stages)] == expected
    assert table.lengths == lengths
    assert table.peak_in_flight == peak
    # 3M + S - 1 units: the bubble is (S-1)/(3M+S-1), a third of 1f1b's idle time 3(S-1) (the paper's
    # (S-1)(F+B-W) against (S-1)(F+B+W) with F = B = W)
    assert sum(lengths) == 3 * micro_batches + stages - 1
    assert table.bubble == pytest.approx((stages - 1) / (3 * micro_batches + stages - 1))
    idle_zb = table.bubble * sum(lengths)
    idle_1f1b = one_f_one_b_bubble(stages, micro_batches) * 3 * (micro_batches + stages - 1)
    assert idle_zb == pytest.approx(idle_1f1b / 3)


@pytest.mark.parametrize("stages,micro_batches", [(1, 3), (2, 2), (3, 5), (4, 4), (8, 16)])
def test_every_table_keeps_the_dependencies(stages, micro_batches):
    table = zb_h1_table(stages, micro_batches)
    at = {}  # (kind, micro batch, stage) -> tick
    for t, row in enumerate(table.work):
        for s, (f, b, ws) in enumerate(row):
            for kind, ms in (("F", [f] if f is not None else []), ("B", [b] if b is not None else []), ("W", ws)):
                for m in ms:
                    assert (kind, m, s) not in at, (kind, m, s)
                    at[(kind, m, s)] = t
    assert len(at) == 3 * stages * micro_batches          # each of F, B, W once per micro batch and stage
    for m in range(micro_batches):
        for s in range(stages):
            if s:
                assert at[("F", m, s)] > at[("F", m, s - 1)]  # the activation arrives the tick after
            if s < stages - 1:
                assert at[("B", m, s)] > at[("B", m, s + 1)]  # so does the cotangent
            else:
                assert at[("B", m, s)] >= at[("F", m, s)]     # the last stage's B follows its own F
            assert at[("W", m, s)] >= at[("B", m, s)]
    assert max(table.peak_in_flight) <= 2 * stages - 1      # the 1f1b ring's slots still hold them


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="must be positive"):
        zb_h1_table(0, 4)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (3, 5)])
def test_tick_arrays_hold_the_table_and_slots_are_never_reused_early(stages, micro_batches):
    table = zb_h1_table(stages, micro_batches)
    f_at, b_at, w_at, slots = tick_arrays(table)
    w_tick = {}
    for t, row in enumerate(table.work):
        for s, (f, b, ws) in enumerate(row):
            assert f_at[t, s] == (-1 if f is None else f) and b_at[t, s] == (-1 if b is None else b)
            assert sorted(m for m in w_at[t, s] if m >= 0) == sorted(ws)
            w_tick.update({(s, m): t for m in ws})
    # micro batch m + slots reuses m's slot at its F (tick m + slots + s): m's W must have run before
    for (s, m), t in w_tick.items():
        assert t < m + slots + s, (s, m, t, slots)
    assert slots <= 2 * stages - 1   # no more than 1f1b's ring
    assert slots - 1 == max(t - (m + s) for (s, m), t in w_tick.items())  # and no more than the longest span
    assert np.all(w_at.max(axis=2) < micro_batches)


def _layout(*overrides):
    return Layout.planned(load(None, ["parallel.stage=2", "parallel.data=1", "train.global_batch_size=8",
                                      "train.micro_batch_size=1", *overrides]), 2)


def test_planner_bubble_is_below_1f1b():
    zb, ofob = _layout("parallel.pipeline_schedule=zb_h1"), _layout("parallel.pipeline_schedule=1f1b")
    assert zb.accumulation_steps == ofob.accumulation_steps == 8
    assert zb.bubble == pytest.approx(zb_h1_table(2, 8).bubble) == pytest.approx(1 / 25)
    assert ofob.bubble == pytest.approx(1 / 9)
    assert zb.pipeline().ticks == ofob.pipeline().ticks == 8 + 2
    assert zb.pipeline(for_eval=True).schedule == "gpipe"   # evaluation runs the forward loop


def test_zb_h1_with_recompute_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.pipeline_recompute"):
        _layout("parallel.pipeline_schedule=zb_h1", "parallel.pipeline_recompute=true")
