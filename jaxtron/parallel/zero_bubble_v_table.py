"""The ZB-V tick table (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): which F (forward), B
(backward to the chunk's input) or W (backward to the chunk's weights) each device runs at each tick, when each
device holds two chunks of the layers in a V.

The V. The layers are cut into 2S chunks; device d holds chunk d (the down leg, chunk 0 of the device) and chunk
2S - 1 - d (the up leg, chunk 1 of the device). A micro batch goes down the devices through the first chunks,
turns on device S - 1 (which hands its chunk 0's output to its own chunk 1) and comes back up to device 0, whose
chunk 1 ends in the loss: the embedding and the loss head both sit on device 0. Cotangents go the other way.

The ticks. A tick is one unit: one F, B or W of one chunk (half a stage's layers, so half of what a unit is in
:mod:`jaxtron.parallel.zero_bubble`'s table; the bubble is a fraction either way). All devices run a tick
together; what a device sends in tick t (a chunk's output or input cotangent, to its neighbour or to itself on
device S - 1) is there from tick t + 1. Each device picks, each tick, greedily in this order:

1. B of the oldest micro batch whose output cotangent is there (of the up-leg chunk first: it is the older
   one in the micro batch's backward), as it unblocks the neighbour;
2. F of the oldest micro batch whose input is there (up-leg chunk first), if the device holds fewer than
   ``cap`` chunk residuals (default 2S: S stages' worth, 1F1B's peak in Megatron's accounting, half of
   jaxtron's lockstep 1f1b ring of 2S - 1 stage slots);
3. W of the oldest micro batch whose B has run (up-leg chunk first);
4. nothing.

F, B and W of one chunk run in micro batch order. :func:`zbv_table` checks that every F, B and W runs exactly
once and that no device is stuck. The bubble is 1 - 6M / T (T ticks; a device's own work is 6M units); it is
below 1f1b's (S-1)/(M+S-1) and zb_h1's (S-1)/(3M+S-1) at the same S and M (tests/test_zero_bubble_v.py).

This module is the table only (no jax): :class:`jaxtron.parallel.pipeline_layout.PipelineSpec` reads its ticks
and bubble, :mod:`jaxtron.parallel.zero_bubble_v` runs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# What a device runs in a tick: (kind, chunk, micro batch), kind 'F' | 'B' | 'W', chunk 0 (down leg) or 1 (up).
Op = tuple


@dataclass(frozen=True)
class ZbvTable:
    """``work[t][d]``: the op device d runs at tick t, or None; ``bubble``: 1 - 6M / T; ``peak_in_flight[d]``:
    the most chunk residuals device d holds at once (F run, W not finished; the one whose W runs in the tick
    counted), in chunk units (a stage slot of 1f1b is two)."""

    stages: int
    micro_batches: int
    cap: int
    work: tuple
    bubble: float
    peak_in_flight: tuple

    @property
    def ticks(self) -> int:
        return len(self.work)

    def describe(self, device: int) -> list[str]:
        """Device ``device``'s ticks as text: 'F3' is chunk 0's (down leg) F of micro batch 3, 'f3' chunk 1's (up
        leg); '-' an idle tick."""
        out = []
        for row in self.work:
            op = row[device]
            if op is None:
                out.append("-")
            else:
                kind, c, m = op
                out.append(f"{kind if c == 0 else kind.lower()}{m}")
        return out


@functools.lru_cache(maxsize=64)
def zbv_table(stages: int, micro_batches: int, cap: int | None = None) -> ZbvTable:
    """The ZB-V ticks for ``stages`` devices and ``micro_batches`` micro batches (module docstring); ``cap``: the
    most chunk residuals a device holds (default 2 * stages)."""
    S, M = stages, micro_batches
    cap = 2 * S if cap is None else cap
    if S < 1 or M < 1:
        raise ValueError(f"zbv_table: stages and micro_batches must be positive (got {S}, {M})")
    if cap < 2:
        raise ValueError(f"zbv_table: cap must be at least 2 chunk residuals (got {cap})")
    done: dict = {}                                   # (kind, chunk, m, device) -> tick
    nxt = {(k, c, d): 0 for k in "FBW" for c in (0, 1) for d in range(S)}
    held = [0] * S                                    # chunk residuals held at the start of the tick
    work = []
    t = 0

    def before(key) -> bool:
        return done.get(key, t) < t

    def inputs_here(kind: str, c: int, m: int, d: int) -> bool:
        """Whether what op (kind, c, m) on device d reads was made in an earlier tick."""
        if kind == "F":
            if c == 0:
                return d == 0 or before(("F", 0, m, d - 1))
            return before(("F", 0, m, d)) if d == S - 1 else before(("F", 1, m, d + 1))
        if kind == "B":
            if c == 1:   # device 0's chunk 1 ends in the loss: its output cotangent comes with its own F
                return before(("F", 1, m, d)) if d == 0 else before(("B", 1, m, d - 1))
            return before(("B", 1, m, d)) if d == S - 1 else before(("B", 0, m, d + 1))
        return before(("B", c, m, d))

    while len(done) < 6 * S * M:
        row = []
        for d in range(S):
            op = None
            for kind in "BFW":
                if kind == "F" and held[d] >= cap:
                    continue
                ready = [(nxt[(kind, c, d)], c) for c in (1, 0)
                         if nxt[(kind, c, d)] < M and inputs_here(kind, c, nxt[(kind, c, d)], d)]
                if ready:
                    m, c = min(ready, key=lambda o: (o[0], -o[1]))
                    op = (kind, c, m)
                    break
            row.append(op)
        if not any(row):
            raise AssertionError(f"zbv_table: no device can run anything at tick {t} (S={S}, M={M}, cap={cap})")
        for d, op in enumerate(row):
            if op is not None:
                kind, c, m = op
                done[(kind, c, m, d)] = t
                nxt[(kind, c, d)] += 1
                held[d] += {"F": 1, "B": 0, "W": -1}[kind]
        work.append(tuple(row))
        t += 1
    for key in ((k, c, m, d) for k in "FBW" for c in (0, 1) for m in range(M) for d in range(S)):
        assert key in done, f"zbv_table: {key} never ran"
    T = len(work)
    peak = []
    for d in range(S):   # residuals held per tick: +1 from the F's tick, -1 after the W's
        delta = np.zeros(T + 1, np.int64)
        for c in (0, 1):
            for m in range(M):
                delta[done["F", c, m, d]] += 1
                delta[done["W", c, m, d] + 1] -= 1
        peak.append(int(np.cumsum(delta).max()))
    peak = tuple(peak)
    return ZbvTable(S, M, cap, tuple(work), 1.0 - 6 * M / T, peak)


# ------------------------------------------------------------------------------------- arrays for the loop

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
LEFT, RIGHT, SELF = 0, 1, 2   # where a device's incoming buffer comes from: device d - 1, d + 1, or itself


@dataclass(frozen=True)
class ZbvArrays:
    """The table as [T, S] arrays the compiled loop indexes by (tick, device), and the ring sizes.

    ``op``: IDLE/FWD/BWD/WGT; ``chunk``, ``micro``: the op's chunk (0, 1) and micro batch; ``res_slot``: the slot of
    the residual ring its chunk's residuals of that micro batch sit in (F writes it, B and W read it);
    ``buf_slot``: the slot of the activation-shaped buffer ring it reads (F: its input, -1 for device 0's chunk
    0, which starts from the embedding; B and W: the chunk's output cotangent); ``head_slot``: where device 0's
    F of chunk 1 puts the loss's cotangent (-1 elsewhere); ``recv`` [T, S, 3]: the buffer slot each incoming
    buffer (LEFT, RIGHT, SELF: sent in the tick before) is written to at the start of the tick, -1 to drop it.
    Slots are given out when a value arrives and taken back after its last use, so the rings hold no more than
    is ever live at once: ``res_slots`` is the table's peak in flight."""

    op: np.ndarray
    chunk: np.ndarray
    micro: np.ndarray
    res_slot: np.ndarray
    buf_slot: np.ndarray
    head_slot: np.ndarray
    recv: np.ndarray
    res_slots: int
    buf_slots: int


class _Slots:
    """Ring slots given out at a value's first tick and free again after its last one."""

    def __init__(self):
        self.free_at: list[int] = []   # per slot: the first tick it is free

    def take(self, first: int, last: int) -> int:
        for i, f in enumerate(self.free_at):
            if f <= first:
                self.free_at[i] = last + 1
                return i
        self.free_at.append(last + 1)
        return len(self.free_at) - 1


def zbv_arrays(table: ZbvTable) -> ZbvArrays:
    S, M, T = table.stages, table.micro_batches, table.ticks
    at = {}
    for t, row in enumerate(table.work):
        for d, op in enumerate(row):
            if op is not None:
                at[(*op, d)] = t
    arr = {k: np.full((T, S), -1, np.int32) for k in ("chunk", "micro", "res_slot", "buf_slot", "head_slot")}
    op_at = np.zeros((T, S), np.int32)
    recv = np.full((T, S, 3), -1, np.int32)
    res_n, buf_n = 0, 0
    for d in range(S):
        res, buf = _Slots(), _Slots()
        # residuals: from F to W, in the order of the F's (slots are given out in tick order)
        res_of = {}
        buf_of = {}   # ('x' | 'dy', chunk, m) -> slot
        events = []   # (first tick, last tick, key): every value the device holds
        for c in (0, 1):
            for m in range(M):
                events.append((at["F", c, m, d], at["W", c, m, d], ("res", c, m)))
                # the input of F (chunk 0 on device 0: none, the embedding runs inside its F)
                if not (d == 0 and c == 0):
                    src_dev = d if (c == 1 and d == S - 1) else (d - 1 if c == 0 else d + 1)
                    src_chunk = 0 if (c == 1 and d == S - 1) else c
                    events.append((at["F", src_chunk, m, src_dev] + 1, at["F", c, m, d], ("x", c, m)))
                # the output cotangent, read by B and W
                if c == 1 and d == 0:
                    events.append((at["F", 1, m, 0], at["W", 1, m, 0], ("dy", 1, m)))
                else:
                    src_dev = d if (c == 0 and d == S - 1) else (d - 1 if c == 1 else d + 1)
                    src_chunk = 1 if (c == 0 and d == S - 1) else c
                    events.append((at["B", src_chunk, m, src_dev] + 1, at["W", c, m, d], ("dy", c, m)))
        for first, last, key in sorted(events, key=lambda e: (e[0], e[1])):
            if key[0] == "res":
                res_of[key[1:]] = res.take(first, last)
            else:
                buf_of[key] = buf.take(first, last)
        res_n, buf_n = max(res_n, len(res.free_at)), max(buf_n, len(buf.free_at))
        for t, row in enumerate(table.work):
            op = row[d]
            if op is None:
                continue
            kind, c, m = op
            op_at[t, d] = {"F": FWD, "B": BWD, "W": WGT}[kind]
            arr["chunk"][t, d], arr["micro"][t, d] = c, m
            arr["res_slot"][t, d] = res_of[c, m]
            if kind == "F":
                arr["buf_slot"][t, d] = buf_of.get(("x", c, m), -1)
                if c == 1 and d == 0:
                    arr["head_slot"][t, d] = buf_of["dy", 1, m]
            else:
                arr["buf_slot"][t, d] = buf_of["dy", c, m]
        # what arrives: the sender's op of the tick before decides what it is
        for t in range(1, T):
            for src, dev in ((LEFT, d - 1), (RIGHT, d + 1), (SELF, d)):
                if not 0 <= dev < S or table.work[t - 1][dev] is None:
                    continue
                kind, c, m = table.work[t - 1][dev]
                key = None
                if kind == "F" and c == 0 and src == LEFT:
                    key = ("x", 0, m)
                elif kind == "F" and c == 0 and src == SELF and d == S - 1:
                    key = ("x", 1, m)
                elif kind == "F" and c == 1 and src == RIGHT:
                    key = ("x", 1, m)
                elif kind == "B" and c == 1 and src == LEFT:
                    key = ("dy", 1, m)
                elif kind == "B" and c == 1 and src == SELF and d == S - 1:
                    key = ("dy", 0, m)
                elif kind == "B" and c == 0 and src == RIGHT:
                    key = ("dy", 0, m)
                if key is not None:
                    recv[t, d, src] = buf_of[key]
    return ZbvArrays(op_at, arr["chunk"], arr["micro"], arr["res_slot"], arr["buf_slot"], arr["head_slot"], recv,
                     res_n, buf_n)
