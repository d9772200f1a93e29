"""Routing baselines on the same `Instance`: SWARM's stochastic wiring, greedy nearest hop, random.

Owns: `swarm_routes`, `greedy_routes`, `random_routes`. Each returns a legal routing
(`validate_routes` passes): as many routes as it can, up to the total data-holder demand
(min(demand, capacity) per data holder). Data holders take turns (round-robin, one microbatch each),
so no data holder starves the others. A hop only goes to a node with spare capacity.

SWARM (ANCHORS.md 2.1, PAPER.md 6.5; docs/routing.md has our reading): per stage a min-heap keyed by
each peer's virtual busy time; a microbatch goes to the least-loaded peer, whose virtual time then
grows by the task's expected duration (forward + 2.5x for backward, over the peer's throughput).
The result is an interleaved round-robin weighted by throughput. SWARM ignores memory; here a full
peer is skipped so the routing stays legal. Peers start at a random phase (new peers are put near
the top of the heap in the released code), drawn from `rng`.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import numpy as np

from gwtf.flow.instance import Instance, Route
from gwtf.ids import NodeId


def _dh_limits(instance: Instance) -> dict[NodeId, int]:
    return {n: min(instance.by_id[n].demand, instance.by_id[n].capacity) for n in instance.by_stage[0]}


def _round_robin(instance: Instance, pick: Callable[[NodeId], Route | None]) -> list[Route]:
    """Data holders take turns asking `pick` for one route until demand is met or a pick fails."""
    left = _dh_limits(instance)
    routes: list[Route] = []
    active = [n for n in instance.by_stage[0] if left[n] > 0]
    while active:
        for dh in list(active):
            route = pick(dh)
            if route is None:
                return routes
            routes.append(route)
            left[dh] -= 1
            if left[dh] == 0:
                active.remove(dh)
    return routes


def swarm_routes(instance: Instance, rng: random.Random) -> list[Route]:
    """SWARM's throughput-weighted interleaved round-robin, skipping peers without memory left."""
    spare = {n.id: n.capacity for n in instance.nodes if not n.is_data_holder}
    heaps: list[list[tuple[float, int, NodeId]]] = []
    for k in range(1, instance.stages):
        heap = []
        for order, nid in enumerate(instance.by_stage[k]):
            heap.append((rng.random() * _task_s(instance, nid), order, nid))
        heapq.heapify(heap)
        heaps.append(heap)

    def pick(dh: NodeId) -> Route | None:
        route = [dh]
        for heap in heaps:
            while heap and spare[heap[0][2]] == 0:
                heapq.heappop(heap)  # full: SWARM would overload it; we skip it
            if not heap:
                return None
            busy, order, nid = heap[0]
            heapq.heapreplace(heap, (busy + _task_s(instance, nid), order, nid))
            route.append(nid)
        for nid in route[1:]:
            spare[nid] -= 1
        return tuple(route)

    return _round_robin(instance, pick)


def _task_s(instance: Instance, nid: NodeId) -> float:
    """Expected seconds of one microbatch at the peer's throughput.

    SWARM charges size/throughput for a forward and 2.5x that for a backward; c_i already is the
    forward + backward time, so the heap key grows by c_i (the same ratio across peers).
    """
    return instance.by_id[nid].compute_s


def _stage_costs(instance: Instance) -> list[np.ndarray]:
    """[k] -> d(i, j) for i in stage k, j in stage k+1 (k = 0..S-2), as dense matrices."""
    out = []
    for k in range(instance.stages - 1):
        a, b = instance.by_stage[k], instance.by_stage[k + 1]
        out.append(np.array([[instance.edge_cost_s(i, j) for j in b] for i in a]).reshape(len(a), len(b)))
    return out


def greedy_routes(instance: Instance) -> list[Route]:
    """Each hop takes the nearest (lowest d) next-stage node with spare capacity; ties by id order."""
    costs = _stage_costs(instance)
    spare = [np.array([instance.by_id[n].capacity for n in s], dtype=np.int64) for s in instance.by_stage]
    pos = {nid: i for s in instance.by_stage for i, nid in enumerate(s)}

    def pick(dh: NodeId) -> Route | None:
        idx = [pos[dh]]
        for k in range(1, instance.stages):
            row = np.where(spare[k] > 0, costs[k - 1][idx[-1]], np.inf)
            j = int(np.argmin(row))
            if not np.isfinite(row[j]):
                return None
            idx.append(j)
        for k in range(1, instance.stages):
            spare[k][idx[k]] -= 1
        return tuple(instance.by_stage[k][i] for k, i in enumerate(idx))

    return _round_robin(instance, pick)


def random_routes(instance: Instance, rng: random.Random) -> list[Route]:
    """Each hop takes a uniformly random next-stage node with spare capacity."""
    spare = {n.id: n.capacity for n in instance.nodes if not n.is_data_holder}

    def pick(dh: NodeId) -> Route | None:
        route = [dh]
        for k in range(1, instance.stages):
            free = [n for n in instance.by_stage[k] if spare[n] > 0]
            if not free:
                return None
            route.append(rng.choice(free))
        for nid in route[1:]:
            spare[nid] -= 1
        return tuple(route)

    return _round_robin(instance, pick)
