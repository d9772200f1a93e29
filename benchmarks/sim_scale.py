"""Simulator scale: events, wall and CPU time, events/s and peak memory of one scenario, per variant,
or against another revision (`--against`, the speed guard of issue 45).

Usage: `python benchmarks/sim_scale.py [SCENARIO.toml | --scenario configs/scenarios/scale-1k.toml]
[--iterations 2] [--seed 1] [--variants scenario,fixed-tick,greedy,view-32,all-peers] [--set K=V ...]`
or `python benchmarks/sim_scale.py SCENARIO.toml --against REV [--seed 0] [--systems gwtf]
[--repeat 2] [--iterations N] [--set K=V ...] [--compiled]`.

`--against REV` (docs/simulator.md "Guarding speed"): `gwtf simulate SCENARIO.toml --no-progress`
as a user runs it (each run in its own process, output into a temporary folder) on the working
tree's code and on REV's (a detached `git worktree` under /tmp, removed at the end), alternating
tree, REV, tree, REV, ... for `--repeat` rounds on the same box. Printed: per side the median wall
seconds of the whole command (start-up and plots included), the peak RSS of its process
(`os.wait4`'s ru_maxrss), and per system the simulator's events, the virtual training time and
the iterations of summary.json; and the ratios REV / tree (wall > 1: the working tree is faster;
events != 1: the change runs a different number of events). A bad REV or scenario: one line, exit 2.
`--compiled`: the working tree's runs take `gwtf simulate --compiled` (`gwtf.commands.compiled`; the
build is made first, untimed); REV runs its Python source as before. `--tree-set K=V`: an
override for the working tree's runs only (a key REV does not have).

Without `--against`, each variant runs the same scenario and seed in its own process (so peak
RSS is its own) with a few overrides:
- `scenario`: the file as it is (the scale scenarios turn on the flow protocol's quiet-tick
  back-off and advert hysteresis, docs/flow-protocol.md);
- `fixed-tick`: gwtf's flow router with a fixed tick and exact adverts (`flow.tick_max_s = 0`,
  `flow.advert_tolerance = 0`, the defaults of every other scenario);
- `greedy`: the greedy router (no routing protocol traffic at all), a floor for the training
  protocol's own cost;
- `view-32` / `all-peers`: routers see ~32 peers of each neighbouring stage / all of them
  (`protocol.view_size`, docs/protocol.md "Bounded views"; both scale scenarios ship with 32).
`--rev REV` (e.g. `--rev HEAD~5`) also runs every variant on that git revision's code (exported
to a temporary folder, on PYTHONPATH), alternating old and new, so a refactoring's effect on
simulator speed is measured side by side in one run (`old/new` rows).
Ratios are against the first variant. The machine may be shared: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = ROOT / "configs" / "scenarios" / "scale-1k.toml"
VARIANT_DEFAULT = "scenario,fixed-tick,greedy"
VARIANTS = {
    "scenario": [],
    "fixed-tick": ["flow.tick_max_s=0.0", "flow.advert_tolerance=0.0"],
    "greedy": ['protocol.router="greedy"'],
    "view-32": ["protocol.view_size=32"],
    "all-peers": ["protocol.view_size=0"],
}
CHILD = r"""
import json, resource, sys, time
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario
path, seed, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
sc = load_scenario(path, overrides)
w0, c0 = time.perf_counter(), time.process_time()
summary, _ = run_scenario(sc, seed)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
print(json.dumps({"events": summary["events"], "wall_s": wall, "cpu_s": cpu,
                  "sim_time_s": summary.get("training_time_s"), "finished": summary.get("finished"),
                  "violations": summary.get("invariant_violations"),
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def run_variant(scenario: str, iterations: int, seed: int, extra: list[str], src: Path | None = None) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, scenario, str(seed), f"train.iterations={iterations}", *extra]
    env = dict(os.environ, PYTHONPATH=str(src or ROOT / "src"))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def export_rev(rev: str, into: Path) -> Path:
    """`git archive` of rev's src/ into `into`; returns its src folder."""
    tar = into / "src.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(tar), rev, "src"], check=True, cwd=ROOT)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


# ---- --against REV: `gwtf simulate` on the working tree and on REV, alternating ----------------


class Refused(Exception):
    """A mistake of the user's (bad REV, missing scenario, bad flag): one line, exit 2."""


@dataclass
class Side:
    """One code base: its label, its src folder (PYTHONPATH) and what its runs measured."""

    label: str
    src: Path
    walls: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)  # summary.json of the last run
    events_seen: set[tuple[int, ...]] = field(default_factory=set)  # per run: events per system


def git(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True)


def resolve_rev(rev: str) -> str:
    """The commit REV names, or Refused."""
    r = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if r.returncode != 0 or not r.stdout.strip():
        raise Refused(f"--against {rev!r}: not a git revision of {ROOT}")
    return r.stdout.strip()


def simulate_once(side: Side, cmd_args: list[str], out: Path, cwd: Path) -> None:
    """One `python -m gwtf simulate ... --out OUT` on `side`'s code, in its own process: wall time
    of the whole command, the child's peak RSS (os.wait4) and its summary.json."""
    cmd = [sys.executable, "-m", "gwtf", "simulate", *cmd_args, "--no-progress", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(side.src), MPLBACKEND="Agg")
    with tempfile.TemporaryFile(mode="w+") as err:  # a file, not a pipe: wait4 cannot deadlock on it
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = [ln for ln in err.read().splitlines() if ln.strip()]
    summary_path = out / "summary.json"
    # exit 1 with a summary: invariant violations (the table shows them); anything else is a failure
    if child.returncode not in (0, 1) or not summary_path.exists():
        why = lines[-1] if lines else f"exit {child.returncode}"
        msg = f"{side.label}: `gwtf simulate` failed: {why}"
        if child.returncode == 2:  # gwtf's UserError: a bad scenario value or flag
            raise Refused(msg)
        raise RuntimeError(msg + f"\n  command: PYTHONPATH={side.src} {shlex.join(cmd)}")
    side.walls.append(wall)
    side.rss_mb.append(usage.ru_maxrss / 1024)  # Linux: kilobytes
    side.summary = json.loads(summary_path.read_text(encoding="utf-8"))
    side.events_seen.add(tuple(int(v["events"]) for _, v in sorted(side.summary.items())))


def against(args: argparse.Namespace, scenario: Path) -> None:
    if args.repeat < 1:
        raise Refused(f"--repeat {args.repeat}: must be at least 1")
    if args.variants != VARIANT_DEFAULT or args.rev:
        raise Refused("--against runs `gwtf simulate` as is: --variants and --rev are for the variant table")
    commit = resolve_rev(args.against)
    seed = 0 if args.seed is None else args.seed
    sets = [*args.overrides, *([f"train.iterations={args.iterations}"] if args.iterations is not None else [])]
    cmd_args = [str(scenario), "--seed", str(seed), "--systems", args.systems]
    for kv in sets:
        cmd_args += ["--set", kv]
    tmp = Path(tempfile.mkdtemp(prefix="sim_scale-"))
    tree_dir = tmp / "rev"
    added = False
    try:
        r = git("worktree", "add", "--detach", str(tree_dir), commit)
        if r.returncode != 0:
            raise RuntimeError(f"git worktree add {args.against}: {r.stderr.strip()}")
        added = True
        if not (tree_dir / "src" / "gwtf" / "commands" / "simulate.py").exists():
            raise Refused(f"--against {args.against}: that revision has no `gwtf simulate` (src/gwtf/commands/simulate.py)")
        tree, rev = Side("working tree", ROOT / "src"), Side(f"{args.against} ({commit[:7]})", tree_dir / "src")
        tree_args = [*cmd_args, *(a for kv in args.tree_overrides for a in ("--set", kv))]
        if args.compiled:  # the working tree on its compiled core, built before any run is timed
            tree.label, tree_args = "working tree, --compiled", [*tree_args, "--compiled"]
            build = subprocess.run([sys.executable, "-c", "from gwtf.commands.compiled import ensure_build; ensure_build()"],
                                   env=dict(os.environ, PYTHONPATH=str(tree.src)), capture_output=True, text=True)
            if build.returncode != 0:
                raise Refused(f"--compiled: {(build.stderr.strip().splitlines() or ['the build failed'])[-1]}")
        for k in range(args.repeat):
            for side in (tree, rev):
                out = tmp / f"out-{'tree' if side is tree else 'rev'}-{k}"
                simulate_once(side, tree_args if side is tree else cmd_args, out, tmp)
                print(f"  round {k + 1}/{args.repeat}, {side.label}: {side.walls[-1]:.2f} s wall", file=sys.stderr)
    finally:
        if added:
            r = git("worktree", "remove", "--force", str(tree_dir))
            if r.returncode != 0:
                print(f"sim_scale: could not remove the worktree {tree_dir}: {r.stderr.strip()}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    print_against(args, scenario, seed, sets, tree, rev)


def _ratio(new: float | None, old: float | None, fmt: str = ".2f") -> str:
    if new is None or old is None or not new:
        return "-"
    return format(old / new, fmt)


def print_against(args: argparse.Namespace, scenario: Path, seed: int, sets: list[str], tree: Side, rev: Side) -> None:
    where = f", --set {' '.join(sets)}" if sets else ""
    where += f"; working tree also --set {' '.join(args.tree_overrides)}" if args.tree_overrides else ""
    print(f"\n{scenario.name}, seed {seed}, --systems {args.systems}{where}; {args.repeat} round(s), "
          f"alternating working tree / {rev.label}\n")
    print(f"| metric | {tree.label} | {rev.label} | {args.against} / tree |")
    print("|---|---|---|---|")
    med = [statistics.median(s.walls) for s in (tree, rev)]
    each = [" ".join(f"{w:.2f}" for w in s.walls) for s in (tree, rev)]
    rss = [max(s.rss_mb) for s in (tree, rev)]
    print(f"| wall, median [s] | {med[0]:.2f} | {med[1]:.2f} | {_ratio(med[0], med[1])} |")
    print(f"| wall, each run [s] | {each[0]} | {each[1]} | |")
    print(f"| peak RSS [MB] | {rss[0]:.0f} | {rss[1]:.0f} | {_ratio(rss[0], rss[1])} |")
    rows = (("events", "events [count]", "n"), ("training_time_s", "virtual training time [s]", "s"),
            ("iterations", "iterations [count]", "n"), ("invariant_violations", "invariant violations [count]", "n"))
    for system in sorted(set(tree.summary) | set(rev.summary)):
        a, b = tree.summary.get(system, {}), rev.summary.get(system, {})
        for key, label, kind in rows:
            x, y = a.get(key), b.get(key)
            cell = [("-" if v is None else f"{v:,}" if kind == "n" else f"{v:,.2f}") for v in (x, y)]
            ratio = _ratio(x, y, ".4f" if key == "events" else ".2f") if key in ("events", "training_time_s") else ""
            print(f"| {system}: {label} | {cell[0]} | {cell[1]} | {ratio} |")
    # every system's events over the command's wall time (start-up and plots included)
    rates = [sum(int(v.get("events") or 0) for v in s.summary.values()) / m for s, m in zip((tree, rev), med)]
    print(f"| events/s of wall, all systems [count/s] | {rates[0]:,.0f} | {rates[1]:,.0f} | "
          f"{_ratio(rates[0], rates[1])} |")
    for s in (tree, rev):
        if len(s.events_seen) > 1:  # a run is deterministic: this would be a bug of its own
            print(f"\nwarning: {s.label}'s runs differ in events: {sorted(s.events_seen)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario_file", nargs="?", metavar="SCENARIO.toml", help="scenario (same as --scenario)")
    ap.add_argument("--scenario", default="", help=f"scenario (default {DEFAULT_SCENARIO.relative_to(ROOT)})")
    ap.add_argument("--iterations", type=int, default=None,
                    help="train.iterations (variants: default 2; --against: the scenario's own)")
    ap.add_argument("--seed", type=int, default=None, help="seed (variants: default 1; --against: default 0)")
    ap.add_argument("--variants", default=VARIANT_DEFAULT)
    ap.add_argument("--rev", default="", help="also run every variant on this git revision's code")
    ap.add_argument("--against", metavar="REV", default="",
                    help="run `gwtf simulate` on the working tree and on REV, alternating, side by side")
    ap.add_argument("--systems", default="gwtf", help="--against: `gwtf simulate --systems` (default gwtf)")
    ap.add_argument("--tree-set", dest="tree_overrides", metavar="K=V", action="append", default=[],
                    help="--against: an override for the working tree only (a key REV does not know, e.g. "
                         "wire.stage_gradients=\"fp32\" to pin today's defaults to an older revision's)")
    ap.add_argument("--compiled", action="store_true",
                    help="--against: the working tree runs `gwtf simulate --compiled` (its build made before timing)")
    ap.add_argument("--repeat", type=int, default=2, help="--against: rounds of (tree, REV) (default 2)")
    ap.add_argument("--set", dest="overrides", metavar="K=V", action="append", default=[],
                    help="scenario override (repeatable), as `gwtf simulate --set`")
    args = ap.parse_args()
    try:
        if args.scenario_file and args.scenario:
            raise Refused("give the scenario once: SCENARIO.toml or --scenario")
        scenario = Path(args.scenario_file or args.scenario or DEFAULT_SCENARIO).resolve()
        if not scenario.is_file():
            raise Refused(f"no scenario file {args.scenario_file or args.scenario}")
        if args.against:
            against(args, scenario)
        else:
            variants(args, str(scenario))
    except Refused as e:
        print(f"sim_scale: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a failed run of either side: what it said, and the command
        print(f"sim_scale: {e}", file=sys.stderr)
        return 1
    return 0


def variants(args: argparse.Namespace, scenario: str) -> None:
    iterations = 2 if args.iterations is None else args.iterations
    seed = 1 if args.seed is None else args.seed
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise Refused(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    if args.rev:
        resolve_rev(args.rev)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = export_rev(args.rev, Path(tmp)) if args.rev else None
        for name in names:
            codes: list[tuple[str, Path | None]] = [(name, None)]
            if old is not None:
                codes = [(f"{name} ({args.rev})", old), (f"{name} (working tree)", None)]
            for label, src in codes:
                r = run_variant(scenario, iterations, seed, [*VARIANTS[name], *args.overrides], src)
                rows.append((label, r))
                print(f"  {label}: {r['events']:,} events in {r['wall_s']:.1f} s", file=sys.stderr)
    base = rows[0][1]
    print(f"\n{Path(scenario).name}, seed {seed}, {iterations} iterations\n")
    print("| variant | events | wall s | CPU s | events/s (CPU) | virtual s | peak RSS GB | violations | wall ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        rate = r["events"] / max(r["cpu_s"], 1e-9)
        print(f"| {name} | {r['events']:,} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {rate:,.0f} | "
              f"{r['sim_time_s']:.0f} | {r['rss_gb']:.2f} | {r['violations']} | {r['wall_s'] / base['wall_s']:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
