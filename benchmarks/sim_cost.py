"""Where a simulated event's wall time goes: the protocol core (NodeCore) or the simulator driving it.

Usage: `python benchmarks/sim_cost.py [--scenario configs/scenarios/scale-1k.toml] [--warmup 10]
[--iterations 10] [--seed 1] [--top 15]`.

Three child processes run the same scenario and seed to the end of iteration `--warmup` (setup and
flow establishment excluded), then time the next `--iterations` iterations:
- `plain` (twice, before and after `split`; the faster one counts): nothing added, the simulator as
  `gwtf simulate` runs it;
- `split`: every NodeCore entry point the simulator calls (`on_message`, `on_timer`,
  `on_compute_done`, `on_send_failed`) is timed, per event kind (message class, timer key, compute
  kind).

A run is deterministic, so all three run the very same events. Printed: the plain run's wall
time per event; the protocol core's share of it (inside those entry points: handlers, flow router,
ledger, effect construction); the rest, which is the driver (event heap, network and compute
models, applying effects, invariant checker, metrics); and the events/s the simulator would reach
if the driver cost nothing, the ceiling of any driver-only speed-up. The driver row is a
difference between two processes: expect it to move by 20% from one run to the next on a shared
box; the core row moves less. Then the event kinds that cost the most core time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import gc, json, sys, time
from gwtf.sim.scenario import load_scenario
from gwtf.protocol.systems import get_system
from gwtf.sim.simulator import Simulator, _quiet_gc
mode, path = sys.argv[1], sys.argv[2]
seed, warmup, iterations = (int(a) for a in sys.argv[3:6])
sc = load_scenario(path, [f"train.iterations={warmup + iterations + 1}"])
sim = Simulator(sc, seed, get_system("gwtf", sc.protocol))
pc = time.perf_counter
cost, count = {}, {}

def timed(orig, kind_of):
    def entry(self, *args):
        k = kind_of(self, args)  # before the call: on_compute_done pops the job it names
        t = pc()
        try:
            return orig(self, *args)
        finally:
            cost[k] = cost.get(k, 0.0) + pc() - t
            count[k] = count.get(k, 0) + 1
    return entry

def timer_kind(self, a):
    key = a[0]
    return "timer " + (":".join(map(str, key[:2])) if key[0] in ("flow", "swarm") else str(key[0]))

with _quiet_gc():  # the GC settings of Simulator.run
    sim.start()
    gc.freeze()
    limit = sc.sim.max_time_s
    sim.engine.run(until_s=limit, stop=lambda: sim._iterations_done >= warmup)
    if mode == "split":
        cls = type(next(iter(sim.cores.values())))
        cls.on_message = timed(cls.on_message, lambda self, a: type(a[1]).__name__)
        cls.on_timer = timed(cls.on_timer, timer_kind)
        cls.on_compute_done = timed(cls.on_compute_done,
                                    lambda self, a: "compute " + self.jobs.get(a[0], ("?",))[0])
        cls.on_send_failed = timed(cls.on_send_failed, lambda self, a: "send_failed " + type(a[1]).__name__)
    e0, w0 = sim.engine.events_run, pc()
    sim.engine.run(until_s=limit, stop=lambda: sim._iterations_done >= warmup + iterations)
    wall = pc() - w0
print(json.dumps({"events": sim.engine.events_run - e0, "wall_s": wall, "cost": cost, "count": count,
                  "virtual_s": sim.engine.now, "iterations": sim._iterations_done}))
"""


def run_child(mode: str, scenario: str, seed: int, warmup: int, iterations: int) -> dict:
    cmd = [sys.executable, "-c", CHILD, mode, scenario, str(seed), str(warmup), str(iterations)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "configs" / "scenarios" / "scale-1k.toml"))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if not Path(args.scenario).is_file():
        ap.error(f"no scenario file {args.scenario}")
    # plain, split, plain: the faster plain run is the one compared (noise here is mostly slow-downs)
    runs = [run_child(mode, args.scenario, args.seed, args.warmup, args.iterations)
            for mode in ("plain", "split", "plain")]
    split = runs[1]
    plain = min(runs[0], runs[2], key=lambda r: r["wall_s"])
    if len({r["events"] for r in runs}) != 1:
        sys.exit(f"the runs differ ({[r['events'] for r in runs]} events): not deterministic")
    n = plain["events"]
    core_s = sum(split["cost"].values())
    us = 1e6 / n
    w = plain["wall_s"]
    driver_s = max(w - core_s, 0.0)
    first, last = args.warmup + 1, args.warmup + args.iterations
    print(f"\n{Path(args.scenario).name}, seed {args.seed}, iterations {first}..{last} ({n:,} events, "
          f"{split['virtual_s']:.0f} virtual s at the end)\n")
    print("| | wall s | us/event | share | events/s |")
    print("|---|---|---|---|---|")
    print(f"| simulator as run (plain) | {w:.2f} | {w * us:.2f} | 100% | {n / w:,.0f} |")
    print(f"| protocol core (NodeCore entry points, split run) | {core_s:.2f} | {core_s * us:.2f} | "
          f"{100 * core_s / w:.0f}% | {n / core_s:,.0f} (ceiling: driver at zero cost) |")
    print(f"| driver (the rest of the plain run) | {driver_s:.2f} | {driver_s * us:.2f} | "
          f"{100 * driver_s / w:.0f}% | |")
    print(f"| split run, timers included | {split['wall_s']:.2f} | {split['wall_s'] * us:.2f} | | |")
    print(f"\nCore time by event kind (top {args.top}):\n")
    print("| kind | events | share of events | core us/event | share of core time |")
    print("|---|---|---|---|---|")
    for k, c in sorted(split["cost"].items(), key=lambda kv: -kv[1])[: args.top]:
        cnt = split["count"][k]
        print(f"| {k} | {cnt:,} | {100 * cnt / n:.1f}% | {1e6 * c / cnt:.1f} | {100 * c / core_s:.1f}% |")


if __name__ == "__main__":
    main()
