"""Plots of simulated runs (matplotlib, Agg backend): what `gwtf simulate` writes beside its CSVs.

Owns: `RunPlotData` (one system's run: summary, timeline rows, churn event times) and
`write_plots(out_dir, runs)`, which writes
- `throughput.png`: microbatches per second of every iteration against time, one line per
  system, crashes (red, solid) and joins (green, dashed) marked;
- `cumulative.png`: microbatches trained so far against time;
- `systems.png`: one bar per system in four panels, each on its own scale: training time,
  throughput, idle GPU time and discarded compute (both in % of the GPU time available; their
  sum is `gpu_waste_fraction`). Discarded compute is ~100x smaller than idle time, so it gets
  its own panel; every bar is labelled with its value, with headroom above the tallest.
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
import matplotlib.ticker  # noqa: E402

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


def _fraction(summary: Mapping[str, Any], key: str, seconds: str) -> float:
    """A share of available GPU time; summaries from before the field existed: from the seconds."""
    if key in summary:
        return float(summary[key])
    return float(summary.get(seconds, 0.0)) / max(float(summary.get("available_s", 0.0)), 1e-12)


def _label(v: float, percent: bool) -> str:
    if percent:
        return f"{100 * v:.3g}%"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _systems_figure(runs: Mapping[str, RunPlotData], path: Path) -> None:
    fig = systems_figure(runs)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def systems_figure(runs: Mapping[str, RunPlotData]) -> Any:
    """The figure of systems.png (a matplotlib Figure; the caller closes it)."""
    names = list(runs)
    colors = [COLORS[i % len(COLORS)] for i in range(len(names))]
    s = [runs[n].summary for n in names]
    panels = (
        ("training time (s)", [float(x["training_time_s"]) for x in s], False),
        ("throughput (microbatches/s)", [float(x["throughput_microbatches_per_s"]) for x in s], False),
        ("idle GPU time (% of available)", [_fraction(x, "idle_fraction", "idle_s") for x in s], True),
        ("discarded compute (% of compute done)", [float(x.get("discarded_fraction", 0.0)) for x in s], True),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    for ax, (title, values, percent) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize="medium")
        top = max(values, default=0.0)
        ax.set_ylim(0.0, 1.2 * top if top > 0 else 1.0)  # room for the labels under the title
        if percent:
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(xmax=1.0))
        for j, v in enumerate(values):
            ax.annotate(_label(v, percent), (j, v), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize="small")
    fig.tight_layout()
    return fig


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
