"""Seeded random fault schedules for the simulator tests and the long-mode script.

Owns: `random_schedule(seed)`: a small scenario (as `--set` style overrides) plus 1-4 faults
drawn from: crash at a random time, crash right after a protocol record (mid-forward,
mid-backward, mid-aggregation, at a step, during a redo), graceful leave, join, link cut,
link degradation, and a whole-stage loss followed by joins. Pure; no I/O.
"""

from __future__ import annotations

import random

TRIGGERS = ("mb_start", "contribute", "collect", "decision", "iter_start", "suspect", "redo", "step",
            "reroute", "iteration_done", "evict")


def random_schedule(seed: int) -> list[str]:
    """Overrides for `load_scenario(None, overrides)`: shape + faults for one seeded run."""
    rng = random.Random(f"faults:{seed}")
    stages = rng.choice((2, 3, 3, 4))
    dhs = rng.randint(2, 3)
    relays = rng.randint(stages - 1 + 2, stages - 1 + 6)
    nodes = [f"n{i}" for i in range(dhs + relays)]
    faults = [_fault(rng, nodes, stages) for _ in range(rng.randint(1, 4))]
    if any(f.startswith('{event="crash_stage"') for f in faults):
        faults += [f'{{event="join", time_s={rng.uniform(5, 40):.3f}}}' for _ in range(2)]
    return [
        'model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", f"model.stages={stages}",
        f"nodes.count={dhs + relays}", f"nodes.data_holders={dhs}", "nodes.relay_capacity=[1, 3]",
        f"train.iterations={rng.randint(2, 4)}", f"train.microbatches={rng.randint(1, 3)}",
        "sim.max_time_s=1500.0", "sim.progress_bound_s=600.0",
        "faults=[" + ", ".join(faults) + "]",
    ]


def _fault(rng: random.Random, nodes: list[str], stages: int) -> str:
    kind = rng.choices(("crash_t", "crash_ev", "leave", "join", "cut", "degrade", "crash_stage"),
                       (3, 5, 1, 1, 1, 1, 1))[0]
    t = rng.uniform(0.0, 8.0)
    node = rng.choice(nodes)
    if kind == "crash_t":
        return f'{{event="crash", node="{node}", time_s={t:.4f}}}'
    if kind == "crash_ev":
        who = rng.choice(("", node))
        return (f'{{event="crash", node="{who}", after_event="{rng.choice(TRIGGERS)}", '
                f'count={rng.randint(1, 6)}}}')
    if kind == "leave":
        return f'{{event="leave", node="{node}", time_s={t:.4f}}}'
    if kind == "join":
        return f'{{event="join", time_s={t:.4f}}}'
    if kind == "crash_stage":
        return f'{{event="crash_stage", stage={rng.randint(1, stages - 1)}, time_s={t:.4f}}}'
    peer = rng.choice([n for n in nodes if n != node])
    return (f'{{event="{kind}", node="{node}", peer="{peer}", time_s={t:.4f}, '
            f'duration_s={rng.uniform(1.0, 30.0):.3f}}}')


def main(argv: list[str] | None = None) -> int:
    """Long mode: `python tests/sim/faultgen.py --seeds N [--first K] [--nodes 120 --view-size 16]
    [--reduce-fanout 2] [--reduce butterfly] [--set KEY=VALUE ...]`; exit 1 on any violation."""
    import argparse

    from gwtf.sim.scenario import load_scenario
    from gwtf.sim.simulator import run_scenario

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--system", default="gwtf")
    parser.add_argument("--nodes", type=int, default=0, help="more nodes than the schedule's own shape")
    parser.add_argument("--view-size", type=int, default=0, help="protocol.view_size (bounded views)")
    parser.add_argument("--reduce-fanout", type=int, default=0, help="protocol.reduce_fanout (broadcast tree)")
    parser.add_argument("--reduce", choices=("gather", "butterfly"), default="gather", help="protocol.reduce")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a scenario override after the schedule's own (repeatable)")
    args = parser.parse_args(argv)
    extra = ([f"nodes.count={args.nodes}"] if args.nodes else []) + [f"protocol.view_size={args.view_size}",
                                                                     f"protocol.reduce_fanout={args.reduce_fanout}",
                                                                     f'protocol.reduce="{args.reduce}"', *args.set]
    bad = 0
    stops: dict[str, int] = {}
    for seed in range(args.first, args.first + args.seeds):
        summary, _ = run_scenario(load_scenario(None, random_schedule(seed) + extra), seed, args.system)
        if summary["invariant_violations"]:
            bad += 1
            print(f"seed {seed}: {summary['violations'][:3]}", flush=True)
        elif not summary["finished"]:
            reason = summary["stop_reason"].split(" lost")[0] if summary["stop_reason"].startswith("stage") \
                else summary["stop_reason"]
            stops[reason] = stops.get(reason, 0) + 1
    unfinished = ", ".join(f"{n} {r!r}" for r, n in sorted(stops.items())) or "none"
    print(f"{bad} of {args.seeds} schedules violated an invariant; unfinished and excused: {unfinished}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
