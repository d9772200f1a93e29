"""Measured compute (issue 15, deliverable 2): `NodeCore.on_compute_measured` makes a node's
measured compute time its advertised `compute_s`, and the members that price it (`mem.compute`)
re-price their flow edges with it, so flows leave a replica that turned out slow.

In-memory cores (`core_harness`), one data holder and two relays of stage 1 advertising the same
placeholder compute time (1 s, and the runtime's 0: not measured yet) before they measured anything."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from core_harness import TRAIN, Harness

from gwtf.flow.cost import edge_cost_s
from gwtf.protocol import messages as m
from gwtf.protocol.base import Send
from gwtf.protocol.core import COMPUTE_ADVERT_GAP_S, COMPUTE_READVERTISE, NodeCore
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.routing import FlowAgent
from gwtf.protocol.simple_router import GreedyRouter
from gwtf.protocol.swarm import SwarmRouter

TWO_STAGES = replace(TRAIN, stages=2, microbatches=4, iterations=10_000, stage_flops=(1.0, 1.0),
                     stage_state_bytes=(3000, 3000), stage_grad_bytes=(1000, 1000))
PLACEHOLDER_S = 1.0


def _swarm(placeholder_s: float = PLACEHOLDER_S) -> Harness:
    nodes = [PeerInfo(id="d0", stage=0, region="r", compute_s=placeholder_s, capacity=4, demand=4),
             PeerInfo(id="a0", stage=1, region="r", compute_s=placeholder_s, capacity=4),
             PeerInfo(id="a1", stage=1, region="r", compute_s=placeholder_s, capacity=4)]
    h = Harness(nodes, TWO_STAGES)
    h.start()
    h.run(10.0)
    return h


def _router(h: Harness, node: str) -> FlowAgent:
    r = h.cores[node].router
    assert isinstance(r, FlowAgent)
    return r


def _flows_via(h: Harness) -> dict[str, int]:
    """The data holder's flows per first hop."""
    out = {"a0": 0, "a1": 0}
    for e in _router(h, "d0").state.flows.values():
        if e.next in out and not e.pending:
            out[e.next] += 1
    return out


def test_a_measured_compute_time_reaches_the_flow_costs_of_the_peers_that_price_it() -> None:
    h = _swarm()
    slow = h.cores["a1"]
    before = _router(h, "d0").state.next_peers["a1"].cost_s
    out = slow.on_compute_measured(h.now, 4.0)
    sent = {e.to for e in out if isinstance(e, Send) and isinstance(e.msg, m.ComputeUpdate)}
    assert sent == {"d0", "a0"}  # the data holder (prev and next stage) and the other replica
    assert [e.fields for e in out if isinstance(e, m.Record) and e.event == "compute_advertised"] == [
        (("node", "a1"), ("stage", 1), ("compute_s", 4.0), ("previous_s", PLACEHOLDER_S))]
    assert slow.me.compute_s == 4.0 and slow.directory["a1"].compute_s == 4.0
    # the slow relay's own edges are re-priced at once (its router's view of itself)
    own = _router(h, "a1").state.prev_peers["d0"]
    assert own.cost_s == edge_cost_s(4.0, PLACEHOLDER_S, own.link.latency_s, own.link.latency_s,
                                     own.link.bandwidth_bytes_per_s, own.link.bandwidth_bytes_per_s,
                                     TWO_STAGES.activation_bytes)
    h.apply("a1", out)
    h.run(h.now + 1.0)
    dh = h.cores["d0"]
    assert dh.directory["a1"].compute_s == 4.0 and h.cores["a0"].directory["a1"].compute_s == 4.0
    nb = _router(h, "d0").state.next_peers["a1"]
    assert nb.info.compute_s == 4.0
    assert nb.cost_s == edge_cost_s(PLACEHOLDER_S, 4.0, nb.link.latency_s, nb.link.latency_s,
                                    nb.link.bandwidth_bytes_per_s, nb.link.bandwidth_bytes_per_s,
                                    TWO_STAGES.activation_bytes)
    assert math.isclose(nb.cost_s - before, (4.0 - PLACEHOLDER_S) / 2, rel_tol=1e-6)  # d(i,j) takes c_j / 2
    # a joiner converting the measured time to another stage uses the measured speed
    assert slow.members.speed_flops_per_s == TWO_STAGES.stage_flops[1] / 4.0


@pytest.mark.parametrize("placeholder_s", [PLACEHOLDER_S, 0.0])
def test_flows_leave_the_replica_that_measured_itself_slow(placeholder_s: float) -> None:
    """With the runtime's placeholder (0: not measured yet) the replica that never served, so
    never measured, looks fast and takes the flows; then it measures itself (still faster)."""
    h = _swarm(placeholder_s)
    via = _flows_via(h)
    assert sum(via.values()) == 4, via
    slow, fast = ("a0", "a1") if via["a0"] >= via["a1"] else ("a1", "a0")  # slow down the busier one
    h.apply(slow, h.cores[slow].on_compute_measured(h.now, 4.0))
    if placeholder_s > 0:
        h.apply(fast, h.cores[fast].on_compute_measured(h.now, 0.5))
    h.run(h.now + 60.0, stop=lambda: _flows_via(h)[fast] >= 2)
    h.apply(fast, h.cores[fast].on_compute_measured(h.now, 0.5))
    h.run(h.now + 60.0, stop=lambda: _flows_via(h)[fast] == 4)
    assert _flows_via(h) == {fast: 4, slow: 0}, f"after {h.now:.0f}s of simulated time"
    assert h.cores[fast].router.state.flows and not _router(h, slow).state.flows


def test_small_changes_and_nonsense_are_not_advertised() -> None:
    h = _swarm()
    core = h.cores["a1"]
    nearly = PLACEHOLDER_S * (1 + COMPUTE_READVERTISE * 0.9)
    for value in (nearly, 0.0, -1.0, math.nan, math.inf):
        assert core.on_compute_measured(h.now, value) == [], value
    assert core.me.compute_s == PLACEHOLDER_S
    joiner = NodeCore(PeerInfo(id="j0", stage=-1, region="r", compute_s=1.0, capacity=4), h.cfg, TWO_STAGES,
                      random.Random(0))
    assert joiner.on_compute_measured(0.0, 3.0) == []  # no stage yet: nothing measured is its stage's


def test_a_node_advertises_at_most_once_per_gap() -> None:
    h = _swarm()
    core = h.cores["a1"]
    assert core.on_compute_measured(h.now, 2.0)
    assert core.on_compute_measured(h.now + COMPUTE_ADVERT_GAP_S / 2, 4.0) == []  # too soon
    assert core.me.compute_s == 2.0
    assert core.on_compute_measured(h.now + COMPUTE_ADVERT_GAP_S, 4.0)
    assert core.me.compute_s == 4.0


def test_a_member_advertising_an_impossible_compute_time_is_refused() -> None:
    h = _swarm()
    dh = h.cores["d0"]
    out = dh.on_message("a1", m.ComputeUpdate(compute_s=math.inf), h.now)
    assert [e.event for e in out if isinstance(e, m.Record)] == ["message_refused"]
    assert dh.directory["a1"].compute_s == PLACEHOLDER_S
    assert _router(h, "d0").state.next_peers["a1"].info.compute_s == PLACEHOLDER_S
    stranger = dh.on_message("x9", m.ComputeUpdate(compute_s=2.0), h.now)
    assert [e.event for e in stranger if isinstance(e, m.Record)] == ["unauthorized"]


def test_the_greedy_and_swarm_routers_weigh_a_measured_compute_time() -> None:
    me = PeerInfo(id="d0", stage=0, region="r", compute_s=1.0, capacity=4)
    link = LinkEstimate(0.01, 1e9)
    greedy = GreedyRouter(me, 2, 1000)
    swarm = SwarmRouter(me, 2, 1000, ban_s=60.0, rng=random.Random(0))
    for r in (greedy, swarm):
        for pid in ("a0", "a1"):
            r.on_peer_up(PeerInfo(id=pid, stage=1, region="r", compute_s=1.0, capacity=4), link, 0.0)
    assert greedy.next_hop(-1, "d0", "d0", (), 0.0) == ("a0", -1)  # a tie: the lower id
    greedy.on_release("a0")
    greedy.on_compute_update("a0", 3.0, 0.0)
    assert greedy.next_hop(-1, "d0", "d0", (), 0.0) == ("a1", -1)
    swarm.on_compute_update("a0", 3.0, 0.0)
    assert math.isclose(swarm.expected_s("a0") - swarm.expected_s("a1"), 2.0)
    greedy.on_compute_update("d0", 2.0, 0.0)  # my own compute time: every edge moves by half of it
    assert greedy.me.compute_s == 2.0 and greedy.next_hop(-1, "d0", "d0", (), 0.0) == ("a1", -1)
