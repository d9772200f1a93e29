"""The load-aware cost (flow.cost.queue_factor) and its central optimum (flow.load_optimum):
exact against brute force where the relaxation is exact (one data holder), feasible and bounded
where it is not, and balancing where the paper's cost stacks routes."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest

from gwtf.flow.cost import queue_factor
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance, NodeSpec, validate_routes
from gwtf.flow.load_optimum import load_aware_optimum, load_route_costs
from gwtf.flow.network import load_network
from gwtf.flow.optimum import max_flow_value, optimum


def test_queue_factor_is_the_mean_position_in_a_round() -> None:
    assert [queue_factor(k) for k in (0, 1, 2, 3, 10)] == [1.0, 1.0, 1.5, 2.0, 5.5]


def _tiny(dh_demand: int, dhs: int = 1) -> Instance:
    """Data holders in Oregon, 2 relay stages of 3 relays each spread over 3 regions."""
    net = load_network("geo10")
    regions = ["Oregon", "Frankfurt", "Tokyo"]
    nodes = [NodeSpec(f"d{h}", 0, regions[h % 3], "x", 0.05, 4, dh_demand) for h in range(dhs)]
    for k in (1, 2):
        nodes += [NodeSpec(f"r{k}{i}", k, regions[i], "x", 0.2 + 0.05 * i, 3) for i in range(3)]
    return Instance(tuple(nodes), 3, net, 1 << 20)


def _brute_min_sum(inst: Instance, flow: int) -> float:
    """Least load-aware sum over every multiset of `flow` legal routes (capacities respected)."""
    cycles = [tuple(p) for p in itertools.product(*inst.by_stage)]
    best = float("inf")
    for combo in itertools.combinations_with_replacement(cycles, flow):
        try:
            validate_routes(inst, combo)
        except ValueError:
            continue
        best = min(best, sum(load_route_costs(inst, combo)))
    return best


def test_one_data_holder_is_exact_against_brute_force() -> None:
    inst = _tiny(dh_demand=4)
    assert max_flow_value(inst) == 4
    opt = load_aware_optimum(inst)
    assert len(opt.routes) == 4
    validate_routes(inst, opt.routes)
    assert opt.sum_s == pytest.approx(_brute_min_sum(inst, 4), rel=1e-6)
    assert opt.lower_bound_sum_s == pytest.approx(opt.sum_s, rel=1e-6)  # one commodity: no repair


def test_several_data_holders_return_home_and_the_bound_holds() -> None:
    inst = generate_instance(60, 6, 6, seed=1003)
    opt = load_aware_optimum(inst)
    assert len(opt.routes) == max_flow_value(inst)
    validate_routes(inst, opt.routes)  # every route is a cycle through its own data holder
    costs = load_route_costs(inst, opt.routes)
    assert sum(costs) == pytest.approx(opt.sum_s)
    assert max(costs) == pytest.approx(opt.max_route_cost_s)
    assert opt.lower_bound_sum_s <= opt.sum_s * (1 + 1e-9)
    assert opt.sum_s <= 1.05 * opt.lower_bound_sum_s  # the repair costs little here


def test_uniform_compute_bound_routes_are_balanced_where_the_paper_cost_stacks_them() -> None:
    """Uniform GPUs, compute 1 s per microbatch: the paper's optimum fills the nearest relays to
    capacity; the load-aware optimum spreads routes over every relay of a stage."""
    inst = generate_instance(60, 6, 6, seed=7)
    inst = replace(inst, nodes=tuple(replace(n, compute_s=1.0) for n in inst.nodes))
    paper = optimum(inst, time_limit_s=10.0).routes
    aware = load_aware_optimum(inst).routes
    assert len(aware) == len(paper)

    def spread(routes: list[tuple[str, ...]]) -> int:
        """Per stage: the most loaded relay's routes minus the least loaded's among those with
        room left (a full relay is as loaded as it can be); the worst stage."""
        load = Counter(n for r in routes for n in r[1:])
        worst = 0
        for stage in inst.by_stage[1:]:
            room = [load[n] for n in stage if load[n] < inst.by_id[n].capacity]
            if room:
                worst = max(worst, max(load[n] for n in stage) - min(room))
        return worst

    assert spread(aware) <= 2 < spread(paper)  # link costs may shift a route or two
    assert sum(load_route_costs(inst, aware)) < 0.9 * sum(load_route_costs(inst, paper))
