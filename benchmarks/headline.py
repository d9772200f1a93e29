"""Headline benchmark: gwtf vs the SWARM baseline in the simulator (DESIGN.md 6, PAPER.md 6).

Usage: `python benchmarks/headline.py [--quick] [--seeds 5] [--iterations 120] [--jobs 2]
[--out DIR] [--set KEY=VALUE ...]`.

For each model family (GPT-like, LLaMA-like) and churn level (none / low / high) and seed, both
systems run the same scenario: the same generated instance (nodes, regions, GPUs) and the same
churn trace (crash / leave / join times and victims are drawn from the scenario seed, identical
for both systems because they come from the simulator's seeded rng before any system-specific
event). Printed: the mean over seeds of training time (both, and gwtf's reduction in %),
throughput (both, and gwtf's gain in %), GPU waste and discarded compute of both, microbatches
dropped, invariant violations. `--out DIR` also writes results.csv and, for the first seed of
every scenario, the simulator plots (sim/plots.py) under DIR/<scenario>/.

The scenario (below, SCENARIO) is the paper's setting as far as it is known: heterogeneous nodes
in the 10-region AWS table (geo10), a 124M-parameter model cut in 4 stages, 4 data holders.
Churn levels per node and hour follow the CheckFree failure rates (PAPER.md 6.3): low 10 %/h,
high 33 %/h crashes, plus graceful leaves, with joins arriving at the swarm-wide crash+leave
rate so the swarm keeps its size. Deadline knobs are the same for both systems (see docs/baselines.md).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from gwtf.protocol.systems import System, get_system
from gwtf.sim.plots import RunPlotData, write_plots
from gwtf.sim.scenario import ScenarioConfig, load_scenario
from gwtf.sim.simulator import Simulator

SYSTEMS = ("gwtf", "swarm")
FAMILIES = ("gpt", "llama")
NODES = 24
CHURN: dict[str, tuple[float, float]] = {  # per node per hour: (crash, graceful leave)
    "none": (0.0, 0.0),
    "low": (0.10, 0.02),
    "high": (0.33, 0.07),
}
SCENARIO = [
    'model.preset="124m"', "model.stages=4", "model.seq_len=1024", "model.microbatch_size=8",
    f"nodes.count={NODES}", "nodes.data_holders=4", 'nodes.network="geo10"', "nodes.jitter_fraction=0.1",
    "train.microbatches=8",
    # 25 MB activations over 0.3-1 Gbit/s links: acks wait seconds behind a full uplink, so the
    # deadline floors are raised for both systems (the defaults evict healthy nodes here)
    "protocol.deadline_floor_s=20", "protocol.evict_after_s=60", "protocol.suspect_after_s=30",
    "protocol.partition_timeout_s=180",
    'protocol.router="flow"', "protocol.swarm_rebalance_period_s=300",
    "sim.max_time_s=20000", "sim.progress_bound_s=3600",
]


def scenario_overrides(family: str, churn: str, iterations: int, extra: list[str]) -> list[str]:
    crash, leave = CHURN[churn]
    joins = NODES * (crash + leave)
    return [*SCENARIO, f'model.family="{family}"', f"train.iterations={iterations}",
            f"churn.crash_rate_per_hour={crash}", f"churn.leave_rate_per_hour={leave}",
            f"churn.join_rate_per_hour={joins}", f'name="{family}-{churn}"', *extra]


def system_for(name: str, sc: ScenarioConfig) -> System:
    """The named system (a joiner's placeholder router before it picks a stage is
    `gwtf.protocol.systems.build_core`'s)."""
    return get_system(name, sc.protocol)


def run_one(job: tuple[str, str, int, str, int, list[str], str]) -> dict[str, Any]:
    """One (family, churn, seed, system) run; writes plots for it when `plot_dir` is set."""
    family, churn, seed, system, iterations, extra, plot_dir = job
    sc = load_scenario(None, scenario_overrides(family, churn, iterations, extra))
    sim = Simulator(sc, seed, system_for(system, sc))
    joins: list[float] = []
    record = sim._record

    def on_record(node: str, rec: Any, now: float) -> None:
        if rec.event == "join":
            joins.append(now)
        record(node, rec, now)

    sim._record = on_record  # type: ignore[method-assign]
    t0 = time.perf_counter()
    s = sim.run()
    row = {"family": family, "churn": churn, "seed": seed, "system": system, "wall_s": time.perf_counter() - t0,
           "training_time_s": s["training_time_s"], "finished": s["finished"], "iterations": s["iterations"],
           "throughput_mb_per_s": s["throughput_microbatches_per_s"], "gpu_waste": s["gpu_waste_fraction"],
           "discarded": s["discarded_fraction"], "dropped": s["microbatches_dropped"],
           "violations": s["invariant_violations"], "crashes": s["crashes"],
           "moves": s["counters"].get("join", 0), "busy_s": s["busy_s"], "discarded_s": s["discarded_s"]}
    if plot_dir:
        row["plot"] = RunPlotData(summary=s, rows=sim.metrics.timeline_rows(),
                                  crash_times_s=tuple(sim.metrics.crash_times), join_times_s=tuple(joins))
    return row


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(float(r[key]) for r in rows) if rows else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<12}{'time gwtf':>10}{'time swarm':>11}{'reduct.':>8}{'tput gwtf':>10}{'tput swarm':>11}"
            f"{'gain':>7}{'waste g/s':>14}{'discard g/s':>14}{'dropped g/s':>12}{'viol g/s':>9}{'crash':>6}")
    lines = [head, "-" * len(head)]
    for family in FAMILIES:
        for churn in CHURN:
            g = [r for r in rows if (r["family"], r["churn"], r["system"]) == (family, churn, "gwtf")]
            w = [r for r in rows if (r["family"], r["churn"], r["system"]) == (family, churn, "swarm")]
            if not g or not w:
                continue
            tg, tw = _mean(g, "training_time_s"), _mean(w, "training_time_s")
            pg, pw = _mean(g, "throughput_mb_per_s"), _mean(w, "throughput_mb_per_s")
            lines.append(
                f"{family + '-' + churn:<12}{tg:>10.0f}{tw:>11.0f}{100 * (tw - tg) / tw:>7.1f}%{pg:>10.3f}{pw:>11.3f}"
                f"{100 * (pg - pw) / pw:>6.1f}%{_mean(g, 'gpu_waste'):>7.3f}/{_mean(w, 'gpu_waste'):.3f}"
                f"{_mean(g, 'discarded'):>7.3f}/{_mean(w, 'discarded'):.3f}"
                f"{sum(r['dropped'] for r in g):>6}/{sum(r['dropped'] for r in w):<5}"
                f"{sum(r['violations'] for r in g):>4}/{sum(r['violations'] for r in w):<4}"
                f"{_mean(g, 'crashes'):>6.1f}")
    unfinished = [r for r in rows if not r["finished"]]
    lines.append(f"runs: {len(rows)}, unfinished: {len(unfinished)} "
                 + " ".join(f"{r['system']}:{r['family']}-{r['churn']}-s{r['seed']}" for r in unfinished))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 40 iterations: a smoke run")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out", default="", help="write results.csv and plots here")
    ap.add_argument("--set", action="append", default=[], help="extra scenario override KEY=VALUE")
    args = ap.parse_args(argv)
    seeds = 1 if args.quick else args.seeds
    iterations = 40 if args.quick else args.iterations
    jobs = [(f, c, seed, system, iterations, list(args.set), args.out if seed == 0 else "")
            for f in FAMILIES for c in CHURN for seed in range(seeds) for system in SYSTEMS]
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_one, jobs))
    else:
        rows = [run_one(j) for j in jobs]
    print(f"# gwtf vs SWARM: {seeds} seed(s) x {len(FAMILIES)} families x {len(CHURN)} churn levels, "
          f"{iterations} iterations, {NODES} nodes; wall {time.perf_counter() - t0:.0f} s")
    print("# time: training time (s, mean over seeds); tput: microbatches/s; reduct./gain: gwtf vs SWARM")
    print(table(rows))
    if args.out:
        _write_outputs(Path(args.out), rows)
    return 0


def _write_outputs(out: Path, rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = [k for k in rows[0] if k != "plot"]
    with (out / "results.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    for family in FAMILIES:
        for churn in CHURN:
            runs = {r["system"]: r["plot"] for r in rows
                    if "plot" in r and (r["family"], r["churn"]) == (family, churn)}
            write_plots(out / f"{family}-{churn}", runs)


if __name__ == "__main__":
    sys.exit(main())
