"""SWARM baseline: stochastic wiring proportions, ban + retry, the rebalancing decision."""

from __future__ import annotations

import random

import pytest

from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.swarm import SwarmRouter, plan_move, stage_throughputs

FAST_LINK = LinkEstimate(latency_s=0.0, bandwidth_bytes_per_s=1e18)


def _router(peers: dict[str, float], ban_s: float = 60.0, seed: int = 0) -> SwarmRouter:
    me = PeerInfo(id="me", stage=1, region="r", compute_s=1.0, capacity=4)
    r = SwarmRouter(me, stages=4, activation_bytes=1000, ban_s=ban_s, rng=random.Random(seed))
    for pid, c in peers.items():
        r.on_peer_up(PeerInfo(id=pid, stage=2, region="r", compute_s=c, capacity=1), FAST_LINK, 0.0)
    return r


def _picks(r: SwarmRouter, n: int, now: float = 0.0, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    out: dict[str, int] = {}
    for _ in range(n):
        choice = r.next_hop(-1, "me", "dh", exclude, now)
        assert choice is not None
        out[choice[0]] = out.get(choice[0], 0) + 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wiring_is_proportional_to_throughput(seed: int) -> None:
    """Peers 1x, 2x and 4x slower get microbatches in ratio 4:2:1 (within one pick)."""
    r = _router({"a": 1.0, "b": 2.0, "c": 4.0}, seed=seed)
    got = _picks(r, 700)
    for pid, want in (("a", 400), ("b", 200), ("c", 100)):
        assert abs(got[pid] - want) <= 2, got


def test_wiring_interleaves_rather_than_bursts() -> None:
    """Equal peers alternate: no peer gets two in a row while another waits (round-robin)."""
    r = _router({"a": 1.0, "b": 1.0, "c": 1.0})
    seq = [r.next_hop(-1, "me", "dh", (), 0.0) for _ in range(9)]
    names = [s[0] for s in seq if s is not None]
    for i in range(0, 9, 3):
        assert sorted(names[i:i + 3]) == ["a", "b", "c"]


def test_wiring_counts_the_link_not_only_compute() -> None:
    """Same compute, one peer behind a slow link: it gets fewer microbatches."""
    me = PeerInfo(id="me", stage=1, region="r", compute_s=1.0, capacity=4)
    r = SwarmRouter(me, stages=4, activation_bytes=10**6, ban_s=60.0, rng=random.Random(0))
    r.on_peer_up(PeerInfo(id="near", stage=2, region="r", compute_s=1.0, capacity=1), FAST_LINK, 0.0)
    slow = LinkEstimate(latency_s=0.5, bandwidth_bytes_per_s=1e6)  # 1 s + 0.5 s each way
    r.on_peer_up(PeerInfo(id="far", stage=2, region="r", compute_s=1.0, capacity=1), slow, 0.0)
    got = _picks(r, 400)
    assert got["near"] == pytest.approx(4 * got["far"], abs=4)


def test_only_next_stage_peers_are_used() -> None:
    r = _router({"a": 1.0})
    r.on_peer_up(PeerInfo(id="same", stage=1, region="r", compute_s=0.1, capacity=1), FAST_LINK, 0.0)
    r.on_peer_up(PeerInfo(id="dh", stage=0, region="r", compute_s=0.1, capacity=1), FAST_LINK, 0.0)
    assert set(_picks(r, 10)) == {"a"}


def test_failed_peer_is_banned_until_expiry_and_work_retries_elsewhere() -> None:
    r = _router({"a": 1.0, "b": 1.0, "c": 1.0}, ban_s=30.0)
    r.on_peer_down("a", 10.0)
    # heard from again during the ban: SWARM keeps it banned until its record expires
    r.on_peer_up(PeerInfo(id="a", stage=2, region="r", compute_s=1.0, capacity=1), FAST_LINK, 12.0)
    assert "a" not in _picks(r, 20, now=39.9)
    # the core retries a failed hop with the failed peer excluded: another replica of the stage
    assert set(_picks(r, 10, now=20.0, exclude=("b",))) == {"c"}
    # everything banned or excluded: no hop (the core parks the microbatch and retries)
    assert r.next_hop(-1, "me", "dh", ("b", "c"), 20.0) is None
    # after expiry the peer is back, near the top of the heap (measured again soon)
    first = [r.next_hop(-1, "me", "dh", (), 40.0) for _ in range(3)]
    assert ("a", -1) in first


def test_ban_does_not_outlive_a_stage_change() -> None:
    r = _router({"a": 1.0})
    r.on_peer_down("a", 0.0)
    r.set_me(PeerInfo(id="me", stage=2, region="r", compute_s=1.0, capacity=4))
    assert r.banned == {}
    assert r.next_hop(-1, "me", "dh", (), 0.0) is None  # stage 3 peers not known yet


def _p(pid: str, stage: int, c: float) -> PeerInfo:
    return PeerInfo(id=pid, stage=stage, region="r", compute_s=c, capacity=4)


FLOPS = (1.0, 10.0, 10.0, 10.0)


def test_rebalancing_moves_a_peer_of_the_least_loaded_stage_to_the_bottleneck() -> None:
    members = [_p("dh", 0, 1.0), _p("s1", 1, 1.0), _p("x", 2, 1.0), _p("y", 2, 1.0), _p("z", 2, 0.5),
               _p("t1", 3, 1.0), _p("t2", 3, 1.0)]
    tp = stage_throughputs(members, 4)
    assert tp[1:] == [1.0, 4.0, 2.0]
    move = plan_move(members, FLOPS)
    assert move == ("x", 1)  # x or y leave 3.0 at stage 2 (z would leave 2.0): lowest id wins


def test_rebalancing_accounts_for_a_different_stage_cost() -> None:
    """A node's time at its new stage scales with that stage's FLOPs."""
    flops = (1.0, 40.0, 10.0, 10.0)  # stage 1 costs 4x stage 2
    members = [_p("s1", 1, 1.0), _p("a", 2, 0.25), _p("b", 2, 0.25), _p("t", 3, 0.1)]
    assert plan_move(members, flops) == ("a", 1)  # a at stage 1: 1.0 s per mb; min 1 -> 2 mb/s
    # with stage 3 also at 1 mb/s, the move cannot raise the minimum: none
    slow3 = [*members[:3], _p("t", 3, 1.0)]
    assert plan_move(slow3, flops) is None


def test_no_move_when_it_would_not_raise_the_minimum() -> None:
    balanced = [_p("a", 1, 1.0), _p("b", 2, 1.0), _p("c", 3, 1.0)]
    assert plan_move(balanced, FLOPS) is None
    two_each = [_p("a", 1, 1.0), _p("a2", 1, 1.0), _p("b", 2, 1.0), _p("b2", 2, 1.0), _p("c", 3, 1.0)]
    # moving b to stage 3 leaves stage 2 at 1.0: the minimum stays 1.0, no move
    assert plan_move(two_each, FLOPS) is None


def test_dead_or_moved_peers_are_not_used_after_the_ban() -> None:
    r = _router({"a": 1.0, "b": 1.0, "c": 1.0}, ban_s=5.0)
    r.on_peer_down("a", 0.0)  # evicted: never announced again
    r.on_peer_up(PeerInfo(id="b", stage=3, region="r", compute_s=1.0, capacity=1), FAST_LINK, 0.0)  # moved
    assert set(_picks(r, 6, now=100.0)) == {"c"}


def test_rebalancing_counts_the_network_time_of_each_peer() -> None:
    """Compute alone says stage 1 is the bottleneck; with x's slow network stage 2 is."""
    members = [_p("a", 1, 1.0), _p("b", 1, 1.0), _p("x", 2, 0.25), _p("t1", 3, 1.0), _p("t2", 3, 1.0),
               _p("t3", 3, 1.0), _p("t4", 3, 1.0)]
    assert plan_move(members, FLOPS) == ("t1", 1)
    assert plan_move(members, FLOPS, {"x": 3.75}) == ("t1", 2)


def test_a_swarm_joiner_refills_a_lost_stage_other_than_stage_1() -> None:
    """Issue 16: `on_welcome` chose the stage before it filled the directory from the Welcome,
    so SWARM's rule (the relay stage with the least throughput) saw no members and every
    SWARM joiner took stage 1; a lost stage 2 was never refilled."""
    from dataclasses import replace

    from core_harness import TRAIN

    from gwtf.config import ProtocolConfig
    from gwtf.protocol import messages as m
    from gwtf.protocol.swarm import SwarmCore

    train = replace(TRAIN, stages=4, stage_flops=(1.0,) * 4, stage_state_bytes=(3000,) * 4,
                    stage_grad_bytes=(1000,) * 4)
    j = SwarmCore(PeerInfo(id="j", stage=-1, region="r", compute_s=0.1, capacity=4), ProtocolConfig(), train,
                  random.Random(1))
    j.on_start(0.0, [PeerInfo(id="d0", stage=-1, region="r", compute_s=0.1, capacity=1)])
    members = (("d0", 0, "r", 0.1, 4, 2, 0), ("a0", 1, "r", 0.1, 4, 0, -1), ("a1", 1, "r", 0.1, 4, 0, -1),
               ("c0", 3, "r", 0.1, 4, 0, -1))  # stage 2 has no replica left
    welcome = m.Welcome(term=0, stage=1, members=members, utilisation=(1.0, 1.0, 1e9, 1.0), iteration=3,
                        checkpoint_iteration=0)
    out = j.on_message("d0", welcome, 0.1)
    assert j.me.stage == 2, [getattr(e, "fields", None) for e in out if getattr(e, "event", "") == "join_stage"]
    assert set(j.directory) == {"d0", "a0", "a1", "c0", "j"}  # relays keep stages 1-3 of 4 and the data holders


def test_a_swarm_joiner_an_operator_placed_keeps_its_stage() -> None:
    """The runtime's `--stage K` joiner (`fixed_stage`) serves K under SWARM too (SWARM's own
    rule would send it to the least-served stage); a moving peer still goes where it was sent."""
    from core_harness import TRAIN

    from gwtf.config import ProtocolConfig
    from gwtf.protocol.swarm import SwarmCore

    j = SwarmCore(PeerInfo(id="j", stage=-1, region="r", compute_s=0.1, capacity=4), ProtocolConfig(), TRAIN,
                  random.Random(1))
    j.directory = {p.id: p for p in (PeerInfo(id="a0", stage=1, region="r", compute_s=0.1, capacity=4),
                                     PeerInfo(id="b0", stage=2, region="r", compute_s=0.1, capacity=4),
                                     PeerInfo(id="b1", stage=2, region="r", compute_s=0.1, capacity=4))}
    assert j.choose_join_stage((1.0, 1.0, 1.0)) == 1  # SWARM's rule: stage 1 has the least throughput
    j.fixed_stage = 2
    assert j.choose_join_stage((1.0, 1.0, 1.0)) == 2
    j.mover.move_target = 1
    assert j.choose_join_stage((1.0, 1.0, 1.0)) == 1
