"""NCCL's tuning model as the planner uses it (jaxtron/plan/nccl.py): each collective takes the fastest of ring
and tree, LL, LL128 and Simple, latency plus bytes over the protocol's share of the link; figures worked by hand
from NCCL's latency tables."""

import pytest

from jaxtron.plan import nccl

NET, NVLINK = 40e9, 360e9  # effective bytes/s


def test_a_small_all_reduce_across_nodes_takes_the_tree_and_ll():
    secs, algorithm, protocol = nccl.collective_seconds("all-reduce", 64, 8, 1e6, 0.0, NET, NVLINK)
    assert (algorithm, protocol) == ("tree", "LL")
    # tree latency: base 6.8 + 2 x (7 NVLink hops x 0.6 + log2(8) network hops x 5.0); LL carries half the bytes
    assert secs == pytest.approx((6.8 + 2 * (7 * 0.6 + 3 * 5.0)) * 1e-6 + 1e6 / (NET * 0.5))


def test_a_large_all_gather_takes_the_ring_and_simple_and_its_latency_grows_with_the_ranks():
    secs, algorithm, protocol = nccl.collective_seconds("all-gather", 64, 8, 100e6, 0.0, NET, NVLINK)
    assert (algorithm, protocol) == ("ring", "Simple")
    # 63 steps, 7 of them across nodes
    assert secs == pytest.approx((8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6 + 100e6 / NET)
    one_node = nccl.collective_seconds("all-gather", 8, 1, 0.0, 100e6, NET, NVLINK)[0]
    assert one_node == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 100e6 / NVLINK)


def test_exchanges_and_permutes_send_to_their_peers_at_once():
    secs, algorithm, _p = nccl.collective_seconds("all-to-all", 16, 2, 50e6, 40e6, NET, NVLINK)
    assert algorithm == "ring" and secs == pytest.approx((8.4 + 14.0) * 1e-6 + 50e6 / NET)
    tiny = nccl.collective_seconds("collective-permute", 2, 1, 0.0, 1e3, NET, NVLINK)
    assert tiny[2] == "LL" and tiny[0] == pytest.approx((6.6 + 0.6) * 1e-6 + 1e3 / (NVLINK * 0.5))
