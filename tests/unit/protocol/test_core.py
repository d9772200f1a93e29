"""NodeCore unit tests on the in-memory harness: happy path, recovery, dedup, planner, router."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.protocol import messages as m
from gwtf.protocol.aggregation import plan_redo
from gwtf.protocol.base import MESSAGE_TYPES
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.simple_router import GreedyRouter

ONE = replace(TRAIN, microbatches=1, iterations=1)


def test_happy_path_two_iterations_every_microbatch_once_per_stage() -> None:
    """Without faults, 2 DHs x 2 microbatches x 2 iterations: each microbatch is contributed
    exactly once at each of the 3 stages, and every replica steps to version 2."""
    h = Harness(peers((2, 2, 1)))
    h.start()
    h.run(200.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done")
    h.run(h.now + 5.0)
    per_stage: dict[int, list[tuple[str, int, int]]] = {}
    for f in h.events("contribute"):
        per_stage.setdefault(f["stage"], []).append(f["mb"])
    expected = sorted((d, it, i) for d in ("d0", "d1") for it in (0, 1) for i in (0, 1))
    for stage in range(3):
        assert sorted(per_stage[stage]) == expected
    assert {c.version for c in h.cores.values()} == {2}
    steps = h.events("step")
    assert len(steps) == 2 * len(h.cores)


def _crash_first_stage1_receiver(h: Harness, kind: type) -> list[str]:
    """Crash the first stage-1 replica ("a*") a `kind` message is sent to, and lose that message;
    returns the list the victim's id is put in."""
    victim: list[str] = []

    def drop(src: str, dst: str, msg: object) -> bool:
        if isinstance(msg, kind) and dst.startswith("a") and not victim:
            victim.append(dst)
            h.crash(dst)
            return True
        return False

    h.drop = drop
    return victim


def test_forward_reroute_when_next_hop_crashes() -> None:
    """A stage-1 replica that dies on receiving a forward: the DH reroutes from its cached
    activation to the other replica; nothing upstream is recomputed (one embed per microbatch)."""
    h = Harness(peers((1, 2, 1), demand=1), ONE)
    h.start()
    victim = _crash_first_stage1_receiver(h, m.Forward)
    h.run(300.0, stop=lambda: bool(h.events("iteration_done")))
    assert h.events("iteration_done")
    assert [f["dead"] for f in h.events("reroute")] == victim
    embeds = [s for s in h.sent if isinstance(s[2], m.Forward) and s[0] == "d0"]
    assert len({s[2].key for s in embeds}) == 1  # the same cached activation, resent


def test_backward_crash_redoes_only_the_crashed_stage() -> None:
    """The stage-1 replica dies after its forward (mid-backward): the DH's gradient holder
    starts a redo at stage 1 only, and the iteration still covers the microbatch once."""
    h = Harness(peers((1, 2, 1), demand=1), ONE)
    h.start()
    crashed = _crash_first_stage1_receiver(h, m.Backward)
    h.run(300.0, stop=lambda: bool(h.events("iteration_done")))
    redo = h.events("redo")
    assert redo and redo[0]["start"] == 1 and redo[0]["until"] == 2
    stage2 = [f for f in h.events("contribute") if f["stage"] == 2]
    assert len(stage2) == 1  # the stage after the crash is not redone
    decision = [f for f in h.events("decision") if f["stage"] == 1][-1]
    assert crashed[0] not in decision["contributions"]
    assert sum(len(v) for v in decision["contributions"].values()) == 1


def test_duplicate_return_is_ignored() -> None:
    """A second return of the same microbatch (a slow original after a reroute) is dropped."""
    h = Harness(peers((1, 1, 1), demand=1), ONE)
    h.start()
    dup: list[m.Forward] = []

    def drop(src: str, dst: str, msg: object) -> bool:
        if isinstance(msg, m.Forward) and dst == "d0" and not dup:
            dup.append(msg)
            h._push(h.now + 0.05, "msg", src, dst, msg)
        return False

    h.drop = drop
    h.run(200.0, stop=lambda: bool(h.events("iteration_done")))
    assert len(h.events("dup_return")) == 1
    assert len([f for f in h.events("contribute") if f["stage"] == 0]) == 1


def test_plan_redo_resets_duplicates_and_chains_missing() -> None:
    """Planner invariant: after its resets and chains, every expected microbatch is covered once."""
    expected = {"d0": (0, 1)}
    contrib = {
        "d0": (0, frozenset({("d0", 0), ("d0", 1)})),
        "a0": (1, frozenset({("d0", 0)})),
        "a1": (1, frozenset({("d0", 0), ("d0", 1)})),
        "b0": (2, frozenset({("d0", 1)})),
    }
    plan = plan_redo(3, expected, contrib)
    assert plan.resets == ("a0",)
    plan = plan_redo(3, expected, {k: v for k, v in contrib.items() if k != "a0"})
    assert plan.resets == ()
    assert [(c.mb, c.start, c.until, c.start_node, c.holder) for c in plan.chains] == [
        (("d0", 0), 2, 3, "a1", "d0")]


def test_plan_redo_voids_a_dead_data_holders_microbatches_with_the_batch_held() -> None:
    """`void`: a replica whose gradient holds a part of a microbatch of a data holder that is not
    expected (it died; its data is served again under another id) is reset, and its other
    microbatches are chained again; without `void` (the paper's rule) the part stays counted."""
    expected = {"d0": (0,)}
    contrib = {
        "d0": (0, frozenset({("d0", 0)})),
        "a0": (1, frozenset({("d0", 0), ("d1", 0)})),  # d1 died after a0 back-propagated its microbatch
        "b0": (2, frozenset({("d0", 0), ("d1", 0)})),
        "b1": (2, frozenset()),
    }
    assert plan_redo(3, expected, contrib).resets == ()
    plan = plan_redo(3, expected, contrib, void=True)
    assert plan.resets == ("a0", "b0")
    assert [(c.mb, c.start, c.until, c.start_node, c.holder) for c in plan.chains] == [
        (("d0", 0), 1, 3, "d0", "d0")]
    assert plan.missing == 2


def test_greedy_router_prefers_cheap_spare_capacity_and_honours_exclude() -> None:
    me = PeerInfo(id="d0", stage=0, region="r", compute_s=0.1, capacity=4, demand=2)
    r = GreedyRouter(me, 3, 1000)
    fast = PeerInfo(id="a0", stage=1, region="r", compute_s=0.1, capacity=1)
    slow = PeerInfo(id="a1", stage=1, region="r", compute_s=5.0, capacity=1)
    for p in (slow, fast):
        r.on_peer_up(p, LinkEstimate(0.01, 1e9), 0.0)
    assert r.next_hop(-1, "d0", "d0", (), 0.0) == ("a0", -1)
    assert r.next_hop(-1, "d0", "d0", (), 0.0) == ("a1", -1)  # a0 is full now
    assert r.next_hop(-1, "d0", "d0", ("a0", "a1"), 0.0) is None
    r.on_release("a0")
    assert r.next_hop(-1, "d0", "d0", (), 0.0) == ("a0", -1)


def test_protocol_messages_are_registered_under_their_prefixes() -> None:
    ours = [c for c in MESSAGE_TYPES.values() if c.__module__ == m.__name__]
    assert len(ours) >= 25
    # SWARM's move is a "swarm." message its core claims by a handler (dispatch.routes_of)
    assert all(c.TYPE.split(".")[0] in ("train", "mem", "agg") for c in ours if c is not m.SwarmMove)
    fwd = m.Forward(mb=("d0", 0, 0), flow_id=-1, path=("d0",), legs=(0,), key=("act", "d0", 0, 0, "d0", 0),
                    size_bytes=TRAIN.activation_bytes)
    assert fwd.tensor_bytes == TRAIN.activation_bytes and m.Passed(mb=("d0", 0, 0), leg=0).tensor_bytes == 0
