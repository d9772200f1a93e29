"""Settings side by side in the simulator: arms x seeds x systems on one scenario, one table.

    python benchmarks/sim_grid.py configs/scenarios/paper-gpt-high.toml --seeds 4242,1,2,3,4,5 \
        --arm 'defaults=' --arm 'delay 1=train.update_delay=1' --systems gwtf,swarm --jobs 2

An arm is `NAME=KEY=VALUE;KEY=VALUE...` (the `--set` overrides of `gwtf simulate`; empty: the
scenario as it is). Every (arm, seed, system) is one `run_scenario`; results go to `--cache`
(JSON lines keyed by scenario, arm overrides, seed, system), so an interrupted grid resumes and
a finished one prints at once. The table: per arm and system, the training time of each seed,
the median ratio to the first arm (same seed: the same nodes and churn trace), the median
achieved / bound ratio (`summary.json`'s `achieved_over_bound`), the median idle GPU share,
and the invariant violations summed. Benchmarks are not tests: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def _run(job: tuple[str, list[str], int, str]) -> dict[str, Any]:
    from gwtf.sim.scenario import load_scenario
    from gwtf.sim.simulator import run_scenario

    path, overrides, seed, system = job
    summary, _ = run_scenario(load_scenario(path, overrides), seed, system)
    keep = ("training_time_s", "iterations", "finished", "invariant_violations", "achieved_over_bound",
            "bound_s", "bound_term", "idle_fraction", "throughput_tokens_per_s", "crashes")
    return {k: summary.get(k) for k in keep}


def _key(path: str, overrides: list[str], seed: int, system: str) -> str:
    return json.dumps([Path(path).name, overrides, seed, system])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--arm", action="append", default=[], help="NAME=KEY=VALUE;KEY=VALUE (repeatable)")
    ap.add_argument("--systems", default="gwtf")
    ap.add_argument("--set", action="append", default=[], help="an override for every arm")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cache", default="sim_grid.jsonl")
    args = ap.parse_args(argv)
    arms: list[tuple[str, list[str]]] = []
    for spec in args.arm or ["defaults="]:
        name, _, sets = spec.partition("=")
        arms.append((name, [s for s in sets.split(";") if s] + list(args.set)))
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = args.systems.split(",")
    cache_path = Path(args.cache)
    cache: dict[str, dict[str, Any]] = {}
    if cache_path.is_file():
        for line in cache_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                cache[row["key"]] = row["result"]
    jobs = [(args.scenario, sets, seed, system) for _, sets in arms for seed in seeds for system in systems]
    todo = [j for j in jobs if _key(*j) not in cache]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool, cache_path.open("a", encoding="utf-8") as sink:
        for job, result in zip(todo, pool.map(_run, todo), strict=True):
            cache[_key(*job)] = result
            sink.write(json.dumps({"key": _key(*job), "result": result}) + "\n")
            sink.flush()
            print(f"done {job[1]} seed {job[2]} {job[3]}: {result['training_time_s']}", file=sys.stderr)
    base = arms[0][1]
    print(f"{args.scenario}, seeds {args.seeds}")
    print("| arm | system | time (s) per seed | vs first arm (median) | achieved / bound (median) | idle GPU (median) | violations |")
    print("|---|---|---|---|---|---|---|")
    for name, sets in arms:
        for system in systems:
            rows = [cache[_key(args.scenario, sets, s, system)] for s in seeds]
            firsts = [cache[_key(args.scenario, base, s, system)] for s in seeds]
            times = [r["training_time_s"] for r in rows]
            ratio = statistics.median(f["training_time_s"] / r["training_time_s"] for f, r in zip(firsts, rows, strict=True))
            bound = statistics.median(r["achieved_over_bound"] or float("nan") for r in rows)
            idle = statistics.median(r["idle_fraction"] for r in rows)
            unfinished = sum(1 for r in rows if not r["finished"])
            cell = ", ".join(f"{t:.0f}" for t in times) + (f" ({unfinished} unfinished)" if unfinished else "")
            print(f"| {name} | {system} | {cell} | {ratio:.2f} | {bound:.2f} | {100 * idle:.1f}% | "
                  f"{sum(r['invariant_violations'] for r in rows)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
