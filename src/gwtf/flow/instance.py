"""A routing instance: nodes (stage, region, compute, capacity, demand) over a network.

Owns: `NodeSpec`, `Instance` (with the per-edge cost d(i,j) of `flow.cost`), `Route`, and
`evaluate_routes` / `validate_routes`, the one place that checks a routing is legal and scores it.
The seeded generator lives in `flow.generate`.

A route is a tuple (data_holder, relay_stage_1, ..., relay_stage_{S-1}); the cycle closes at the
data holder. A routing is a list of routes, one per microbatch slot per iteration. Capacities:
each relay carries at most `capacity` routes; a data holder originates at most
min(demand, capacity) routes.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gwtf.flow.cost import edge_cost_s, route_cost_s
from gwtf.flow.network import Network
from gwtf.ids import NodeId

Route = tuple[NodeId, ...]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node as the routing sees it."""

    id: NodeId
    stage: int  # 0 = data holder (embedding + head); 1..S-1 relay stages
    region: str
    profile: str  # compute class name (see flow.profiles)
    compute_s: float  # c_i: seconds of forward+backward compute for one microbatch of its stage
    capacity: int  # max microbatches in flight through this node (memory)
    demand: int = 0  # data holders: microbatches it wants to train per iteration

    @property
    def is_data_holder(self) -> bool:
        return self.stage == 0


@dataclass(frozen=True)
class Instance:
    """Nodes + network + microbatch size: everything the cost model needs."""

    nodes: tuple[NodeSpec, ...]
    stages: int
    network: Network
    activation_bytes: int  # bytes crossing a stage boundary per microbatch
    by_id: dict[NodeId, NodeSpec] = field(init=False, repr=False, compare=False)
    by_stage: tuple[tuple[NodeId, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", {n.id: n for n in self.nodes})
        stages: list[list[NodeId]] = [[] for _ in range(self.stages)]
        for n in self.nodes:
            stages[n.stage].append(n.id)
        object.__setattr__(self, "by_stage", tuple(tuple(s) for s in stages))

    def latency_s(self, i: NodeId, j: NodeId) -> float:
        return self.network.latency_s(self.by_id[i].region, self.by_id[j].region)

    def bandwidth_bytes_per_s(self, i: NodeId, j: NodeId) -> float:
        return self.network.bandwidth_bytes_per_s(self.by_id[i].region, self.by_id[j].region)

    def linked(self, i: NodeId, j: NodeId) -> bool:
        """A link both ways (an instance file's `links` may leave pairs out: no link, d = inf)."""
        return math.isfinite(self.latency_s(i, j)) and math.isfinite(self.latency_s(j, i))

    def edge_cost_s(self, i: NodeId, j: NodeId) -> float:
        """d(i,j) for consecutive-stage nodes i -> j (or last relay -> data holder); inf: no link."""
        a, b = self.by_id[i], self.by_id[j]
        net = self.network
        lat_ab, lat_ba = net.latency_s(a.region, b.region), net.latency_s(b.region, a.region)
        if math.isinf(lat_ab) or math.isinf(lat_ba):
            return math.inf
        return edge_cost_s(
            a.compute_s, b.compute_s, lat_ab, lat_ba,
            net.bandwidth_bytes_per_s(a.region, b.region), net.bandwidth_bytes_per_s(b.region, a.region),
            self.activation_bytes,
        )

    def route_cost_s(self, route: Route) -> float:
        return route_cost_s(route, self.edge_cost_s)

    def max_flow_bound(self) -> int:
        """Trivial upper bound: min over stages of total capacity (DH side: min(demand, capacity))."""
        dh = sum(min(self.by_id[n].demand, self.by_id[n].capacity) for n in self.by_stage[0])
        relay = [sum(self.by_id[n].capacity for n in s) for s in self.by_stage[1:]]
        return min([dh, *relay])


@dataclass(frozen=True, slots=True)
class RouteStats:
    flow: int  # routes (microbatches per iteration slot)
    max_route_cost_s: float
    sum_route_cost_s: float


def validate_routes(instance: Instance, routes: Sequence[Route]) -> None:
    """Raise ValueError unless every route is a legal cycle and capacities hold."""
    load: Counter[NodeId] = Counter()
    for route in routes:
        if len(route) != instance.stages:
            raise ValueError(f"route {route} has {len(route)} hops, expected {instance.stages}")
        for k, nid in enumerate(route):
            spec = instance.by_id.get(nid)
            if spec is None:
                raise ValueError(f"route {route} uses unknown node {nid}")
            if spec.stage != k:
                raise ValueError(f"route {route}: node {nid} serves stage {spec.stage}, not {k}")
            load[nid] += 1
    for nid, n in load.items():
        spec = instance.by_id[nid]
        limit = min(spec.demand, spec.capacity) if spec.is_data_holder else spec.capacity
        if n > limit:
            raise ValueError(f"node {nid} carries {n} routes, limit {limit}")


def evaluate_routes(instance: Instance, routes: Sequence[Route]) -> RouteStats:
    """Validate and score a routing: flow, max and sum of route costs (seconds)."""
    validate_routes(instance, routes)
    costs = [instance.route_cost_s(r) for r in routes]
    return RouteStats(len(routes), max(costs, default=0.0), sum(costs))
