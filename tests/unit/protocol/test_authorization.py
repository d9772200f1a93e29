"""Authorization in the core (issue 14): every message type states who may send it (`@handles(..., sender=)` where its handler lives),
and a message from anyone else is refused with an `unauthorized` record before its handler runs,
in both drivers. The simulator's fault schedules show honest swarms still finish (tests/sim)."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.protocol import messages as m
from gwtf.protocol.base import MESSAGE_TYPES
from gwtf.protocol.core import NodeCore, Sender, message_routes
from gwtf.protocol.dispatch import router_route
from gwtf.protocol.rebalance import GwtfCore
from gwtf.protocol.swarm import SwarmCore

ONE = replace(TRAIN, microbatches=1, iterations=3)
FOUR_STAGES = (2, 1, 1, 1)  # d0 d1 | a0 | b0 | c0


def _started(sizes: tuple[int, ...] = FOUR_STAGES) -> Harness:
    n = len(sizes)
    h = Harness(peers(sizes), replace(ONE, stages=n, stage_flops=(1.0,) * n, stage_state_bytes=(3000,) * n,
                                      stage_grad_bytes=(1000,) * n))
    h.start()
    h.run(0.5)
    return h


def _refused(out: list[object]) -> list[dict[str, object]]:
    return [dict(e.fields) for e in out if getattr(e, "event", "") == "unauthorized"]  # type: ignore[attr-defined]


def _forward(h: Harness, src: str) -> m.Forward:
    it = h.cores["d0"].iteration
    return m.Forward(mb=("d1", it, 0), flow_id=0, path=(src,), legs=(1,), key=("act", src, 1))


def test_every_message_type_states_who_may_send_it() -> None:
    """Every registered message is a core part's (a handler with a sender rule) or the router's,
    in every system's core, and each core part's handler exists."""
    for core in (NodeCore, GwtfCore, SwarmCore):
        routes = message_routes(core)
        for t, cls in MESSAGE_TYPES.items():
            route = routes.get(cls) or router_route(cls)
            if t == "mem.move" and core is NodeCore:
                continue  # only the rebalancing cores take stage moves
            assert route is not None, f"{core.__name__}: {t} has no handler and no sender rule"
            owner = core.PARTS[route.part] if route.part else core
            assert route.handler is None or callable(getattr(owner, route.handler)), (core.__name__, t)
    assert message_routes(SwarmCore)[MESSAGE_TYPES["swarm.move"]].handler == "on_swarm_move"


def test_an_activation_from_a_member_of_a_stage_not_adjacent_is_refused() -> None:
    h = _started()
    dh = h.cores["d0"]  # stage 0 of 4: activations come from stage 3 (loss) or stage 1 (gradients)
    out = dh.on_message("b0", _forward(h, "b0"), h.now)  # b0 serves stage 2
    assert _refused(out) == [{"node": "d0", "sender": "b0", "type": "train.fwd", "allowed": Sender.NEIGHBOUR}]
    assert not _refused(dh.on_message("c0", _forward(h, "c0"), h.now))  # stage 3: adjacent (cyclic)


def test_a_gradient_share_from_another_stage_is_refused() -> None:
    h = _started()
    relay = h.cores["a0"]
    share = m.GradShare(iteration=relay.iteration, round=1, key=("g", 1), count=1)
    assert _refused(relay.on_message("d0", share, h.now))[0]["allowed"] == Sender.REPLICA


def test_a_stranger_can_neither_report_nor_raise_the_term() -> None:
    h = _started()
    leader = h.cores["d0"]
    report = m.Report(term=0, iteration=leader.iteration, version=0, stage=1, contributed=())
    assert _refused(leader.on_message("x9", report, h.now))[0]["allowed"] == Sender.MEMBER
    out = leader.on_message("x9", m.TermNotice(term=7, leader="x9"), h.now)
    assert _refused(out) and leader.is_leader and leader.term == 0
    out = leader.on_message("x9", m.Heartbeat(term=7, version=0), h.now)  # a newer term in a heartbeat
    assert leader.is_leader and leader.term == 0 and _refused(out)[0]["type"] == "term"


def test_a_member_may_still_raise_the_term() -> None:
    h = _started()
    leader = h.cores["d0"]
    leader.on_message("d1", m.TermNotice(term=2, leader="d1"), h.now)
    assert not leader.is_leader and (leader.term, leader.leader) == (2, "d1")


def test_a_joiner_without_a_directory_hears_its_contact() -> None:
    h = _started()
    relay = h.cores["a0"]
    assert not relay.authorized("x9", Sender.MEMBER)
    relay.active = False  # as a joiner before its Welcome: it has no directory to judge by
    assert relay.authorized("x9", Sender.MEMBER) and relay.authorized("x9", Sender.NEIGHBOUR)
