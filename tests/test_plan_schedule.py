"""The replay of XLA's schedule (jaxtron/plan/schedule.py) on a hand-written scheduled module: an asynchronous
transfer is exposed only for what the compute between its start and done does not cover, a synchronous one
whole, transfers queue on one communication stream, a loop's transfer awaited in the next iteration overlaps
across the boundary, a conditional costs its slowest branch. Each compute instruction's time comes from a timer
that reads it off the fusion's name (``calls=%msN``: N milliseconds), so every figure below is worked by hand."""

import re

import pytest

from jaxtron.plan import hlo
from jaxtron.plan.schedule import Schedule

MODULE = """HloModule m, is_scheduled=true

%ms1 (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8] parameter(0)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %g = f32[8] get-tuple-element(%p), index=1
  %d2 = f32[16] all-gather-done(%g)
  %b1 = f32[8] fusion(%g), kind=kLoop, calls=%ms1
  %s2 = (f32[8], f32[16]) all-gather-start(%b1), replica_groups={{0,1}}, dimensions={0}
  %b2 = f32[8] fusion(%b1), kind=kLoop, calls=%ms0.5
  ROOT %t = (s32[], f32[8]) tuple(%i, %b2)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]) parameter(0)
  ROOT %lt = pred[] compare(%q, %q), direction=LT
}

%fast (r: f32[8]) -> f32[8] {
  %r = f32[8] parameter(0)
  ROOT %f = f32[8] fusion(%r), kind=kLoop, calls=%ms1
}

%slow (u: f32[8]) -> f32[8] {
  %u = f32[8] parameter(0)
  ROOT %v = f32[8] fusion(%u), kind=kLoop, calls=%ms5
}

%wrapped (w: f32[8]) -> f32[8] {
  %w = f32[8] parameter(0)
  ROOT %a2a = f32[8] all-to-all(%w), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %s1 = (f32[8], f32[16]) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
  %f1 = f32[8] fusion(%a), kind=kLoop, calls=%ms2
  %d1 = f32[16] all-gather-done(%s1)
  %ar = f32[8] all-reduce(%f1), replica_groups={{0,1}}, to_apply=%add
  %tup = (s32[], f32[8]) tuple(%i0, %ar)
  %loop = (s32[], f32[8]) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %br = f32[8] conditional(%i0, %ar, %ar), branch_computations={%fast, %slow}
  %x1 = ((f32[8]), f32[8]) async-start(%br), calls=%wrapped
  %x2 = ((f32[8]), f32[8]) async-start(%br), calls=%wrapped
  %f2 = f32[8] fusion(%br), kind=kLoop, calls=%ms1
  %y1 = f32[8] async-done(%x1)
  ROOT %y2 = f32[8] async-done(%x2)
}
"""
MS = 1e-3
# link seconds per execution of each collective, keyed as jaxtron.plan.hlo.collectives names them
TRANSFERS = {("main", "s1"): 3 * MS, ("main", "ar"): 4 * MS, ("body", "s2"): 2 * MS, ("wrapped", "a2a"): 2 * MS}


class _Timer:
    """The step model's instruction timer, reduced to reading ``calls=%msN``."""

    def __init__(self, mod):
        self.mod = mod

    def instr(self, shape, opcode, rest, shapes):
        m = re.search(r"calls=%ms([\d.]+)", rest)
        return {"t": float(m.group(1)) * MS if m else 0.0}

    @staticmethod
    def seconds(st):
        return st["t"]


def test_the_replay_of_a_hand_written_schedule():
    schedule = Schedule(_Timer(hlo.parse_module(MODULE)), TRANSFERS, {})
    r = schedule.run("main")
    # s1 (3 ms) under f1 (2 ms): 1 ms wait. ar, synchronous: 4 ms exposed (t = 7).
    # the loop body, first replay: d2 has no start in the body (t 0), b1 1 ms, s2 from 1 to 3, b2 to 1.5:
    # 1.5 ms in flight at the end. Second replay: d2 waits for that 1.5 ms, b1 to 2.5, s2 to 4.5, b2 to 3.0.
    # 3 iterations: 9 ms, 4.5 ms of it waiting (t = 16). The conditional: its slow branch, 5 ms (t = 21).
    # x1 and x2 queue on the communication stream: 21-23 and 23-25; f2 to 22, y1 waits 1, y2 waits 2 (t = 25).
    assert r["time"] == pytest.approx(25 * MS)
    assert r["exposed"] == pytest.approx((1 + 4 + 4.5 + 1 + 2) * MS)
    assert r["comm"] == pytest.approx((3 + 4 + 3 * 2 + 2 + 2) * MS)
    assert r["time"] - r["exposed"] == pytest.approx((2 + 3 * 1.5 + 5 + 1) * MS)  # the compute alone
    waits = {(w["collective"], w["instruction"]): w["seconds"] for w in schedule.top_waits(10)}
    assert waits[("all-reduce", "ar")] == pytest.approx(4 * MS)
    assert waits[("async", "x2")] == pytest.approx(2 * MS)


def test_a_transfer_with_nothing_between_start_and_done_is_exposed_whole():
    adjacent = MODULE.replace("  %f1 = f32[8] fusion(%a), kind=kLoop, calls=%ms2\n  %d1 = f32[16] all-gather-done(%s1)",
                              "  %d1 = f32[16] all-gather-done(%s1)\n  %f1 = f32[8] fusion(%a), kind=kLoop, calls=%ms2")
    assert adjacent != MODULE
    base = Schedule(_Timer(hlo.parse_module(MODULE)), TRANSFERS, {}).run("main")
    moved = Schedule(_Timer(hlo.parse_module(adjacent)), TRANSFERS, {}).run("main")
    assert moved["exposed"] - base["exposed"] == pytest.approx(2 * MS)  # s1's 3 ms, all of it now
    assert moved["time"] - base["time"] == pytest.approx(2 * MS)


PEELED = """HloModule p, is_scheduled=true

%fused_compare (x: s32[]) -> pred[] {
  %x = s32[] parameter(0)
  %limit = s32[] constant(15)
  ROOT %lt = pred[] compare(%x, %limit), direction=LT
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]) parameter(0)
  %iv = s32[] get-tuple-element(%c), index=0
  ROOT %cmp = pred[] fusion(%iv), kind=kLoop, calls=%fused_compare
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]) parameter(0)
  %k = f32[8] fusion(%b), kind=kLoop, calls=%ms1
  ROOT %r = (s32[], f32[8]) tuple(%b, %k)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]) tuple(%start, %a)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("edit, trips", [
    ({}, 15),                                                   # 0 <= i < 15
    ({"direction=LT": "direction=LE"}, 16),                    # 0 <= i <= 15
    ({"constant(0)": "constant(3)"}, 12),                      # the start from the init tuple, through a copy
    ({"body=%body": 'body=%body, backend_config={"known_trip_count":{"n":"7"}}'}, 7),  # XLA's annotation wins
])
def test_a_loop_without_xlas_trip_count_takes_it_from_its_condition(edit, trips):
    """XLA's collective pipeliner peels a loop and drops its known_trip_count; the condition still says it."""
    text = PEELED
    for old, new in edit.items():
        text = text.replace(old, new)
    mod = hlo.parse_module(text)
    assert mod.multipliers()["body"] == trips
    assert Schedule(_Timer(mod), {}, {}).run("main")["time"] == pytest.approx(trips * MS)


SLICED = """HloModule s, is_scheduled=true

%fused (p0: f32[48,64,32], p1: s32[]) -> f8e4m3fn[1,64,32] {
  %p0 = f32[48,64,32] parameter(0)
  %view = f32[48,2048] bitcast(%p0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %one = f32[1,2048] dynamic-slice(%view, %p1, %zero), dynamic_slice_sizes={1,2048}
  %back = f32[1,64,32] bitcast(%one)
  ROOT %q = f8e4m3fn[1,64,32] convert(%back)
}

ENTRY %main (w: f32[48,64,32], i: s32[]) -> f8e4m3fn[1,64,32] {
  %w = f32[48,64,32] parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = f8e4m3fn[1,64,32] fusion(%w, %i), kind=kLoop, calls=%fused
}
"""


@pytest.mark.parametrize("use, read", [("%view", 2048 * 4), ("%p0", 48 * 2048 * 4)])
def test_a_fusion_that_slices_a_stacked_operand_through_a_bitcast_reads_the_slice(use, read):
    """One layer's weights quantized out of the scan's stacked fp32 weights: the fusion reads the 8 KiB slice,
    not the 384 KiB stack, though a bitcast stands between the parameter and the slice. Used whole as well
    (``%p0`` sliced directly *and* converted whole), it is read whole."""
    from jaxtron.plan import steptime

    text = SLICED if use == "%view" else SLICED.replace(
        "ROOT %q = f8e4m3fn[1,64,32] convert(%back)",
        "%whole = f8e4m3fn[48,64,32] convert(%p0)\n  ROOT %q = f8e4m3fn[1,64,32] convert(%back)")
    mod = hlo.parse_module(text)
    instrs = mod.computations["main"]
    shapes = {n: s for n, s, _o, _r in instrs}
    _n, shape, opcode, rest = instrs[-1]
    moved = steptime._moved_bytes(mod, opcode, rest, shape, shapes)
    assert moved == read + 4 + 64 * 32  # the slice or the stack, the index, the FP8 result


def test_a_loop_whose_trip_count_cannot_be_read_is_listed():
    """A condition the fallback cannot read (the limit is not a constant) counts the loop once, and says so."""
    unreadable = PEELED.replace("%limit = s32[] constant(15)", "%limit = s32[] parameter(1)")
    mod = hlo.parse_module(unreadable)
    assert mod.multipliers()["body"] == 1 and hlo.unknown_trip_counts(mod) == ["w"]
    assert hlo.unknown_trip_counts(hlo.parse_module(PEELED)) == []


UPDATED = """HloModule m

%fused (p0: bf16[14336,512], p1: bf16[32,14336,512], p2: s32[]) -> bf16[512,32,14336] {
  %p1 = bf16[32,14336,512]{1,0,2} parameter(1)
  %view = bf16[512,32,14336]{2,1,0} bitcast(%p1)
  %p0 = bf16[14336,512]{0,1} parameter(0)
  %update = bf16[512,1,14336]{2,1,0} bitcast(%p0)
  %zero = s32[] constant(0)
  %p2 = s32[] parameter(2)
  ROOT %dus = bf16[512,32,14336]{2,1,0} dynamic-update-slice(%view, %update, %zero, %p2, %zero)
}

ENTRY %main (g: bf16[14336,512], stack: bf16[32,14336,512], i: s32[]) -> bf16[512,32,14336] {
  %g = bf16[14336,512]{0,1} parameter(0)
  %stack = bf16[32,14336,512]{1,0,2} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = bf16[512,32,14336]{2,1,0} fusion(%g, %stack, %i), kind=kLoop, calls=%fused
}
"""


def test_a_fusion_that_updates_a_stacked_buffer_through_a_bitcast_moves_the_update():
    """The layer scan's backward writes one layer's weight gradient into the stacked gradients in place, through
    a bitcast of the stack (a layout XLA picked): the fusion reads and writes the 14.7 MB update, not the 470 MB
    stack."""
    from jaxtron.plan import steptime

    mod = hlo.parse_module(UPDATED)
    instrs = mod.computations["main"]
    shapes = {n: s for n, s, _o, _r in instrs}
    _n, shape, opcode, rest = instrs[-1]
    update = 14336 * 512 * 2
    assert steptime._moved_bytes(mod, opcode, rest, shape, shapes) == 2 * update + 4
