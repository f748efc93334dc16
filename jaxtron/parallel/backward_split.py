"""A stage's backward split in two, as the zero-bubble schedules need: B, the backward to the stage's input (the
previous stage waits for it), and W, the backward to the weights (nothing waits for it), run later from what B
left behind, without running B's chain of input cotangents again.

``jax.vjp`` gives one pullback that computes both. Asking it for the input part only is cheap (XLA removes the
weight-gradient dots), but asking it again for the weight part alone runs the whole chain of cotangents through
the stage's layers a second time, since each layer's weight gradient needs the cotangent at that layer. So the
pullback is split at the level of its jaxpr (:class:`SplitBackward`):

- Its equations are flattened: calls that only group equations (``jit``, ``checkpoint``, ``closed_call``) are
  inlined; ``scan`` (the loop over a stage's layers) is kept and split itself, recursively; anything else (a
  custom call, a ``shard_map``, a ``cond``) is one indivisible equation.
- B is every equation the input cotangent needs (with a loop's carries closed to a fixed point). W is every
  other equation the weight gradients need. What W reads from B's equations is handed over: per layer, from
  B's loop as extra stacked outputs; those are the "stash" a schedule keeps from a micro batch's B to its W
  (the layers' output cotangents and the activations their weight-gradient dots read). Values that depend on
  the weights alone (casts, gathers, transposes of a weight) are computed again in W instead of being kept.
- A weight gradient that B's equations produce anyway (an indivisible equation that returns both cotangents)
  is returned by B and added then, not kept until W.

The split is exact: W's equations are the pullback's own, applied to the same values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxtron.jaxprs import scan_groups

# equations that only group others: inlined, so that their parts can go to B or W
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "remat2": "jaxpr", "checkpoint": "jaxpr"}

_ids = itertools.count()


@dataclass(frozen=True)
class Const:
    """A literal or a jaxpr constant: available to B and W alike."""
    value: Any


@dataclass
class Node:
    eqn: Any                 # the source equation (its primitive and params)
    ins: list                # int ids or Const
    outs: list[int]
    body: "Program | None" = None   # a scan's body
    groups: tuple = (0, 0)   # a scan's (loop constants, carries) among its operands
    tainted: bool = False    # depends on the micro batch (else on weights and constants only)


@dataclass
class Program:
    ins: list[int]
    nodes: list[Node]
    outs: list               # int ids or Const


def _closed(value) -> tuple[Jaxpr, list]:
    if isinstance(value, ClosedJaxpr):
        return value.jaxpr, list(value.consts)
    return value, []


def _convert(jaxpr: Jaxpr, in_refs: list, consts: list, nodes: list[Node]) -> list:
    """Append ``jaxpr``'s equations to ``nodes`` (inlining grouping calls); return its output refs."""
    env: dict = {}
    for v, r in zip(jaxpr.invars, in_refs):
        env[v] = r
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = Const(c)

    def ref(v):
        return Const(v.val) if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [ref(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINED and _INLINED[name] in eqn.params:
            sub, sub_consts = _closed(eqn.params[_INLINED[name]])
            outs = _convert(sub, ins, sub_consts, nodes)
            for v, r in zip(eqn.outvars, outs):
                env[v] = r
            continue
        outs = [next(_ids) for _ in eqn.outvars]
        body, groups = None, (scan_groups(eqn) if name == "scan" else None)
        if groups is not None:  # else (a scan whose operands do not read clearly) one indivisible equation
            sub, sub_consts = _closed(eqn.params["jaxpr"])
            body_ins = [next(_ids) for _ in sub.invars]
            body_nodes: list[Node] = []
            body = Program(body_ins, body_nodes, _convert(sub, body_ins, sub_consts, body_nodes))
            if len(body.outs) != len(outs):
                body = None
        nodes.append(Node(eqn, ins, outs, body, groups or (0, 0)))
        for v, r in zip(eqn.outvars, outs):
            env[v] = r
    return [ref(v) for v in jaxpr.outvars]


def _is_id(r) -> bool:
    return not isinstance(r, Const)


def _taint(prog: Program, tainted_in: list[bool]) -> list[bool]:
    """Mark the nodes that depend on a tainted input (through scan carries to a fixed point); return the
    outputs' marks."""
    marked = {i for i, t in zip(prog.ins, tainted_in) if t}
    for node in prog.nodes:
        ins = [_is_id(r) and r in marked for r in node.ins]
        node.tainted = any(ins)
        if node.body is not None:
            nc, nk = node.groups
            carry = ins[nc:nc + nk]
            while True:
                out = _taint(node.body, ins[:nc] + carry + ins[nc + nk:])
                new = [a or b for a, b in zip(carry, out[:nk])]
                if new == carry:
                    break
                carry = new
            outs = carry + out[nk:]
            node.tainted = any(outs)
        else:
            outs = [node.tainted] * len(node.outs)
        marked.update(o for o, t in zip(node.outs, outs) if t)
    return [_is_id(r) and r in marked for r in prog.outs]


@dataclass
class ScanSplit:
    """How one scan is split: the carries and stacked outputs B's loop computes, those W's loop computes, and
    the body's split."""
    b_carry: list[int]
    w_carry: list[int]
    b_ys: list[int]
    w_ys: list[int]
    plan: "Plan"


@dataclass
class Plan:
    """One program's split: which nodes B runs, which W runs (some in both: weight-only values W makes
    again), the refs W reads from B (the stash), and the splits of the scans among the nodes."""
    in_b: set = field(default_factory=set)        # node indices
    in_w: set = field(default_factory=set)
    stash: list = field(default_factory=list)     # ids defined by B, read by W
    scans: dict = field(default_factory=dict)     # node index -> ScanSplit (scans with a W part)
    b_scans: dict = field(default_factory=dict)   # node index -> Plan of the body's B part (B-only scans)
    b_inputs: set = field(default_factory=set)    # program inputs B reads
    w_inputs: set = field(default_factory=set)    # program inputs W reads


def _plan_b(prog: Program, need_b: list[bool]) -> Plan:
    """B's part of ``prog``: every node the outputs in ``need_b`` need (a scan's carries closed to a fixed
    point: a carry B's body reads is one B's loop carries)."""
    plan = Plan()
    live = {r for r, n in zip(prog.outs, need_b) if n and _is_id(r)}
    for i in reversed(range(len(prog.nodes))):
        node = prog.nodes[i]
        need_out = [o in live for o in node.outs]
        if not any(need_out):
            continue
        plan.in_b.add(i)
        if node.body is None:
            live.update(r for r in node.ins if _is_id(r))
            continue
        nc, nk = node.groups
        body = node.body
        carry = [j for j in range(nk) if need_out[j]]
        ys = [k for k in range(nk, len(node.outs)) if need_out[k]]
        while True:
            body_need = [j in carry or j in ys for j in range(len(body.outs))]
            sub = _plan_b(body, body_need)
            read = [j for j in range(nk) if body.ins[nc + j] in sub.b_inputs and j not in carry]
            if not read:
                break
            carry = sorted(set(carry) | set(read))
        plan.b_scans[i] = (carry, ys, sub)
        for pos, r in enumerate(node.ins):
            if not _is_id(r):
                continue
            if nc <= pos < nc + nk:
                if pos - nc in carry:
                    live.add(r)
            elif body.ins[pos] in sub.b_inputs:
                live.add(r)
    plan.b_inputs = live & set(prog.ins)
    return plan


def _b_outputs(prog: Program, plan: Plan) -> set:
    """The refs B's nodes compute (of a scan B runs, only the carries and stacked outputs B's loop has)."""
    out = set()
    for i in plan.in_b:
        node = prog.nodes[i]
        if node.body is None:
            out.update(node.outs)
        else:
            carry, ys, _ = plan.b_scans[i]
            out.update(node.outs[k] for k in list(carry) + list(ys))
    return out


def _plan_w(prog: Program, plan: Plan, need_w: list[bool], w_has: set) -> None:
    """W's part of ``prog``, given B's (``plan``): the nodes the outputs in ``need_w`` need that B does not run,
    reading from B what B's nodes define (the stash) unless it depends on weights alone (W runs that node
    again). ``w_has``: the program inputs W can read itself; any other input W needs (a carry of B's loop) is
    stashed too."""
    live = {r for r, n in zip(prog.outs, need_w) if n and _is_id(r)}
    stash: set = set()
    for i in reversed(range(len(prog.nodes))):
        node = prog.nodes[i]
        need = [o in live for o in node.outs]
        if not any(need):
            continue
        if node.body is None or not node.tainted:
            if i in plan.in_b and node.tainted:
                stash.update(o for o, n in zip(node.outs, need) if n)
                continue
            plan.in_w.add(i)
            live.update(r for r in node.ins if _is_id(r))
            continue
        nk = node.groups[1]
        b_carry, b_ys, _ = plan.b_scans.get(i, ([], [], None))
        from_b = [k for k, n in enumerate(need) if n and ((k < nk and k in b_carry) or (k >= nk and k in b_ys))]
        stash.update(node.outs[k] for k in from_b)
        rest = [n and k not in from_b for k, n in enumerate(need)]
        if any(rest):
            plan.in_w.add(i)
            live.update(_scan_w(plan, i, node, rest))
    reads = live & set(prog.ins)
    stash |= reads - w_has
    plan.w_inputs = reads & w_has
    plan.stash = sorted(stash)


def _scan_w(plan: Plan, i: int, node: Node, need_w: list[bool]) -> list:
    """Split scan ``i``: W's loop computes the outputs in ``need_w`` from the loop's constants and inputs, its
    own carries and, per iteration, the stash of B's loop; return the outer refs W's loop reads."""
    nc, nk = node.groups
    body = node.body
    b_carry, b_ys, _ = plan.b_scans.get(i, ([], [], None))
    w_carry = [j for j in range(nk) if need_w[j]]
    w_ys = [k for k in range(nk, len(node.outs)) if need_w[k]]
    outer = {body.ins[pos] for pos in range(len(body.ins)) if not nc <= pos < nc + nk}
    while True:
        sub = _plan_b(body, [j in b_carry or j in b_ys for j in range(len(body.outs))])
        w_has = outer | {body.ins[nc + j] for j in w_carry}
        _plan_w(body, sub, [j in w_carry or j in w_ys for j in range(len(body.outs))], w_has)
        extra = [j for j in range(nk) if body.ins[nc + j] in sub.stash and j not in b_carry]
        if not extra:
            break
        w_carry = sorted(set(w_carry) | set(extra))
    plan.scans[i] = ScanSplit(b_carry, w_carry, b_ys, w_ys, sub)
    reads = []
    for pos, r in enumerate(node.ins):
        if not _is_id(r):
            continue
        if nc <= pos < nc + nk:
            if pos - nc in w_carry:
                reads.append(r)
        elif body.ins[pos] in sub.w_inputs:
            reads.append(r)
    return reads


def _bind(node: Node, vals: list) -> list:
    """Apply ``node``'s equation to ``vals``, as ``jax.core.eval_jaxpr`` does."""
    eqn = node.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = []
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is None:
        out = eqn.primitive.bind(*subfuns, *vals, **params)
    else:
        with ctx:
            out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict, r):
    return r.value if isinstance(r, Const) else env[r]


def _run_b(prog: Program, plan: Plan, env: dict) -> tuple[list, dict]:
    """Run B's nodes; return the stashed values (``plan.stash`` order) and, per split scan, its body stash
    stacked over the loop."""
    loops = {}
    for i, node in enumerate(prog.nodes):
        if i not in plan.in_b:
            continue
        vals = [_read(env, r) if (not _is_id(r) or r in env) else None for r in node.ins]
        if node.body is None:
            outs = _bind(node, vals)
            for o, v in zip(node.outs, outs):
                env[o] = v
            continue
        carry, ys, sub = plan.b_scans[i]
        split = plan.scans.get(i)
        sub = split.plan if split is not None else sub
        outs, stacked = _scan_b(node, vals, carry, ys, sub)
        for k, v in outs.items():
            env[node.outs[k]] = v
        loops[i] = stacked
    return [env[r] for r in plan.stash], loops


def _scan_b(node: Node, vals: list, carry: list[int], ys: list[int], sub: Plan):
    p = node.eqn.params
    nc, nk = node.groups
    body = node.body
    consts, inits, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]

    def step(c, x):
        env = {k: v for k, v in zip(body.ins[:nc], consts) if v is not None}
        env.update({body.ins[nc + j]: v for j, v in zip(carry, c)})
        env.update({k: v for k, v in zip(body.ins[nc + nk:], x) if v is not None})
        stash, loops = _run_b(body, sub, env)
        return [_read(env, body.outs[j]) for j in carry], ([_read(env, body.outs[k]) for k in ys], stash, loops)

    c, (y, stash, loops) = lax.scan(step, [inits[j] for j in carry], xs, length=p["length"], reverse=p["reverse"],
                                    unroll=p.get("unroll", 1))
    outs = dict(zip(carry, c))
    outs.update(dict(zip(ys, y)))
    return outs, (stash, loops)


def _run_w(prog: Program, plan: Plan, env: dict, stash: list, loops: dict) -> None:
    env.update(dict(zip(plan.stash, stash)))
    for i, node in enumerate(prog.nodes):
        if i not in plan.in_w:
            continue
        vals = [_read(env, r) if (not _is_id(r) or r in env) else None for r in node.ins]
        split = plan.scans.get(i)
        if node.body is None or split is None:
            outs = _bind(node, vals)
            for o, v in zip(node.outs, outs):
                env[o] = v
            continue
        p = node.eqn.params
        nc, nk = node.groups
        body = node.body
        consts, inits, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        body_stash, body_loops = loops.get(i, ([], {}))  # a loop B does not run: nothing stashed

        def step(c, x, body=body, split=split, consts=consts, nc=nc, nk=nk):
            xs_, stash_, loops_ = x
            env_ = {k: v for k, v in zip(body.ins[:nc], consts) if v is not None}
            env_.update({body.ins[nc + j]: v for j, v in zip(split.w_carry, c)})
            env_.update({k: v for k, v in zip(body.ins[nc + nk:], xs_) if v is not None})
            _run_w(body, split.plan, env_, stash_, loops_)
            return [_read(env_, body.outs[j]) for j in split.w_carry], [_read(env_, body.outs[k]) for k in split.w_ys]

        c, y = lax.scan(step, [inits[j] for j in split.w_carry], (xs, body_stash, body_loops), length=p["length"],
                        reverse=p["reverse"], unroll=p.get("unroll", 1))
        for j, v in zip(split.w_carry, c):
            env[node.outs[j]] = v
        for k, v in zip(split.w_ys, y):
            env[node.outs[k]] = v


class SplitBackward:
    """``backward(*args) -> (b_out, w_out)`` split into ``input_part(*args) -> (b_out, early, stash)`` and
    ``weight_part(*args, stash) -> w_out``, where ``early`` are W's outputs that B's equations produce (the
    same structure as ``w_out``, zeros elsewhere): ``early + w_out`` is W's whole result. ``tainted(args)``:
    which arguments depend on the micro batch (their flattened leaves' marks); what depends on the others alone
    W computes again instead of taking from the stash."""

    def __init__(self, backward: Callable, args: tuple, tainted: tuple[bool, ...]):
        closed = jax.make_jaxpr(backward)(*args)
        self.args_tree = jax.tree.structure(args)
        out_shape = jax.eval_shape(backward, *args)
        self.b_tree = jax.tree.structure(out_shape[0])
        self.w_tree = jax.tree.structure(out_shape[1])
        self.w_avals = jax.tree.leaves(out_shape[1])
        n_b = self.b_tree.num_leaves
        leaf_taint = [t for a, t in zip(args, tainted) for _ in jax.tree.leaves(a)]
        nodes: list[Node] = []
        ins = [next(_ids) for _ in closed.jaxpr.invars]
        self.prog = Program(ins, nodes, _convert(closed.jaxpr, ins, list(closed.consts), nodes))
        _taint(self.prog, leaf_taint)
        n = len(self.prog.outs)
        need_b = [k < n_b for k in range(n)]
        need_w = [k >= n_b for k in range(n)]
        self.plan = _plan_b(self.prog, need_b)
        self.n_b = n_b
        # W's outputs that B's nodes define: B returns them (W would only read them from the stash)
        b_defined = _b_outputs(self.prog, self.plan)
        self.early = [k for k in range(n_b, n) if _is_id(self.prog.outs[k]) and self.prog.outs[k] in b_defined]
        _plan_w(self.prog, self.plan, [need_w[k] and k not in self.early for k in range(n)], set(ins))
        stash_shapes = jax.eval_shape(lambda *a: self.input_part(*a)[2], *args)
        self.stash_shapes = stash_shapes

    def _env(self, args) -> dict:
        leaves = jax.tree.leaves(args)
        return dict(zip(self.prog.ins, leaves))

    def input_part(self, *args):
        env = self._env(args)
        stash, loops = _run_b(self.prog, self.plan, env)
        outs = self.prog.outs
        b = [_read(env, r) for r in outs[:self.n_b]]
        early = [(_read(env, outs[k]) if k in self.early else jnp.zeros(a.shape, a.dtype))
                 for k, a in zip(range(self.n_b, len(outs)), self.w_avals)]
        return (jax.tree.unflatten(self.b_tree, b), jax.tree.unflatten(self.w_tree, early), (stash, loops))

    def weight_part(self, *args_and_stash):
        *args, (stash, loops) = args_and_stash
        env = self._env(tuple(args))
        _run_w(self.prog, self.plan, env, stash, loops)
        outs = self.prog.outs
        w = []
        for k, a in zip(range(self.n_b, len(outs)), self.w_avals):
            r = outs[k]
            if k in self.early or (_is_id(r) and r not in env):
                w.append(jnp.zeros(a.shape, a.dtype))
            else:
                w.append(jnp.broadcast_to(jnp.asarray(_read(env, r), a.dtype), a.shape))
        return jax.tree.unflatten(self.w_tree, w)
