"""Routing quality of gwtf's decentralized flow protocol against the central optimum and baselines.

For every size N (and its stated stage / data-holder shape) and every seed: generate the geo10
instance, solve the optimum, run the protocol in the routing-only simulator until its objective
settles (flow and max route cost stable for 20 ticks; --stop-when routes: no route changes at
all) or the virtual time limit, score SWARM and greedy, then crash 10% of the relays and let the
protocol re-converge. Prints one table per size and the targets:
flow equal to the optimum on >= 95% of instances, median max-route-cost ratio <= 1.05,
re-convergence within 60 virtual s.

    .venv/bin/python benchmarks/routing_quality.py                      # all sizes, 5 seeds
    .venv/bin/python benchmarks/routing_quality.py --sizes 24 60 --seeds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from gwtf.commands.route import compare
from gwtf.config import Config, load_config
from gwtf.flow.generate import generate_instance

# N -> (stages incl. stage 0, data holders): ~5% data holders, 3 to 7 relay stages
SHAPES: dict[int, tuple[int, int]] = {24: (4, 4), 60: (6, 6), 200: (8, 16), 1000: (8, 40)}


def one(n: int, seed: int, cfg: Config, crash: float, time_limit_s: float, network: str,
        stop_when: str = "objective") -> dict[str, Any]:
    stages, dhs = SHAPES.get(n, (max(3, min(8, n // 25)), max(2, n // 25)))
    inst = generate_instance(n, stages, dhs, network=network, seed=seed)
    t0 = time.perf_counter()
    res = compare(inst, cfg, seed, crash_fraction=crash, time_limit_s=time_limit_s, stop_when=stop_when)
    res["n"], res["seed"], res["stages"], res["data_holders"] = n, seed, stages, dhs
    res["wall_s"] = time.perf_counter() - t0
    return res


def _ratio(r: dict[str, Any], ref: dict[str, Any]) -> float:
    return r["max_route_cost_s"] / ref["max_route_cost_s"] if ref["max_route_cost_s"] else 1.0


def _med(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]" if xs else "-"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    opt = [r["optimal"] for r in rows]
    g = [r["gwtf"] for r in rows]
    out: dict[str, Any] = {
        "instances": len(rows),
        "flow_equal": sum(a["flow"] == o["flow"] for a, o in zip(g, opt)),
        "gwtf_flow_ratio": [a["flow"] / o["flow"] for a, o in zip(g, opt)],
        "gwtf_max_ratio": [_ratio(a, o) for a, o in zip(g, opt)],
        "swarm_max_ratio": [_ratio(r["swarm"], r["optimal"]) for r in rows],
        "greedy_max_ratio": [_ratio(r["greedy"], r["optimal"]) for r in rows],
        "swarm_flow_ratio": [r["swarm"]["flow"] / r["optimal"]["flow"] for r in rows],
        "converged": sum(a["converged"] for a in g),
        "converged_at_s": [a["converged_at_s"] for a in g],
        "routes_changed_at_s": [a["routes_changed_at_s"] for a in g],
        "flow_reached_at_s": [a["flow_reached_at_s"] for a in g],
        "messages_per_node": [a["messages_per_node"] for a in g],
        "wall_s": [a["wall_s"] for a in g],
    }
    crashed = [r["gwtf_after_crash"] for r in rows if "gwtf_after_crash" in r]
    if crashed:
        out["crash_flow_equal"] = sum(c["flow"] == c["optimal_flow"] for c in crashed)
        out["crash_max_ratio"] = [
            c["max_route_cost_s"] / c["optimal_max_route_cost_s"] if c["optimal_max_route_cost_s"] else 1.0
            for c in crashed
        ]
        out["crash_flow_restored_at_s"] = [c["flow_restored_at_s"] for c in crashed]
        out["crash_reconverged_at_s"] = [c["reconverged_at_s"] for c in crashed]
    return out


def print_summary(n: int, rows: list[dict[str, Any]], s: dict[str, Any]) -> None:
    r0 = rows[0]
    print(f"\nN={n}  S={r0['stages']}  D={r0['data_holders']}  seeds={len(rows)}  "
          f"(optimum: {', '.join(sorted({r['optimal']['method'] for r in rows}))})")
    lines = [
        ("gwtf flow == optimum", f"{s['flow_equal']}/{s['instances']}"),
        ("gwtf flow / optimum", _med(s["gwtf_flow_ratio"])),
        ("gwtf max cost / optimum", _med(s["gwtf_max_ratio"])),
        ("swarm max cost / optimum", _med(s["swarm_max_ratio"])),
        ("swarm flow / optimum", _med(s["swarm_flow_ratio"])),
        ("greedy max cost / optimum", _med(s["greedy_max_ratio"])),
        ("gwtf converged (objective stable 20 ticks)", f"{s['converged']}/{s['instances']}"),
        ("gwtf optimum flow reached at (virtual s)", _med(s["flow_reached_at_s"])),
        ("gwtf objective settled at (virtual s)", _med(s["converged_at_s"])),
        ("gwtf last route change (virtual s)", _med(s["routes_changed_at_s"])),
        ("gwtf messages per node", _med(s["messages_per_node"])),
        ("gwtf wall s (protocol run)", _med(s["wall_s"])),
    ]
    if "crash_flow_equal" in s:
        lines += [
            ("after 10% crash: flow == new optimum", f"{s['crash_flow_equal']}/{s['instances']}"),
            ("after crash: max cost / new optimum", _med(s["crash_max_ratio"])),
            ("after crash: optimum flow back at (virtual s)", _med(s["crash_flow_restored_at_s"])),
            ("after crash: objective settled at (virtual s)", _med(s["crash_reconverged_at_s"])),
        ]
    for k, v in lines:
        print(f"  {k:<46} {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=sorted(SHAPES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--crash-fraction", type=float, default=0.1)
    ap.add_argument("--time-limit-s", type=float, default=600.0, help="virtual seconds per protocol run")
    ap.add_argument("--network", default="geo10")
    ap.add_argument("--stop-when", choices=["objective", "routes"], default="objective",
                    help="objective: flow and max route cost stable; routes: no route changes at all")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, e.g. flow.tick_s=2")
    ap.add_argument("--json", metavar="PATH", help="also write every row and summary as JSON")
    args = ap.parse_args(argv)
    cfg = load_config(None, args.overrides)
    report: dict[str, Any] = {"rows": [], "summary": {}}
    all_rows: list[dict[str, Any]] = []
    for n in args.sizes:
        rows = []
        for seed in range(args.seeds):
            row = one(n, seed, cfg, args.crash_fraction, args.time_limit_s, args.network, args.stop_when)
            rows.append(row)
            print(f"  N={n} seed={seed}: flow {row['gwtf']['flow']}/{row['optimal']['flow']} "
                  f"max x{_ratio(row['gwtf'], row['optimal']):.3f}  wall {row['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        summary = summarize(rows)
        print_summary(n, rows, summary)
        report["summary"][str(n)] = summary
        all_rows += rows
    report["rows"] = all_rows
    total = len(all_rows)
    equal = sum(r["gwtf"]["flow"] == r["optimal"]["flow"] for r in all_rows)
    ratios = [_ratio(r["gwtf"], r["optimal"]) for r in all_rows]
    recon = [r["gwtf_after_crash"]["flow_restored_at_s"] for r in all_rows if "gwtf_after_crash" in r]
    print(f"\ntargets: flow == optimum on {equal}/{total} = {equal / total:.0%} (target >= 95%); "
          f"median max-cost ratio {statistics.median(ratios):.3f} (target <= 1.05); "
          f"optimum flow back after crash within 60 virtual s on "
          f"{sum(x is not None and x <= 60 for x in recon)}/{len(recon)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
