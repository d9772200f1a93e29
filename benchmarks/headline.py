"""Headline benchmark: gwtf vs both SWARM variants over a documented grid, in the simulator (issue 16).

Usage: `python benchmarks/headline.py [--quick] [--seeds 5] [--iterations 120] [--jobs 2]
[--cache FILE] [--table-out FILE] [--heatmap FILE] [--out DIR] [--family F] [--churn C]
[--regime R] [--mix M] [--cells GLOB] [--list] [--set KEY=VALUE ...]`.

The grid (`grid_cells`): model family x churn x regime x GPU mix, 2 x 4 x 3 x 3 = 72 cells.
- churn (`CHURN`), crashes per node-hour 0, 0.33, 1, 2; graceful leaves per node-hour 0, 0.07,
  0.2, 0.4 (0.33/0.07 is the previous "high" level, the CheckFree rate; the others keep about
  the same 1:5 leave:crash ratio); joins arrive at the swarm-wide crash + leave rate
  (nodes x (crash + leave) per hour) so the swarm keeps its size.
- regime (`REGIMES`): "shipped" (the scenario below on the shipped defaults: int8 wire, butterfly
  reduction since 2026-12-07; fp32 + gather before, which docs/baselines.md's tables measured); "bf16"
  (activations and activation gradients bf16 on the wire, `protocol.reduce = "butterfly"`: what
  a real swarm sends); "compute" (compute-bound: `nodes.gpu_flops_scale = 0.025`,
  `nodes.link_bandwidth_scale = 10`: every GPU 40x slower, every link 10x faster; halving the
  FLOP/s from there cuts throughput to 0.58x (gwtf, GPT, uniform mix, seed 0, 10 iterations),
  so compute, not the network, sets the iteration).
- GPU mix (`MIXES`, `nodes.gpu_mix`): "uniform" (all A100), "default" (the volunteer mix),
  "half-slow" (half A100, half T4).
- systems (`SYSTEMS`): "gwtf", "swarm-released" (SWARM as its released code runs: no
  rebalancing) and "swarm" (with the SWARM paper's rebalancing every
  `protocol.swarm_rebalance_period_s` = 300 s).
- the reference ("optimum", `OptimumRouter`): the central optimum's routes
  (`gwtf.flow.optimum`) on the same instance, replayed without churn by plain nodes that follow
  them (one run per family x regime x mix x seed, shared by the cell's churn levels). It is the
  optimum of the routing objective (max flow, then min-max route cost), not of iteration time:
  it models no queueing of several microbatches on one GPU and no stage moves, so a system can
  exceed 1.0 of it (gwtf's and SWARM's stage moves change the instance it was solved on; the
  compute-bound uniform cells stack microbatches). With `--set flow.load_aware=true` the replay
  follows the load-aware optimum instead (`gwtf.flow.load_optimum`: convex node costs, the
  cost gwtf then routes by). TODO(optimum-upper-bound): a true upper bound needs the optimum
  over stage assignments too (or the routes re-solved after every move).

Every run of a (cell, seed) pair uses the same generated instance and the same churn trace
(drawn from the scenario seed before any system-specific event). Per cell and system: median
and min-max over seeds of training time and throughput, throughput as a fraction of the
optimum's (paired by seed), and gwtf's reduction in training time vs each SWARM variant
(paired by seed: (t_swarm - t_gwtf) / t_swarm).

`--cache FILE` appends one JSON line per finished run, keyed by everything that defines it (the
scenario overrides, system, seed): a rerun skips every run already in the file, so an
interrupted grid resumes. `--table-out FILE` writes the markdown table (docs/baselines.md),
`--heatmap FILE` the PNG of gwtf's median reduction, `--out DIR` results.csv and, for seed 0 of
every executed run, the simulator's plots (sim/plots.py) under DIR/<cell>/.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gwtf.config import FlowConfig, ProtocolConfig
from gwtf.flow.instance import Route
from gwtf.protocol.base import NodeId
from gwtf.protocol.ledger import Policy, TrainParams
from gwtf.protocol.messages import NONE
from gwtf.protocol.router import FlowSlot, PeerInfo, Router
from gwtf.protocol.simple_router import GreedyRouter
from gwtf.protocol.systems import System, get_system

NODES = 24
FAMILIES = ("gpt", "llama")
CHURN: dict[str, tuple[float, float]] = {  # per node per hour: (crash, graceful leave)
    "0": (0.0, 0.0),
    "0.33": (0.33, 0.07),
    "1": (1.0, 0.2),
    "2": (2.0, 0.4),
}
REGIMES: dict[str, tuple[str, ...]] = {
    "shipped": (),
    "bf16": ('wire.activations="bf16"', 'wire.gradients="bf16"', 'protocol.reduce="butterfly"'),
    "compute": ("nodes.gpu_flops_scale=0.025", "nodes.link_bandwidth_scale=10"),
}
MIXES = ("uniform", "default", "half-slow")
SYSTEMS = ("gwtf", "swarm-released", "swarm")
SWARMS = ("swarm-released", "swarm")
OPTIMUM = "optimum"
CACHE_VERSION = 2  # bump when a run's meaning changes without its overrides changing (2: the int8 + butterfly defaults)
SCENARIO = (
    'model.preset="124m"', "model.stages=4", "model.seq_len=1024", "model.microbatch_size=8",
    f"nodes.count={NODES}", "nodes.data_holders=4", 'nodes.network="geo10"', "nodes.jitter_fraction=0.1",
    "train.microbatches=8",
    # 25 MB activations over 0.3-1 Gbit/s links: acks wait seconds behind a full uplink, so the
    # deadline floors are raised for both systems (the defaults evict healthy nodes here)
    "protocol.deadline_floor_s=20", "protocol.evict_after_s=60", "protocol.suspect_after_s=30",
    "protocol.partition_timeout_s=180",
    'protocol.router="flow"', "protocol.swarm_rebalance_period_s=300",
    "sim.max_time_s=20000", "sim.progress_bound_s=3600",
)


# ---- the grid ------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Cell:
    family: str
    churn: str
    regime: str
    mix: str

    @property
    def name(self) -> str:
        return f"{self.family}/c{self.churn}/{self.regime}/{self.mix}"

    @property
    def base(self) -> Cell:
        """The same cell without churn: where its optimum runs."""
        return Cell(self.family, "0", self.regime, self.mix)


def grid_cells(families: Sequence[str] = FAMILIES, churn: Sequence[str] = tuple(CHURN),
               regimes: Sequence[str] = tuple(REGIMES), mixes: Sequence[str] = MIXES,
               patterns: Sequence[str] = ()) -> list[Cell]:
    """The cells of the grid in table order; `patterns` (fnmatch on `Cell.name`) keep a subset."""
    for what, got, known in (("family", families, FAMILIES), ("churn", churn, CHURN),
                             ("regime", regimes, REGIMES), ("mix", mixes, MIXES)):
        bad = [g for g in got if g not in known]
        if bad:
            raise SystemExit(f"unknown {what} {', '.join(bad)} (known: {', '.join(known)})")
    cells = [Cell(f, c, r, m) for f in families for r in regimes for m in mixes for c in churn]
    if patterns:
        cells = [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return cells


@dataclass(frozen=True)
class Job:
    cell: Cell
    seed: int
    system: str
    iterations: int
    extra: tuple[str, ...] = ()
    plot_dir: str = ""

    def overrides(self) -> list[str]:
        c = self.cell
        crash, leave = CHURN[c.churn]
        return [*SCENARIO, *REGIMES[c.regime], f'nodes.gpu_mix="{c.mix}"', f'model.family="{c.family}"',
                f"train.iterations={self.iterations}", f"churn.crash_rate_per_hour={crash}",
                f"churn.leave_rate_per_hour={leave}", f"churn.join_rate_per_hour={NODES * (crash + leave)}",
                f'name="{c.family}-c{c.churn}-{c.regime}-{c.mix}"', *self.extra]

    def key(self) -> str:
        """What defines the run: its full scenario, system and seed (the cache key)."""
        blob = json.dumps({"v": CACHE_VERSION, "overrides": self.overrides(), "system": self.system,
                           "seed": self.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def grid_jobs(cells: Sequence[Cell], seeds: int, iterations: int, systems: Sequence[str] = SYSTEMS,
              extra: Sequence[str] = (), plot_dir: str = "", with_optimum: bool = True) -> list[Job]:
    """Every run the cells need: each system per (cell, seed), and one optimum replay per
    (churn-free base cell, seed), listed once even when several churn levels share it."""
    jobs: list[Job] = []
    bases: dict[Cell, None] = {}
    for cell in cells:
        for seed in range(seeds):
            for system in systems:
                jobs.append(Job(cell, seed, system, iterations, tuple(extra), plot_dir if seed == 0 else ""))
        bases.setdefault(cell.base, None)
    if with_optimum:
        jobs += [Job(b, seed, OPTIMUM, iterations, tuple(extra)) for b in bases for seed in range(seeds)]
    return jobs


# ---- the cache -----------------------------------------------------------------------------


def read_cache(path: Path | None) -> dict[str, dict[str, Any]]:
    """key -> row of every complete line (a line cut short by an interrupted write is skipped)."""
    out: dict[str, dict[str, Any]] = {}
    if path is None or not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("row"), dict):
            out[rec["key"]] = rec["row"]
    return out


def append_cache(path: Path, key: str, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "row": {k: v for k, v in row.items() if k != "plot"}},
                           sort_keys=True) + "\n")
        f.flush()


def pending(jobs: Sequence[Job], cache: dict[str, dict[str, Any]]) -> list[Job]:
    return [j for j in jobs if j.key() not in cache]


# ---- the optimum replay --------------------------------------------------------------------


class OptimumRouter(GreedyRouter):
    """Follows the central optimum's routes (flow id = the route's index): a data holder owns one
    slot per route it starts and sends microbatches beyond them round-robin over its routes; a
    relay sends a microbatch of route i to the route's next node. A hop the routes cannot give
    (a dead or excluded node; never without churn) falls back to the greedy choice."""

    def __init__(self, me: PeerInfo, stages: int, activation_bytes: int, routes: Sequence[Route]) -> None:
        super().__init__(me, stages, activation_bytes)
        self.routes = [tuple(r) for r in routes]
        self._rr = 0

    def _mine(self) -> list[int]:
        return [i for i, r in enumerate(self.routes) if r[0] == self.me.id]

    def flow_slots(self, now: float) -> list[FlowSlot]:
        if self.me.stage != 0:
            return []
        return [FlowSlot(i, self.routes[i][1]) for i in self._mine()]

    def next_hop(self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId],
                 now: float) -> tuple[NodeId, int] | None:
        banned = set(exclude)
        k = self.me.stage
        if k == 0 and (flow_id == NONE or not 0 <= flow_id < len(self.routes)):
            mine = [i for i in self._mine() if self.routes[i][1] not in banned]
            if mine:
                i = mine[self._rr % len(mine)]
                self._rr += 1
                return self.routes[i][1], i
        elif 0 <= flow_id < len(self.routes) and k + 1 < self.stages:
            route = self.routes[flow_id]
            if route[k] == self.me.id and route[k + 1] not in banned and route[k + 1] in self._peers:
                return route[k + 1], flow_id
        return super().next_hop(flow_id, prev, origin, banned, now)


def optimum_system(routes: Sequence[Route]) -> System:
    """Plain nodes (no rebalancing, gwtf's recovery policy) routing along `routes`."""

    def router(me: PeerInfo, train: TrainParams, protocol: ProtocolConfig, flow: FlowConfig) -> Router:
        return OptimumRouter(me, train.stages, train.route_bytes, routes)

    return System(OPTIMUM, Policy(), router)


# ---- running -------------------------------------------------------------------------------


def run_one(job: Job) -> dict[str, Any]:
    """One run; its row (with plot data when `job.plot_dir` is set)."""
    from gwtf.flow.load_optimum import load_aware_optimum
    from gwtf.flow.optimum import optimum
    from gwtf.sim.plots import RunPlotData
    from gwtf.sim.scenario import build, load_scenario
    from gwtf.sim.simulator import Simulator

    t_job = time.perf_counter()
    sc = load_scenario(None, job.overrides())
    built = build(sc, job.seed)
    extra: dict[str, Any] = {}
    if job.system == OPTIMUM:
        t = time.perf_counter()
        if sc.flow.load_aware:  # the optimum of the cost gwtf then routes by
            lopt = load_aware_optimum(built[0])
            routes, method = lopt.routes, "load-aware-mcf"
        else:
            opt = optimum(built[0], time_limit_s=10.0)
            routes, method = opt.routes, opt.method
        system = optimum_system(routes)
        extra = {"optimum_method": method, "optimum_routes": len(routes),
                 "optimum_wall_s": round(time.perf_counter() - t, 3)}
    else:
        system = get_system(job.system, sc.protocol)
    sim = Simulator(sc, job.seed, system, built)
    joins: list[float] = []
    record = sim._record

    def on_record(node: str, rec: Any, now: float) -> None:
        if rec.event == "join":
            joins.append(now)
        record(node, rec, now)

    sim._record = on_record  # type: ignore[method-assign]
    t0 = time.perf_counter()
    s = sim.run()
    c = job.cell
    row: dict[str, Any] = {
        "key": job.key(), "family": c.family, "churn": c.churn, "regime": c.regime, "mix": c.mix,
        "seed": job.seed, "system": job.system, "iterations_target": job.iterations,
        "wall_s": round(time.perf_counter() - t0, 3), "job_wall_s": round(time.perf_counter() - t_job, 3),
        "training_time_s": s["training_time_s"], "finished": s["finished"], "iterations": s["iterations"],
        "throughput_mb_per_s": s["throughput_microbatches_per_s"], "gpu_waste": s["gpu_waste_fraction"],
        "idle": s["idle_fraction"], "discarded": s["discarded_fraction"],
        "discarded_crashed": s["discarded_crashed_fraction"], "discarded_live": s["discarded_live_fraction"], "dropped": s["microbatches_dropped"],
        "violations": s["invariant_violations"], "crashes": s["crashes"], "moves": s["counters"].get("join", 0),
        "busy_s": s["busy_s"], "discarded_s": s["discarded_s"], "stop_reason": s["stop_reason"], **extra}
    if job.plot_dir:
        row["plot"] = RunPlotData(summary=s, rows=sim.metrics.timeline_rows(),
                                  crash_times_s=tuple(sim.metrics.crash_times), join_times_s=tuple(joins))
    return row


def execute(jobs: Sequence[Job], workers: int, cache_path: Path | None,
            progress: bool = True) -> Iterator[dict[str, Any]]:
    """Rows of `jobs` as they finish, each appended to the cache file (under its job's key) first."""
    total = len(jobs)
    t0 = time.perf_counter()

    def note(i: int, job: Job, row: dict[str, Any]) -> dict[str, Any]:
        if cache_path is not None:
            append_cache(cache_path, job.key(), row)
        if progress:
            print(f"  [{i}/{total}] {job.system:<14} {job.cell.name} s{job.seed}: "
                  f"{row['training_time_s']:.0f} s sim, {row['wall_s']:.1f} s wall "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return row

    if workers > 1 and total > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_one, j): j for j in jobs}
            for i, fut in enumerate(as_completed(futures), 1):
                yield note(i, futures[fut], fut.result())
    else:
        for i, j in enumerate(jobs, 1):
            yield note(i, j, run_one(j))


# ---- summaries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    n: int

    @staticmethod
    def of(values: Iterable[float]) -> Spread:
        v = [x for x in values if not math.isnan(x)]
        if not v:
            return Spread(math.nan, math.nan, math.nan, 0)
        return Spread(statistics.median(v), min(v), max(v), len(v))

    def fmt(self, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
        """"median[suffix] [min, max]" ("-" without values, no range for one value)."""
        if self.n == 0:
            return "-"
        m, lo, hi = self.median * scale, self.lo * scale, self.hi * scale
        if self.n == 1:
            return f"{m:.{digits}f}{suffix}"
        return f"{m:.{digits}f}{suffix} [{lo:.{digits}f}, {hi:.{digits}f}]"


@dataclass(frozen=True)
class CellSummary:
    cell: Cell
    seeds: int  # seeds with a row of every system
    time: dict[str, Spread]  # system -> training time (s)
    tput: dict[str, Spread]  # system -> microbatches / s
    frac_opt: dict[str, Spread]  # system -> throughput / the optimum's (same seed)
    reduction: dict[str, Spread]  # SWARM variant -> gwtf's training-time reduction (fraction)
    discarded: Spread  # gwtf's discarded compute fraction
    split: dict[str, tuple[Spread, ...]]  # system -> discarded: all, on crashed nodes, redone on live ones
    unfinished: int  # runs (any system) that did not finish
    violations: int


SPLIT = ("discarded", "discarded_crashed", "discarded_live")
"""A run row's discarded compute: all of it, on nodes that crashed, redone on live ones."""


def _fraction(rows: Sequence[dict[str, Any]], opt: Sequence[dict[str, Any] | None]) -> Spread:
    """Throughput over the same seed's optimum replay (nan where the optimum is missing)."""
    return Spread.of(r["throughput_mb_per_s"] / o["throughput_mb_per_s"]
                     if o is not None and o["throughput_mb_per_s"] > 0 else math.nan
                     for r, o in zip(rows, opt, strict=True))


def summarize(rows: Sequence[dict[str, Any]], cells: Sequence[Cell],
              systems: Sequence[str] = SYSTEMS) -> list[CellSummary]:
    """One summary per cell that has rows; seeds are paired (a seed counts when every system ran it)."""
    by: dict[tuple[Cell, str, int], dict[str, Any]] = {}
    for r in rows:
        by[(Cell(r["family"], str(r["churn"]), r["regime"], r["mix"]), r["system"], int(r["seed"]))] = r
    out: list[CellSummary] = []
    for cell in cells:
        seeds = sorted({s for (c, sy, s) in by if c == cell and sy in systems})
        seeds = [s for s in seeds if all((cell, sy, s) in by for sy in systems)]
        if not seeds:
            continue
        got = {sy: [by[(cell, sy, s)] for s in seeds] for sy in systems}
        opt = [by.get((cell.base, OPTIMUM, s)) for s in seeds]
        red: dict[str, Spread] = {}
        if "gwtf" in got:
            for sw in (s for s in SWARMS if s in got):
                red[sw] = Spread.of((w["training_time_s"] - g["training_time_s"]) / w["training_time_s"]
                                    for g, w in zip(got["gwtf"], got[sw], strict=True))
        out.append(CellSummary(
            cell=cell, seeds=len(seeds),
            time={sy: Spread.of(float(r["training_time_s"]) for r in got[sy]) for sy in systems},
            tput={sy: Spread.of(float(r["throughput_mb_per_s"]) for r in got[sy]) for sy in systems},
            frac_opt={sy: _fraction(got[sy], opt) for sy in systems}, reduction=red,
            discarded=Spread.of(float(r["discarded"]) for r in got.get("gwtf", [])),
            split={sy: tuple(Spread.of(float(r.get(k, math.nan)) for r in got[sy])
                             for k in SPLIT) for sy in systems},
            unfinished=sum(1 for sy in systems for r in got[sy] if not r["finished"]),
            violations=sum(int(r["violations"]) for sy in systems for r in got[sy])))
    return out


SHORT = {"gwtf": "gwtf", "swarm-released": "SWARM rel.", "swarm": "SWARM reb."}


def markdown_table(summaries: Sequence[CellSummary], systems: Sequence[str] = SYSTEMS) -> str:
    """The grid as a markdown table (median [min, max] over seeds), for docs/baselines.md."""
    head = ["family", "churn /h", "regime", "GPU mix", "seeds"]
    head += [f"tput {SHORT.get(s, s)} (mb/s)" for s in systems]
    head += [f"{SHORT.get(s, s)} / optimum" for s in systems]
    head += [f"gwtf vs {SHORT.get(s, s)}" for s in SWARMS if s in systems and "gwtf" in systems]
    head += ["gwtf discarded", "unfinished", "viol."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in summaries:
        c = s.cell
        cols = [c.family, c.churn, c.regime, c.mix, str(s.seeds)]
        cols += [s.tput[sy].fmt(3) for sy in systems]
        cols += [s.frac_opt[sy].fmt(3) for sy in systems]
        cols += [s.reduction[sw].fmt(1, 100.0, "%") if sw in s.reduction else "-"
                 for sw in SWARMS if sw in systems and "gwtf" in systems]
        cols += [s.discarded.fmt(2, 100.0, "%"), str(s.unfinished), str(s.violations)]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def discarded_table(summaries: Sequence[CellSummary], systems: Sequence[str] = SYSTEMS) -> str:
    """Discarded compute per cell and system, split by where it ran (median [min, max] over the
    cell's paired seeds): on nodes that crashed (lost with the GPU) and on live nodes (what
    recovery redid). Cells whose runs predate the split (cached rows without it) are left out."""
    head = ["family", "churn /h", "regime", "GPU mix"]
    for sy in systems:
        head += [f"{SHORT.get(sy, sy)} discarded", f"{SHORT.get(sy, sy)} on crashed", f"{SHORT.get(sy, sy)} redone"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in summaries:
        if any(part.n == 0 for sy in systems for part in s.split[sy]):
            continue
        c = s.cell
        cols = [c.family, c.churn, c.regime, c.mix] + [part.fmt(2, 100.0, "%") for sy in systems for part in s.split[sy]]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_heatmap(summaries: Sequence[CellSummary], path: Path) -> None:
    """gwtf's median training-time reduction vs each SWARM variant: rows family/regime/mix,
    columns churn; red = gwtf slower."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sorted({(s.cell.family, s.cell.regime, s.cell.mix) for s in summaries},
                  key=lambda k: (FAMILIES.index(k[0]), list(REGIMES).index(k[1]), MIXES.index(k[2])))
    cols = [c for c in CHURN if any(s.cell.churn == c for s in summaries)]
    fig, axes = plt.subplots(1, len(SWARMS), figsize=(4.2 * len(SWARMS) + 1.5, 0.42 * len(rows) + 1.8),
                             squeeze=False)
    grids = {sw: np.full((len(rows), len(cols)), np.nan) for sw in SWARMS}
    unfinished = {(rows.index((s.cell.family, s.cell.regime, s.cell.mix)), cols.index(s.cell.churn))
                  for s in summaries if s.unfinished}
    for s in summaries:
        for sw, grid in grids.items():
            if sw in s.reduction and s.reduction[sw].n:
                grid[rows.index((s.cell.family, s.cell.regime, s.cell.mix)), cols.index(s.cell.churn)] = \
                    100.0 * s.reduction[sw].median
    finite = [abs(v) for g in grids.values() for v in g.flat if np.isfinite(v)]
    lim = max([5.0, *finite])  # one colour scale for both panels
    for ax, sw in zip(axes[0], SWARMS, strict=True):
        grid = grids[sw]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.1f}" + ("*" if (i, j) in unfinished else ""), ha="center", va="center",
                        fontsize=8)
        ax.set_xticks(range(len(cols)), [f"{c}/h" for c in cols])
        ax.set_yticks(range(len(rows)), ["/".join(r) for r in rows])
        ax.set_xlabel("crashes per node-hour")
        ax.set_title(f"gwtf vs {SHORT[sw]}: time reduction %", fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8)
    if unfinished:
        fig.text(0.01, 0.01, "* a run of the cell did not finish (its time is sim.max_time_s)", fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if unfinished else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_outputs(out: Path, rows: list[dict[str, Any]]) -> None:
    from gwtf.sim.plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r if k != "plot"})
    with (out / "results.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plots: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "plot" in r:
            plots.setdefault(f"{r['family']}-c{r['churn']}-{r['regime']}-{r['mix']}", {})[r["system"]] = r["plot"]
    for name, runs in plots.items():
        write_plots(out / name, runs)


def _csv(values: list[str]) -> list[str]:
    return [v for item in values for v in item.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 seed, 40 iterations, churn 0 and 0.33, shipped regime, default mix")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--family", action="append", default=[], help=f"keep these ({', '.join(FAMILIES)}); repeat or comma")
    ap.add_argument("--churn", action="append", default=[], help=f"crash rates to keep ({', '.join(CHURN)})")
    ap.add_argument("--regime", action="append", default=[], help=f"keep these ({', '.join(REGIMES)})")
    ap.add_argument("--mix", action="append", default=[], help=f"keep these ({', '.join(MIXES)})")
    ap.add_argument("--cells", action="append", default=[],
                    help="fnmatch patterns on cell names family/cCHURN/regime/mix, e.g. 'gpt/c0*/shipped/*'")
    ap.add_argument("--no-optimum", action="store_true", help="skip the optimum replays (no fraction of optimum)")
    ap.add_argument("--cache", default="", help="JSONL file of finished runs: reused, and appended to")
    ap.add_argument("--table-out", default="", help="write the markdown table here")
    ap.add_argument("--heatmap", default="", help="write the reduction heat-map PNG here")
    ap.add_argument("--out", default="", help="write results.csv and plots (seed 0 of executed runs) here")
    ap.add_argument("--list", action="store_true", help="print the runs the filters select and exit")
    ap.add_argument("--set", action="append", default=[], help="extra scenario override KEY=VALUE")
    args = ap.parse_args(argv)
    seeds = 1 if args.quick else args.seeds
    iterations = 40 if args.quick else args.iterations
    cells = grid_cells(
        _csv(args.family) or FAMILIES,
        _csv(args.churn) or (("0", "0.33") if args.quick else tuple(CHURN)),
        _csv(args.regime) or (("shipped",) if args.quick else tuple(REGIMES)),
        _csv(args.mix) or (("default",) if args.quick else MIXES),
        args.cells)
    jobs = grid_jobs(cells, seeds, iterations, extra=args.set, plot_dir=args.out, with_optimum=not args.no_optimum)
    cache_path = Path(args.cache) if args.cache else None
    cache = read_cache(cache_path)
    todo = pending(jobs, cache)
    print(f"# grid: {len(cells)} cell(s) x {seeds} seed(s), {iterations} iterations, {NODES} nodes: "
          f"{len(jobs)} runs, {len(jobs) - len(todo)} in the cache, {len(todo)} to run", flush=True)
    if args.list:
        for j in todo:
            print(f"{j.key()} {j.system} {j.cell.name} s{j.seed}")
        return 0
    t0 = time.perf_counter()
    fresh = list(execute(todo, args.jobs, cache_path))
    wall = time.perf_counter() - t0
    keys = {j.key() for j in jobs}
    rows = [r for k, r in cache.items() if k in keys] + fresh
    ran = [r["wall_s"] for r in fresh]
    print(f"# ran {len(fresh)} run(s) in {wall:.0f} s wall"
          + (f" (sim wall per run: median {statistics.median(ran):.1f} s, max {max(ran):.1f} s)" if ran else ""))
    summaries = summarize(rows, cells)
    print("# tput: microbatches/s; / optimum: throughput over the optimum's routes replayed without churn "
          "(same seed); gwtf vs X: training-time reduction; median [min, max] over seeds")
    table = markdown_table(summaries)
    print(table)
    split = discarded_table(summaries)
    if split:
        print("# discarded compute (% of compute done): all, on nodes that crashed, redone on live nodes")
        print(split)
    if args.table_out:
        Path(args.table_out).write_text(table, encoding="utf-8")
    if args.heatmap and summaries:
        write_heatmap(summaries, Path(args.heatmap))
    if args.out:
        _write_outputs(Path(args.out), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
