"""What real swarms pay on the wire: fp32 + gather against bf16 + butterfly, in real node processes.

Usage: `python benchmarks/wire_real.py [--iterations 20] [--warmup 3] [--repeat 2] [--preset tiny]
[--seq-len 128] [--microbatch-size 4] [--microbatches 8] [--wan geo10] [--regions Oregon,Frankfurt,Tokyo]
[--replicas 2] [--arms "fp32 + gather,bf16 + butterfly"]`.

Each arm is a local swarm (`gwtf.runtime.swarm.Swarm`, configs/swarm-test.toml with the demo's
short timeouts): 2 data holders and 3 stages with `--replicas` replicas each, on loopback with
WAN emulation between the regions (`runtime.wan`: latency plus size over bandwidth per region
pair), no churn. The arms differ only in what travels between and within stages:
- `fp32 + gather`: activations and activation gradients as computed (`wire.activations = "fp32"`),
  a stage's gradients gathered by one reducer that sends the mean back to every replica
  (`protocol.reduce = "gather"`, R-1 gradients on its uplink);
- `bf16 + butterfly`: 2 bytes a value on the wire (`wire.* = "bf16"`), reduce-scatter +
  all-gather over R parts (`protocol.reduce = "butterfly"`, 2(R-1)/R of a gradient per node);
- `bf16 + gather` and `fp32 + butterfly`: each change alone, so the table says which one pays.
The arms alternate (A B A B ...: `--repeat` rounds), so a drift of the machine's load hits both.
Per arm: tokens/s and seconds per iteration, the median over its runs of each run's median over
the iterations after `--warmup`; and its ratio to fp32 + gather. The machine may be shared: compare
within one run, and prefer a quiet one (real processes measure wall time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sim_vs_real import DEMO_TIMEOUTS as TIMEOUTS  # noqa: E402  (benchmarks/ is on sys.path)
from sim_vs_real import TEST_CONFIG  # noqa: E402

from gwtf.config import load_config  # noqa: E402
from gwtf.errors import UserError  # noqa: E402
from gwtf.runtime.swarm import Swarm, SwarmOptions  # noqa: E402

ARMS = {
    "fp32 + gather": ('wire.activations="fp32"', 'wire.gradients="fp32"', 'protocol.reduce="gather"',
                      'wire.stage_gradients="fp32"'),
    "bf16 + butterfly": ('wire.activations="bf16"', 'wire.gradients="bf16"', 'protocol.reduce="butterfly"'),
    "bf16 + gather": ('wire.activations="bf16"', 'wire.gradients="bf16"', 'protocol.reduce="gather"'),
    "fp32 + butterfly": ('wire.activations="fp32"', 'wire.gradients="fp32"', 'protocol.reduce="butterfly"'),
    "int8 + butterfly + int8 stage": ('wire.activations="int8"', 'wire.gradients="int8"', 'protocol.reduce="butterfly"',
                                      'wire.stage_gradients="int8"'),
    "int8 + butterfly + int8 stage + delay 1": ('wire.activations="int8"', 'wire.gradients="int8"',
                                                'protocol.reduce="butterfly"', 'wire.stage_gradients="int8"',
                                                "train.update_delay=1"),
}
"""The old defaults, then each change alone (which of them costs or pays), then today's defaults
(int8 everywhere, the butterfly: docs/wire-formats.md), and those with the reduction overlapping
the next iteration's passes (`train.update_delay = 1`, docs/protocol.md)."""
RUN_LIMIT_S = 600.0


def run_arm(overrides: tuple[str, ...], regions: tuple[str, ...], replicas: int, iterations: int,
            out: Path) -> list[dict[str, Any]]:
    """The metrics rows of one swarm run to `iterations` (no churn)."""
    cfg = load_config(TEST_CONFIG, list(overrides))
    opts = SwarmOptions(out_dir=out, replicas=replicas, config_path=TEST_CONFIG, overrides=overrides,
                        regions=regions)
    swarm = Swarm(cfg, opts, say=lambda s: None)
    with swarm:
        swarm.start()
        t0 = time.monotonic()
        while not swarm.complete(iterations):
            swarm.step()
            if time.monotonic() - t0 > RUN_LIMIT_S:
                raise SystemExit(f"swarm: only {swarm.metrics.next_iteration}/{iterations} iterations in "
                                 f"{RUN_LIMIT_S:.0f} s\n{swarm.log_tails()}")
            time.sleep(0.05)  # polling period of a bounded wait
        return list(swarm.metrics.rows)


def run_stats(rows: list[dict[str, Any]], warmup: int) -> tuple[float, float]:
    """(median tokens/s, median seconds per iteration) over the iterations after `warmup`."""
    kept = rows[warmup:] or rows
    ends = [float(r["time_s"]) for r in rows]
    durations = [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)][warmup:] or [ends[-1]]
    return statistics.median(float(r["tokens_per_s"]) for r in kept), statistics.median(durations)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="first iterations left out of each run's median")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; each runs every arm once")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per data holder per iteration")
    ap.add_argument("--wan", default="geo10")
    ap.add_argument("--regions", default="Oregon,Frankfurt,Tokyo")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra config override for every arm (after the demo timeouts: it wins)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of arms (default all: {', '.join(ARMS)})")
    args = ap.parse_args()
    arms = {a.strip(): ARMS[a.strip()] for a in args.arms.split(",") if a.strip() in ARMS}
    if "fp32 + gather" not in arms:
        raise SystemExit(f"--arms must include 'fp32 + gather' (the reference); known: {', '.join(ARMS)}")
    if args.iterations <= args.warmup:
        raise SystemExit(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup})")
    base = (*TIMEOUTS, f'model.preset="{args.preset}"', f"model.seq_len={args.seq_len}",
            f"model.microbatch_size={args.microbatch_size}", f"train.microbatches={args.microbatches}", "train.iterations=100000", f'runtime.wan="{args.wan}"', *args.set)
    regions = tuple(args.regions.split(","))
    got: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.repeat):
            for arm, extra in arms.items():
                t0 = time.monotonic()
                rows = run_arm((*base, *extra), regions, args.replicas, args.iterations,
                               Path(tmp) / f"{rnd}-{list(arms).index(arm)}")
                got[arm].append(run_stats(rows, args.warmup))
                tps, it_s = got[arm][-1]
                print(f"round {rnd + 1} {arm}: {tps:.0f} tokens/s, {it_s:.3f} s/iteration "
                      f"({time.monotonic() - t0:.0f} s wall)", file=sys.stderr)
    print(f"\n{args.preset} ({args.microbatches} x {args.microbatch_size} x {args.seq_len} tokens per data holder), 3 stages x {args.replicas} replicas, 2 data holders, --wan {args.wan} "
          f"({args.regions}), {args.iterations} iterations ({args.warmup} warm-up) x {args.repeat} rounds, no churn\n")
    print("| arm | tokens/s (median) | s per iteration (median) | tokens/s vs fp32 + gather |")
    print("|---|---|---|---|")
    ref = statistics.median(t for t, _ in got["fp32 + gather"])
    for arm, runs in got.items():
        tps = statistics.median(t for t, _ in runs)
        it_s = statistics.median(s for _, s in runs)
        print(f"| {arm} | {tps:.0f} | {it_s:.3f} | {tps / ref:.2f} |")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:  # a bad --set: one line, exit 2
        print(f"wire_real: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
