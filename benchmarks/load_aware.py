"""The load-aware cost (`flow.load_aware`) against the paper's, in the routing simulator, side by side.

Usage: `python benchmarks/load_aware.py [--cases 24:4:4:3:1.0 60:6:6:7:1.0 ...] [--network geo10]`.

Each case N:S:D:SEED:C is a generated instance (N nodes, S stages, D data holders) with every
node's compute set to C seconds per microbatch (uniform GPUs; C large against the links =
compute-bound), or to the generator's own profiles when C is 0. Both costs route it in the
routing-only simulator until the objective settles (`stop_when = "objective"`); printed per case
and cost: flow over the max flow, the load-aware sum of the routes over the certified lower
bound of `flow.load_optimum` (1.0 = optimal; what sets a compute-bound iteration), the
load-aware max route cost over the load-aware optimum's, the paper max route cost over the
paper optimum's (`flow.optimum`), messages per node, virtual seconds to converge, wall seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gwtf.config import FlowConfig  # noqa: E402
from gwtf.flow.generate import generate_instance  # noqa: E402
from gwtf.flow.load_optimum import load_aware_optimum, load_route_costs  # noqa: E402
from gwtf.flow.optimum import optimum  # noqa: E402
from gwtf.sim.routing_sim import RoutingSim  # noqa: E402

DEFAULT_CASES = ("24:4:4:3:1.0", "60:6:6:7:1.0", "60:6:6:8:0.3", "200:8:16:5:1.0", "60:6:6:1003:0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="N:S:D:SEED:C (C=0: the generator's compute)")
    ap.add_argument("--network", default="geo10")
    ap.add_argument("--time-limit-s", type=float, default=600.0)
    args = ap.parse_args()
    head = ["case", "cost", "flow", "la sum / bound", "la max / la opt", "paper max / opt", "msgs/node", "conv s", "wall s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for case in args.cases:
        n, s, d, seed, c = case.split(":")
        inst = generate_instance(int(n), int(s), int(d), network=args.network, seed=int(seed))
        if float(c) > 0:
            inst = replace(inst, nodes=tuple(replace(x, compute_s=float(c)) for x in inst.nodes))
        lo = load_aware_optimum(inst)
        paper = optimum(inst, time_limit_s=10.0)
        for aware in (False, True):
            t = time.perf_counter()
            sim = RoutingSim(inst, FlowConfig(load_aware=aware), seed=int(seed), stop_when="objective")
            out = sim.run(time_limit_s=args.time_limit_s)
            routes = list(out.routes)
            la = load_route_costs(inst, routes)
            pm = max((inst.route_cost_s(r) for r in routes), default=0.0)
            row = [case, "load-aware" if aware else "paper", f"{len(routes)}/{paper.stats.flow}",
                   f"{sum(la) / lo.lower_bound_sum_s:.3f}", f"{max(la) / lo.max_route_cost_s:.3f}",
                   f"{pm / paper.stats.max_route_cost_s:.3f}", f"{out.messages / int(n):,.0f}",
                   f"{out.converged_at_s:.0f}" + ("" if out.converged else " (not)"), f"{time.perf_counter() - t:.1f}"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
