"""`gwtf route`: build a routing instance and compare gwtf's decentralized flow with the rest.

Owns: the command's flags and report. It generates a seeded instance (`flow.generate`) or reads
one from a file (`--instance`, `flow.instance_file`; `--write-instance` writes it), solves
the central optimum (`flow.optimum`), runs the decentralized protocol in the routing-only
simulator (`sim.routing_sim`), the SWARM, greedy and random baselines (`flow.baselines`), and
optionally crashes a fraction of the relays after convergence and measures re-convergence.
Prints a table, or with --json one JSON object keyed by method. Protocol knobs are config
fields (`--set flow.tick_s=2`), not flags.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import Any

from gwtf.cli import add_config_arguments
from gwtf.config import Config, load_config
from gwtf.errors import UserError
from gwtf.flow.baselines import greedy_routes, random_routes, swarm_routes
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance, Route, evaluate_routes
from gwtf.flow.instance_file import load_instance, write_instance
from gwtf.flow.optimum import optimum
from gwtf.sim.routing_sim import RoutingSim

__all__ = ["add_arguments", "run", "compare"]


DEFAULT_SHAPE = {"nodes": 24, "stages": 4, "data_holders": 4, "network": "geo10"}
RECONVERGE_CHECK_S = 60.0  # after a crash, the routes are also scored this many virtual s in (issue 17)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="N: nodes in total (data holders + relays); default 24")
    parser.add_argument("--stages", type=int, help="S: stages incl. stage 0 (data holders); default 4")
    parser.add_argument("--data-holders", type=int, help="D: data holders (stage 0); default 4")
    parser.add_argument("--network", help="region table: geo10 (default) or geo12")
    parser.add_argument("--instance", metavar="FILE",
                        help="read the instance from a .json or .toml file (docs/routing.md) instead of generating one")
    parser.add_argument("--write-instance", metavar="FILE",
                        help="write the instance (generated or read) to a .json or .toml file, then run")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the generated instance and of the protocol's random choices (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--crash-fraction", type=float, default=0.0,
                        help="after convergence, crash this fraction of the relays and re-converge")
    parser.add_argument("--time-limit-s", type=float, default=600.0,
                        help="virtual seconds the protocol may run (each phase)")
    add_config_arguments(parser)


def _check(args: argparse.Namespace) -> None:
    shape = [f"--{k.replace('_', '-')}" for k in DEFAULT_SHAPE if getattr(args, k) is not None]
    if args.instance is not None and shape:
        raise UserError(f"--instance gives the nodes and the network; drop {shape[0]}")
    for k, v in DEFAULT_SHAPE.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.stages < 2:
        raise UserError(f"--stages must be >= 2 (stage 0 plus a relay stage), got {args.stages}")
    if args.data_holders < 1:
        raise UserError(f"--data-holders must be >= 1, got {args.data_holders}")
    if args.nodes < args.data_holders + args.stages - 1:
        raise UserError(f"--nodes {args.nodes} is too few for {args.stages} stages and "
                        f"{args.data_holders} data holders (need >= {args.data_holders + args.stages - 1})")
    if not 0.0 <= args.crash_fraction < 1.0:
        raise UserError(f"--crash-fraction must be in [0, 1), got {args.crash_fraction}")
    if args.time_limit_s <= 0:
        raise UserError(f"--time-limit-s must be > 0, got {args.time_limit_s}")


def _scores(instance: Instance, routes: list[Route] | tuple[Route, ...]) -> dict[str, Any]:
    """Flow and route costs, the flow each data holder starts (`flow_by_data_holder`, every data
    holder listed) and the data holder of the costliest route (`worst_data_holder`, None without
    routes): which data holders get the bottleneck's slots is part of the answer (issue 17)."""
    st = evaluate_routes(instance, routes)
    by_dh = dict.fromkeys(instance.by_stage[0], 0)
    for r in routes:
        by_dh[r[0]] += 1
    worst = max(routes, key=instance.route_cost_s)[0] if routes else None
    return {"flow": st.flow, "max_route_cost_s": st.max_route_cost_s, "sum_route_cost_s": st.sum_route_cost_s,
            "flow_by_data_holder": by_dh, "worst_data_holder": worst}


def _baseline_scores(instance: Instance, routes: list[Route]) -> dict[str, Any]:
    """A baseline's scores; its routes over a missing link (an instance file's `links`) cannot run
    and are dropped (counted in `unusable_routes`, present only when there are any)."""
    usable = [r for r in routes if math.isfinite(instance.route_cost_s(r))]
    out = _scores(instance, usable)
    if len(usable) < len(routes):
        out["unusable_routes"] = len(routes) - len(usable)
    return out


def compare(instance: Instance, cfg: Config, seed: int, crash_fraction: float = 0.0,
            time_limit_s: float = 600.0, stop_when: str = "objective",
            check_s: float = RECONVERGE_CHECK_S) -> dict[str, dict[str, Any]]:
    """Every method on one instance: {"optimal", "gwtf", "swarm", "greedy", "random"[, "gwtf_after_crash"]}.

    The protocol runs until its objective (flow, max route cost) is stable for 20 ticks
    (`stop_when="routes"`: until no route changes); `converged_at_s` is that last change and
    `routes_changed_at_s` the last change of any route before the run stopped.
    """
    t0 = time.perf_counter()
    opt = optimum(instance)
    out: dict[str, dict[str, Any]] = {"optimal": {
        **_scores(instance, opt.routes), "lower_bound_max_route_cost_s": opt.lower_bound_max_route_cost_s,
        "method": opt.method, "wall_s": time.perf_counter() - t0,
    }}
    t0 = time.perf_counter()
    sim = RoutingSim(instance, cfg.flow, seed=seed, stop_when=stop_when)
    res = sim.run(time_limit_s, target_flow=opt.stats.flow)
    out["gwtf"] = {
        **_scores(instance, res.routes), "converged": res.converged, "converged_at_s": res.converged_at_s,
        "flow_reached_at_s": res.flow_reached_at_s, "routes_changed_at_s": res.routes_changed_at_s,
        "messages": res.messages, "messages_per_node": res.messages / len(instance.nodes),
        "wall_s": time.perf_counter() - t0,
    }
    out["swarm"] = _baseline_scores(instance, swarm_routes(instance, random.Random(seed)))
    out["greedy"] = _baseline_scores(instance, greedy_routes(instance))
    out["random"] = _baseline_scores(instance, random_routes(instance, random.Random(seed)))
    if crash_fraction > 0:
        out["gwtf_after_crash"] = _after_crash(sim, crash_fraction, seed, time_limit_s, check_s)
    return out


def _after_crash(sim: RoutingSim, fraction: float, seed: int, time_limit_s: float,
                 check_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    victims = sim.crash(fraction, random.Random(seed + 1))
    survivors = sim.surviving_instance()
    opt = optimum(survivors)
    res = sim.run(time_limit_s, target_flow=opt.stats.flow, check_s=check_s)
    at_check = evaluate_routes(survivors, res.check_routes or ())
    return {
        **_scores(survivors, res.routes), "crashed": len(victims), "converged": res.converged,
        "reconverged_at_s": res.converged_at_s, "flow_restored_at_s": res.flow_reached_at_s,
        "routes_changed_at_s": res.routes_changed_at_s,
        "messages": res.messages, "optimal_flow": opt.stats.flow,
        "optimal_max_route_cost_s": opt.stats.max_route_cost_s,
        "optimal_lower_bound_max_route_cost_s": opt.lower_bound_max_route_cost_s,
        # the routes `check_s` virtual s after the crash (the run's best recent snapshot then)
        "check_s": check_s, "flow_at_check": at_check.flow, "max_route_cost_at_check_s": at_check.max_route_cost_s,
        "wall_s": time.perf_counter() - t0,
    }


def run(args: argparse.Namespace) -> int:
    _check(args)
    cfg: Config = load_config(args.config, args.overrides)
    if args.instance is not None:
        instance = load_instance(args.instance)
    else:
        instance = generate_instance(args.nodes, args.stages, args.data_holders, network=args.network,
                                     seed=args.seed)
    if args.write_instance is not None:
        write_instance(instance, args.write_instance)
    result = compare(instance, cfg, args.seed, args.crash_fraction, args.time_limit_s)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_table(result, args)
    return 0


def _print_table(result: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    opt = result["optimal"]
    shape = (f"{args.instance}" if args.instance is not None else
             f"N={args.nodes} S={args.stages} D={args.data_holders} {args.network}")
    table = Table(title=f"gwtf route: {shape} seed={args.seed}")
    for col in ("method", "flow", "max route s", "max / optimal", "sum route s", "notes"):
        table.add_column(col, justify="left" if col in ("method", "notes") else "right")
    for name, r in result.items():
        ref = r.get("optimal_max_route_cost_s", opt["max_route_cost_s"])
        ratio = r["max_route_cost_s"] / ref if ref else float("nan")
        notes = ""
        if name == "optimal":
            notes = f"{r['method']}, lower bound {r['lower_bound_max_route_cost_s']:.3f} s"
        elif name == "gwtf":
            notes = f"converged at {r['converged_at_s']:.0f} virtual s, {r['messages']} messages"
        elif name == "gwtf_after_crash":
            at = r["max_route_cost_at_check_s"] / ref if ref else float("nan")
            notes = (f"{r['crashed']} relays crashed; re-converged in {r['reconverged_at_s']:.0f} s; "
                     f"optimum flow {r['optimal_flow']}; at {r['check_s']:.0f} s: flow {r['flow_at_check']}, "
                     f"max / optimal {at:.3f}")
        table.add_row(name, str(r["flow"]), f"{r['max_route_cost_s']:.3f}", f"{ratio:.3f}",
                      f"{r['sum_route_cost_s']:.2f}", notes)
    Console().print(table)
