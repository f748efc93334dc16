"""Expert parallelism: MoE expert weights split over the ``expert`` mesh axis, tokens sent to their experts'
devices with all-to-all (Megatron's EP within data parallelism).

The rules table maps the expert stacks' leading axis (logical ``experts``) onto ``expert`` and the batch
(``act_batch``) onto data, fsdp *and* expert, so an expert rank holds E/EP experts and its own slice of the
batch; every other weight is replicated over ``expert`` (or FSDP-sharded as without it). Routing, the aux
losses and the expert loads are computed by the model on the whole (GSPMD-global) batch before dispatch, so
they are those of one device.

:func:`dispatch` (``model.moe.ep_dispatch=all_to_all``) runs in a ``jax.shard_map`` that is manual over the
axes that split the tokens (the batch axes, expert among them, and the residual stream's sequence axes:
context, and tensor under ``parallel.sequence_parallel``), so each device packs only its own tokens; stage, and
tensor without sequence parallelism (the experts' ``mlp`` dim), stay automatic. With sequence parallelism each
tensor rank sends its own part of the sequence and runs its experts at full width (Megatron's expert tensor
parallel size 1): left automatic there, every tensor rank sent every token of its micro batch and ran the
Pallas grouped GEMM (a custom call GSPMD cannot split) on all of them, twice the exchange bytes and the expert
FLOPs at tensor 2 (DeepSeek-V3 on 1,024 H100s, docs/moe.md). Per device:

1. the T*k (token, choice) assignments, first choices before second choices (as ``capacity`` dispatch), get a
   destination rank (expert // experts per rank) and a place in that rank's queue, by a stable argsort of
   the destinations (no [T*k, EP] one-hot, no scatter);
2. each rank's assignments fill a fixed buffer of C rows,
   C = min(ceil(ep_capacity_factor * T * k / EP), T * min(k, E/EP)) (the second term is the worst case: every
   token sends all the choices it can to one rank; ``ep_capacity_factor=null`` gives it, i.e. dropless); an
   assignment past C is dropped (contributes nothing, counted in ``moe_dropped``). The buffer is one gather
   of the tokens (:func:`gather_rows`: slot -> token), whose gradient is a gather too (token -> its k slots);
3. ``all_to_all`` over ``expert`` exchanges the [EP, C, D] buffers and the slots' local expert ids;
4. the received rows are permuted into local-expert order (an argsort of the ids and a gather) and run
   through the model's grouped matmuls (``ffn``: ``ragged_dot`` or the Pallas kernel); empty slots sort last,
   past every group, and come out as zeros; the results are permuted back by the inverse gather;
5. ``all_to_all`` sends the results back, and each token's k rows are gathered and summed with their routing
   weights in one fused gather-reduce (:func:`combine_rows`; its gradient is a gather per slot).

No step scatters floats, forward or backward: ``jnp.take``'s transpose is a scatter-add (atomics on GPUs,
after zeroing the buffer), and the one-hot/scatter pack read and wrote the buffers several times over; the
planner's memory-bound bytes under the dispatch fell from 3.80 to 1.62 TB per step for Qwen3-30B-A3B on 16
H100s (docs/moe.md).

``ep_dispatch=ragged_all_to_all`` (GPUs: XLA:CPU has no ragged all-to-all) sends each rank exactly its rows
instead (:func:`_ragged_exchange`) into one receive buffer of EP x C rows: the same memory, only the routed
rows on the wire, and what is dropped past a small buffer is the tail of the last senders' rows.

``ep_overlap`` pipelines each device's tokens in :data:`OVERLAP_CHUNKS` chunks: chunk i + 1's dispatch
exchange is issued before chunk i's expert matmuls and chunk i's return before chunk i + 1's, with nothing
but data dependencies between them (XLA's latency-hiding scheduler decides what runs under which transfer).

The expert weights enter the shard_map split over ``expert`` only, so FSDP's gather of them happens at its
boundary and the transpose sums their gradients over the batch axes (``check_vma=False``: every output is
split over every manual axis, so the transpose psums exactly the replicated inputs' cotangents). On GPUs they
are cast to the compute dtype before the boundary, so those gathers and reductions move bf16; on CPUs the
grouped matmuls cast them inside (XLA:CPU aborts on the bf16 all-reduce the transpose would get). Without an
expert axis the same shard_map runs each device's own tokens through every expert (:func:`_local`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron.config.schema import Config, ConfigError
from jaxtron.parallel.sharding import current_context, devices_are_cpu, logical_to_spec, mesh_axes_of

IMPLEMENTATIONS = ("all_to_all", "ragged_all_to_all")
WEIGHT_NAME = "experts"  # the logical name of the expert stacks' leading axis (rules.py maps it onto the expert axis)


def check_expert(cfg: Config, expert: Optional[int], platform: Optional[str] = None) -> None:
    """The config errors of ``parallel.expert`` (``expert``: the resolved size, None if unknown; ``platform``
    of the devices, when known)."""
    m = cfg.model.moe
    if m.ep_dispatch not in IMPLEMENTATIONS:  # validation checks it too; the Layout may get an unvalidated cfg
        raise ConfigError("model.moe.ep_dispatch", f"{m.ep_dispatch!r} is not one of {IMPLEMENTATIONS}")
    if expert is None or expert == 1:
        return
    if not m.num_experts:
        raise ConfigError("parallel.expert", f"{expert} expert ranks need an MoE model (model.moe.num_experts > 0)")
    if m.num_experts % expert:
        raise ConfigError("parallel.expert", f"model.moe.num_experts={m.num_experts} is not divisible by "
                                             f"parallel.expert={expert}")
    if m.ep_dispatch == "ragged_all_to_all":
        if m.ep_overlap:
            raise ConfigError("model.moe.ep_overlap", "applies to ep_dispatch=all_to_all")
        if platform == "cpu":
            raise ConfigError("model.moe.ep_dispatch", "ragged_all_to_all runs on GPUs only (XLA:CPU has no "
                                                       "ragged all-to-all); use all_to_all")


def capacity(tokens: int, k: int, ranks: int, local_experts: int, factor: Optional[float]) -> int:
    """Rows per destination in a send buffer of ``tokens`` tokens' top-``k`` assignments spread over ``ranks``
    destinations of ``local_experts`` experts each: ceil(factor * tokens * k / ranks), at most the worst case
    tokens * min(k, local_experts) (``factor`` None: the worst case, nothing dropped). A destination is an
    expert rank here, and one expert in the model's ``capacity`` dispatch (ranks = experts, local_experts = 1:
    an expert gets at most one assignment per token)."""
    worst = tokens * min(k, local_experts)
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * tokens * k / ranks)))


def dispatch_tokens(cfg: Config, micro_batch: int, context: int, tensor: int) -> int:
    """Tokens each device dispatches per micro batch of ``micro_batch`` sequences: the sequence split over
    context, and over tensor too under ``parallel.sequence_parallel`` (the axes :func:`dispatch`'s shard_map
    is manual over)."""
    return micro_batch * cfg.data.seq_len // (context * (tensor if cfg.parallel.sequence_parallel else 1))


def describe_buffers(moe, expert: int, tokens: int) -> Optional[str]:
    """One start-up line on the all_to_all exchange buffers for ``tokens`` tokens per device and micro batch on
    ``expert`` ranks: their rows, the capacity factor they come from and what that means (the worst case is
    dropless but sends every rank's buffer whole whatever the routing); None without expert parallelism."""
    if expert <= 1 or not moe.num_experts or moe.dispatch != "dropless":
        return None
    k, local = moe.num_experts_per_token, moe.num_experts // expert
    chunks = exchange_chunks(moe, tokens)
    cap = capacity(tokens // chunks, k, expert, local, moe.ep_capacity_factor)
    balanced = tokens // chunks * k / expert
    what = (f"ep_capacity_factor={moe.ep_capacity_factor}: assignments past a buffer are dropped (moe_dropped)"
            if moe.ep_capacity_factor is not None else "ep_capacity_factor=null: the worst case, nothing "
            "dropped; a factor (1.25 as Megatron's capacity runs) sends less and may drop")
    return (f"MoE expert parallelism: {moe.ep_dispatch} over {expert} ranks in {chunks} chunk(s), buffers of {cap} "
            f"rows per rank and chunk ({cap / balanced:.2f}x the balanced load; {what})")


OVERLAP_CHUNKS = 2  # ep_overlap's pipeline depth: each chunk's exchange under the other chunk's expert matmuls


def exchange_chunks(moe, tokens: int) -> int:
    """Chunks the all_to_all dispatch pipelines a device's ``tokens`` in (``moe.ep_overlap``), 1 without it
    or when they do not split evenly (a single decoding token goes in one piece)."""
    if moe.ep_overlap and moe.ep_dispatch == "all_to_all" and tokens % OVERLAP_CHUNKS == 0:
        return OVERLAP_CHUNKS
    return 1


def dispatch(x, experts, weights, expert_weights: Sequence, ffn: Callable, plain: Callable, moe):
    """Routed experts over the ``expert`` axis. x [B, S, D]; experts (ids) and weights (combine weights, fp32)
    [B, S, k]; ``expert_weights``: arrays whose leading axis is the experts (logical ``experts``);
    ``ffn(rows sorted by expert, group_sizes [E_local], *local expert weights) -> rows`` (fp32 or x's dtype);
    ``moe``: the model's MoE config (``ep_dispatch``, ``ep_capacity_factor``, ``ep_overlap``).
    Returns (y [B, S, D] in x's dtype, dropped assignments as an fp32 scalar). Without an expert axis of size
    > 1, each device runs its own tokens through every expert in the same ``shard_map`` (:func:`_local`: no
    exchange, nothing dropped); left to GSPMD, the dropless dispatch's sort over the batch-split tokens gathers
    the whole batch onto every device, which then repeats the whole batch's expert work. A batch that does not
    split over the devices (a few prompts in generation) or a single device: ``plain()``, the dropless dispatch
    on the whole batch."""
    ctx = current_context()
    if ctx is None or ctx[1] is None:
        return plain()
    rules, mesh = ctx
    ep_axes = mesh_axes_of(logical_to_spec((WEIGHT_NAME,), rules)[0], mesh)
    batch, seq = (mesh_axes_of(logical_to_spec((name,), rules)[0]) for name in ("act_batch", "act_res_seq"))
    seq = tuple(a for a in seq if a not in batch)  # rules may put both on one axis: it splits the batch then
    assert set(ep_axes) <= set(batch), f"expert axes {ep_axes} must split the batch ({batch}): EP within DP"
    n_batch = math.prod(mesh.shape[a] for a in batch)
    n_seq = math.prod(mesh.shape[a] for a in seq)
    if x.shape[0] % n_batch or x.shape[1] % n_seq or n_batch * n_seq == 1:
        return plain()
    ep = math.prod(mesh.shape[a] for a in ep_axes)
    t, k = (x.shape[0] // n_batch) * (x.shape[1] // n_seq), experts.shape[-1]
    local_experts = expert_weights[0].shape[0] // ep
    chunks = exchange_chunks(moe, t)
    cap = capacity(t // chunks, k, ep, local_experts, moe.ep_capacity_factor)

    if not devices_are_cpu():
        # cast before the boundary: FSDP gathers the weights there, and the transpose reduces their gradients,
        # both in bf16 (XLA:CPU aborts on a bf16 all-reduce there; on CPU ``ffn`` casts inside instead)
        expert_weights = [w.astype(x.dtype) for w in expert_weights]

    def body(x, experts, weights, *local_weights):
        if ep == 1:
            y, dropped = _local(x, experts, weights, local_weights, ffn)
        elif moe.ep_dispatch == "ragged_all_to_all":
            y, dropped = _ragged_exchange(x, experts, weights, local_weights, ffn, ep_axes, ep, ep * cap)
        else:
            y, dropped = _exchange(x, experts, weights, local_weights, ffn, ep_axes, ep, cap, chunks)
        return y, dropped.reshape(1, 1)

    tokens = P(batch or None, seq or None, None)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens) + tuple(
                               P(ep_axes or None, *([None] * (w.ndim - 1))) for w in expert_weights),
                           out_specs=(tokens, P(batch or None, seq or None)),
                           axis_names=frozenset(batch + seq), check_vma=False)
    y, dropped = mapped(x, experts, weights, *expert_weights)
    return y, dropped.sum()


def _take(src, index):
    """Rows of ``src`` at ``index`` (any shape); an index past the end reads a row of zeros."""
    return jnp.take(src, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def gather_rows(src, index, inverse):
    """out[r] = src[index[r]] (zeros where index[r] >= len(src)): a token permutation by gather. ``inverse``
    [len(src), m]: for each src row the (up to m) out rows that read it, past len(index) where fewer, so that
    the gradient is a gather of m rows per src row and their sum, not the scatter-add that ``jnp.take``'s
    transpose is (on GPUs an atomic scatter over the whole buffer, after zeroing it)."""
    return _take(src, index)


def _gather_rows_fwd(src, index, inverse):
    return _take(src, index), inverse


def _gather_rows_bwd(inverse, g):
    if inverse.shape[1] == 1:
        return _take(g, inverse[:, 0]), None, None
    return jnp.sum(_take(g, inverse), axis=1, dtype=jnp.float32).astype(g.dtype), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def combine_rows(src, weights, index, assignment):
    """out[i] = sum_j weights[i, j] * src[index[i, j]] in fp32, returned in src's dtype: each token's k expert
    outputs (rows of ``src``; an index past the end reads zeros: a dropped assignment) weighted and summed, a
    gather fused with its reduction. ``assignment`` [len(src)]: the flat (token-major, i * k + j) assignment
    whose result each src row holds, t * k for none; the gradient is then a gather too (each row is read by
    at most one assignment)."""
    return _weighted_sum(src, weights, index)


def _weighted_sum(src, weights, index):
    rows = _take(src, index).astype(jnp.float32)                              # [t, k, D], fused into the sum
    return jnp.sum(rows * weights[..., None], axis=1).astype(src.dtype)


def _combine_rows_fwd(src, weights, index, assignment):
    return _weighted_sum(src, weights, index), (src, weights, index, assignment)


def _combine_rows_bwd(res, g):
    src, weights, index, assignment = res
    t, k = weights.shape
    g = g.astype(jnp.float32)
    held = assignment < t * k
    w = jnp.where(held, _take(weights.reshape(-1), assignment), 0.0)
    d_src = (_take(g, jnp.where(held, assignment // k, t)) * w[:, None]).astype(src.dtype)
    d_weights = jnp.sum(_take(src, index).astype(jnp.float32) * g[:, None, :], axis=-1)
    return d_src, d_weights.astype(weights.dtype), None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def _inverse(order):
    """The inverse of the permutation ``order`` (an int scatter of len(order) entries: cheaper than a sort)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def sorted_dropless(x, experts, weights, local_weights: Sequence, ffn: Callable):
    """Dropless experts on one device's tokens x [t, D] (experts and weights [t, k]): the t * k assignments
    sorted by expert, their tokens gathered in that order (one [t * k, D] buffer), the grouped matmuls, and
    each token's k results gathered back and weighted (:func:`combine_rows`): two gathers forward, two
    backward, no scatter. Returns [t, D] in x's dtype."""
    t, k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)                  # assignment a = token a // k, choice a % k
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)     # assignments grouped by expert
    where = _inverse(order).reshape(t, k)                         # each assignment's row in that order
    group_sizes = jnp.bincount(flat, length=local_weights[0].shape[0]).astype(jnp.int32)
    ys = ffn(gather_rows(x, order // k, where), group_sizes, *local_weights).astype(x.dtype)
    return combine_rows(ys, weights.astype(jnp.float32), where, order)


def _pack(experts, local_experts: int, ep: int, cap: int):
    """Steps 1-2 of the module doc for one device's routing experts [t, k], by a sort (no one-hot or
    scatter over the buffer): (the token each of the EP*C slots sends, t where empty; each slot's local
    expert id, ``local_experts`` where empty; the assignment each slot holds, token-major, t * k where empty;
    each assignment's slot [t, k], EP*C where dropped; dropped count). An assignment's place in its rank's
    queue counts first choices before second ones, each in token order (choice-major), as before."""
    t, k = experts.shape
    n = t * k
    flat = experts.T.reshape(-1).astype(jnp.int32)                 # choice-major: c = j * t + i
    dest = flat // local_experts
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)      # queue order within each rank
    counts = jnp.bincount(dest, length=ep).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    position = _inverse(order) - starts[dest]                      # place in its rank's queue
    kept = position < cap
    slot_of = jnp.where(kept, dest * cap + position, ep * cap).reshape(k, t).T   # [t, k]
    s = jnp.arange(ep * cap, dtype=jnp.int32)
    rank, place = s // cap, s % cap
    filled = place < counts[rank]
    c = jnp.where(filled, _take(order, starts[rank] + place), n)   # the choice-major assignment in slot s
    token = jnp.where(filled, c % t, t)
    assignment = jnp.where(filled, token * k + c // t, n)
    ids = jnp.where(filled, _take(flat, c) % local_experts, local_experts)
    return token, ids, assignment, slot_of, jnp.sum(~kept).astype(jnp.float32)


def _exchange(x, experts, weights, local_weights, ffn, axes, ep: int, cap: int, chunks: int = 1):
    """One device's tokens x [b, s, D] to their experts' ranks and back (steps 1-5 of the module doc).

    ``chunks`` > 1: the tokens in that many chunks, each with its own buffers of ``cap`` rows per rank,
    pipelined: chunk i + 1's dispatch exchange is issued before chunk i's experts, and chunk i's return
    exchange before chunk i + 1's experts, with nothing but data dependencies between them, so XLA's
    latency-hiding scheduler can run each transfer under the other chunk's expert matmuls (and the backward's
    transposed exchanges under the backward's)."""
    b, s, d = x.shape
    t = b * s
    local_experts = local_weights[0].shape[0]
    exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)  # noqa: E731  chunk j <-> rank j
    xs, es, ws = (a.reshape(chunks, t // chunks, -1) for a in (x, experts, weights))
    packed = [_pack(es[i], local_experts, ep, cap) for i in range(chunks)]

    sent = [gather_rows(xs[i], packed[i][0], packed[i][3]) for i in range(chunks)]
    send = lambda i: (exchange(sent[i]), exchange(packed[i][1]))  # noqa: E731
    received, outs, backs = {0: send(0)}, [], []
    for i in range(chunks):
        # step i: chunk i + 1's dispatch and chunk i - 1's return issued before chunk i's experts, which need
        # neither (XLA's scheduling-group annotation around them crashed the XLA:GPU compile here)
        if i + 1 < chunks:
            received[i + 1] = send(i + 1)
        if i >= 1:
            backs.append(exchange(outs[i - 1]))
        outs.append(_run_experts(*received.pop(i), local_weights, ffn).astype(x.dtype))
    backs.append(exchange(outs[-1]))
    ys = [combine_rows(backs[i], ws[i].astype(jnp.float32), packed[i][3], packed[i][2]) for i in range(chunks)]
    y = jnp.concatenate(ys).reshape(b, s, d)
    return y, sum(p[4] for p in packed)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` (GPU); the CPU tests put an all_gather emulation of its semantics here."""
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)


def _local(x, experts, weights, local_weights, ffn):
    """Without expert parallelism: one device's tokens x [b, s, D] through every expert (dropless)."""
    b, s, d = x.shape
    y = sorted_dropless(x.reshape(b * s, d), experts.reshape(b * s, -1), weights.reshape(b * s, -1),
                        local_weights, ffn)
    return y.reshape(b, s, d), jnp.zeros((), jnp.float32)


def _run_experts(rows, row_ids, local_weights, ffn):
    """Received rows (slot ids: local expert, or ``local_experts`` for an empty slot) through the grouped
    matmuls, returned in the order they came; both permutations are gathers (:func:`gather_rows`)."""
    local_experts = local_weights[0].shape[0]
    order = jnp.argsort(row_ids, stable=True).astype(jnp.int32)
    back = _inverse(order)
    group_sizes = jnp.bincount(row_ids, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    out = ffn(gather_rows(rows, order, back[:, None]), group_sizes, *local_weights)  # empty slots: past the groups, 0
    return gather_rows(out, back, order[:, None])


def _ragged_exchange(x, experts, weights, local_weights, ffn, axes, ep: int, rows_max: int):
    """``ep_dispatch=ragged_all_to_all``: each device sorts its T*k assignments by expert (so by destination
    rank), trades per-rank counts and offsets with small all_to_alls, and sends exactly its rows with
    ``ragged_all_to_all`` into a static receive buffer of ``rows_max`` rows (EP x the all_to_all capacity;
    at worst case, EP * T * min(k, E/EP), nothing is dropped); the results come back the same way with send
    and receive roles swapped. A receiver fills its buffer in sender rank order: the rows past it (the tail of
    the last senders' chunks, i.e. their highest local experts) are not sent, contribute zeros and are
    counted as dropped."""
    b, s, d = x.shape
    t, k = b * s, experts.shape[-1]
    local_experts = local_weights[0].shape[0]
    flat = experts.reshape(-1).astype(jnp.int32)              # token-major: assignment i is token i // k
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # by expert, hence by destination rank
    where = _inverse(order).reshape(t, k)                     # each assignment's row in the send buffer
    send = gather_rows(x.reshape(t, d), order // k, where)
    wanted = jnp.bincount(flat // local_experts, length=ep).astype(jnp.int32)
    exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)  # noqa: E731  entry j <-> rank j
    offered = exchange(wanted)
    recv_offsets = jnp.cumsum(offered) - offered
    recv_sizes = jnp.clip(rows_max - recv_offsets, 0, offered)          # what fits, first senders first
    send_sizes, send_offsets = exchange(recv_sizes), jnp.cumsum(wanted) - wanted
    # where this device's chunk starts in each peer's receive buffer, and (the way back) in its send buffer
    peer_recv_offsets, peer_send_offsets = exchange(recv_offsets), exchange(send_offsets)
    there = lambda a, out: ragged_all_to_all(a, out, send_offsets, send_sizes, peer_recv_offsets,  # noqa: E731
                                             recv_sizes, axis_name=axes)
    rows = there(send, jnp.zeros((rows_max, d), x.dtype))
    row_ids = there(jnp.take(flat, order) % local_experts, jnp.full((rows_max,), local_experts, jnp.int32))
    out = _run_experts(rows, row_ids, local_weights, ffn).astype(x.dtype)
    back = ragged_all_to_all(out, jnp.zeros((t * k, d), x.dtype), recv_offsets, recv_sizes, peer_send_offsets,
                             send_sizes, axis_name=axes)
    combined = combine_rows(back, weights.reshape(t, k).astype(jnp.float32), where, order)
    return combined.reshape(b, s, d), jnp.sum(wanted - send_sizes).astype(jnp.float32)
