"""Scale guardrail (slow): 1,000 simulated nodes finish two iterations cleanly and the
simulator sustains a minimum event rate (catches accidental O(N^2) work per event)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario

SCENARIO = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "scale-1k.toml"


@pytest.mark.slow
def test_thousand_nodes_two_iterations() -> None:
    sc = load_scenario(SCENARIO, ["train.iterations=2", "sim.max_time_s=5000.0"])
    t0 = time.process_time()
    summary, _ = run_scenario(sc, 1)
    cpu_s = time.process_time() - t0
    assert summary["finished"] and summary["invariant_violations"] == 0, summary["violations"]
    assert summary["events"] / cpu_s > 20_000, f"{summary['events'] / cpu_s:.0f} events/s"
