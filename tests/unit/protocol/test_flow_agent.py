"""FlowAgent (protocol/routing/) in a tiny in-memory harness: a few agents, one inbox queue per
node, a manual clock. Covers phase A reservation, capacity limits, crash repair, rerouting in
`next_hop`, link re-pricing, the wire rules of the flow messages, and determinism."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from typing import Any

import pytest

from gwtf.config import FlowConfig
from gwtf.flow.instance import Instance, NodeSpec, Route, evaluate_routes
from gwtf.flow.network import Network
from gwtf.protocol.base import MESSAGE_TYPES, NodeId, Send, SetTimer
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.routing import FlowAgent
from gwtf.protocol.routing.messages import FlowQuery
from gwtf.protocol.routing.moves import Choice

DELAY_S = 0.05
STEP_S = 0.05

NET = Network(
    name="two", regions=("a", "b"),
    latency_matrix_s=((0.01, 0.08), (0.08, 0.01)),
    bandwidth_matrix_bytes_per_s=((2.5e8, 5e7), (5e7, 2.5e8)),
)


def tiny_instance(demand: int = 2, relay_capacity: int = 1, stages: int = 3) -> Instance:
    """One data holder (region a) and two relays per relay stage: r<k>a (cheap) and r<k>b."""
    nodes = [NodeSpec("dh", 0, "a", "x", 0.01, 8, demand)]
    for k in range(1, stages):
        nodes.append(NodeSpec(f"r{k}a", k, "a", "x", 0.05, relay_capacity))
        nodes.append(NodeSpec(f"r{k}b", k, "b", "x", 0.08, relay_capacity))
    return Instance(nodes=tuple(nodes), stages=stages, network=NET, activation_bytes=1_000_000)


class Harness:
    """Delivers every message DELAY_S after it was sent; the clock advances in STEP_S steps."""

    def __init__(self, inst: Instance, seed: int = 0, cfg: FlowConfig | None = None) -> None:
        self.inst = inst
        self.now = 0.0
        self.cfg = cfg or FlowConfig()
        self.agents = {
            n.id: FlowAgent(_info(n), inst.stages, inst.activation_bytes, self.cfg, random.Random(f"{seed}/{n.id}"))
            for n in inst.nodes
        }
        self.inbox: dict[NodeId, deque[tuple[float, NodeId, Any]]] = {nid: deque() for nid in self.agents}
        self.timers: dict[tuple[NodeId, Any], float] = {}
        self.dead: set[NodeId] = set()
        self.sent = 0
        for n in inst.nodes:
            for m in inst.nodes:
                if m.id != n.id and _adjacent(inst, n, m):
                    self.apply(n.id, self.agents[n.id].on_peer_up(_info(m), _link(inst, n.id, m.id), 0.0))
        for nid, agent in self.agents.items():
            self.apply(nid, agent.on_start(0.0))

    def apply(self, nid: NodeId, effects: list[Any]) -> None:
        for eff in effects:
            if isinstance(eff, Send):
                self.sent += 1
                self.inbox[eff.to].append((self.now + DELAY_S, nid, eff.msg))
            elif isinstance(eff, SetTimer):
                self.timers[(nid, eff.key)] = eff.at

    def step(self) -> None:
        self.now += STEP_S
        for nid, queue in self.inbox.items():
            while queue and queue[0][0] <= self.now + 1e-12:
                _, src, msg = queue.popleft()
                if nid not in self.dead:
                    self.apply(nid, self.agents[nid].on_message(src, msg, self.now))
        for (nid, key), at in sorted(self.timers.items(), key=lambda kv: (kv[1], kv[0][0], str(kv[0][1]))):
            if at <= self.now and self.timers.get((nid, key)) == at:
                del self.timers[(nid, key)]
                if nid not in self.dead:
                    self.apply(nid, self.agents[nid].on_timer(key, self.now))
        self.assert_capacities()

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.step()

    def crash(self, victim: NodeId) -> None:
        """Silent crash; every neighbour is told at once (the detection delay is not under test)."""
        self.dead.add(victim)
        for nid, agent in self.agents.items():
            if nid not in self.dead:
                self.apply(nid, agent.on_peer_down(victim, self.now))

    def assert_capacities(self) -> None:
        for nid, a in self.agents.items():
            assert a.state.load <= a.state.me.capacity, f"{nid} over capacity"
            if a.state.is_dh:
                assert len(a.state.flows) <= min(a.state.me.demand, a.state.me.capacity)

    def routes(self) -> list[Route]:
        out: list[Route] = []
        dh = self.agents["dh"]
        for key, e in dh.state.flows.items():
            if e.pending or e.next is None:
                continue
            route, prev, node = ["dh"], "dh", e.next
            while node != "dh":
                f = self.agents[node].state.flows.get(key)
                assert f is not None and f.prev == prev and not f.pending, f"broken flow {key} at {node}"
                route.append(node)
                prev, node = node, f.next
            out.append(tuple(route))
        return sorted(out)


def _info(n: NodeSpec) -> PeerInfo:
    return PeerInfo(n.id, n.stage, n.region, n.compute_s, n.capacity, n.demand)


def _adjacent(inst: Instance, a: NodeSpec, b: NodeSpec) -> bool:
    """Same, previous or next stage; not a prev / next node it has no link to (as RoutingSim)."""
    return (b.stage - a.stage) % inst.stages in (0, 1, inst.stages - 1) and (
        a.stage == b.stage or inst.linked(a.id, b.id))


def _link(inst: Instance, a: NodeId, b: NodeId) -> LinkEstimate:
    return LinkEstimate(inst.latency_s(a, b), inst.bandwidth_bytes_per_s(a, b))


def _relay_flow_counts(h: Harness) -> dict[NodeId, int]:
    return {nid: len(a.state.flows) for nid, a in h.agents.items() if not a.state.is_dh and nid not in h.dead}


def test_flows_are_established_end_to_end() -> None:
    inst = tiny_instance(demand=2, relay_capacity=1)
    h = Harness(inst)
    h.run(15.0)
    routes = h.routes()
    assert evaluate_routes(inst, routes).flow == 2
    assert len(h.agents["dh"].flow_slots(h.now)) == 2
    # every relay holds exactly the flows that pass through it: nothing reserved and forgotten
    through = {nid: sum(nid in r for r in routes) for nid in _relay_flow_counts(h)}
    assert through == _relay_flow_counts(h)


def test_demand_above_capacity_is_capped_and_cheapest_route_is_taken() -> None:
    inst = tiny_instance(demand=5, relay_capacity=1)
    h = Harness(inst)
    h.run(15.0)
    assert len(h.routes()) == 2  # two relays of capacity 1 per stage
    inst1 = tiny_instance(demand=1, relay_capacity=1)
    h1 = Harness(inst1)
    h1.run(15.0)
    assert h1.routes() == [("dh", "r1a", "r2a")]  # region a is cheaper everywhere


def test_crash_of_a_relay_rebuilds_its_flow_through_the_survivor() -> None:
    inst = tiny_instance(demand=1, relay_capacity=2)
    h = Harness(inst)
    h.run(15.0)
    assert h.routes() == [("dh", "r1a", "r2a")]
    h.crash("r1a")
    h.run(10.0)
    assert h.routes() == [("dh", "r1b", "r2a")]
    assert _relay_flow_counts(h) == {"r1b": 1, "r2a": 1, "r2b": 0}


def test_crash_of_a_last_stage_relay_repairs_downstream_part_only() -> None:
    inst = tiny_instance(demand=2, relay_capacity=2, stages=4)
    h = Harness(inst)
    h.run(20.0)
    assert len(h.routes()) == 2
    h.crash("r3a")
    h.run(10.0)
    routes = h.routes()
    assert len(routes) == 2 and all(r[3] == "r3b" for r in routes)
    assert sum(_relay_flow_counts(h).values()) == 2 * 3


def test_next_hop_follows_the_flow_and_reroutes_around_excluded_peers() -> None:
    inst = tiny_instance(demand=1, relay_capacity=1)
    h = Harness(inst)
    h.run(15.0)
    dh = h.agents["dh"]
    (slot,) = dh.flow_slots(h.now)
    assert dh.next_hop(slot.flow_id, "dh", "dh", (), h.now) == (slot.next, slot.flow_id)
    other = "r1b" if slot.next == "r1a" else "r1a"
    assert dh.next_hop(slot.flow_id, "dh", "dh", [slot.next], h.now) == (other, slot.flow_id)
    assert dh.next_hop(slot.flow_id, "dh", "dh", ["r1a", "r1b"], h.now) is None
    r1 = h.agents[slot.next]
    hop = r1.next_hop(slot.flow_id, "dh", "dh", (), h.now)
    assert hop is not None and hop[0] in ("r2a", "r2b")
    assert r1.next_hop(slot.flow_id, "dh", "dh", [hop[0]], h.now) == (
        "r2b" if hop[0] == "r2a" else "r2a", slot.flow_id)
    # an unknown flow still gets the best live next-stage peer
    assert r1.next_hop(12345, "dh", "dh", (), h.now) == ("r2a", 12345)
    # the last stage always returns to the origin
    assert h.agents["r2a"].next_hop(slot.flow_id, "r1a", "dh", (), h.now) == ("dh", slot.flow_id)


def test_link_update_reprices_routes_up_to_the_data_holder() -> None:
    inst = tiny_instance(demand=1, relay_capacity=1)
    h = Harness(inst)
    h.run(15.0)
    dh = h.agents["dh"]
    (entry,) = dh.state.flows.values()
    before = entry.down_s
    assert before == pytest.approx(inst.route_cost_s(h.routes()[0]))
    r1 = h.agents["r1a"]
    slow = LinkEstimate(latency_s=1.0, bandwidth_bytes_per_s=inst.bandwidth_bytes_per_s("r1a", "r2a"))
    h.apply("r1a", r1.on_link_update("r2a", slow, h.now))
    h.run(1.0)
    assert dh.state.flows[entry.key].down_s == pytest.approx(before + 1.0 - 0.01)


def test_same_seed_same_routes_and_messages() -> None:
    runs = []
    for _ in range(2):
        h = Harness(tiny_instance(demand=3, relay_capacity=2, stages=4), seed=7)
        h.run(20.0)
        runs.append((h.routes(), h.sent, sorted(h.agents["dh"].state.flows)))
    assert runs[0] == runs[1]


def test_flow_messages_follow_the_wire_rules() -> None:
    flow_types = {name: cls for name, cls in MESSAGE_TYPES.items() if name.startswith("flow.")}
    assert len(flow_types) >= 12
    for name, cls in flow_types.items():
        for f in dataclasses.fields(cls):
            assert f.type in ("int", "float", "str", "bool") or f.type.startswith("tuple["), (name, f.name)


def test_agent_rejects_a_stage_outside_the_pipeline() -> None:
    with pytest.raises(ValueError):
        FlowAgent(PeerInfo("x", 5, "a", 0.1, 1), 3, 1000, FlowConfig(), random.Random(0))


def test_crash_mid_route_releases_the_orphaned_downstream_part() -> None:
    inst = tiny_instance(demand=1, relay_capacity=1, stages=5)
    h = Harness(inst)
    h.run(20.0)
    assert h.routes() == [("dh", "r1a", "r2a", "r3a", "r4a")]
    h.crash("r2a")
    h.run(5.0)  # well before the periodic consistency checks could clean anything up
    routes = h.routes()
    assert len(routes) == 1 and routes[0][2] == "r2b"
    through = {nid: sum(nid in r for r in routes) for nid in _relay_flow_counts(h)}
    assert through == _relay_flow_counts(h)


def test_swap_next_hops_trades_tails_renames_them_and_scores_like_the_instance() -> None:
    """PAPER.md 3.3.4 Move 1: two same-stage relays swap the next hops of two flows of one origin.

    The move is started by hand (annealing off), so the test sees exactly one swap; the
    routes must come out as head_a + tail_b and head_b + tail_a with consistent names hop by hop,
    and the score must match the route costs the instance computes."""
    cfg = dataclasses.replace(FlowConfig(), anneal_probability=0.0, anneal_swap_next=True)
    inst = tiny_instance(demand=2, relay_capacity=1, stages=4)
    h = Harness(inst, cfg=cfg)
    h.run(20.0)
    before = h.routes()
    assert len(before) == 2
    a, b = h.agents["r1a"], h.agents["r1b"]
    (ea,), (eb,) = a.state.flows.values(), b.state.flows.values()
    route_a = next(r for r in before if r[1] == "r1a")
    route_b = next(r for r in before if r[1] == "r1b")
    effects = b.on_message("r1a", FlowQuery(tuple(sorted({ea.prev, ea.next or ""}))), h.now)
    (table,) = [eff.msg for eff in effects if isinstance(eff, Send)]
    (score, _order, index, mine), = list(a.anneal.swap.moves(table, [ea], dict(zip(table.link_nodes, table.link_costs_s))))
    new_a, new_b = route_a[:2] + route_b[2:], route_b[:2] + route_a[2:]
    old_max = max(inst.route_cost_s(route_a), inst.route_cost_s(route_b))
    new_max = max(inst.route_cost_s(new_a), inst.route_cost_s(new_b))
    assert score[0] == pytest.approx(old_max - new_max)
    a.anneal.propose("r1b", table, Choice(score[0], "swap_next", index, mine))
    h.apply("r1a", a.state.flush())
    h.run(3.0)
    assert h.routes() == sorted([new_a, new_b])  # Harness.routes checks names and prevs hop by hop
    dh = h.agents["dh"]
    for e in dh.state.flows.values():
        route = next(r for r in (new_a, new_b) if r[1] == e.next)
        assert e.prev == route[-1]  # the data holder learned its route's new last relay
        assert e.down_s == pytest.approx(inst.route_cost_s(route))
    assert a.state.flows[ea.key].next == route_b[2] and b.state.flows[eb.key].next == route_a[2]
    assert all(n == 1 for n in _relay_flow_counts(h).values())


def _exchange_then_crash_the_proposer() -> tuple[Harness, Any, Any]:
    """r2a proposes an exchange of its flow with r2b's (by hand, annealing off); r2b accepts,
    leaves a tombstone for its old flow pointing at r2a and installs r2a's; r2a crashes before
    the accept arrives. Returns the harness (just after the crash) and the two flow keys."""
    cfg = dataclasses.replace(FlowConfig(), anneal_probability=0.0)
    inst = tiny_instance(demand=2, relay_capacity=1, stages=4)
    h = Harness(inst, cfg=cfg)
    h.run(20.0)
    assert len(h.routes()) == 2
    a, b = h.agents["r2a"], h.agents["r2b"]
    (ea,), (eb,) = a.state.flows.values(), b.state.flows.values()
    effects = b.on_message("r2a", FlowQuery(tuple(sorted({ea.prev, ea.next or ""}))), h.now)
    (table,) = [eff.msg for eff in effects if isinstance(eff, Send)]
    a.anneal.propose("r2b", table, Choice(0.0, "exchange", 0, ea))
    h.apply("r2a", a.state.flush())
    h.step()  # r2b has the proposal and accepts; its answer is still on the way
    assert eb.key not in b.state.flows and b.state.tombstones[eb.key][0] == "r2a" and ea.key in b.state.flows
    h.crash("r2a")
    return h, ea.key, eb.key


def test_a_tombstone_to_a_relay_that_died_mid_exchange_does_not_strand_the_route() -> None:
    """Regression (issue 17): the exchange's tombstone at r2b points at r2a, which died before
    the accept arrived. The neighbours of r2b's old flow (r1b, r3b) were told r2a is down while
    the flow was still at r2b; their next consistency check then learned 'r2a holds it' and
    re-pointed the flow at the dead peer, whose silence never failed a check: a half-route held
    r1b and r3b for good (`gwtf route --nodes 200 --stages 8 --data-holders 16 --seed 1002
    --crash-fraction 0.1`: flow 227 of 228). The route must be released or rebuilt."""
    h, _, _ = _exchange_then_crash_the_proposer()
    h.run(60.0)  # four consistency-check periods
    for nid, agent in h.agents.items():
        if nid in h.dead:
            continue
        for e in agent.state.flows.values():
            assert "r2a" not in (e.prev, e.next), f"{nid} still routes {e.key} through the dead r2a"
    routes = h.routes()  # checks names and prevs hop by hop
    assert len(routes) == 1  # stage 2 has one survivor of capacity 1
    assert len(h.agents["dh"].state.flows) == 1
    through = {nid: sum(nid in r for r in routes) for nid in _relay_flow_counts(h)}
    assert through == _relay_flow_counts(h)


def test_a_check_of_a_flow_at_a_dead_peer_fails_like_an_unanswered_one() -> None:
    """A flow whose next hop is a peer already reported down (however it got there) is not
    checked forever into silence: each check it cannot send counts as a failed one, and the
    usual two failures rebuild the downstream part."""
    cfg = dataclasses.replace(FlowConfig(), anneal_probability=0.0)
    inst = tiny_instance(demand=1, relay_capacity=2, stages=3)
    h = Harness(inst, cfg=cfg)
    h.run(15.0)
    assert h.routes() == [("dh", "r1a", "r2a")]
    h.crash("r2b")
    r1a = h.agents["r1a"]
    (e,) = r1a.state.flows.values()
    e.next = "r2b"  # as a late notice would have left it
    h.run(2 * cfg.check_every_ticks * cfg.tick_s + 2.0)
    assert h.routes() == [("dh", "r1a", "r2a")]
    assert _relay_flow_counts(h) == {"r1a": 1, "r1b": 0, "r2a": 1}


def test_every_move_kind_on_the_wire_has_one_strategy() -> None:
    """The annealer dispatches a proposal by its kind: each kind the wire allows belongs to
    exactly one move strategy, and every strategy's kinds are allowed on the wire."""
    from gwtf.protocol.routing.messages import MOVE_KINDS

    agent = FlowAgent(PeerInfo("r1a", 1, "a", 0.05, 1), 3, 1_000_000, FlowConfig(), random.Random(0))
    kinds = [k for m in agent.anneal.moves for k in m.kinds]
    assert sorted(kinds) == sorted(MOVE_KINDS) and len(set(kinds)) == len(kinds)


FAR = Network(
    name="far", regions=("a", "b", "c"),
    latency_matrix_s=((0.01, math.inf, 0.05), (math.inf, 0.01, 0.3), (0.05, 0.3, 0.01)),  # no a-b link
    bandwidth_matrix_bytes_per_s=((2.5e8,) * 3,) * 3,
)


def bottleneck_instance(stages: int = 3) -> Instance:
    """Two data holders and one route's worth of capacity: every stage from 2 on is one relay
    `B<k>` (region c) of capacity 1. The optimum gives them to `dh` (region a, near c):
    dh -> a1 -> B2 [-> B3]. `far` (region b) reaches them only through b1, over the slow b-c
    link both ways. There is no a-b link, so handing far's route to dh (the `yield` move, which
    keeps b1) is no move at all, and no relay move changes a route's owner. With 4 stages the
    costly route fills two consecutive full relays (B2, B3): B2 has no next hop with capacity,
    so its take asks B3 to give up far's slot as well (a chained take)."""
    nodes = [
        NodeSpec("dh", 0, "a", "x", 0.01, 8, 1), NodeSpec("far", 0, "b", "x", 0.01, 8, 1),
        NodeSpec("a1", 1, "a", "x", 0.01, 1), NodeSpec("b1", 1, "b", "x", 0.01, 1),
    ]
    nodes += [NodeSpec(f"B{k}", k, "c", "x", 0.01, 1) for k in range(2, stages)]
    return Instance(nodes=tuple(nodes), stages=stages, network=FAR, activation_bytes=1_000_000)


def _bottleneck_route(h: Harness) -> Route | None:
    """The one complete route through the last stage, walked from its origin (names and prevs checked)."""
    (e,) = h.agents[f"B{h.inst.stages - 1}"].state.flows.values() or (None,)
    if e is None or e.pending:
        return None
    origin = e.origin
    (start,) = [f for f in h.agents[origin].state.flows.values() if not f.pending and f.next]
    route, prev, node = [origin], origin, start.next
    while node != origin:
        f = h.agents[node].state.flows.get(start.key)
        assert f is not None and f.prev == prev and not f.pending, f"broken flow {start.key} at {node}"
        route.append(node)
        prev, node = node, f.next
    return tuple(route)


@pytest.mark.parametrize(("stages", "seed"), [(3, 3), (4, 2)])
@pytest.mark.parametrize("claim", [False, True])
def test_a_blocked_data_holder_claims_the_bottleneck_from_a_costlier_route(claim: bool, stages: int, seed: int) -> None:
    """issue 17 (N=60 geo12 seed 2002 in small): `far` wins the race for the only slots; `dh`,
    left with unmet demand and no next hop with capacity, claims them: B2 releases far's route
    (over 3x the cost of dh's route) and carries dh's. Without the claim move the costlier
    allocation stays for good: no other move reaches the optimum. (The seeds are ones where far
    wins the race: checked as a precondition.)"""
    inst = bottleneck_instance(stages)
    cfg = dataclasses.replace(FlowConfig(), anneal_claim=claim, anneal_t0_s=0.0)  # improving moves only
    h = Harness(inst, seed=seed, cfg=cfg)
    tail = tuple(f"B{k}" for k in range(2, stages))
    h.run(1.5)
    assert _bottleneck_route(h) == ("far", "b1", *tail), "precondition: far holds the bottleneck first"
    h.run(40.0)
    route = _bottleneck_route(h)
    best = ("dh", "a1", *tail)
    assert inst.route_cost_s(best) * 3 < inst.route_cost_s(("far", "b1", *tail))
    if claim:
        assert route == best
        assert h.agents["B2"].anneal.claim.preempted == 1  # one release (by the top), not a ping-pong
        assert sum(a.anneal.claim.preempted for a in h.agents.values()) == 1
        assert h.agents["dh"].anneal.claim.claimed == 1
    else:
        assert route == ("far", "b1", *tail)
    # nothing leaked: every relay holds exactly the flow of the route through it, nothing locked
    assert _relay_flow_counts(h) == {"a1": int(route[1] == "a1"), "b1": int(route[1] == "b1"), **{b: 1 for b in tail}}
    assert all(len(h.agents[d].state.flows) == int(route[0] == d) for d in ("dh", "far"))
    assert not any(e.locked for a in h.agents.values() for e in a.state.flows.values())
    assert not any(a.anneal.claim.probes for a in h.agents.values())


@pytest.mark.parametrize("aware", [False, True])
def test_load_aware_spreads_flows_and_every_peer_knows_each_relays_load(aware: bool) -> None:
    """Relays of 1 s compute (queueing dominates the links): priced by the paper's cost, all 4
    routes take the cheap relays r*a; with `flow.load_aware` both relays of a stage carry some.
    After settling, every neighbour's view of a relay's load (its `flow.load` announcements) is
    the number of flows the relay carries."""
    nodes = [NodeSpec("dh", 0, "a", "x", 0.01, 8, 4)]
    for k in (1, 2):
        nodes += [NodeSpec(f"r{k}a", k, "a", "x", 1.0, 4), NodeSpec(f"r{k}b", k, "b", "x", 1.0, 4)]
    inst = Instance(nodes=tuple(nodes), stages=3, network=NET, activation_bytes=1_000_000)
    h = Harness(inst, seed=1, cfg=FlowConfig(load_aware=aware))
    h.run(120.0)
    routes = h.routes()
    assert len(routes) == 4
    evaluate_routes(inst, routes)
    through = {n.id: sum(n.id in r for r in routes) for n in nodes if n.stage > 0}
    if not aware:
        assert through["r1b"] == through["r2b"] == 0, through
        return
    assert all(v >= 1 for v in through.values()), through
    for nid, agent in h.agents.items():
        for table in (agent.state.prev_peers, agent.state.same_peers, agent.state.next_peers):
            for pid, nb in table.items():
                if pid in through:
                    assert nb.load == through[pid], (nid, pid, nb.load, through[pid])


def _walk(h: Harness, origin: NodeId) -> list[Route]:
    """`origin`'s complete routes, walked hop by hop (each relay must hold the flow under the
    origin's name with the right prev)."""
    out: list[Route] = []
    for key, e in h.agents[origin].state.flows.items():
        if e.pending or e.next is None:
            continue
        route, prev, node = [origin], origin, e.next
        while node != origin:
            f = h.agents[node].state.flows.get(key)
            assert f is not None and f.prev == prev and not f.pending, f"broken flow {key} at {node}"
            route.append(node)
            prev, node = node, f.next
        out.append(tuple(route))
    return out


def test_a_route_traded_between_data_holders_while_its_first_relay_hands_it_over_stays_whole() -> None:
    """Regression (issue 17, the `yield`/rename race of docs/flow-protocol.md "Known gaps"):
    dh2 offers its route to dh1 in a data-holder exchange (its entry locked, first hop X); before
    dh1's accept reaches dh2, X hands the flow to the idle Y (a redirect) and Y's switch reaches
    dh2 first: dh2's locked entry now says Y, but dh1 adopted the route with first hop X. dh2 then
    forgot the entry without passing the change on, so dh1 sent its microbatches to X, which no
    longer held the flow under any name, until the consistency checks (two failures, 15 ticks
    apart) rebuilt it (`gwtf route --nodes 60 --stages 6 --data-holders 6 --network geo12 --seed
    3007 --set flow.anneal_claim=true`: flow 100 of 101). Both routes must be whole at once."""
    cfg = dataclasses.replace(FlowConfig(), anneal_probability=0.0)
    nodes = [NodeSpec("dh1", 0, "a", "x", 0.01, 8, 1), NodeSpec("dh2", 0, "a", "x", 0.01, 8, 1)]
    nodes += [NodeSpec(f"r1{c}", 1, "a", "x", 0.05, 1) for c in "abc"]
    nodes += [NodeSpec(f"r2{c}", 2, "a", "x", 0.05, 1) for c in "ab"]
    inst = Instance(nodes=tuple(nodes), stages=3, network=NET, activation_bytes=1_000_000)
    h = Harness(inst, cfg=cfg)
    h.run(20.0)
    assert len(_walk(h, "dh1")) == 1 and len(_walk(h, "dh2")) == 1
    dh1, dh2 = h.agents["dh1"], h.agents["dh2"]
    (f2,) = dh2.state.flows.values()
    x = f2.next
    assert x is not None
    (y,) = [n for n in ("r1a", "r1b", "r1c") if not h.agents[n].state.flows]
    held: list[tuple[NodeId, NodeId, Any]] = []  # (to, from, message): the network, by hand

    def sends(src: NodeId, effects: list[Any]) -> list[tuple[NodeId, NodeId, Any]]:
        return [(eff.to, src, eff.msg) for eff in effects if isinstance(eff, Send)]

    def deliver(to: NodeId, src: NodeId, msg: Any) -> None:
        held.extend(sends(to, h.agents[to].on_message(src, msg, h.now)))

    def take(to: NodeId, src: NodeId, kind: type) -> Any:
        (item,) = [m for m in held if m[0] == to and m[1] == src and isinstance(m[2], kind)]
        held.remove(item)
        return item[2]

    from gwtf.protocol.routing.messages import FlowPropose, FlowRespond, FlowSwitch

    # Y takes dh2's flow from X: proposal, accept; Y installs it and switches X's neighbours
    (table,) = [m for _, _, m in sends(x, h.agents[x].on_message(y, FlowQuery(("dh2",)), h.now))]
    h.agents[y].anneal.propose(x, table, Choice(0.0, "redirect", 0, None))
    held.extend(sends(y, h.agents[y].state.flush()))
    deliver(x, y, take(x, y, FlowPropose))
    deliver(y, x, take(y, x, FlowRespond))
    switch = take("dh2", y, FlowSwitch)
    # meanwhile dh2 offers its route (still through X) to dh1, which accepts at once
    (table,) = [m for _, _, m in sends("dh1", dh1.on_message("dh2", FlowQuery(()), h.now))]
    dh2.anneal.propose("dh1", table, Choice(0.0, "exchange", 0, f2))
    held.extend(sends("dh2", dh2.state.flush()))
    deliver("dh1", "dh2", take("dh1", "dh2", FlowPropose))
    respond = take("dh2", "dh1", FlowRespond)
    deliver("dh2", y, switch)  # the switch overtakes the accept (another link, another latency)
    deliver("dh2", "dh1", respond)
    for to, src, msg in held:
        h.inbox[to].append((h.now + DELAY_S, src, msg))
    h.run(3.0)  # the notices settle; no consistency check is due (15 ticks)
    routes = _walk(h, "dh1") + _walk(h, "dh2")
    assert len(routes) == 2
    through = {nid: sum(nid in r for r in routes) for nid in _relay_flow_counts(h)}
    assert through == _relay_flow_counts(h)
