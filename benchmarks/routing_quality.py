"""Routing quality of gwtf's decentralized flow protocol against the central optimum and baselines.

For every size N (and its stated stage / data-holder shape) and every seed: generate the instance
on --network, solve the optimum, run the protocol in the routing-only simulator until its
objective settles (flow and max route cost stable for 20 ticks; --stop-when routes: no route
changes at all) or the virtual time limit, score SWARM and greedy, then crash 10% of the relays
and let the protocol re-converge (scored when it settles and 60 virtual s after the crash).
`--instances DIR` adds every .json / .toml instance file in DIR (docs/routing.md, "Instance
files"), each run once per seed (the seed drives the protocol). Prints one table per size (and
one for the instance files) with the median, p90 and max of each ratio (p90: linear
interpolation; the flow ratio also shows its min, its bad side) and the targets: flow equal to
the optimum on >= 95% of instances, median max-route-cost ratio <= 1.05, and 60 virtual s after
the crash the survivors' optimum flow with a max route cost within 10% of their optimum's.

    .venv/bin/python benchmarks/routing_quality.py                      # all sizes, seeds 0-4
    .venv/bin/python benchmarks/routing_quality.py --sizes 24 60 --seeds 1001-1010 --network geo12
    .venv/bin/python benchmarks/routing_quality.py --instances my-instances/ --seeds 1,5,9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gwtf.commands.route import compare
from gwtf.config import Config, load_config
from gwtf.errors import UserError
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance
from gwtf.flow.instance_file import load_instance

# N -> (stages incl. stage 0, data holders): ~5% data holders, 3 to 7 relay stages
SHAPES: dict[int, tuple[int, int]] = {24: (4, 4), 60: (6, 6), 200: (8, 16), 1000: (8, 40)}


def one(n: int, seed: int, cfg: Config, crash: float, time_limit_s: float, network: str,
        stop_when: str = "objective") -> dict[str, Any]:
    stages, dhs = SHAPES.get(n, (max(3, min(8, n // 25)), max(2, n // 25)))
    inst = generate_instance(n, stages, dhs, network=network, seed=seed)
    return run_instance(inst, seed, cfg, crash, time_limit_s, stop_when)


def run_instance(inst: Instance, seed: int, cfg: Config, crash: float, time_limit_s: float,
                 stop_when: str = "objective") -> dict[str, Any]:
    t0 = time.perf_counter()
    res = compare(inst, cfg, seed, crash_fraction=crash, time_limit_s=time_limit_s, stop_when=stop_when)
    res["n"], res["seed"], res["stages"] = len(inst.nodes), seed, inst.stages
    res["data_holders"] = len(inst.by_stage[0])
    res["wall_s"] = time.perf_counter() - t0
    return res


def parse_seeds(text: str) -> list[int]:
    """'1001-1010', '1,5,9' or a mix ('0-4,9'): the seeds in the order given, duplicates dropped."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            span = range(int(lo), int(hi) + 1) if sep else range(int(lo), int(lo) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seeds: {part!r} is not a seed or a range a-b") from None
        if not span:
            raise argparse.ArgumentTypeError(f"--seeds: empty range {part!r}")
        seeds += [x for x in span if x not in seeds]
    return seeds


def instance_files(folder: str) -> list[Path]:
    """Every .json / .toml file in `folder`, sorted by name."""
    d = Path(folder)
    if not d.is_dir():
        raise UserError(f"--instances {folder}: not a directory")
    files = sorted(p for p in d.iterdir() if p.suffix in (".json", ".toml") and p.is_file())
    if not files:
        raise UserError(f"--instances {folder}: no .json or .toml instance file in it")
    return files


def _ratio(r: dict[str, Any], ref: dict[str, Any]) -> float:
    return r["max_route_cost_s"] / ref["max_route_cost_s"] if ref["max_route_cost_s"] else 1.0


def _med(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]" if xs else "-"


def _tail(xs: list[float], low_too: bool = False) -> str:
    """median / p90 / max of a ratio (and its min when low values are the bad side)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    p90 = float(np.percentile(xs, 90))
    text = f"median {statistics.median(xs):.3f}  p90 {p90:.3f}  max {max(xs):.3f}"
    return text + (f"  min {min(xs):.3f}" if low_too else "")


def _check_ratio(c: dict[str, Any], ref: str = "optimal_max_route_cost_s") -> float:
    """Max route cost `check_s` after the crash / the survivors' optimum (or its lower bound)."""
    return c["max_route_cost_at_check_s"] / c[ref] if c[ref] else 1.0


def _reconverged(c: dict[str, Any]) -> bool:
    """The re-convergence target: `check_s` (60 virtual s) after the crash, the flow is the
    survivors' optimum and the max route cost within 10% of their optimum's."""
    return c["flow_at_check"] == c["optimal_flow"] and _check_ratio(c) <= 1.10 + 1e-9


def _lb_ratio(r: dict[str, Any], ref: dict[str, Any]) -> float:
    lb = ref["lower_bound_max_route_cost_s"]
    return r["max_route_cost_s"] / lb if lb else 1.0


def _worst_over_served(r: dict[str, Any], ref: dict[str, Any]) -> bool:
    """The data holder of the costliest route starts more microbatches than in the optimum: the
    bottleneck's slots went to a data holder farther from it (seed 2002, geo12, N=60: the
    Australian data holder takes 4 slots of the two Canadian stage-2 relays, the optimum none)."""
    dh = r.get("worst_data_holder")
    return dh is not None and r["flow_by_data_holder"][dh] > ref["flow_by_data_holder"].get(dh, 0)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    opt = [r["optimal"] for r in rows]
    g = [r["gwtf"] for r in rows]
    out: dict[str, Any] = {
        "instances": len(rows),
        "flow_equal": sum(a["flow"] == o["flow"] for a, o in zip(g, opt)),
        "gwtf_flow_ratio": [a["flow"] / o["flow"] for a, o in zip(g, opt)],
        "gwtf_max_ratio": [_ratio(a, o) for a, o in zip(g, opt)],
        "gwtf_lb_ratio": [_lb_ratio(a, o) for a, o in zip(g, opt)],
        "gwtf_worst_dh_over_served": sum(_worst_over_served(a, o) for a, o in zip(g, opt)),
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
        out["crash_check_max_ratio"] = [_check_ratio(c) for c in crashed]
        out["crash_check_lb_ratio"] = [_check_ratio(c, "optimal_lower_bound_max_route_cost_s") for c in crashed]
        out["crash_check_ok"] = sum(_reconverged(c) for c in crashed)
    return out


def print_summary(title: str, rows: list[dict[str, Any]], s: dict[str, Any]) -> None:
    print(f"\n{title}  runs={len(rows)}  "
          f"(optimum: {', '.join(sorted({r['optimal']['method'] for r in rows}))})")
    lines = [
        ("gwtf flow == optimum", f"{s['flow_equal']}/{s['instances']}"),
        ("gwtf flow / optimum", _tail(s["gwtf_flow_ratio"], low_too=True)),
        ("gwtf max cost / optimum", _tail(s["gwtf_max_ratio"])),
        ("gwtf max cost / certified lower bound", _tail(s["gwtf_lb_ratio"])),
        ("gwtf worst route's data holder over-served", f"{s['gwtf_worst_dh_over_served']}/{s['instances']}"),
        ("swarm max cost / optimum", _tail(s["swarm_max_ratio"])),
        ("swarm flow / optimum", _tail(s["swarm_flow_ratio"], low_too=True)),
        ("greedy max cost / optimum", _tail(s["greedy_max_ratio"])),
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
            ("after crash: max cost / new optimum", _tail(s["crash_max_ratio"])),
            ("after crash: optimum flow back at (virtual s)", _med(s["crash_flow_restored_at_s"])),
            ("after crash: objective settled at (virtual s)", _med(s["crash_reconverged_at_s"])),
            ("after crash, at 60 s: max cost / new optimum", _tail(s["crash_check_max_ratio"])),
            ("after crash, at 60 s: max cost / lower bound", _tail(s["crash_check_lb_ratio"])),
            ("after crash, at 60 s: flow == and max <= 1.10x", f"{s['crash_check_ok']}/{s['instances']}"),
        ]
    for k, v in lines:
        print(f"  {k:<46} {v}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+",
                    help=f"N values (default {' '.join(map(str, sorted(SHAPES)))}; none with --instances)")
    ap.add_argument("--seeds", type=parse_seeds,
                    help="seeds: a list and/or ranges, e.g. 1001-1010 or 1,5,9 (default 0-4; 0 with --instances)")
    ap.add_argument("--instances", metavar="DIR", help="also run every .json / .toml instance file in DIR")
    ap.add_argument("--crash-fraction", type=float, default=0.1)
    ap.add_argument("--time-limit-s", type=float, default=600.0, help="virtual seconds per protocol run")
    ap.add_argument("--network", default="geo10", help="region table of the generated instances: geo10 or geo12")
    ap.add_argument("--stop-when", choices=["objective", "routes"], default="objective",
                    help="objective: flow and max route cost stable; routes: no route changes at all")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, e.g. flow.tick_s=2")
    ap.add_argument("--json", metavar="PATH", help="also write every row and summary as JSON")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [] if args.instances else sorted(SHAPES)
    if args.seeds is None:
        args.seeds = [0] if args.instances and not args.sizes else list(range(5))
    return args


Job = tuple[str, int, Callable[[], Instance]]  # (label, seed, make the instance)


def _groups(args: argparse.Namespace) -> list[tuple[str, list[Job]]]:
    """(title, jobs) per size, then one group for the instance files (each file once per seed)."""
    out: list[tuple[str, list[Job]]] = []
    for n in args.sizes:
        stages, dhs = SHAPES.get(n, (max(3, min(8, n // 25)), max(2, n // 25)))
        jobs: list[Job] = [
            (f"N={n} seed={seed}", seed,
             partial(generate_instance, n, stages, dhs, network=args.network, seed=seed))
            for seed in args.seeds
        ]
        out.append((f"N={n}  S={stages}  D={dhs}  {args.network}  seeds={','.join(map(str, args.seeds))}", jobs))
    if args.instances:
        files = instance_files(args.instances)
        loaded = {f: load_instance(f) for f in files}  # a bad file fails before any run
        jobs = [(f"{f.name} seed={seed}", seed, partial(loaded.__getitem__, f)) for f in files for seed in args.seeds]
        out.append((f"instances {args.instances} ({len(files)} files, seeds={','.join(map(str, args.seeds))})",
                    jobs))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    cfg = load_config(None, args.overrides)
    report: dict[str, Any] = {"rows": [], "summary": {}}
    all_rows: list[dict[str, Any]] = []
    try:
        groups = _groups(args)
    except UserError as exc:
        print(f"routing_quality: error: {exc}", file=sys.stderr)
        return 2
    for title, jobs in groups:
        rows = []
        for label, seed, make in jobs:
            row = run_instance(make(), seed, cfg, args.crash_fraction, args.time_limit_s, args.stop_when)
            row["label"] = label
            rows.append(row)
            print(f"  {label}: flow {row['gwtf']['flow']}/{row['optimal']['flow']} "
                  f"max x{_ratio(row['gwtf'], row['optimal']):.3f}  wall {row['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        summary = summarize(rows)
        print_summary(title, rows, summary)
        report["summary"][title] = summary
        all_rows += rows
    report["rows"] = all_rows
    _print_targets(all_rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=float)
    return 0


def _print_targets(all_rows: list[dict[str, Any]]) -> None:
    total = len(all_rows)
    if not total:
        return
    equal = sum(r["gwtf"]["flow"] == r["optimal"]["flow"] for r in all_rows)
    ratios = [_ratio(r["gwtf"], r["optimal"]) for r in all_rows]
    crashed = [r["gwtf_after_crash"] for r in all_rows if "gwtf_after_crash" in r]
    recon = [c["flow_restored_at_s"] for c in crashed]
    print(f"\ntargets: flow == optimum on {equal}/{total} = {equal / total:.0%} (target >= 95%); "
          f"max-cost ratio {_tail(ratios)} (target median <= 1.05, p90 <= 1.10); "
          f"optimum flow back after crash within 60 virtual s on "
          f"{sum(x is not None and x <= 60 for x in recon)}/{len(recon)}, and with max cost within 10% of "
          f"the new optimum's at 60 s on {sum(_reconverged(c) for c in crashed)}/{len(crashed)}")


if __name__ == "__main__":
    raise SystemExit(main())
