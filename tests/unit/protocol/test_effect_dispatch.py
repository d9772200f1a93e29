"""Every driver handles every effect type: `messages.Effect` is a closed union, and a new effect
(or a deleted branch) must fail here, not be silently dropped by a driver.

Two checks: an inspection of each driver's dispatch (the effect classes it `isinstance`-tests
must cover the union, and it must end in `assert_never`, so mypy names a missing case), and a
run of the simulator's dispatch on one instance of every effect type (plus an unknown object,
which must raise). The same for compute kinds in the runtime's job dispatch."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, get_args

import pytest
from core_harness import Harness

from gwtf.protocol.base import CancelTimer, Log, RouterEffect, Send, SetTimer, log
from gwtf.protocol.kinds import ComputeKind
from gwtf.protocol.messages import EFFECT_TYPES, Compute, FreeIteration, GradRequest, Record, record
from gwtf.protocol.systems import get_system
from gwtf.runtime.drive import Host
from gwtf.runtime.node import NodeRuntime
from gwtf.sim.routing_sim import RoutingSim
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator

DISPATCHES: list[tuple[Callable[..., Any], tuple[type, ...]]] = [
    (Simulator._apply, EFFECT_TYPES),
    (NodeRuntime._apply_one, EFFECT_TYPES),
    (Harness.apply, EFFECT_TYPES),
    (RoutingSim._apply, get_args(RouterEffect)),
]


def _isinstance_classes(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """Class names a function tests with isinstance(x, C) / isinstance(x, (C, D)), and whether it
    calls assert_never."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names: set[str] = set()
    never = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id == "assert_never":
            never = True
        elif node.func.id == "isinstance" and len(node.args) == 2:
            arg = node.args[1]
            for c in arg.elts if isinstance(arg, ast.Tuple) else [arg]:
                if isinstance(c, ast.Name):
                    names.add(c.id)
    return names, never


@pytest.mark.parametrize(("fn", "types"), DISPATCHES, ids=lambda x: getattr(x, "__qualname__", ""))
def test_every_driver_dispatch_covers_the_effect_union(fn: Callable[..., Any], types: tuple[type, ...]) -> None:
    names, never = _isinstance_classes(fn)
    missing = {t.__name__ for t in types} - names
    assert not missing, f"{fn.__qualname__} does not handle {sorted(missing)}"
    assert never, f"{fn.__qualname__} does not end in assert_never (an unknown effect must raise)"


def test_the_union_is_what_the_core_can_return() -> None:
    assert set(EFFECT_TYPES) == {Send, SetTimer, CancelTimer, Log, Compute, Record, FreeIteration}


def test_the_simulator_runs_every_effect_type_and_refuses_an_unknown_one() -> None:
    sc = load_scenario(None, ['model.preset="tiny"', "model.stages=2", "nodes.count=4", "nodes.data_holders=1"])
    sim = Simulator(sc, 1, get_system("gwtf", sc.protocol))
    sim.start()
    a, b = sorted(sim.cores)[:2]
    timer = ("test", "timer")
    queued = len(sim.engine)
    samples: dict[type, tuple[Any, Callable[[], bool]]] = {  # effect, what it must have done
        Send: (Send(b, GradRequest(mb=(a, 0, 0), path=(a, b), legs=(0, 1))), lambda: len(sim.engine) == queued + 1),
        SetTimer: (SetTimer(timer, 1.0), lambda: (a, timer) in sim.timers),
        CancelTimer: (CancelTimer(timer), lambda: (a, timer) not in sim.timers),
        Log: (log("info", "test"), lambda: True),
        Compute: (Compute(999, "reset_grad", 0, None, 0.0), lambda: len(sim.engine) == queued + 3),
        Record: (record("reroute", node=a), lambda: sim.metrics.counters.get("reroute") == 1),
        FreeIteration: (FreeIteration(0), lambda: True),
    }
    assert set(samples) == set(EFFECT_TYPES), "add a sample of the new effect type here"
    for t in EFFECT_TYPES:
        eff, done = samples[t]
        sim._apply(a, [eff])
        assert done(), f"the simulator did not act on {eff!r}"
    with pytest.raises(AssertionError):
        sim._apply(a, [object()])  # type: ignore[list-item]


def test_the_runtime_runs_every_compute_kind() -> None:
    """Host._run_job matches every ComputeKind (and ends in assert_never): a new kind is a
    mypy error there and fails here, instead of a job the runtime never runs."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Host._run_job)))
    handled = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "ComputeKind"}
    missing = {k.name for k in ComputeKind} - handled
    assert not missing, f"Host._run_job does not run {sorted(missing)}"
    assert "assert_never" in {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                              and isinstance(n.func, ast.Name)}
