"""The discrete-event engine: time order, FIFO ties, cancellation, run bounds."""

from __future__ import annotations

from gwtf.sim.engine import Engine


def test_time_order_and_fifo_ties() -> None:
    eng = Engine()
    seen: list[tuple[float, str]] = []
    eng.schedule(2.0, lambda: seen.append((eng.now, "b")))
    eng.schedule(1.0, lambda: seen.append((eng.now, "a")))
    eng.schedule(2.0, lambda: seen.append((eng.now, "c")))
    eng.run()
    assert seen == [(1.0, "a"), (2.0, "b"), (2.0, "c")]


def test_cancel_and_until() -> None:
    eng = Engine()
    seen: list[str] = []
    h = eng.after(1.0, seen.append, "x")
    eng.after(2.0, seen.append, "y")
    eng.after(5.0, seen.append, "z")
    eng.cancel(h)
    eng.run(until_s=3.0)
    assert seen == ["y"] and eng.now == 3.0
    eng.run()
    assert seen == ["y", "z"] and eng.events_run == 2


def test_events_scheduled_in_the_past_run_now() -> None:
    eng = Engine(start_s=10.0)
    eng.schedule(3.0, lambda: None)
    eng.run()
    assert eng.now == 10.0
