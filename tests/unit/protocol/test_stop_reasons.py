"""`invariants.stop_reason`: which unfinished runs the checker excuses (issue 42: no class of
node is irreplaceable, so losing every data holder is no excuse while a joiner could take it)."""

from __future__ import annotations

from gwtf.protocol.invariants import InvariantChecker, stop_reason


def test_every_data_holder_gone_with_a_joiner_alive_is_no_excuse() -> None:
    live = {"r1": (1, True), "r2": (2, True), "j1": (-1, False)}
    assert stop_reason(3, live) == ""  # j1 could have become a data holder: the run is stuck


def test_every_data_holder_gone_and_nobody_to_take_it() -> None:
    live = {"r1": (1, True), "r2": (2, True)}
    assert stop_reason(3, live) == "stage 0 lost with no node left for it"


def test_bounded_views_excuse_a_leaderless_swarm() -> None:
    """With protocol.view_size relays cannot lead: losing every data holder ends the run."""
    live = {"r1": (1, True), "r2": (2, True), "j1": (-1, False)}
    assert stop_reason(3, live, leaderless_stops=True) == "no data holder left"


def test_a_relay_stage_lost_with_a_joiner_alive_is_a_deadlock() -> None:
    assert stop_reason(3, {"d0": (0, True), "r2": (2, True), "j1": (-1, False)}) == ""
    assert stop_reason(3, {"d0": (0, True), "r2": (2, True)}) == "stage 1 lost with no node left for it"
    assert stop_reason(3, {"d0": (0, True), "r1": (1, True), "r2": (2, True)}) == ""


def test_the_checker_flags_the_stuck_run() -> None:
    checker = InvariantChecker(3, progress_bound_s=1e9, iterations=10)
    checker.finish(100.0, finished=False, stage_lost=True, versions={"r1": 4, "r2": 4},
                   live={"r1": (1, True), "r2": (2, True), "j1": (-1, False)})
    assert checker.stop_reason == ""
    assert any(v.startswith("deadlock") for v in checker.violations), checker.violations
