"""Simulator scale: events, wall and CPU time, events/s and peak memory of one scenario, per variant.

Usage: `python benchmarks/sim_scale.py [--scenario configs/scenarios/scale-1k.toml]
[--iterations 2] [--seed 1] [--variants scenario,fixed-tick,greedy,view-32,all-peers]`.

Each variant runs the same scenario and seed in its own process (so peak RSS is its own) with a
few overrides:
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
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "configs" / "scenarios" / "scale-1k.toml"))
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="scenario,fixed-tick,greedy")
    ap.add_argument("--rev", default="", help="also run every variant on this git revision's code")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = export_rev(args.rev, Path(tmp)) if args.rev else None
        for name in names:
            codes: list[tuple[str, Path | None]] = [(name, None)]
            if old is not None:
                codes = [(f"{name} ({args.rev})", old), (f"{name} (working tree)", None)]
            for label, src in codes:
                r = run_variant(args.scenario, args.iterations, args.seed, VARIANTS[name], src)
                rows.append((label, r))
                print(f"  {label}: {r['events']:,} events in {r['wall_s']:.1f} s", file=sys.stderr)
    base = rows[0][1]
    print(f"\n{Path(args.scenario).name}, seed {args.seed}, {args.iterations} iterations\n")
    print("| variant | events | wall s | CPU s | events/s (CPU) | virtual s | peak RSS GB | violations | wall ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        rate = r["events"] / max(r["cpu_s"], 1e-9)
        print(f"| {name} | {r['events']:,} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {rate:,.0f} | "
              f"{r['sim_time_s']:.0f} | {r['rss_gb']:.2f} | {r['violations']} | {r['wall_s'] / base['wall_s']:.2f} |")


if __name__ == "__main__":
    main()
