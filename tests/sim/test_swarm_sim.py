"""SWARM baseline in the simulator: same churn trace as gwtf, restart on backward crash, rebalancing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gwtf.protocol.messages import Compute, Record
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import ScenarioConfig, build, load_scenario
from gwtf.sim.simulator import Simulator, run_scenario

BASE = ['model.preset="tiny"', "nodes.count=10", "nodes.data_holders=2", "model.stages=4",
        "train.iterations=12", "sim.max_time_s=3000"]


def _scenario(extra: list[str]) -> ScenarioConfig:
    return load_scenario(None, BASE + extra)


def _trace(tmp_path: Path, sc: ScenarioConfig, seed: int) -> Path:
    """Crash one replica of every relay stage that has two, at staggered times; two joins."""
    inst, _ = build(sc, seed)
    rows = ["time_s,event,node"]
    t = 6.0
    for k in range(1, sc.model.stages):
        if len(inst.by_stage[k]) >= 2:
            rows.append(f"{t},crash,{inst.by_stage[k][-1]}")
            t += 7.0
    rows += [f"{t},join,", f"{t + 5},join,"]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("seed", [0, 3])
def test_gwtf_and_swarm_finish_the_same_churn_trace_without_violations(tmp_path: Path, seed: int) -> None:
    sc0 = _scenario([])
    trace = _trace(tmp_path, sc0, seed)
    sc = _scenario([f'churn.trace="{trace}"', "protocol.swarm_rebalance_period_s=20"])
    results = {name: run_scenario(sc, seed, name)[0] for name in ("gwtf", "swarm")}
    for name, s in results.items():
        assert s["finished"], (name, s)
        assert s["iterations"] == 12, name
        assert s["invariant_violations"] == 0, (name, s["violations"])
    crashes = {name: s["counters"].get("crashes_injected", 0) for name, s in results.items()}
    assert crashes["gwtf"] == crashes["swarm"] >= 2  # the same trace hit both systems


def _run_with_backward_crash(system: str, stage: int) -> tuple[list[Any], list[tuple[int, tuple[str, int, int]]]]:
    """Run until a relay of `stage` is back-propagating a microbatch, crash it there, finish.

    Returns the redo records and every forward compute (stage, microbatch) after the crash.
    """
    sc = _scenario(["churn.spare_leader=true"])
    sim = Simulator(sc, 0, get_system(system, sc.protocol))
    redo: list[Any] = []
    forwards: list[tuple[int, tuple[str, int, int]]] = []
    crashed: list[tuple[str, tuple[str, int, int]]] = []
    compute_done, record = sim._compute_done, sim._record

    def on_compute(node: str, job: Compute, dur_s: float) -> None:
        if crashed and job.kind == "forward" and node in sim.cores and job.mb is not None:
            forwards.append((sim.cores[node].me.stage, job.mb))
        compute_done(node, job, dur_s)

    def on_record(node: str, rec: Record, now: float) -> None:
        if rec.event == "redo":
            redo.append(dict(rec.fields))
        record(node, rec, now)

    sim._compute_done = on_compute  # type: ignore[method-assign]
    sim._record = on_record  # type: ignore[method-assign]
    sim.start()
    while not crashed and sim.engine.step():
        for nid, core in sorted(sim.cores.items()):
            legs = [leg for leg in core.plane.legs.values() if leg.phase == "bwd"]
            if core.me.stage == stage and legs and sim.engine.now > 1.0:
                crashed.append((nid, legs[0].mb))
                sim.crash(nid)
                break
    assert crashed, "no backward pass seen at that stage"
    sim.engine.run(until_s=sc.sim.max_time_s, stop=sim._done)
    assert sim.finished and sim.checker.count == 0, sim.checker.violations
    mb = crashed[0][1]
    return [r for r in redo if tuple(r["mb"]) == mb], [f for f in forwards if f[1] == mb]


def test_swarm_restarts_a_backward_crash_from_the_data_holder_gwtf_redoes_one_stage() -> None:
    stage = 2
    swarm_redo, swarm_fwd = _run_with_backward_crash("swarm", stage)
    gwtf_redo, gwtf_fwd = _run_with_backward_crash("gwtf", stage)
    assert swarm_redo and swarm_redo[0]["start"] == 1 and swarm_redo[0]["mode"] == "inflight"
    assert gwtf_redo and gwtf_redo[0]["start"] == stage
    # SWARM: every stage from the data holder to the crashed one computes its forward again
    assert {s for s, _ in swarm_fwd} == set(range(1, stage + 1))
    # gwtf: only the crashed stage is redone
    assert {s for s, _ in gwtf_fwd} == {stage}


def test_rebalancing_moves_a_relay_to_the_bottleneck_stage_and_training_stays_correct() -> None:
    sc = _scenario(["protocol.swarm_rebalance_period_s=20", "train.iterations=20"])
    sim = Simulator(sc, 0, get_system("swarm", sc.protocol))
    moves: list[dict[str, Any]] = []
    record = sim._record

    def on_record(node: str, rec: Record, now: float) -> None:
        if rec.event == "rebalance" and dict(rec.fields)["moved"]:
            moves.append(dict(rec.fields))
        record(node, rec, now)

    sim._record = on_record  # type: ignore[method-assign]
    summary = sim.run()
    assert summary["invariant_violations"] == 0, summary["violations"]
    assert summary["finished"]
    assert moves, "the generated instance is unbalanced: SWARM should move a relay"
    mover = sim.cores[moves[0]["moved"]]
    assert mover.active and mover.me.stage == moves[0]["to"]
    # it downloaded the target stage's state before serving (the move's cost)
    assert mover.version == sc.train.iterations


def test_swarm_as_released_never_rebalances() -> None:
    """The two SWARM variants of docs/baselines.md: the paper's (rebalancing every T) and the
    released code's (none), on the same unbalanced instance as the test above."""
    sc = _scenario(["protocol.swarm_rebalance_period_s=20", "train.iterations=20"])
    plans: dict[str, int] = {}
    for name in ("swarm", "swarm-released"):
        sim = Simulator(sc, 0, get_system(name, sc.protocol))
        record = sim._record
        seen = [0]

        def on_record(node: str, rec: Record, now: float, seen: list[int] = seen, record: Any = record) -> None:
            if rec.event in ("rebalance", "swarm_move"):
                seen[0] += 1
            record(node, rec, now)

        sim._record = on_record  # type: ignore[method-assign]
        summary = sim.run()
        assert summary["finished"] and summary["invariant_violations"] == 0, (name, summary["violations"])
        plans[name] = seen[0]
    assert plans["swarm"] > 0 and plans["swarm-released"] == 0, plans
