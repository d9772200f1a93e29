"""gwtf's stage rebalancing in the simulator: a relay moves to the bottleneck stage mid-training,
pays its state download, and exactly-once / replica identity hold, also under random faults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import test_real_tensors as rt
from faultgen import random_schedule

from gwtf.protocol.messages import Record
from gwtf.protocol.rebalance import GwtfCore
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator
from gwtf.tensor_sim import run_with_tensors

setup = rt.setup  # the real-tensor module fixture (reference weights, no-churn run)
BASE = ['model.preset="tiny"', "nodes.count=10", "nodes.data_holders=2", "model.stages=4",
        "train.iterations=20", "sim.max_time_s=3000", "protocol.rebalance_period_s=20"]


def _run(extra: list[str], seed: int, base: list[str] = BASE) -> tuple[Simulator, dict[str, Any], list[dict[str, Any]]]:
    sc = load_scenario(None, base + extra)
    sim = Simulator(sc, seed, get_system("gwtf", sc.protocol))
    moves: list[dict[str, Any]] = []
    record = sim._record

    def on_record(node: str, rec: Record, now: float) -> None:
        if rec.event == "stage_move":
            moves.append(dict(rec.fields))
        record(node, rec, now)

    sim._record = on_record  # type: ignore[method-assign]
    return sim, sim.run(), moves


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_relay_moves_to_the_bottleneck_and_training_stays_correct(seed: int) -> None:
    sim, summary, moves = _run([], seed)
    assert summary["invariant_violations"] == 0, summary["violations"]
    assert summary["finished"]
    assert moves, "the generated instance is unbalanced: gwtf should move a relay"
    mover = sim.cores[moves[0]["node"]]
    assert isinstance(mover, GwtfCore)
    last = [m for m in moves if m["node"] == mover.me.id][-1]
    assert mover.active and mover.me.stage == last["to"]
    assert mover.version == sim.sc.train.iterations  # it downloaded the state and stepped in lockstep
    for k in range(1, sim.sc.model.stages):  # never a stage without a replica
        assert any(c.alive and c.active and c.me.stage == k for c in sim.cores.values())


def test_rebalancing_off_moves_nothing() -> None:
    _, summary, moves = _run(["protocol.rebalance_period_s=0"], 0)
    assert summary["finished"] and not moves


@pytest.mark.parametrize("first", [0, 40])
def test_fault_schedules_with_frequent_rebalancing_keep_every_invariant(first: int) -> None:
    failures = []
    moved = 0
    for seed in range(first, first + 40):
        extra = ["protocol.rebalance_period_s=3", "protocol.rebalance_min_gain=0"]
        _, summary, moves = _run(extra, seed, random_schedule(seed))
        if summary["invariant_violations"]:
            failures.append((seed, summary["violations"][:3]))
        moved += len(moves)
    assert not failures, failures
    assert moved >= 5, f"only {moved} moves in 40 schedules: the test does not exercise rebalancing"


@pytest.mark.slow  # about 3 s: the module fixture trains the reference and a no-churn run
def test_a_relay_moving_mid_training_keeps_real_tensors_exactly_once(setup: rt.Setup) -> None:
    """Real tensors: with a period of one iteration and min gain 0, a relay of the test instance
    leaves its stage at iteration 1 to move (its in-flight work is recovered by the others) and
    fetches the target stage's state; every node that served ends with the no-churn weights.
    (In K = 3 iterations the mover is not activated at its new stage before the end; the joiner
    side of a move is the ordinary join, checked with real state in test_real_tensors.py.)"""
    proto = dataclasses.replace(setup.sc.protocol, rebalance_period_s=1e-6, rebalance_min_gain=0.0)
    sc = dataclasses.replace(setup.sc, protocol=proto)
    run = run_with_tensors(sc, 1, setup.cfg, setup.dataset, built=setup.built)
    assert not run.crashed
    left = rt._initial(setup) - frozenset(run.weights)
    assert left, "no relay moved: the test does not exercise rebalancing"
    assert rt._problems(run, rt._stage_weights(setup.no_churn), rt._initial(setup) - left) == []
