"""The flow cost model (DESIGN.md section 4, PAPER.md 3.1), exactly as the paper writes it.

Owns: `edge_cost_s`, the cost of using nodes i -> j (consecutive stages) for one microbatch,
forward and backward, and `route_cost_s`, the sum over a route's edges with the cycle closed at
the data holder:

    d(i,j) = (c_i + c_j)/2 + (lat(i,j) + lat(j,i))/2 + 2*size / (bw(i,j) + bw(j,i))

Note the bandwidth term is size / mean(bw_ij, bw_ji), not the mean of size/bw. Every intermediate
node appears in two consecutive edges, so its compute time is counted once; the data holder
appears at both ends of its cycle, so it is counted once too.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def edge_cost_s(
    compute_i_s: float,
    compute_j_s: float,
    latency_ij_s: float,
    latency_ji_s: float,
    bandwidth_ij_bytes_per_s: float,
    bandwidth_ji_bytes_per_s: float,
    size_bytes: float,
) -> float:
    """d(i,j) in seconds for one microbatch (forward + backward) over the edge i -> j."""
    return (
        (compute_i_s + compute_j_s) / 2.0
        + (latency_ij_s + latency_ji_s) / 2.0
        + 2.0 * size_bytes / (bandwidth_ij_bytes_per_s + bandwidth_ji_bytes_per_s)
    )


def queue_factor(load: int) -> float:
    """Load-aware cost (issue 17, `flow.load_aware`): a GPU serves the microbatches of the k flows
    it carries one at a time, so a microbatch there takes its compute time plus, on average, half
    of the others' when the flows' microbatches arrive together: c * (k + 1) / 2 (k >= 1; an idle
    node prices the first flow at c). Summed over a node's flows this is c * k (k + 1) / 2, convex
    in k: the k-th flow adds c * k (`flow.load_optimum.load_aware_optimum` prices it so)."""
    return (max(load, 1) + 1) / 2.0


def route_cost_s(route: Sequence[str], edge_cost: Callable[[str, str], float]) -> float:
    """Cost of the cycle route[0] -> route[1] -> ... -> route[-1] -> route[0]."""
    total = 0.0
    n = len(route)
    for k in range(n):
        total += edge_cost(route[k], route[(k + 1) % n])
    return total
