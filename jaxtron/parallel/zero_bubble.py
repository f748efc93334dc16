"""The ZB-H1 tick table (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), in the lockstep ticks of
jaxtron's 1f1b loop: which micro batch each stage runs F (forward), B (backward to the stage's input, which
the previous stage needs now) and W (backward to the weights, which nothing waits for) on at each tick.

A pure function, not yet a schedule the pipeline runs (``parallel.pipeline_schedule`` has no ``zb_h1``): running
it needs the stage's backward split into a B that keeps, per micro batch, the cotangents W will read (the
outputs' cotangents of every matmul in the stage), which jaxtron's stage VJP does not expose yet.

The ticks. As in 1f1b (:mod:`jaxtron.parallel.one_f_one_b`), stage s runs F of micro batch m at tick m + s and B at
tick m + 2S - 2 - s; all stages run each tick together, so a tick lasts as long as its busiest stage. With F,
B and W one time unit each (the paper's assumption), 1f1b runs W with B: its S - 1 fill ticks last 1, its M
full ticks 3 and its S - 1 drain ticks 2 (B and W), (S-1)/(M+S-1) idle. Here B leaves W behind: stage 0, which
is never idle after its first B, runs W with each B (it has no later idle tick to put W in); every other
stage puts its W's, oldest first, into whatever time the tick leaves it (the tick's length minus its own F
and B), and from its last B on runs the rest two to a tick, in ticks stage 0's B and W make two long. Fill
ticks then last 1, the ticks with some B but no stage-0 W 2, stage 0's steady ticks 3 and its drain 2: in
all 3M + S - 1 units against 1f1b's 3M + 3(S - 1), a bubble of (S-1)/(3M+S-1), the paper's (S-1)(F+B-W)
against (S-1)(F+B+W), one third. Every stage ends with stage 0's last B (checked: :func:`zb_h1_table` raises
if a W is left over). The price is memory: a stage holds a micro batch's residuals from its F to its W, up to
2S - 1 on stage 0 (as in 1f1b) and up to 2S - 2 on the others (1f1b: 2(S - 1 - s) + 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TickTable:
    """``work[t][s]``: (F micro batch or None, B micro batch or None, W micro batches) of stage s at tick t;
    ``lengths[t]``: the tick's length in units (its busiest stage's F + B + W count); ``bubble``: the idle
    fraction of a stage, 1 - 3M / sum(lengths); ``peak_in_flight[s]``: the most micro batches stage s holds
    residuals of at once (F run, W not yet finished, the one whose W runs in that tick included)."""

    stages: int
    micro_batches: int
    work: tuple
    lengths: tuple
    bubble: float
    peak_in_flight: tuple

    def describe(self, stage: int) -> list[str]:
        """Stage ``stage``'s ticks as text: 'F3 B1 W0', '-' for an idle tick."""
        out = []
        for tick in self.work:
            f, b, ws = tick[stage]
            parts = ([f"F{f}"] if f is not None else []) + ([f"B{b}"] if b is not None else []) + \
                [f"W{w}" for w in ws]
            out.append(" ".join(parts) or "-")
        return out


def one_f_one_b_bubble(stages: int, micro_batches: int) -> float:
    """1f1b's idle fraction in the same units: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def zb_h1_table(stages: int, micro_batches: int) -> TickTable:
    """The ZB-H1 ticks for ``stages`` stages and ``micro_batches`` micro batches (see the module docstring)."""
    S, M = stages, micro_batches
    if S < 1 or M < 1:
        raise ValueError(f"zb_h1_table: stages and micro_batches must be positive (got {S}, {M})")
    T = M + 2 * S - 2

    def f_of(s, t):
        m = t - s
        return m if 0 <= m < M else None

    def b_of(s, t):
        m = t - (2 * S - 2 - s)
        return m if 0 <= m < M else None

    # a tick's length: its busiest stage's F + B, and W on stage 0 wherever stage 0 runs a B
    lengths = [max((f_of(s, t) is not None) + (b_of(s, t) is not None) + (s == 0 and b_of(s, t) is not None)
                   for s in range(S)) for t in range(T)]
    work = [[None] * S for _ in range(T)]
    w_tick = [[None] * M for _ in range(S)]
    for s in range(S):
        pending: list[int] = []
        for t in range(T):
            f, b = f_of(s, t), b_of(s, t)
            if b is not None:
                pending.append(b)
            room = lengths[t] - (f is not None) - (b is not None)
            done = pending[:max(room, 0)]
            pending = pending[len(done):]
            for m in done:
                w_tick[s][m] = t
            work[t][s] = (f, b, tuple(done))
        if pending:
            raise AssertionError(f"zb_h1_table: stage {s} has W of micro batches {pending} left after tick {T - 1}")
    peak = tuple(max(sum(1 for m in range(M) if m + s <= t <= w_tick[s][m]) for t in range(T)) for s in range(S))
    total = sum(lengths)
    return TickTable(S, M, tuple(tuple(row) for row in work), tuple(lengths), 1.0 - 3 * M / total, peak)
