"""Collectives against XLA's schedule: which transfers the compiled step hides behind compute and which it waits for.

XLA:GPU's latency-hiding scheduler leaves the optimized module scheduled (``is_scheduled=true``): a computation's
instructions are listed in the order they run. This replays that order on two clocks:

* the compute stream runs one instruction after another, each for its step-model time (jaxtron/plan/steptime.py:
  GEMMs, attention kernels, memory-bound ops; a ``while`` for its trip count, a ``conditional`` for its slowest
  branch, a ``call`` for its callee);
* the communication stream runs the asynchronous collectives (``all-gather-start`` ... ``all-gather-done``,
  ``reduce-scatter``, ``all-reduce``, ``collective-permute``, and ``async-start``/``async-done`` around a wrapped
  collective) one after the other, as NCCL does on one communicator: a transfer starts when its ``*-start`` is
  reached and the previous transfer has finished, and lasts its link time (:func:`jaxtron.plan.model.
  collective_timing`: wire bytes over NVLink or the network, ring algorithms, plus a latency).

A ``*-done`` blocks the compute stream until its transfer ends: the time it waits is **exposed** communication, the
rest of the transfer ran under compute (**overlapped**). A synchronous collective is exposed whole. So a collective
is hidden exactly as far as the scheduler placed independent work between its start and done: no rule by mesh axis.

A transfer started near the end of a loop body and awaited in the next iteration (XLA's collective pipeliner) has
a ``*-done`` whose start is not in the same body: the body is replayed a second time, that ``*-done`` waiting for
what the first replay left in flight at the body's end, measured from the body's start.

Not modelled: compute and communication slowing each other down when they overlap (NCCL kernels take SMs), and
several communicators running at once on separate streams.
"""

from __future__ import annotations

import re

from jaxtron.plan import hlo

_ASYNC = r"^(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute|async)"
_DONE, _START = re.compile(_ASYNC + "-done$"), re.compile(_ASYNC + "-start$")
_IGNORE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
           "replica-id", "opt-barrier", "add-dependency", "domain", "async-update", "copy-start", "copy-done",
           "send", "recv", "send-done", "recv-done"}


def _first_operand(rest: str) -> str:
    m = re.match(r"[\w\-]+\(\s*(?:[a-z][\w\[\],{}]*\s+)?%?([\w.\-]+)", rest)
    return m.group(1) if m else ""


class Schedule:
    """Replays a scheduled module (module doc). ``walk``: the step model's instruction timer
    (``steptime._Walk``); ``collective_s``: seconds per execution of each collective, keyed by (computation,
    instruction name) as :func:`jaxtron.plan.hlo.collectives` names them; ``attention_s``: seconds of one
    attention kernel call, by 'fwd' and 'bwd'."""

    def __init__(self, walk, collective_s: dict, attention_s: dict):
        self.walk, self.mod = walk, walk.mod
        self.collective_s, self.attention_s = collective_s, attention_s
        self.memo: dict = {}
        self.waits: dict = {}  # (computation, start instruction) -> seconds waited at its done, one execution

    def _transfer(self, comp: str, name: str, opcode: str, rest: str) -> float:
        if opcode == "async-start":  # the collective is the wrapped computation's instruction
            callee = dict(hlo.CALLEE_RE.findall(rest)).get("calls", "")
            return sum(self.collective_s.get((callee, n), 0.0) for n, *_ in self.mod.computations.get(callee, []))
        return self.collective_s.get((comp, name), 0.0)

    def _compute(self, shape: str, opcode: str, rest: str, shapes: dict) -> float:
        st = self.walk.instr(shape, opcode, rest, shapes)
        calls = st.get("attention_calls", {})
        return self.walk.seconds(st) + sum(self.attention_s.get(k, 0.0) * n for k, n in calls.items())

    def run(self, comp: str, carry: float = 0.0) -> dict:
        """{"time": seconds of one execution of ``comp`` on the compute stream, waits included; "exposed": the
        waits; "comm": transfer seconds; "leftover": transfer time still in flight at its end; "unmatched":
        whether a ``*-done`` waited for a transfer started before it}."""
        key = (comp, carry)
        if key in self.memo:
            return self.memo[key]
        t = free = exposed = comm = 0.0
        unmatched = False
        in_flight: dict = {}
        instrs = self.mod.computations.get(comp, [])
        shapes = {n: sh for n, sh, _op, _r in instrs}
        for name, shape, opcode, rest in instrs:
            if opcode in _IGNORE:
                continue
            if _START.match(opcode):
                if opcode == "async-start":  # wrapped compute (an async fusion) is timed where it starts
                    t += self._compute(shape, opcode, rest, shapes)
                secs = self._transfer(comp, name, opcode, rest)
                begin = max(t, free)
                free = in_flight[name] = begin + secs
                comm += secs
            elif _DONE.match(opcode):
                start = _first_operand(rest)
                if start in in_flight:
                    end = in_flight.pop(start)
                else:
                    end, unmatched = carry, True
                self.waits[(comp, start)] = max(0.0, end - t)
                if end > t:
                    exposed += end - t
                    t = end
            elif opcode in hlo.KINDS:  # synchronous: the compute stream waits for the whole transfer
                secs = self._transfer(comp, name, opcode, rest)
                begin = max(t, free)
                self.waits[(comp, name)] = begin + secs - t
                exposed += begin + secs - t
                t = free = begin + secs
                comm += secs
            elif opcode in ("while", "conditional", "call"):
                inner = self._control(comp, opcode, rest)
                t += inner["time"]
                exposed += inner["exposed"]
                comm += inner["comm"]
            else:
                t += self._compute(shape, opcode, rest, shapes)
        leftover = max([end - t for end in in_flight.values()] + [0.0])
        out = {"time": t, "exposed": exposed, "comm": comm, "leftover": leftover, "unmatched": unmatched}
        self.memo[key] = out
        return out

    def _loop_body(self, body: str) -> dict:
        first = self.run(body)
        return self.run(body, first["leftover"]) if first["unmatched"] and first["leftover"] else first

    def _control(self, comp: str, opcode: str, rest: str) -> dict:
        callees = dict(hlo.CALLEE_RE.findall(rest))
        if opcode == "while":
            trip = hlo.while_trip_count(self.mod, comp, rest)
            body, cond = self._loop_body(callees.get("body", "")), self.run(callees.get("condition", ""))
            return {k: trip * body[k] + (trip + 1) * cond[k] for k in ("time", "exposed", "comm")}
        if opcode == "conditional":
            runs = [self.run(b) for b in hlo.branch_computations(rest)]
            return max(runs, key=lambda r: r["time"]) if runs else {"time": 0.0, "exposed": 0.0, "comm": 0.0}
        return self.run(callees.get("to_apply", callees.get("calls", "")))

    def instruction_costs(self) -> dict:
        """Seconds of one execution of each instruction of the module's scheduled computations (all but fusion
        bodies), by the name XLA's scheduler knew it by (``scheduling_name`` in the optimized module's metadata,
        else its name): each asynchronous collective's transfer time, keyed by its ``*-start``, and every other
        instruction's step-model time. What XLA:GPU's profile-guided latency estimator reads
        (jaxtron/plan/latency_profile.py)."""
        fused = {callee for instrs in self.mod.computations.values() for _n, _s, opcode, rest in instrs
                 if opcode in ("fusion", "fusion-start") for kind, callee in hlo.CALLEE_RE.findall(rest)
                 if kind == "calls"}
        costs: dict = {}
        for comp, instrs in self.mod.computations.items():
            if comp in fused:
                continue
            shapes = {n: sh for n, sh, _op, _r in instrs}
            for name, shape, opcode, rest in instrs:
                if opcode in _IGNORE or _DONE.match(opcode) or opcode in ("while", "conditional", "call"):
                    continue
                scheduled = hlo.SCHEDULING_NAME_RE.search(rest)
                key = scheduled.group(1) if scheduled else name
                if _START.match(opcode) or opcode in hlo.KINDS:
                    secs = self._transfer(comp, name, opcode, rest)
                    if opcode == "async-start":
                        secs = max(secs, self._compute(shape, opcode, rest, shapes))
                else:
                    secs = self._compute(shape, opcode, rest, shapes)
                costs[key] = secs
        return costs

    def top_waits(self, n: int = 5) -> list[dict]:
        """The collectives the compute stream waits for longest per step: kind, what JAX op they serve, seconds
        (a branch's waits counted as if every branch ran)."""
        mult = self.mod.multipliers()
        instr = {(c, name): (opcode, rest) for c, lst in self.mod.computations.items()
                 for name, _s, opcode, rest in lst}
        out = []
        for (comp, name), secs in self.waits.items():
            if secs <= 0:
                continue
            opcode, rest = instr.get((comp, name), ("?", ""))
            op_name = hlo.OP_NAME_RE.search(rest)
            out.append({"collective": opcode.replace("-start", ""), "instruction": name,
                        "op": op_name.group(1)[-80:] if op_name else "", "seconds": secs * mult.get(comp, 0.0)})
        return sorted(out, key=lambda w: -w["seconds"])[:n]
