"""GPU waste split in two: discarded compute and idle time, both shares of the GPU time available.

`gpu_waste_fraction` (a summary.json contract) is their sum; the seconds and the fractions agree
on churned runs, including a tiny model whose compute lasts milliseconds (3 fixed decimals
rounded its discarded_s to 0.0 next to a non-zero fraction).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gwtf.sim.metrics import Metrics
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "smoke.toml"
# 124m on 12 nodes, high crash rate and a crash mid-backward: seconds of discarded compute
CHURNED = ["model.stages=3", "nodes.count=12", "nodes.data_holders=3", "nodes.relay_capacity=[1, 3]",
           "train.iterations=8", "train.microbatches=3", "churn.crash_rate_per_hour=6.0",
           "churn.join_rate_per_hour=60.0", "churn.spare_leader=true",
           'faults=[{event="crash", after_event="contribute", count=7}]',
           # the crash rate must hit a run this long: the gather reduce's with fp32 messages
           'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
           'protocol.reduce="gather"']


def _check_split(s: dict[str, Any]) -> None:
    avail = s["available_s"]
    assert s["discarded_s"] > 0 and s["discarded_waste_fraction"] > 0
    assert math.isclose(s["discarded_s"] / avail, s["discarded_waste_fraction"], rel_tol=1e-5)
    assert math.isclose(s["idle_s"] / avail, s["idle_fraction"], rel_tol=1e-5)
    assert math.isclose(s["discarded_waste_fraction"] + s["idle_fraction"], s["gpu_waste_fraction"], rel_tol=1e-5)
    assert s["discarded_s"] <= s["busy_s"] and s["idle_s"] + s["busy_s"] <= avail * (1 + 1e-8)
    # the share of the compute of finished iterations: busy_s also holds the unfinished ones
    assert s["discarded_s"] / s["busy_s"] * (1 - 1e-5) <= s["discarded_fraction"] <= 1
    # split by where the work ran: nodes that crashed, and nodes that recovery made redo work
    assert min(s["discarded_crashed_s"], s["discarded_live_s"]) >= 0
    assert math.isclose(s["discarded_crashed_s"] + s["discarded_live_s"], s["discarded_s"], rel_tol=1e-6)
    assert math.isclose(s["discarded_crashed_fraction"] + s["discarded_live_fraction"], s["discarded_fraction"],
                        rel_tol=1e-5)


@pytest.mark.parametrize("system", ["gwtf", "swarm"])
def test_discarded_seconds_match_the_fraction_on_a_churned_run(system: str) -> None:
    s, _ = run_scenario(load_scenario(None, CHURNED), 2, system)
    assert s["crashes"] >= 2 and s["invariant_violations"] == 0, s["violations"]
    _check_split(s)
    assert s["discarded_s"] > 0.01  # real seconds, not rounding noise


@pytest.mark.parametrize("system", ["gwtf", "swarm"])
def test_a_tiny_model_keeps_its_millisecond_discarded_seconds(system: str) -> None:
    s, _ = run_scenario(load_scenario(SMOKE, []), 0, system)
    assert s["busy_s"] < 0.2  # the case that rounded to 0.0 (with the run's last checkpoint and its copies)
    _check_split(s)


def test_the_split_from_known_seconds() -> None:
    m = Metrics(tokens_per_microbatch=1)
    m.node_up("a", 0.0)
    m.node_up("b", 0.0)
    m.on_job("a", "fwd", ("a", 0, 0), 3.0)  # iteration 0: never applied, so discarded once it is done
    m.on_job("b", "fwd", None, 1.0)
    m.on_record(10.0, "a", "iteration_done", {"iteration": 1, "expected": 1, "round": 0})
    s = m.summary(end_s=10.0, iterations_target=2)
    assert (s["available_s"], s["busy_s"], s["discarded_s"], s["idle_s"]) == (20.0, 4.0, 3.0, 16.0)
    assert (s["discarded_waste_fraction"], s["idle_fraction"], s["gpu_waste_fraction"]) == (0.15, 0.8, 0.95)
    assert s["discarded_fraction"] == 0.75


def test_discarded_work_is_split_by_whether_its_node_crashed() -> None:
    m = Metrics(tokens_per_microbatch=1)
    for n in "abc":
        m.node_up(n, 0.0)
    m.on_job("a", "fwd", ("a", 0, 0), 2.0)  # iteration 0, never applied: a crashes, b and c do not
    m.on_job("b", "fwd", ("a", 0, 0), 1.0)
    m.on_job("c", "fwd", ("a", 0, 0), 0.5)
    m.node_down("a", 4.0)
    m.node_crashed("a", 4.0)
    m.node_down("c", 5.0)  # a graceful leave: its thrown-away work counts as recovery's
    m.on_record(10.0, "b", "iteration_done", {"iteration": 1, "expected": 1, "round": 0})
    s = m.summary(end_s=10.0, iterations_target=2)
    assert (s["discarded_s"], s["discarded_crashed_s"], s["discarded_live_s"]) == (3.5, 2.0, 1.5)
    assert (s["discarded_crashed_fraction"], s["discarded_live_fraction"]) == (round(2.0 / 3.5, 6), round(1.5 / 3.5, 6))
    assert s["crashes"] == 1
