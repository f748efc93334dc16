"""How long NCCL takes for one collective: its tuning model's algorithms, protocols and latencies.

NCCL times every (algorithm, protocol) pair as latency + bytes / bandwidth and runs the fastest
(``src/graph/tuning.cc``). This does the same, with the link bandwidths of :mod:`jaxtron.plan.gpus`:

* algorithms: **ring** for every collective; **tree** for an all-reduce spanning nodes (a chain inside each node
  and a tree across the nodes: its latency grows with log2 of the nodes instead of the ranks);
* protocols: **LL** (8 bytes of data per 16 sent: half the bandwidth, the lowest latency), **LL128** (120 of
  every 128 bytes) and **Simple** (the full bandwidth, the highest latency): small messages take LL, training's
  large ones Simple;
* latency = base + per-step hop latencies, NCCL's model: a ring all-reduce takes 2 (n - 1) steps, of which
  2 x nodes cross the network; an all-gather or reduce-scatter n - 1, of which nodes - 1 cross; a tree
  all-reduce 2 ((n / nodes - 1) NVLink hops + log2(nodes) network hops); an all-to-all or a collective-permute
  sends to its peers at once: one hop.

The base and hop latencies (microseconds) are NCCL's ``baseLat`` and ``hwLat`` tables (``tuning.cc``, NCCL
2.18 to 2.2x, the NVLink and network rows), not measured by jaxtron.
"""

from __future__ import annotations

import math

# protocol: (fraction of the link bandwidth it carries, base latency (tree, ring), hop latency by link (tree, ring))
PROTOCOLS = {
    "LL": (0.5, (6.8, 6.6), {"nvlink": (0.6, 0.6), "network": (5.0, 2.7)}),
    "LL128": (120 / 128, (14.0, 14.0), {"nvlink": (1.25, 1.9), "network": (8.5, 4.0)}),
    "Simple": (1.0, (8.4, 8.4), {"nvlink": (4.0, 3.4), "network": (14.0, 14.0)}),
}
RINGS = ("all-gather", "reduce-scatter", "all-reduce")


def _latency_us(kind: str, algorithm: str, protocol: str, ranks: int, nodes: int) -> float:
    _fraction, base, hops = PROTOCOLS[protocol]
    a = 0 if algorithm == "tree" else 1
    intra, inter = hops["nvlink"][a], hops["network"][a]
    if algorithm == "tree":  # all-reduce across nodes
        return base[a] + 2 * ((ranks // nodes - 1) * intra + math.ceil(math.log2(nodes)) * inter)
    if kind not in RINGS:  # an exchange or a permute: every peer at once
        return base[a] + (inter if nodes > 1 else intra)
    steps = 2 * (ranks - 1) if kind == "all-reduce" else ranks - 1
    crossing = (2 * nodes if kind == "all-reduce" else nodes - 1) if nodes > 1 else 0
    crossing = min(crossing, steps)
    return base[a] + (steps - crossing) * intra + crossing * inter


def collective_seconds(kind: str, ranks: int, nodes: int, net_bytes: float, nvlink_bytes: float,
                       net_bps: float, nvlink_bps: float) -> tuple[float, str, str]:
    """(seconds, algorithm, protocol) of the fastest way NCCL has to move ``net_bytes`` over the network and
    ``nvlink_bytes`` over NVLink (at the same time) for one ``kind`` collective over ``ranks`` devices in ``nodes``
    nodes; the bandwidths are the links' effective bytes per second."""
    algorithms = ["ring"] + (["tree"] if kind == "all-reduce" and nodes > 1 else [])
    best = None
    for algorithm in algorithms:
        for protocol, (fraction, _base, _hops) in PROTOCOLS.items():
            wire = max(net_bytes / (net_bps * fraction), nvlink_bytes / (nvlink_bps * fraction))
            secs = _latency_us(kind, algorithm, protocol, ranks, nodes) * 1e-6 + wire
            if best is None or secs < best[0]:
                best = (secs, algorithm, protocol)
    return best
