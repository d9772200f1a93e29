"""sim/plots: the figures `gwtf simulate` and the headline benchmark write."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from gwtf.protocol.systems import get_system
from gwtf.sim.plots import (
    RunPlotData,
    cumulative_microbatches,
    iteration_throughput,
    plot_data,
    systems_figure,
    write_plots,
)
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


def test_systems_figure_shows_idle_and_discarded_on_their_own_scales() -> None:
    base = {"training_time_s": 1325.9, "throughput_microbatches_per_s": 1.61}
    runs = {"gwtf": RunPlotData({**base, "idle_fraction": 0.990806, "discarded_fraction": 2.62707e-06}, ROWS),
            "swarm": RunPlotData({**base, "idle_fraction": 0.991626, "discarded_fraction": 1.47451e-05}, ROWS)}
    fig = systems_figure(runs)
    try:
        titles = [ax.get_title() for ax in fig.axes]
        assert titles[2].startswith("idle GPU time") and titles[3].startswith("discarded compute")
        for ax in fig.axes:
            assert ax.get_legend() is None  # nothing drawn over the bars
            labels = [t for t in ax.texts if t.get_text()]
            assert len(labels) == 2
            top = ax.get_ylim()[1]
            assert all(t.xy[1] <= top / 1.15 for t in labels), ax.get_title()  # room under the title
        disc = fig.axes[3]
        assert [t.get_text() for t in disc.texts] == ["0.000263%", "0.00147%"]
        assert disc.patches[0].get_height() / disc.get_ylim()[1] > 0.1  # visible, not a hairline
    finally:
        plt.close(fig)
