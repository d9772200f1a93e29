"""Iterations that trained fewer than the global batch are reported, each with its cause (issue
42: summary.json's `short_iterations` and `short_detail`), in the simulator and from a run."""

from __future__ import annotations

from gwtf.sim.metrics import Metrics
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario


def _done(m: Metrics, it: int, expected: int) -> None:
    m.on_record(float(it), "d0", "iteration_done", {"iteration": it, "expected": expected, "round": 0})


def test_a_short_iteration_is_reported_with_its_cause() -> None:
    m = Metrics(tokens_per_microbatch=1, full_batch=4)
    _done(m, 0, 4)
    m.on_record(1.5, "d0", "dh_lost", {"node": "d1", "iteration": 1, "started": 2})
    _done(m, 1, 2)
    m.on_record(2.5, "d0", "dh_lost", {"node": "d2", "iteration": 2, "started": 0})  # in the reduction already
    _done(m, 2, 2)
    s = m.summary(end_s=3.0, iterations_target=3)
    assert (s["full_batch"], s["short_iterations"]) == (4, 2)
    assert s["short_detail"] == [
        {"iteration": 1, "microbatches": 2, "cause": "a data holder lost in it"},
        {"iteration": 2, "microbatches": 2, "cause": "shards with no data holder (batch not held)"}]


def test_with_the_batch_held_a_churned_run_has_no_short_iteration_and_without_it_says_why() -> None:
    sc = load_scenario("configs/scenarios/paper-gpt-high.toml", ["train.iterations=150"])
    s, _ = run_scenario(sc, 5, "gwtf")
    assert s["counters"].get("dh_lost", 0) >= 1 and s["invariant_violations"] == 0, (s["counters"], s["violations"])
    assert (s["full_batch"], s["short_iterations"]) == (48, 0), s["short_detail"]
    sc = load_scenario("configs/scenarios/paper-gpt-high.toml",
                       ["train.iterations=150", "protocol.hold_batch=false", "protocol.data_holder_joins=false"])
    s, _ = run_scenario(sc, 5, "gwtf")
    assert s["short_iterations"] >= 1 and s["invariant_violations"] == 0
    assert {d["cause"] for d in s["short_detail"]} <= {"a data holder lost in it",
                                                        "shards with no data holder (batch not held)"}
