"""gwtf's rebalancing decision (`plan_gwtf_move`): bottleneck, hysteresis, capacity, move cost."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from core_harness import TRAIN, Harness, peers

from gwtf.config import ProtocolConfig
from gwtf.protocol.rebalance import MoveInputs, plan_gwtf_move, stage_times_s
from gwtf.protocol.router import PeerInfo

FLOPS = (1.0, 1.0, 1.0, 1.0)


def _peer(pid: str, stage: int, compute_s: float = 1.0, capacity: int = 4) -> PeerInfo:
    return PeerInfo(id=pid, stage=stage, region="r", compute_s=compute_s, capacity=capacity)


def _inputs(members: list[PeerInfo], **kw: object) -> MoveInputs:
    base: dict[str, object] = dict(members=members, stage_flops=FLOPS, demand=4, transfer_s={}, download_s={},
                                   iteration_s=0.0, remaining_iterations=0, min_gain=0.02)
    base.update(kw)
    return MoveInputs(**base)  # type: ignore[arg-type]


def _apply(members: list[PeerInfo], move: tuple[str, int]) -> list[PeerInfo]:
    pid, target = move
    return [replace(p, stage=target) if p.id == pid else p for p in members]


def test_a_replica_of_an_over_provisioned_stage_moves_to_the_bottleneck() -> None:
    members = [_peer("d", 0), _peer("a", 1, 2.0), _peer("b", 2), _peer("x", 3), _peer("y", 3), _peer("z", 3)]
    assert plan_gwtf_move(_inputs(members)) == ("x", 1)  # x, y, z are equivalent: lowest id
    # when two stages tie as the bottleneck, one move cannot lower the cost: none
    assert plan_gwtf_move(_inputs(_apply(members, ("x", 1)))) is None


def test_the_network_time_of_a_replica_counts() -> None:
    members = [_peer("d", 0), _peer("a", 1, 2.0), _peer("b", 2), _peer("c", 2), _peer("x", 3), _peer("y", 3)]
    # stage 1 is the bottleneck on compute alone; b's and c's slow links make stage 2 one
    assert plan_gwtf_move(_inputs(members)) == ("b", 1)
    assert plan_gwtf_move(_inputs(members, transfer_s={"b": 9.0, "c": 9.0})) == ("x", 2)


def test_no_move_empties_a_stage_or_breaks_its_capacity() -> None:
    lone = [_peer("d", 0), _peer("a", 1, 0.1), _peer("b", 2, 0.1), _peer("c", 3, 5.0)]
    assert plan_gwtf_move(_inputs(lone)) is None  # every donor has one replica
    # stage 2 would keep 2 slots for a demand of 4: the move is refused although it is faster
    tight = [_peer("d", 0), _peer("a", 1, 0.1), _peer("b", 2, 0.1, 2), _peer("c", 2, 0.1, 2), _peer("z", 3, 5.0)]
    assert plan_gwtf_move(_inputs(tight)) is None
    assert plan_gwtf_move(_inputs(tight, demand=2)) == ("b", 3)


def test_a_stage_over_capacity_is_the_bottleneck_first() -> None:
    members = [_peer("d", 0), _peer("a", 1, 0.1, 2), _peer("b", 2, 1.0), _peer("c", 2, 1.0), _peer("e", 3, 9.0)]
    # stage 3 is the slowest, but stage 1 cannot hold the flow: it gets the replica
    assert plan_gwtf_move(_inputs(members, demand=4)) == ("b", 1)


def test_hysteresis_no_move_for_a_small_gain() -> None:
    # helping stage 1 (1.0 s) leaves stage 2 (0.99 s) as the bottleneck: a 1 % gain
    members = [_peer("d", 0), _peer("a", 1, 1.0), _peer("b", 2, 0.99), _peer("x", 3, 0.1), _peer("y", 3, 0.1)]
    assert plan_gwtf_move(_inputs(members, min_gain=0.0)) == ("x", 1)
    assert plan_gwtf_move(_inputs(members, min_gain=0.02)) is None


def test_a_move_that_does_not_repay_its_state_download_is_refused() -> None:
    members = [_peer("d", 0), _peer("a", 1, 2.0), _peer("b", 2), _peer("x", 3), _peer("y", 3), _peer("z", 3)]
    cheap = _inputs(members, iteration_s=10.0, remaining_iterations=100, download_s={"x": 5.0})
    assert plan_gwtf_move(cheap) == ("x", 1)
    late = replace(cheap, remaining_iterations=1)  # saves 1 iteration x 10 s x 50 % < 100 s download
    assert plan_gwtf_move(replace(late, download_s={"x": 100.0})) is None


def test_repeated_moves_terminate_and_never_raise_the_cost() -> None:
    """The cost per microbatch is a potential: each accepted move lowers it, so no oscillation."""
    for seed in range(30):
        rng = random.Random(seed)
        members = [_peer("d", 0)] + [_peer(f"n{i:02d}", 1 + i % 3, rng.uniform(0.05, 2.0)) for i in range(12)]
        cost = max(stage_times_s(members, 4, {})[1:])
        for _step in range(50):
            move = plan_gwtf_move(_inputs(members))
            if move is None:
                break
            members = _apply(members, move)
            new_cost = max(stage_times_s(members, 4, {})[1:])
            assert new_cost < cost * (1 - 0.02) + 1e-12
            assert all(any(p.stage == k for p in members) for k in range(4))
            cost = new_cost
        else:
            raise AssertionError(f"seed {seed}: no fixed point after 50 moves")


@pytest.mark.parametrize("system", ["gwtf", "swarm"])
@pytest.mark.parametrize("start_s", [0.0, 1e6])
def test_the_first_rebalance_waits_a_period_whatever_the_clock_epoch(system: str, start_s: float) -> None:
    """The runtime's clock is the loop's monotonic time (large at start), the simulator's starts at
    0: a leader plans its first move one period after its own start in both (it planned at once
    in the runtime). The placement is lopsided, so a move is due once the period has passed."""
    cfg = ProtocolConfig(rebalance_period_s=40.0, swarm_rebalance_period_s=40.0, rebalance_min_gain=0.0)
    train = replace(TRAIN, iterations=0)
    members = [replace(p, compute_s=1.0) for p in peers((1, 4, 1), capacity=1, demand=1)]
    h = Harness(members, train, cfg=cfg, system=system, start_s=start_s)
    h.start()
    moves = ("stage_move", "swarm_move")
    h.run(start_s + 35.0)
    assert not [e for _, _, e, _ in h.records if e in moves]
    h.run(start_s + 90.0)
    assert [e for _, _, e, _ in h.records if e in moves]
