"""Long mode for the core's authorization table (the `@handles(..., sender=)` rules, `protocol.dispatch`; docs/protocol.md):
run seeded fault schedules and tally every `unauthorized` record by message type, rule, and
whether the refused sender was a live member in the leader's directory at that moment (a
refusal of a live member is a rule too strict for honest traffic).

    python tests/sim/authtally.py --seeds 1000 --first K [--system swarm] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

from faultgen import random_schedule

from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--system", default="gwtf")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="scenario override")
    args = parser.parse_args(argv)
    tally: collections.Counter[tuple[str, str, str]] = collections.Counter()
    example: dict[tuple[str, str, str], tuple[int, float, str, str]] = {}
    bad = 0
    for seed in range(args.first, args.first + args.seeds):
        sc = load_scenario(None, random_schedule(seed) + args.extra)
        sim = Simulator(sc, seed, get_system(args.system, sc.protocol))
        original = sim._record

        def record(node: str, r: Any, now: float, sim: Simulator = sim, seed: int = seed,
                   original: Any = original) -> None:
            if r.event == "unauthorized":
                f = dict(r.fields)
                sender = sim.cores.get(f["sender"])
                leaders = [c for c in sim.cores.values() if c.alive and c.is_leader]
                lead = max(leaders, key=lambda c: c.term) if leaders else None
                live = sender is not None and sender.alive and sender.active and \
                    (lead is None or f["sender"] in lead.directory)
                key = (f["type"], f["allowed"], "live member" if live else "dead, evicted or not yet a member")
                tally[key] += 1
                example.setdefault(key, (seed, now, node, f["sender"]))
            original(node, r, now)

        sim._record = record  # type: ignore[method-assign]
        summary = sim.run()
        bad += bool(summary["invariant_violations"])
    print(f"{bad} of {args.seeds} schedules violated an invariant")
    for key, n in tally.most_common():
        print(f"{n:6d}  {key[0]:14s} {key[1]:32s} {key[2]:34s} e.g. seed/time/node/sender {example[key]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
