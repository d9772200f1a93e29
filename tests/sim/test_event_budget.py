"""The simulator's event budget (issue 45): a small fixed scenario runs exactly the events it ran
when the constants below were measured, per iteration and in total.

Simulator speed is events x cost per event; `benchmarks/sim_scale.py --against REV` measures the
cost, this test pins the count, which is deterministic (no churn, seeded jitter) and so can be
checked exactly and cheaply. A protocol change that adds a message per microbatch hop adds an event
per hop and fails here (`test_one_more_message_per_hop_breaks_the_budget` shows it) even where the
wall time would hide it in noise.

Updating the constants: a change that means to run more (or fewer) events reruns this file, copies
the numbers from the failure message into EVENTS_PER_ITERATION / EVENTS_TOTAL and says in the
commit message why the count moved (which messages, timers or computes were added or dropped, per
what). An unexplained change of the count is a regression to look at, not a number to refresh.
"""

from __future__ import annotations

from typing import Any

from gwtf.protocol.messages import Got, Message
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator

# 3 data holders x 2 microbatches, 3 stages (3 forward hops per microbatch: DH -> s1 -> s2 -> DH),
# 10 nodes, the flow router, no churn: tests/sim/test_simulator.py's SMALL with 4 iterations.
SCENARIO = ['model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", "model.stages=3",
            "nodes.count=10", "nodes.data_holders=3", "nodes.relay_capacity=[1, 3]",
            "train.iterations=4", "train.microbatches=2", "sim.max_time_s=2000.0",
            "churn.crash_rate_per_hour=0.0", "churn.leave_rate_per_hour=0.0", "churn.join_rate_per_hour=0.0",
            # exact event counts: measured on the gather reduce with fp32 messages (their sizes set the timing)
            'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
            'protocol.reduce="gather"']
SEED = 1
HOPS_PER_ITERATION = 3 * 2 * 3  # data holders x microbatches x stages

# Measured (see the module docstring to update). Iteration 1 includes the start (joins, flow
# establishment); the tail is the events after the last iteration's ITERATION_DONE record (the
# last step on every replica).
EVENTS_PER_ITERATION = (367, 331, 325, 316)
EVENTS_TAIL = 43
EVENTS_TOTAL = 1382


def run_counted(patch: Any = None) -> tuple[dict[str, Any], list[int]]:
    """One run through `Simulator(...).run()`, as `gwtf simulate` does; returns its summary and the
    events of each iteration (the last entry: the tail after the last iteration).

    The engine counts events only when its loop returns, so the count is taken from the stop
    predicate `Simulator.run` hands the engine, which it calls once after every event."""
    sc = load_scenario(None, SCENARIO)
    sim = Simulator(sc, SEED, get_system("gwtf", sc.protocol))
    ran = 0
    marks: list[int] = []
    done = sim._done

    def counting_done() -> bool:
        nonlocal ran
        ran += 1
        return done()

    sim._done = counting_done  # type: ignore[method-assign]
    sim.on_iteration = lambda _done, _now: marks.append(ran + 1)  # during the event that completes it
    if patch is not None:
        patch(sim)
    summary = sim.run()
    assert ran == summary["events"]
    bounds = [0, *marks, summary["events"]]
    return summary, [b - a for a, b in zip(bounds, bounds[1:])]


def budget_problems(summary: dict[str, Any], per_iteration: list[int]) -> list[str]:
    """What differs from the measured budget ([] when nothing): the check both tests use."""
    problems = []
    want = [*EVENTS_PER_ITERATION, EVENTS_TAIL]
    if per_iteration != want:
        problems.append(f"events per iteration (+ tail) {per_iteration}, budget {want}")
    if summary["events"] != EVENTS_TOTAL:
        problems.append(f"events {summary['events']}, budget {EVENTS_TOTAL}")
    return problems


def test_the_small_scenario_runs_its_event_budget_exactly_and_deterministically() -> None:
    summary, per_iteration = run_counted()
    assert summary["finished"] and summary["iterations"] == len(EVENTS_PER_ITERATION)
    assert summary["invariant_violations"] == 0, summary["violations"]
    assert sum(per_iteration) == summary["events"]
    assert budget_problems(summary, per_iteration) == []
    again, again_per_iteration = run_counted()
    assert (again["events"], again_per_iteration) == (summary["events"], per_iteration)
    assert again["training_time_s"] == summary["training_time_s"]


def test_one_more_message_per_hop_breaks_the_budget() -> None:
    """The issue's demonstration: a change that sends one more control message per microbatch
    hop (here every receipt ack `Got` of a Forward is sent twice; the second is ignored by its
    receiver) adds one event per hop, and the budget check reports it."""
    extra = 0

    def double_got(sim: Simulator) -> None:
        send = sim._send

        def send_twice(src: str, dst: str, msg: Message, now: float) -> None:
            nonlocal extra
            send(src, dst, msg, now)
            if isinstance(msg, Got):
                extra += 1
                send(src, dst, msg, now)

        sim._send = send_twice  # type: ignore[method-assign]

    summary, per_iteration = run_counted(double_got)
    assert summary["finished"] and summary["invariant_violations"] == 0  # it still trains correctly ...
    assert extra == HOPS_PER_ITERATION * len(EVENTS_PER_ITERATION)
    assert summary["events"] == EVENTS_TOTAL + extra  # ... with one more event per hop
    problems = budget_problems(summary, per_iteration)
    assert len(problems) == 2, problems  # the per-iteration check and the total both catch it
    assert problems[1] == f"events {EVENTS_TOTAL + extra}, budget {EVENTS_TOTAL}"
