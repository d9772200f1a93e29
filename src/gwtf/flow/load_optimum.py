"""The central optimum under the load-aware cost (`flow.load_aware`, issue 17): convex node costs.

Owns: `load_route_costs(instance, routes)` (each route's cost when every node's compute is scaled
by `flow.cost.queue_factor` of the routes it carries) and `load_aware_optimum(instance, flow)`.

The cost: a node carrying k routes serves their microbatches one at a time, so each pays
c * (k + 1) / 2 there and the node's total is c * k (k + 1) / 2: convex in k, its m-th route
adds c * m. Summed over routes, the load-aware cost of a routing is

    sum over nodes of c_i * k_i (k_i + 1) / 2  +  sum over route edges of the link terms of d(i,j)

(latency and transfer; every node's compute moves off the edges onto the node). That is a
min-cost flow with one unit arc per slot of every node, priced c * m for the m-th (OR-Tools
SimpleMinCostFlow; costs in integer microseconds), at the max flow F (`flow.optimum`):

1. The relaxation: one commodity from a super source through the data holders' slots, the relay
   stages in order, back to any data holder. Its cost is a lower bound on every routing of F
   routes (`lower_bound_sum_s`): routes that must return to their own data holder can only cost
   more.
2. The repair: the relaxation's paths are cut before the last relay stage, and the prefixes are
   assigned to the last-stage relays (each keeping the number of routes the relaxation gave it,
   so every node's load, hence every compute term, is unchanged) by a second min-cost flow that
   prices prefix -> relay -> the prefix's own data holder. The routes it gives are feasible;
   `sum_s` is their load-aware cost and `sum_s / lower_bound_sum_s` bounds the gap.

The objective is the sum, not the max: the load term is what sets a compute-bound iteration's
time, and the sum of convex node costs is what balances it. `max_route_cost_s` is reported too.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.graph.python import min_cost_flow

from gwtf.flow.cost import queue_factor
from gwtf.flow.instance import Instance, Route, validate_routes
from gwtf.flow.optimum import max_flow_value, node_limit
from gwtf.ids import NodeId

_SCALE = 1e6  # integer microseconds


@dataclass(frozen=True)
class LoadOptimum:
    routes: list[Route]
    sum_s: float  # load-aware cost of `routes`, summed
    max_route_cost_s: float  # the dearest of them, load-aware
    lower_bound_sum_s: float  # the relaxation's cost: no routing of as many routes costs less


def _link_s(instance: Instance, i: NodeId, j: NodeId) -> float:
    """d(i,j) without its compute terms (latency + transfer); inf where there is no link."""
    return instance.edge_cost_s(i, j) - (instance.by_id[i].compute_s + instance.by_id[j].compute_s) / 2.0


def load_route_costs(instance: Instance, routes: Sequence[Route]) -> list[float]:
    """Each route's load-aware cost: d(i,j) with every node's compute x queue_factor(its routes)."""
    load = Counter(n for r in routes for n in r)
    scaled = {nid: instance.by_id[nid].compute_s * queue_factor(k) for nid, k in load.items()}
    out = []
    for r in routes:
        s = len(r)
        out.append(sum((scaled[r[k]] + scaled[r[(k + 1) % s]]) / 2.0 + _link_s(instance, r[k], r[(k + 1) % s])
                       for k in range(s)))
    return out


def load_aware_optimum(instance: Instance, flow: int | None = None) -> LoadOptimum:
    """Min load-aware cost routing of `flow` routes (default: the max flow); see the module doc."""
    f = max_flow_value(instance) if flow is None else flow
    if f <= 0:
        return LoadOptimum([], 0.0, 0.0, 0.0)
    S = instance.stages
    dhs = instance.by_stage[0]
    mcf = min_cost_flow.SimpleMinCostFlow()
    src, sink = 0, 1
    index: dict[tuple[str, NodeId], int] = {}

    def node(kind: str, nid: NodeId) -> int:
        key = (kind, nid)
        if key not in index:
            index[key] = len(index) + 2
        return index[key]

    def arc(a: int, b: int, cap: int, cost_s: float) -> int:
        return int(mcf.add_arc_with_capacity_and_unit_cost(a, b, cap, round(cost_s * _SCALE)))

    slot_arcs: list[tuple[int, NodeId]] = []  # arc -> the node whose slot it is
    for h in dhs:
        c = instance.by_id[h].compute_s
        for m in range(1, node_limit(instance, h) + 1):
            slot_arcs.append((arc(src, node("out", h), 1, c * m), h))
        arc(node("in", h), sink, node_limit(instance, h), 0.0)
    for k in range(1, S):
        for j in instance.by_stage[k]:
            c = instance.by_id[j].compute_s
            for m in range(1, node_limit(instance, j) + 1):
                slot_arcs.append((arc(node("in", j), node("out", j), 1, c * m), j))
    hop_arcs: list[tuple[int, NodeId, NodeId]] = []
    for k in range(S):
        nxt = instance.by_stage[(k + 1) % S]
        for i in instance.by_stage[k]:
            for j in nxt:
                d = _link_s(instance, i, j)
                if math.isfinite(d):
                    hop_arcs.append((arc(node("out", i), node("in", j), f, d), i, j))
    mcf.set_node_supply(src, f)
    mcf.set_node_supply(sink, -f)
    for key in list(index.values()):
        mcf.set_node_supply(key, 0)
    if mcf.solve() != mcf.OPTIMAL:
        raise ValueError(f"no routing of {f} routes over the instance's links")
    lower = mcf.optimal_cost() / _SCALE

    # decompose into paths data holder -> ... -> last relay (its return is repaired below)
    nxt_of: dict[NodeId, Counter[NodeId]] = {}
    for a, i, j in hop_arcs:
        x = int(mcf.flow(a))
        if x and instance.by_id[j].stage != 0:
            nxt_of.setdefault(i, Counter())[j] += x
    starts = Counter({h: int(sum(mcf.flow(a) for a, n in slot_arcs if n == h)) for h in dhs})
    prefixes: list[tuple[NodeId, ...]] = []
    for h in dhs:
        for _ in range(starts[h]):
            path = [h]
            for _k in range(1, S):
                options = nxt_of[path[-1]]
                j = min(n for n, x in options.items() if x > 0)
                options[j] -= 1
                path.append(j)
            prefixes.append(tuple(path))
    return LoadOptimum(*_repair(instance, prefixes), lower_bound_sum_s=lower)


def _repair(instance: Instance, paths: list[tuple[NodeId, ...]]) -> tuple[list[Route], float, float]:
    """Re-assign the last relays so that every route returns to its own data holder, each last
    relay keeping its number of routes (a transportation problem, min-cost flow)."""
    S = instance.stages
    groups = Counter(p[:-1] for p in paths)
    last = Counter(p[-1] for p in paths)
    mcf = min_cost_flow.SimpleMinCostFlow()
    g_ids = list(groups)
    x_ids = sorted(last)
    arcs: list[tuple[int, int, int]] = []
    for gi, g in enumerate(g_ids):
        mcf.set_node_supply(gi, groups[g])
        for xi, x in enumerate(x_ids):
            d = _link_s(instance, g[-1], x) + _link_s(instance, x, g[0])
            if math.isfinite(d):
                a = mcf.add_arc_with_capacity_and_unit_cost(gi, len(g_ids) + xi, groups[g], round(d * _SCALE))
                arcs.append((int(a), gi, xi))
    for xi, x in enumerate(x_ids):
        mcf.set_node_supply(len(g_ids) + xi, -last[x])
    if mcf.solve() != mcf.OPTIMAL:
        raise ValueError("the relaxation's routes cannot all return to their own data holders")
    routes: list[Route] = []
    for a, gi, xi in arcs:
        routes += [(*g_ids[gi], x_ids[xi])] * int(mcf.flow(a))
    routes.sort()
    assert all(len(r) == S for r in routes)
    validate_routes(instance, routes)
    costs = load_route_costs(instance, routes)
    return routes, sum(costs), max(costs, default=0.0)
