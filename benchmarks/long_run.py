"""Long runs under churn: one scenario for a fixed number of virtual hours, per seed (issue 42, item 6).

Usage: `python benchmarks/long_run.py [--scenario configs/scenarios/paper-gpt-high.toml]
[--hours 48] [--seeds 0 1 2] [--crash-rate 1.0 [--join-rate R]] [--set k=v ...] [--out DIR]`.

Each run is gwtf (`--system`) on the scenario with `sim.max_time_s` = the hours and an iteration
count no run can reach in them (`train.iterations` must be >= 1: the config has no "unlimited";
one iteration per 15 virtual seconds is the bound used, the paper scenarios take ~30 s each), so
it ends at the horizon. `--crash-rate C` overrides `churn.crash_rate_per_hour`; the joins then
default to the matching rate, C x `nodes.count` per hour (as many joins as crashes, the
scenario's steady state: 0.33 x 48 ~ the paper's 16/h). `--set` overrides go last and win.

An observing `Simulator` subclass (public `crash`/`leave`/`join` and the `_record` feed, plus the
`on_iteration` hook; the simulator's own code is unchanged) writes one time series per run:
- live nodes per role after every change: data holders (active stage-0 members), relays
  (active members of stages >= 1), joiners pending (alive, not yet active members);
- microbatches of every completed iteration (full batch = `nodes.data_holders` x microbatches);
- churn events: crashes (with the role of the crashed node, and whether it led), graceful
  leaves, arrivals of new nodes, joins (a joiner's first activation, with its role) and moves.
The checker reports a run that ends before its iterations with every stage alive as a
"deadlock"; at the horizon that is the benchmark's planned end, so it is left out of the
violations shown (a stall before it is still one: `no_progress`). The simulator runs no model:
there is no loss to plot, and none is shown.

Outputs, one set per scenario / churn / hours / seed in `--out` (default benchmarks/results/
long_run/): NAME.csv (the time series), NAME.json (the run's summary), NAME.png (three panels).
A run whose CSV and JSON exist is not run again (`--rerun`: run it on the code as it is now); the
table is computed from those files. The JSON names the code that ran (`long_run.code`: HEAD, plus
a digest of the uncommitted changes under src/).
Run at most one at a time on a shared machine (`nice -n 10`): 48 virtual hours of
paper-gpt-high take 9-11 CPU minutes, 24 hours at 1 crash/node-h ~5.5 (docs/long-runs.md).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # runnable without an installed gwtf

from gwtf.protocol.kinds import RecordName  # noqa: E402
from gwtf.protocol.messages import Record  # noqa: E402
from gwtf.protocol.systems import get_system  # noqa: E402
from gwtf.sim.scenario import ScenarioConfig, load_scenario  # noqa: E402
from gwtf.sim.simulator import Simulator  # noqa: E402

DEFAULT_SCENARIO = ROOT / "configs" / "scenarios" / "paper-gpt-high.toml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "long_run"
MIN_ITERATION_S = 15.0  # train.iterations = hours / this: more than any run completes
FIELDS = ("time_s", "event", "data_holders", "relays", "joiners", "moving", "iteration", "microbatches",
          "node", "role", "stage", "leader")
ROLE_EVENTS = frozenset({RecordName.ACTIVATED, RecordName.STAGE_MOVE, RecordName.SWARM_MOVE,
                         RecordName.SELF_STOP})
"""Records after which a node's role may have changed (activation, a rebalancing move, a self-stop)."""
NO_LOSS = "no loss: the simulator runs no model (compute and bytes only)"


class ObservedSimulator(Simulator):
    """A Simulator that also writes the long-run time series (`self.series`, FIELDS rows)."""

    def __init__(self, sc: ScenarioConfig, seed: int, system: str) -> None:
        super().__init__(sc, seed, get_system(system, sc.protocol))
        self.series: list[dict[str, Any]] = []
        self.roles = (0, 0, 0, 0)
        self.untracked = 0  # role changes first seen at an iteration's end (a cause not watched here)
        self.activated: set[str] = set()
        self.on_iteration = self._iteration
        self.violation_kinds: dict[str, int] = {}  # all of them by kind (the checker keeps the first 50)
        violate = self.checker.violate

        def counted(text: str) -> None:
            kind = text.split(":", 1)[0]
            self.violation_kinds[kind] = self.violation_kinds.get(kind, 0) + 1
            violate(text)

        self.checker.violate = counted  # type: ignore[method-assign]

    def count_roles(self) -> tuple[int, int, int, int]:
        """(data holders, relays, joiners pending, members moving) among the live nodes: a member
        moving to another stage (rebalancing) is inactive until it is activated there."""
        dh = relays = joiners = moving = 0
        for node, core in self.cores.items():
            if not core.alive:
                continue
            if not core.active:
                if node.startswith("j") and node not in self.activated:
                    joiners += 1
                else:
                    moving += 1
            elif core.me.stage == 0:
                dh += 1
            else:
                relays += 1
        return dh, relays, joiners, moving

    def role_of(self, node: str) -> tuple[str, bool]:
        """(role, leads): "joiner" for any node that is not an active member (a mover too)."""
        core = self.cores[node]
        if not core.active:
            return "joiner", False
        return ("data_holder" if core.me.stage == 0 else "relay"), bool(core.is_leader)

    def emit(self, event: str, **fields: Any) -> None:
        self.roles = self.count_roles()
        dh, relays, joiners, moving = self.roles
        self.series.append({"time_s": round(self.engine.now, 3), "event": event, "data_holders": dh,
                            "relays": relays, "joiners": joiners, "moving": moving, **fields})

    def start(self) -> None:
        super().start()
        self.emit("start")

    def crash(self, node: str) -> None:
        if node in self.cores:
            role, leader = self.role_of(node)
            super().crash(node)
            self.emit("crash", node=node, role=role, leader=int(leader))

    def leave(self, node: str) -> None:
        if node in self.cores:
            role, leader = self.role_of(node)
            super().leave(node)
            self.emit("leave", node=node, role=role, leader=int(leader))

    def join(self) -> None:
        before = self._joins
        super().join()
        if self._joins != before and f"j{self._joins}" in self.cores:
            self.emit("arrive", node=f"j{self._joins}", role="joiner")

    def _record(self, node: str, rec: Record, now: float) -> None:
        super()._record(node, rec, now)
        if rec.event not in ROLE_EVENTS:
            return
        if rec.event == RecordName.ACTIVATED:
            stage = int(dict(rec.fields).get("stage", -1))
            first = node not in self.activated and node.startswith("j")  # a joiner's own activation
            self.activated.add(node)  # (before emit: it counts as a member from now on)
            self.emit("join" if first else "moved", node=node, stage=stage,
                      role="data_holder" if stage == 0 else "relay")
        elif self.count_roles() != self.roles:
            self.emit("roles", node=node)

    def _iteration(self, done: int, now: float) -> None:
        if self.count_roles() != self.roles:
            self.untracked += 1
            self.emit("roles")
        row = self.metrics.rows[-1]
        self.emit("iteration", iteration=row["iteration"], microbatches=row["microbatches"])


# ---- one run -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    scenario: Path
    hours: float
    seed: int
    crash_rate: float | None
    join_rate: float | None
    sets: tuple[str, ...]
    system: str = "gwtf"

    def overrides(self) -> list[str]:
        """The scenario overrides of this run: horizon, iterations, churn, then --set (they win)."""
        horizon_s = self.hours * 3600.0
        out = [f"sim.max_time_s={horizon_s}", f"train.iterations={math.ceil(horizon_s / MIN_ITERATION_S)}"]
        if self.crash_rate is not None:
            count = load_scenario(self.scenario, list(self.sets)).nodes.count
            join = self.join_rate if self.join_rate is not None else self.crash_rate * count
            out += [f"churn.crash_rate_per_hour={self.crash_rate}", f"churn.join_rate_per_hour={join}"]
        elif self.join_rate is not None:
            out.append(f"churn.join_rate_per_hour={self.join_rate}")
        return out + list(self.sets)

    def name(self, sc: ScenarioConfig) -> str:
        c = sc.churn
        tag = f"{sc.name}-c{c.crash_rate_per_hour:g}-j{c.join_rate_per_hour:g}-{self.hours:g}h-s{self.seed}"
        if self.sets or self.system != "gwtf":
            tag += "-" + hashlib.sha1(repr((self.sets, self.system)).encode()).hexdigest()[:8]
        return tag


def run_one(spec: RunSpec, out: Path, code: str, rerun: bool = False) -> Path:
    """Run `spec` unless its CSV and JSON are in `out` (or `rerun`); returns the path stem of its
    files. `code`: what `code_version()` said when this process imported gwtf."""
    sc = load_scenario(spec.scenario, spec.overrides())
    stem = out / spec.name(sc)
    if not rerun and _file(stem, "csv").exists() and _file(stem, "json").exists():
        print(f"cached: {stem.name}", flush=True)
        return stem
    print(f"running: {stem.name} ({spec.hours:g} virtual h)", flush=True)
    sim = ObservedSimulator(sc, spec.seed, spec.system)
    w0, c0 = time.perf_counter(), time.process_time()
    summary = sim.run()
    wall_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
    sim.emit("end")
    covered = {c.me.stage for c in sim.cores.values() if c.active}
    extra = {"scenario": sc.name, "seed": spec.seed, "hours": spec.hours, "system": spec.system,
             "overrides": spec.overrides(), "crash_rate_per_hour": sc.churn.crash_rate_per_hour,
             "join_rate_per_hour": sc.churn.join_rate_per_hour, "data_holders_target": sc.nodes.data_holders,
             "full_batch": sc.nodes.data_holders * (sc.nodes.demand_per_dh or sc.train.microbatches),
             "stage_lost_at_end": sim.stage_lost or len(covered) < sim.train.stages,
             "violation_kinds": dict(sorted(sim.violation_kinds.items())),
             "violations_kept": sim.checker.violations, "untracked_role_changes": sim.untracked,
             "code": code, "wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1)}
    _write_csv(_file(stem, "csv"), sim.series)
    _file(stem, "json").write_text(json.dumps({**summary, "long_run": extra}, indent=2, sort_keys=True)
                                         + "\n", encoding="utf-8")
    print(f"done: {stem.name} in {wall_s:.0f} s wall, {cpu_s:.0f} s CPU", flush=True)
    return stem


def code_version() -> str:
    """HEAD and a digest of the uncommitted changes under src/ (the code a run ran)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "src"], cwd=ROOT, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + (f"+diff:{hashlib.sha1(diff).hexdigest()[:10]}" if diff else "")


def horizon_end(summary: dict[str, Any]) -> bool:
    """The run stopped at its horizon, unfinished, with no allowed stop reason: the checker then
    counted one "deadlock" violation for it (`InvariantChecker.finish`), the planned end here."""
    lr = summary["long_run"]
    return (not summary["finished"] and not summary["stop_reason"]
            and summary["training_time_s"] >= lr["hours"] * 3600.0 - 1e-3)


def _file(stem: Path, ext: str) -> Path:
    return stem.parent / f"{stem.name}.{ext}"  # not with_suffix: a name has dots ("c0.33")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.parent / (path.name + ".tmp")  # renamed when complete: a killed run leaves no cached CSV
    with tmp.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in FIELDS})
    os.replace(tmp, path)


# ---- reading a run back --------------------------------------------------------------------


def read_run(stem: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with _file(stem, "csv").open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["time_s"] = float(r["time_s"])
        for k in ("data_holders", "relays", "joiners", "moving"):
            r[k] = int(r[k])
    return rows, json.loads(_file(stem, "json").read_text(encoding="utf-8"))


def dh_recoveries(rows: list[dict[str, Any]], target: int) -> tuple[list[float], int]:
    """Per data-holder crash: seconds until the data holder count is back at `target` (or above);
    and how many crashes it never came back from before the run ended."""
    back: list[float] = []
    never = 0
    for i, r in enumerate(rows):
        if r["event"] != "crash" or r["role"] != "data_holder":
            continue
        t = next((q["time_s"] for q in rows[i:] if q["data_holders"] >= target), None)
        if t is None:
            never += 1
        else:
            back.append(t - r["time_s"])
    return back, never


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def run_stats(stem: Path) -> dict[str, Any]:
    rows, summary = read_run(stem)
    lr = summary["long_run"]
    its = [r for r in rows if r["event"] == "iteration"]
    full = sum(1 for r in its if int(r["microbatches"]) >= lr["full_batch"])
    back, never = dh_recoveries(rows, lr["data_holders_target"])
    planned = horizon_end(summary)
    if summary["finished"]:
        end = "finished"
    elif planned:
        end = "horizon, a stage lost" if lr.get("stage_lost_at_end") else "horizon"
    else:
        end = summary["stop_reason"] or "deadlock"
    return {
        "run": f"{lr['scenario']} c={lr['crash_rate_per_hour']:g}/h j={lr['join_rate_per_hour']:g}/h s{lr['seed']}",
        "hours": lr["hours"], "reached_h": its[-1]["time_s"] / 3600 if its else 0.0, "iterations": len(its),
        "end": end, "violations": summary["invariant_violations"] - int(planned), "full_pct": 100 * full / len(its) if its else 0.0,
        "crashes": sum(1 for r in rows if r["event"] == "crash"),
        "dh_crashes": sum(1 for r in rows if r["event"] == "crash" and r["role"] == "data_holder"),
        "leader_crashes": sum(1 for r in rows if r["event"] == "crash" and r["leader"] == "1"),
        "back_median_s": statistics.median(back) if back else None,
        "back_p90_s": _pct(back, 0.9) if back else None, "back_max_s": max(back) if back else None,
        "never_back": never, "cpu_min": lr["cpu_s"] / 60,
    }


COLUMNS = (("run", "run", "{}"), ("hours", "horizon [h]", "{:g}"), ("reached_h", "last iteration [h]", "{:.1f}"),
           ("iterations", "iterations", "{:,}"), ("end", "end", "{}"), ("violations", "violations", "{}"),
           ("full_pct", "full batch [% of it.]", "{:.1f}"), ("crashes", "crashes", "{}"),
           ("dh_crashes", "DH crashes (leader)", "{}"), ("back_median_s", "DH back: median [s]", "{:.0f}"),
           ("back_p90_s", "p90 [s]", "{:.0f}"), ("back_max_s", "max [s]", "{:.0f}"),
           ("never_back", "never back", "{}"), ("cpu_min", "CPU [min]", "{:.1f}"))


def violation_note(stem: Path) -> str:
    """The run's violations by kind (all counted; older caches: the kinds of the 10 the summary keeps)."""
    summary = read_run(stem)[1]
    name = f"{stem.name} [code {summary['long_run'].get('code') or '?'}]"
    kinds = dict(summary["long_run"].get("violation_kinds", {}))
    if horizon_end(summary) and kinds.get("deadlock"):
        kinds["deadlock"] -= 1  # the horizon's (see horizon_end)
    kinds = {k: n for k, n in kinds.items() if n}
    if "violation_kinds" not in summary["long_run"]:
        kept = [v.split(":", 1)[0] for v in summary["violations"] if not v.startswith("deadlock:")]
        kinds = {k: kept.count(k) for k in sorted(set(kept))}
        return f"{name}: first kept: " + (", ".join(f"{k} {n}" for k, n in kinds.items()) or "-")
    return f"{name}: " + (", ".join(f"{k} {n}" for k, n in kinds.items()) or "none")


def table(stats: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per run."""
    lines = ["| " + " | ".join(label for _, label, _ in COLUMNS) + " |",
             "|" + "|".join("---" if k == "run" else "---:" for k, _, _ in COLUMNS) + "|"]
    for s in stats:
        cells = []
        for key, _, fmt in COLUMNS:
            v = s[key]
            cell = "-" if v is None else fmt.format(v)
            if key == "dh_crashes":
                cell = f"{v} ({s['leader_crashes']})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- plot ----------------------------------------------------------------------------------


def plot_run(stem: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows, summary = read_run(stem)
    lr = summary["long_run"]
    h = [r["time_s"] / 3600 for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    for key, label, color in (("data_holders", "data holders (stage 0)", "tab:blue"),
                              ("relays", "relays (stages >= 1)", "tab:orange"),
                              ("joiners", "joiners pending", "tab:green"),
                              ("moving", "members moving stage (rebalancing)", "tab:gray")):
        ax1.step(h, [r[key] for r in rows], where="post", label=label, color=color, lw=0.8)
    ax1.axhline(lr["data_holders_target"], color="tab:blue", ls=":", lw=0.8, label="data holder target")
    ax1.set_ylabel("live nodes")
    ax1.set_ylim(0, 1.3 * max(max(r["relays"], r["data_holders"]) for r in rows) + 1)  # room for the legend
    ax1.legend(loc="upper center", ncol=3, fontsize=8)
    its = [r for r in rows if r["event"] == "iteration"]
    ax2.plot([r["time_s"] / 3600 for r in its], [int(r["microbatches"]) for r in its], ".", ms=2, color="tab:blue")
    ax2.axhline(lr["full_batch"], color="gray", ls=":", lw=0.8, label=f"full batch ({lr['full_batch']})")
    ax2.set_ylabel("microbatches / iteration")
    ax2.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.legend(loc="lower right", fontsize=8)
    ax2.text(0.01, 0.04, NO_LOSS, transform=ax2.transAxes, fontsize=8, color="dimgray")
    _plot_events(ax3, rows)
    ax3.set_xlabel("virtual time [h]")
    s = run_stats(stem)
    fig.suptitle(f"{s['run']}, {lr['hours']:g} h: {s['iterations']:,} iterations, end: {s['end']}, "
                 f"{s['violations']} violations, {s['full_pct']:.1f}% of iterations at the full batch", fontsize=10)
    fig.tight_layout()
    png = _file(stem, "png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _plot_events(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Cumulative churn events by kind and role."""
    kinds = (("crash", "data_holder", "crashed: data holder", "tab:red", "-"),
             ("crash", "relay", "crashed: relay", "tab:orange", "-"),
             ("crash", "joiner", "crashed: not an active member (joiner, moving)", "tab:brown", "-"),
             ("arrive", "joiner", "arrived (joiners)", "tab:gray", "--"),
             ("join", "data_holder", "joined as data holder", "tab:blue", "--"),
             ("join", "relay", "joined as relay", "tab:green", "--"))
    end_h = rows[-1]["time_s"] / 3600
    for event, role, label, color, ls in kinds:
        ts = [r["time_s"] / 3600 for r in rows if r["event"] == event and r["role"] == role]
        if ts:
            ax.step([0.0, *ts, end_h], [*range(len(ts) + 1), len(ts)], where="post", label=f"{label} ({len(ts)})",
                    color=color, ls=ls, lw=1)
    ax.set_ylabel("events so far")
    ax.legend(loc="upper left", fontsize=8)


# ---- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO, help="scenario file (default: %(default)s)")
    ap.add_argument("--hours", type=float, default=48.0, help="virtual hours per run (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds, one run each (default: 0 1 2)")
    ap.add_argument("--crash-rate", type=float, default=None, metavar="C",
                    help="churn.crash_rate_per_hour (per node); joins default to C x nodes.count per hour")
    ap.add_argument("--join-rate", type=float, default=None, metavar="R", help="churn.join_rate_per_hour (swarm-wide)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="scenario override (repeatable), applied last")
    ap.add_argument("--system", default="gwtf", help="system every node runs (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="cache folder (default: %(default)s)")
    ap.add_argument("--rerun", action="store_true", help="run again even if the cache has the run (new code)")
    args = ap.parse_args(argv)
    code = code_version()  # gwtf is imported already: the tree as of now is the code that runs
    if args.hours <= 0:
        ap.error("--hours must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    stats, stems = [], []
    for seed in args.seeds:
        spec = RunSpec(args.scenario, args.hours, seed, args.crash_rate, args.join_rate, tuple(args.sets), args.system)
        stem = run_one(spec, args.out, code, args.rerun)
        if args.rerun or not _file(stem, "png").exists():
            plot_run(stem)
        stats.append(run_stats(stem))
        stems.append(stem)
    print(table(stats))
    print("violations by kind:")
    for stem in stems:
        print("  " + violation_note(stem))
    print(f"({NO_LOSS}. DH back: seconds from a data-holder crash until the data holder count is back "
          "at its target; never back: not by the end of the run; violations leave out the checker's "
          "'deadlock' for a run that reaches the horizon with every stage alive)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
