"""The systems of `gwtf.protocol.systems` in real node processes: what the simulator runs, the
runtime runs (issue 15).

Cases: the SWARM baseline (`protocol.system="swarm"`: stochastic wiring, bans, restarts of a
microbatch whose backward lost a node) trains over TCP under `--churn high` with the short
timeouts, and its ledger is clean; with rebalancing on, a lopsided swarm (three replicas of stage 1,
one of stage 2) moves a relay to stage 2 in real processes, under gwtf's rule and under SWARM's:
the mover leaves, downloads stage 2's state through the join path, serves it, and steps with the
same weights as the replica it joined.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_churn import (
    DEMO_SHAPE,
    DEMO_TIMEOUTS,
    LONG,
    _done,
    _events,
    _records,
    _run_on,
    _served,
    _swarm,
    _until,
    high_churn_run,
)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_swarm_baseline_trains_over_tcp_under_high_churn(tmp_path: Path) -> None:
    high_churn_run(tmp_path, ('protocol.system="swarm"', "train.seed=5"))


@pytest.mark.integration
@pytest.mark.timeout(150)
@pytest.mark.parametrize("system", ["gwtf", "swarm"])
def test_a_lopsided_swarm_moves_a_relay_to_the_bottleneck_stage(tmp_path: Path, system: str) -> None:
    period = ("protocol.rebalance_period_s=4.0", "protocol.swarm_rebalance_period_s=4.0",
              "protocol.rebalance_min_gain=0.02")
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, f'protocol.system="{system}"', *period, LONG),
                   replicas=1)
    with swarm:
        swarm.start()
        extra = [swarm.join_node("1"), swarm.join_node("1")]  # stage 1: three replicas, stage 2: one
        _until(swarm, lambda: all(_served(swarm, p.name) for p in extra) or bool(_events(swarm, "stage_move"))
               or bool(_events(swarm, "swarm_move")), 60.0, "the stage-1 joiners serving")
        event = "stage_move" if system == "gwtf" else "swarm_move"
        _until(swarm, lambda: bool(_events(swarm, event)), 60.0, f"a {event}")
        moves = _events(swarm, event)
        mover, move = moves[0]
        assert (int(move["stage"]), int(move["to"])) == (1, 2), moves

        def serves_stage_2() -> bool:
            return any(r.get("event") == "contribute" and int(r["stage"]) == 2 for r in _records(swarm, mover))

        _until(swarm, serves_stage_2, 60.0, f"{mover} serving stage 2")
        _run_on(swarm, 3, 40.0)
        last = _done(swarm) - 1

        def step_hashes() -> dict[str, str]:
            return {name: str(r["hash"]) for name in ("r2a", mover) for r in _records(swarm, name)
                    if r.get("event") == "stepped" and r["iteration"] == last and int(r["stage"]) == 2}

        # an iteration is done once one replica of every stage logged its step: wait for both (bounded)
        _until(swarm, lambda: len(step_hashes()) == 2, 20.0, f"r2a and {mover} logging their step of {last}")
        steps = set(step_hashes().values())
        assert len(steps) == 1, steps  # the mover and stage 2's replica hold the same weights
        assert len(moves) == 1, moves  # balanced after one move: no back-and-forth


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_load_aware_routing_trains_over_tcp_under_high_churn(tmp_path: Path) -> None:
    """`flow.load_aware` (issue 17) in real processes: its `flow.load` announcements cross the
    wire (codec, validation, authentication) between every neighbouring stage, and a swarm routing
    by the load-aware cost trains through `--churn high` with the short timeouts, clean ledger,
    every joiner serving; no node refused a `flow.load`."""
    swarm_dir = tmp_path / "la"
    high_churn_run(swarm_dir, ("flow.load_aware=true", "train.seed=5"))
    refused = [r for f in swarm_dir.glob("swarm/nodes/*/records.jsonl") for r in map(json.loads, f.read_text().splitlines())
               if r.get("event") == "message_refused" and "flow.load" in json.dumps(r)]
    assert list(swarm_dir.glob("swarm/nodes/*/records.jsonl")), "no node records to check"
    assert not refused, refused[:3]
