"""`gwtf simulate SCENARIO.toml`: run a churn scenario in the discrete-event simulator.

Owns: the command's flags, the rich progress display and comparison table, and the run's
outputs: DIR/summary.json ({system: metrics}, no wall-clock values: same seed, same bytes),
DIR/timeline.csv (one row per completed iteration and system), DIR/scenario.resolved.toml and
the plots of `gwtf.sim.plots` (throughput.png, cumulative.png, systems.png).
By default it runs gwtf and SWARM on the same nodes and churn trace (`--systems` picks one or
others) and prints one column per system, every row labelled with its unit; beside the achieved
time per iteration the table and summary.json give its physical lower bound (`sim.bound`).
Scenario knobs are `--set section.key=value` overrides, not flags. `--compiled` changes no
result, only the speed: the same command runs again on the mypyc build of the same source
(`gwtf.commands.compiled`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from gwtf.cli import out_folder
from gwtf.commands import compiled
from gwtf.config import dump_toml
from gwtf.errors import UserError
from gwtf.protocol.faults import parse_fault
from gwtf.protocol.systems import get_system
from gwtf.sim.plots import RunPlotData, plot_data, write_plots
from gwtf.sim.scenario import ScenarioConfig, build, load_scenario
from gwtf.sim.simulator import Simulator

__all__ = ["add_arguments", "run"]

DEFAULT_SYSTEMS = "gwtf,swarm"  # a comparison unless --systems names one
TIP_NODES = 1000  # from this size on, a run without --compiled suggests it (one line on stderr)

# (summary key, label with its unit, how the value is shown)
TABLE = (
    ("training_time_s", "time to K iterations [s]", "s"),
    ("iteration_s", "time per iteration [s]", "s"),
    ("bound_s", "iteration bound [s] (term)", "b"),
    ("achieved_over_bound", "achieved / bound [x]", "x"),
    ("iterations", "iterations completed [count]", "n"),
    ("throughput_microbatches_per_s", "throughput [microbatches/s]", "r"),
    ("throughput_tokens_per_s", "throughput [tokens/s]", "r"),
    ("gpu_waste_fraction", "GPU waste: idle + discarded [% of GPU time]", "%"),
    ("idle_fraction", "idle GPU time [% of GPU time]", "%"),
    ("discarded_waste_fraction", "discarded GPU time [% of GPU time]", "%"),
    ("discarded_fraction", "discarded compute [% of compute done]", "%"),
    ("discarded_crashed_fraction", "  of it on crashed nodes [% of compute done]", "%"),
    ("discarded_live_fraction", "  of it redone by recovery [% of compute done]", "%"),
    ("microbatches_dropped", "microbatches dropped [count]", "n"),
    ("crashes", "crashes [count]", "n"),
    ("recovery_time_mean_s", "recovery time, mean [s]", "s"),
    ("invariant_violations", "invariant violations [count]", "n"),
)


def format_value(value: Any, kind: str) -> str:
    """A table cell: seconds with 2 decimals (`b`: the iteration bound, seconds too), counts as
    integers, rates with 4 significant digits, fractions as percentages, ratios (`x`) with 2
    decimals; "-" when the summary has no such value."""
    if value is None or value == "" or isinstance(value, bool):
        return "-" if value in (None, "") else str(value)
    if not isinstance(value, (int, float)):
        return str(value)
    if kind == "%":
        return f"{100 * value:.2f}%"
    if kind in ("s", "b", "x"):
        return f"{value:,.2f}"
    if kind == "n":
        return f"{int(value):,}"
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO.toml", help="scenario file (see configs/scenarios/)")
    parser.add_argument("--seed", type=int, default=0, help="seed of nodes, churn and jitter")
    parser.add_argument("--out", metavar="DIR", default="", help="output folder (default runs/sim-NAME-sSEED)")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, metavar="A,B",
                        help=f"comma-separated systems to run on the same nodes and churn trace (default: "
                             f"{DEFAULT_SYSTEMS}, the comparison; one name, e.g. --systems gwtf, runs only that)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument("--compiled", action="store_true",
                        help="run the simulator on its mypyc-compiled core (1.2-1.5x faster, the same results byte for "
                             "byte; built once per source version, ~2 minutes; needs mypy and a C compiler)")
    parser.add_argument("--fault", dest="faults", metavar="SPEC", action="append", default=[],
                        help="add one scripted fault (repeatable), e.g. crash:t=30:node=n3 or "
                             "crash:after=contribute:count=7 (docs/faults.md)")
    parser.add_argument(
        "--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
        help="override one scenario value (repeatable), e.g. --set churn.crash_rate_per_hour=0.33",
    )


def run(args: argparse.Namespace) -> int:
    sc = load_scenario(args.scenario, args.overrides)
    if args.faults:  # appended to the scenario's own [[faults]]; checked like them
        sc = replace(sc, faults=sc.faults + tuple(parse_fault(f, "--fault") for f in args.faults))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise UserError("--systems is empty")
    factories = {name: get_system(name, sc.protocol) for name in systems}  # unknown system -> UserError
    if getattr(args, "compiled", False):
        if not compiled.active():
            compiled.reexec(getattr(args, "_argv", sys.argv[1:]))  # the same command on the compiled build; does not return
        print(f"gwtf: running the compiled core (build {os.environ.get(compiled.ENV_KEY, '?')})", file=sys.stderr)
    elif sc.nodes.count >= TIP_NODES:
        print(f"gwtf: tip: --compiled runs {sc.nodes.count:,} nodes 1.2-1.3x faster, with the same results "
              f"(docs/simulator.md, \"The compiled core\")", file=sys.stderr)
    out = out_folder(args.out or f"runs/sim-{sc.name}-s{args.seed}")
    built = build(sc, args.seed)  # same nodes for every system
    summaries: dict[str, dict[str, Any]] = {}
    timeline: list[dict[str, Any]] = []
    plots: dict[str, RunPlotData] = {}
    for name, system in factories.items():
        sim = Simulator(sc, args.seed, system, built)
        summaries[name] = _run_one(sim, name, sc.train.iterations, args.no_progress)
        timeline += [{"system": name, **row} for row in sim.metrics.timeline_rows()]
        plots[name] = plot_data(sim, summaries[name])
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _write_timeline(out / "timeline.csv", timeline)
    _write_resolved(sc, out / "scenario.resolved.toml")
    write_plots(out, plots)
    _print_table(summaries, out)
    return 1 if any(s["invariant_violations"] for s in summaries.values()) else 0


def _run_one(sim: Simulator, name: str, iterations: int, quiet: bool) -> dict[str, Any]:
    if quiet:
        return sim.run()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"[bold]{name}[/]"), BarColumn(), TextColumn("{task.completed}/{task.total} it"),
               TextColumn("sim {task.fields[sim_s]:.0f}s"), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(name, total=iterations, sim_s=0.0)

        def tick(done: int, sim_s: float) -> None:
            bar.update(task, completed=done, sim_s=sim_s)

        sim.on_iteration = tick
        return sim.run()


def _write_resolved(sc: ScenarioConfig, path: Path) -> None:
    """The scenario as run (faults as [[faults]] tables, which dump_toml does not write)."""
    text = "\n".join(line for line in dump_toml(replace(sc, faults=())).splitlines()
                     if not line.startswith("faults = ")) + "\n"
    for f in sc.faults:
        text += "\n[[faults]]\n" + dump_toml(f.table())
    path.write_text(text, encoding="utf-8")


def _write_timeline(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = ["system", "iteration", "start_s", "end_s", "duration_s", "microbatches", "round",
              "crashes_so_far", "dropped_so_far", "redo_so_far"]
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in fields})


def _cell(summary: dict[str, Any], key: str, kind: str) -> str:
    """One system's cell; the bound row names its binding term: "2.86 (route)"."""
    text = format_value(summary.get(key), kind)
    if kind == "b" and summary.get(key) is not None:
        text += f" ({summary.get('bound_term', '-')})"
    return text


def _print_table(summaries: dict[str, dict[str, Any]], out: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"simulation results ({out})")
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right")
    for key, label, kind in TABLE:
        table.add_row(escape(label), *(_cell(s, key, kind) for s in summaries.values()))
    console = Console()
    console.print(table)
    for name, s in summaries.items():
        for v in s.get("violations", []):
            console.print(f"[red]{name}: {v}[/]")
