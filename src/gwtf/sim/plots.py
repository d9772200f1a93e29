"""Plots of simulated runs (matplotlib, Agg backend): what `gwtf simulate` writes beside its CSVs.

Owns: `RunPlotData` (one system's run: summary, timeline rows, churn event times) and
`write_plots(out_dir, runs)`, which writes
- `throughput.png`: microbatches per second of every iteration against time, one line per
  system, crashes (red, solid) and joins (green, dashed) marked;
- `cumulative.png`: microbatches trained so far against time;
- `systems.png`: one bar per system for training time, throughput and GPU waste (the discarded
  share drawn inside the waste bar).
Inputs are the plain dicts `Metrics.summary()` / `timeline_rows()` return; nothing is computed
here that the metrics do not already define.

The sim package may import matplotlib (never torch, asyncio, socket, threading or time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:gray")


@dataclass(frozen=True, slots=True)
class RunPlotData:
    """One system's run, as the simulator reports it."""

    summary: Mapping[str, Any]
    rows: Sequence[Mapping[str, Any]]
    crash_times_s: Sequence[float] = ()
    join_times_s: Sequence[float] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


def iteration_throughput(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """(end time of each iteration, its microbatches / its duration)."""
    xs, ys = [], []
    for r in rows:
        dur = float(r["duration_s"])
        xs.append(float(r["end_s"]))
        ys.append(float(r["microbatches"]) / dur if dur > 0 else 0.0)
    return xs, ys


def cumulative_microbatches(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[int]]:
    """(time 0 then each iteration's end, microbatches trained by then)."""
    xs, ys, total = [0.0], [0], 0
    for r in rows:
        total += int(r["microbatches"])
        xs.append(float(r["end_s"]))
        ys.append(total)
    return xs, ys


def _markers(ax: Any, runs: Mapping[str, RunPlotData]) -> None:
    crashes = sorted({t for r in runs.values() for t in r.crash_times_s})
    joins = sorted({t for r in runs.values() for t in r.join_times_s})
    for i, t in enumerate(crashes):
        ax.axvline(t, color="tab:red", lw=0.8, alpha=0.6, label="crash" if i == 0 else None)
    for i, t in enumerate(joins):
        ax.axvline(t, color="tab:green", lw=0.8, ls="--", alpha=0.6, label="join" if i == 0 else None)


def _time_series_figure(runs: Mapping[str, RunPlotData], path: Path, series: str) -> None:
    """One line per system against time, churn marked: "throughput" or "cumulative"."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (name, run) in enumerate(runs.items()):
        color = COLORS[i % len(COLORS)]
        if series == "throughput":
            ax.plot(*iteration_throughput(run.rows), marker=".", color=color, label=name)
        else:
            ax.step(*cumulative_microbatches(run.rows), where="post", color=color, label=name)
    _markers(ax, runs)
    ax.set_xlabel("time (s)")
    if series == "throughput":
        ax.set_ylabel("microbatches / s (per iteration)")
        ax.set_title("Throughput over time")
    else:
        ax.set_ylabel("microbatches trained")
        ax.set_title("Cumulative microbatches")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _systems_figure(runs: Mapping[str, RunPlotData], path: Path) -> None:
    names = list(runs)
    colors = [COLORS[i % len(COLORS)] for i in range(len(names))]
    s = [runs[n].summary for n in names]
    panels = (
        ("training time (s)", [float(x["training_time_s"]) for x in s]),
        ("throughput (microbatches/s)", [float(x["throughput_microbatches_per_s"]) for x in s]),
        ("GPU waste (share of available)", [float(x["gpu_waste_fraction"]) for x in s]),
    )
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize="medium")
        for j, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (j, v), ha="center", va="bottom", fontsize="small")
    discarded = [float(x.get("discarded_s", 0.0)) / max(float(x.get("available_s", 0.0)), 1e-12) for x in s]
    axes[2].bar(names, discarded, color="tab:red", alpha=0.7, label="discarded compute")
    axes[2].legend(loc="best", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out_dir: str | Path, runs: Mapping[str, RunPlotData]) -> list[Path]:
    """Write throughput.png, cumulative.png and systems.png into `out_dir`; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "throughput.png", out / "cumulative.png", out / "systems.png"]
    if not runs:
        return []
    _time_series_figure(runs, paths[0], "throughput")
    _time_series_figure(runs, paths[1], "cumulative")
    _systems_figure(runs, paths[2])
    return paths


def plot_data(sim: Any, summary: Mapping[str, Any]) -> RunPlotData:
    """The plot inputs of a finished `Simulator` and the summary its `run()` returned.

    Join markers come from `metrics.join_times` when the metrics record them (else none).
    """
    m = sim.metrics
    joins = tuple(getattr(m, "join_times", ()))
    return RunPlotData(summary=summary, rows=m.timeline_rows(), crash_times_s=tuple(m.crash_times),
                       join_times_s=joins)
