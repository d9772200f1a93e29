"""sim/plots: the figures `gwtf simulate` and the headline benchmark write."""

from __future__ import annotations

from pathlib import Path

from gwtf.protocol.systems import get_system
from gwtf.sim.plots import RunPlotData, cumulative_microbatches, iteration_throughput, plot_data, write_plots
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator

ROWS = [{"end_s": 10.0, "duration_s": 10.0, "microbatches": 20},
        {"end_s": 15.0, "duration_s": 5.0, "microbatches": 20},
        {"end_s": 40.0, "duration_s": 25.0, "microbatches": 10}]


def test_series_are_derived_from_the_timeline() -> None:
    assert iteration_throughput(ROWS) == ([10.0, 15.0, 40.0], [2.0, 4.0, 0.4])
    assert cumulative_microbatches(ROWS) == ([0.0, 10.0, 15.0, 40.0], [0, 20, 40, 50])


def test_write_plots_from_real_runs(tmp_path: Path) -> None:
    sc = load_scenario(None, ['model.preset="tiny"', "nodes.count=8", "nodes.data_holders=2", "model.stages=3",
                              "train.iterations=6", "churn.spare_leader=true"])
    runs = {}
    for name in ("gwtf", "swarm"):
        sim = Simulator(sc, 1, get_system(name, sc.protocol))
        summary = sim.run()
        runs[name] = plot_data(sim, summary)
    runs["gwtf"] = RunPlotData(runs["gwtf"].summary, runs["gwtf"].rows, crash_times_s=(3.0,), join_times_s=(5.0,))
    paths = write_plots(tmp_path / "plots", runs)
    assert [p.name for p in paths] == ["throughput.png", "cumulative.png", "systems.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert write_plots(tmp_path / "none", {}) == []
