"""Property tests on small random instances: legality, optimality against oracles, bounds, determinism.

Oracles: networkx max flow on the node-level layered graph (node splitting), and a brute-force
min-max search over all node-level routes (memoised branching on path multiplicities).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from functools import cache

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from gwtf.flow.baselines import greedy_routes, random_routes, swarm_routes
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance, Route, evaluate_routes
from gwtf.flow.optimum import max_flow_value, optimum

TOL = 1e-9


@st.composite
def small_instances(draw: st.DrawFn, max_relays: int = 6) -> Instance:
    stages = draw(st.integers(2, 4))
    dhs = draw(st.integers(1, 3))
    relays = draw(st.integers(stages - 1, max_relays))
    return generate_instance(
        dhs + relays, stages, dhs,
        network=draw(st.sampled_from(["geo10", "geo12"])),
        seed=draw(st.integers(0, 10_000)),
        preset="tiny", seq_len=128,
        relay_capacity=(1, draw(st.integers(1, 3))),
        demand_per_dh=draw(st.integers(1, 4)),
    )


def _nx_max_flow(inst: Instance) -> int:
    g = nx.DiGraph()
    for n in inst.nodes:
        limit = min(n.demand, n.capacity) if n.is_data_holder else n.capacity
        g.add_edge(("in", n.id), ("out", n.id), capacity=limit)
        if n.is_data_holder:
            g.add_edge("src", ("in", n.id))
        if n.stage == inst.stages - 1:
            g.add_edge(("out", n.id), "sink")
    for k in range(inst.stages - 1):
        for a, b in itertools.product(inst.by_stage[k], inst.by_stage[k + 1]):
            g.add_edge(("out", a), ("in", b))
    return int(nx.maximum_flow_value(g, "src", "sink"))


def _brute_min_max(inst: Instance, flow: int) -> float:
    """Least max route cost over all legal routings with `flow` routes (exhaustive)."""
    routes = sorted(itertools.product(*inst.by_stage), key=inst.route_cost_s)
    ids = [n.id for n in inst.nodes]
    limit = tuple(min(n.demand, n.capacity) if n.is_data_holder else n.capacity for n in inst.nodes)
    use = [tuple(ids.index(x) for x in r) for r in routes]

    def packable(count: int) -> int:
        @cache
        def best(i: int, residual: tuple[int, ...]) -> int:
            if i == count:
                return 0
            room = min(residual[j] for j in use[i])
            out = 0
            for y in range(room, -1, -1):
                left = list(residual)
                for j in use[i]:
                    left[j] -= y
                out = max(out, y + best(i + 1, tuple(left)))
                if out >= flow:
                    break
            return out

        return best(0, limit)

    for count in range(1, len(routes) + 1):
        if count < len(routes) and inst.route_cost_s(routes[count]) == inst.route_cost_s(routes[count - 1]):
            continue
        if packable(count) >= flow:
            return inst.route_cost_s(routes[count - 1])
    raise AssertionError("no routing carries the max flow")


def _check_legal(inst: Instance, routes: list[Route]) -> None:
    evaluate_routes(inst, routes)
    load = Counter(n for r in routes for n in r)
    for nid, count in load.items():
        spec = inst.by_id[nid]
        assert count <= (min(spec.demand, spec.capacity) if spec.is_data_holder else spec.capacity)
    for r in routes:
        assert [inst.by_id[n].stage for n in r] == list(range(inst.stages))


@settings(max_examples=30, deadline=None)
@given(small_instances())
def test_optimum_is_exact_against_oracles(inst: Instance) -> None:
    res = optimum(inst, exact=True)
    _check_legal(inst, res.routes)
    assert res.stats.flow == _nx_max_flow(inst) == max_flow_value(inst)
    if res.stats.flow:
        assert abs(res.stats.max_route_cost_s - _brute_min_max(inst, res.stats.flow)) <= TOL


@settings(max_examples=40, deadline=None)
@given(small_instances(max_relays=9), st.integers(0, 100))
def test_optimum_dominates_baselines_and_bounds_hold(inst: Instance, seed: int) -> None:
    exact = optimum(inst, exact=True)
    heur = optimum(inst, exact=False)
    assert heur.stats.flow == exact.stats.flow
    assert heur.lower_bound_max_route_cost_s <= exact.stats.max_route_cost_s + TOL
    assert exact.stats.max_route_cost_s <= heur.stats.max_route_cost_s + TOL
    _check_legal(inst, heur.routes)
    others = [swarm_routes(inst, random.Random(seed)), greedy_routes(inst), random_routes(inst, random.Random(seed))]
    for routes in others:
        _check_legal(inst, routes)
        stats = evaluate_routes(inst, routes)
        assert stats.flow <= exact.stats.flow
        if stats.flow == exact.stats.flow:
            assert exact.stats.max_route_cost_s <= stats.max_route_cost_s + TOL


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_same_seed_same_instance_and_result(seed: int, exact: bool) -> None:
    a = generate_instance(14, 3, 2, seed=seed, relay_capacity=(1, 3), jitter_fraction=0.1)
    b = generate_instance(14, 3, 2, seed=seed, relay_capacity=(1, 3), jitter_fraction=0.1)
    assert a == b
    assert optimum(a, exact=exact) == optimum(b, exact=exact)
    assert swarm_routes(a, random.Random(seed)) == swarm_routes(b, random.Random(seed))
    assert random_routes(a, random.Random(seed)) == random_routes(b, random.Random(seed))
