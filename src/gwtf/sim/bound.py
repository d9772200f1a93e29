"""An iteration's physical lower bound: no schedule of the initial swarm trains one faster.

Owns: `IterationBound` (four terms, seconds per iteration, and which one binds) and
`iteration_bound(instance, train, downlink_bytes_per_s)`, computed from the `Instance` and
`TrainParams` of `sim.scenario.build` (docs/simulator.md, "Iteration bound"). Every term holds
for any routing (the central optimum's, gwtf's, SWARM's) and either reduction of
`protocol.reduce`; they may overlap in time, so the bound is their max, not their sum:

- compute: a data holder computes embedding + head for each of its M microbatches (M c_d);
  a relay stage must run all D M microbatches of the iteration on its nodes: the least
  makespan of D M unit jobs on machines of speed 1 / c_i;
- traffic: every node's tensor bytes leave one after another on its uplink (`sim.models`):
  per microbatch a relay sends an activation on and a gradient back, a data holder an
  activation to stage 1 and a gradient to the last stage, each at best at the fastest link to
  a node of the stage it goes to; the least makespan over the stage as above (data holders:
  M each); with a downlink, its bytes in (activation + gradient per microbatch) too;
- reduction: per stage with R >= 2 replicas, the reduced gradient (stage_grad_bytes) must reach
  every replica but at most one: >= (R-1) G bytes over the replicas' uplinks, each at best its
  fastest link to another replica; data holders all contribute, so stage 0 also gathers:
  2 (R-1) G, the bandwidth-optimal all-reduce's total (a relay replica that carried no
  microbatch sends nothing: the gather part is routing-dependent); with a downlink, G / downlink;
- route: every microbatch goes once around the cycle DH -> relay per stage -> DH and back, so
  the iteration lasts at least the slowest data holder's cheapest cycle: the compute of its
  nodes plus, per hop, both latencies and both transfers (activation on, gradient back).
  This counts what `flow.cost` halves (its d(i,j) prices one direction), and it ignores
  capacities: with fewer route slots than microbatches (F < D M) a schedule may reuse the
  cheapest route in waves, so the central optimum's min-max cost bounds no iteration.

Nominal compute times (`sim.compute_jitter` draws around them) and header bytes left out. The
bound is a property of the initial instance: joiners may add nodes (a faster swarm), crashes and
link windows only slow it, a short iteration (a data holder lost) trains fewer microbatches.
Cached per (instance, train, downlink): both systems of one `gwtf simulate` share it.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from gwtf.flow.instance import Instance
from gwtf.ids import NodeId
from gwtf.protocol.ledger import TrainParams

Term = Literal["compute", "traffic", "reduction", "route"]
TERMS: tuple[Term, ...] = ("compute", "traffic", "reduction", "route")


@dataclass(frozen=True, slots=True)
class IterationBound:
    """The four lower bounds on one iteration, seconds (module docstring)."""

    compute_s: float
    traffic_s: float
    reduction_s: float
    route_s: float

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.traffic_s, self.reduction_s, self.route_s)

    @property
    def term(self) -> Term:
        """The binding term (the first of TERMS on a tie)."""
        values = (self.compute_s, self.traffic_s, self.reduction_s, self.route_s)
        return TERMS[values.index(max(values))]


def min_makespan_s(job_s: Sequence[float], jobs: int) -> float:
    """Least time in which machines taking `job_s[i]` seconds per unit job finish `jobs` jobs.

    Each job goes to the machine that would finish it first: optimal for unit jobs on machines
    of different speeds (the k-th job's finish time is the k-th smallest of all n * job_s[i]).
    """
    if jobs <= 0:
        return 0.0
    if not job_s:
        return math.inf
    heap = [(s, s) for s in job_s]
    heapq.heapify(heap)
    t = 0.0
    for _ in range(jobs):
        t, s = heapq.heappop(heap)
        heapq.heappush(heap, (t + s, s))
    return t


@lru_cache(maxsize=8)
def iteration_bound(instance: Instance, train: TrainParams, downlink_bytes_per_s: float = 0.0) -> IterationBound:
    """All four terms for the instance's nodes (`downlink_bytes_per_s` 0: no downlink limit)."""
    return IterationBound(
        compute_s=compute_bound_s(instance, train),
        traffic_s=traffic_bound_s(instance, train, downlink_bytes_per_s),
        reduction_s=reduction_bound_s(instance, train, downlink_bytes_per_s),
        route_s=route_bound_s(instance, train),
    )


def _jobs(instance: Instance, train: TrainParams) -> int:
    """Microbatches per iteration: M per data holder."""
    return len(instance.by_stage[0]) * train.microbatches


def _stage_makespan_s(instance: Instance, train: TrainParams, stage: int, per_mb_s: Sequence[float]) -> float:
    """Data holders: M microbatches each (their own data); relays: D M over the stage."""
    if stage == 0:
        return train.microbatches * max(per_mb_s, default=0.0)
    return min_makespan_s(per_mb_s, _jobs(instance, train))


def compute_bound_s(instance: Instance, train: TrainParams) -> float:
    """The busiest stage's least compute makespan (fwd+bwd, c_i of each node)."""
    return max((_stage_makespan_s(instance, train, k, [instance.by_id[n].compute_s for n in ids])
                for k, ids in enumerate(instance.by_stage)), default=0.0)


def _bytes_per_s(instance: Instance, a: str, b: str) -> float:
    """Bandwidth from region a to region b; 0 where there is no link."""
    net = instance.network
    return net.bandwidth_bytes_per_s(a, b) if math.isfinite(net.latency_s(a, b)) else 0.0


def _fastest_to(instance: Instance, region: str, regions: Sequence[str]) -> float:
    return max((_bytes_per_s(instance, region, r) for r in regions), default=0.0)


def _div(size: float, rate: float) -> float:
    return size / rate if rate > 0 else math.inf


def traffic_bound_s(instance: Instance, train: TrainParams, downlink_bytes_per_s: float = 0.0) -> float:
    """The busiest stage's least uplink (and downlink) makespan of the boundary tensors."""
    s = instance.stages
    regions = [sorted({instance.by_id[n].region for n in ids}) for ids in instance.by_stage]
    worst = 0.0
    for k, ids in enumerate(instance.by_stage):
        nxt, prev = regions[(k + 1) % s], regions[(k - 1) % s]
        per_region = {r: _div(train.activation_bytes, _fastest_to(instance, r, nxt))
                      + _div(train.activation_grad_bytes, _fastest_to(instance, r, prev)) for r in regions[k]}
        worst = max(worst, _stage_makespan_s(instance, train, k, [per_region[instance.by_id[n].region] for n in ids]))
        if downlink_bytes_per_s > 0 and ids:
            per_mb = (train.activation_bytes + train.activation_grad_bytes) / downlink_bytes_per_s
            worst = max(worst, _stage_makespan_s(instance, train, k, [per_mb] * len(ids)))
    return worst


def reduction_bound_s(instance: Instance, train: TrainParams, downlink_bytes_per_s: float = 0.0) -> float:
    """The slowest stage's least reduction time (module docstring: what must cross which uplinks)."""
    worst = 0.0
    for k, ids in enumerate(instance.by_stage):
        r = len(ids)
        if r < 2:
            continue
        g = float(train.stage_grad_bytes[k])
        total = (2 if k == 0 else 1) * (r - 1) * g
        worst = max(worst, _div(total, sum(_fastest_peer_bytes_per_s(instance, ids))))
        if downlink_bytes_per_s > 0:
            worst = max(worst, g / downlink_bytes_per_s)
    return worst


def _fastest_peer_bytes_per_s(instance: Instance, ids: Sequence[NodeId]) -> list[float]:
    """Per replica: its fastest link to another replica of the stage (by region: O(R x regions))."""
    count = Counter(instance.by_id[n].region for n in ids)
    best: dict[str, float] = {}
    for region in count:
        others = [o for o in count if o != region or count[o] > 1]
        best[region] = _fastest_to(instance, region, others)
    return [best[instance.by_id[n].region] for n in ids]


def route_bound_s(instance: Instance, train: TrainParams) -> float:
    """Max over data holders of its cheapest full cycle (forward and backward), seconds."""
    s = instance.stages
    cheapest: list[dict[str, float]] = []  # [stage][region] -> least c_i there
    for ids in instance.by_stage:
        least: dict[str, float] = {}
        for n in ids:
            spec = instance.by_id[n]
            least[spec.region] = min(least.get(spec.region, math.inf), spec.compute_s)
        cheapest.append(least)
    hop: dict[tuple[str, str], float] = {}

    def hop_s(a: str, b: str) -> float:
        """a -> b: activation on, gradient back, both latencies."""
        key = (a, b)
        if key not in hop:
            net = instance.network
            hop[key] = (net.latency_s(a, b) + net.latency_s(b, a)
                        + _div(train.activation_bytes, _bytes_per_s(instance, a, b))
                        + _div(train.activation_grad_bytes, _bytes_per_s(instance, b, a)))
        return hop[key]

    worst = 0.0
    for dh_region, c_dh in _dh_regions(instance).items():
        best = {dh_region: 0.0}
        for k in range(1, s):
            best = {r: min(v + hop_s(p, r) for p, v in best.items()) + c for r, c in cheapest[k].items()}
        cycle = min((v + hop_s(r, dh_region) for r, v in best.items()), default=math.inf)
        worst = max(worst, max(c_dh) + cycle)
    return worst


def _dh_regions(instance: Instance) -> dict[str, list[float]]:
    """Data holders' compute times by region (each holder's own cycle starts in its region)."""
    out: dict[str, list[float]] = {}
    for n in instance.by_stage[0]:
        spec = instance.by_id[n]
        out.setdefault(spec.region, []).append(spec.compute_s)
    return out
