"""Central optimum on hand-made and generated instances: flow, min-max, lower bound, methods."""

from __future__ import annotations

import pytest

from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance, NodeSpec, evaluate_routes
from gwtf.flow.network import Network
from gwtf.flow.optimum import (
    class_graph,
    greedy_groups,
    lower_bound_max_route_cost_s,
    max_flow_value,
    optimum,
)


def _trap() -> Instance:
    """Cheapest-first routes A->r1 (cheap) and strands B on r2 (1 s away); the optimum crosses over."""
    lat = ((0.010, 0.020, 0.015), (0.020, 0.010, 1.000), (0.015, 1.000, 0.010))
    bw = tuple(tuple(1e12 for _ in range(3)) for _ in range(3))
    net = Network(name="trap", regions=("X", "Y", "Z"), latency_matrix_s=lat, bandwidth_matrix_bytes_per_s=bw)
    nodes = (
        NodeSpec(id="A", stage=0, region="X", profile="t4", compute_s=0.0, capacity=1, demand=1),
        NodeSpec(id="B", stage=0, region="Y", profile="t4", compute_s=0.0, capacity=1, demand=1),
        NodeSpec(id="r1", stage=1, region="X", profile="t4", compute_s=0.0, capacity=1),
        NodeSpec(id="r2", stage=1, region="Z", profile="t4", compute_s=0.0, capacity=1),
    )
    return Instance(nodes=nodes, stages=2, network=net, activation_bytes=0)


def test_cheapest_first_falls_in_the_trap_and_both_methods_escape() -> None:
    inst = _trap()
    graph = class_graph(inst)
    greedy = greedy_groups(graph, 2)
    assert max(graph.path_cost(p) for p in greedy) == pytest.approx(2.0)
    for exact in (True, False):
        res = optimum(inst, exact=exact)
        assert res.stats.flow == 2
        assert sorted(res.routes) == [("A", "r2"), ("B", "r1")]
        assert res.stats.max_route_cost_s == pytest.approx(0.04)
        assert res.lower_bound_max_route_cost_s <= res.stats.max_route_cost_s
    assert optimum(inst, exact=True).method == "exact-cpsat"
    assert optimum(inst, exact=False).method == "heuristic"


def test_max_flow_is_min_stage_capacity() -> None:
    inst = generate_instance(40, 4, 3, seed=11, relay_capacity=(1, 6))
    assert max_flow_value(inst) == inst.max_flow_bound()
    res = optimum(inst, exact=False)
    assert res.stats.flow == inst.max_flow_bound()
    assert evaluate_routes(inst, res.routes) == res.stats


def test_auto_picks_exact_when_small_and_bound_holds() -> None:
    inst = generate_instance(18, 3, 2, seed=4, relay_capacity=(1, 4))
    auto = optimum(inst)
    heur = optimum(inst, exact=False)
    assert auto.method == "exact-cpsat"
    assert auto.stats.flow == heur.stats.flow
    assert auto.stats.max_route_cost_s <= heur.stats.max_route_cost_s + 1e-12
    assert lower_bound_max_route_cost_s(inst) <= auto.stats.max_route_cost_s + 1e-12
    assert auto.lower_bound_max_route_cost_s == auto.stats.max_route_cost_s


def test_an_exact_solve_out_of_time_leaves_the_heuristic_in_the_automatic_choice() -> None:
    """CP-SAT's limit is wall clock: on a loaded machine the automatic choice must not crash a
    benchmark (issue 17's re-convergence runs died at N=60 with 'CP-SAT gave no answer')."""
    inst = generate_instance(18, 3, 2, seed=4, relay_capacity=(1, 4))
    starved = optimum(inst, time_limit_s=1e-9)
    heur = optimum(inst, exact=False)
    assert starved.method == "heuristic"
    assert starved.stats == heur.stats
    assert starved.lower_bound_max_route_cost_s == heur.lower_bound_max_route_cost_s
    with pytest.raises(TimeoutError):
        optimum(inst, exact=True, time_limit_s=1e-9)


def test_large_instance_uses_the_heuristic_and_is_deterministic() -> None:
    inst = generate_instance(200, 5, 8, seed=2)
    a, b = optimum(inst), optimum(inst)
    assert a.method == "heuristic"
    assert a == b
    assert a.stats.flow == inst.max_flow_bound()
    assert 0 < a.lower_bound_max_route_cost_s <= a.stats.max_route_cost_s


def test_wall_s_is_not_part_of_equality() -> None:
    from dataclasses import replace

    res = optimum(_trap())
    assert replace(res, wall_s=12.5) == res
