"""Runtime overhead: tokens/s of a churn-free local swarm vs `gwtf train --local`, same model and cores.

Usage: `python benchmarks/runtime_overhead.py [--iterations 30] [--skip-wire]`.
Both runs train the same config (tiny GPT, synthetic data, byte tokenizer; 2 data holders x 4
microbatches of 8 x 128 tokens; 3 stages). The local trainer uses every core in one process
(torch threads = cores); the swarm runs 2 data holders + 1 replica of each relay stage = 4 node
processes with 1 torch thread each on the same cores. Throughput is measured after a warm-up
(the first 5 iterations are excluded). Target: swarm >= 0.7x local. Then the wire benchmark
(`benchmarks/wire_throughput.py`: codec and loopback transport of 4 MiB tensors) is run and its
table appended. The machine may be shared: numbers are noisy; rerun for a stable figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gwtf.config import load_config
from gwtf.model.trainer import train_local
from gwtf.runtime.swarm import Swarm, SwarmOptions

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def overrides(iterations: int) -> list[str]:
    return [
        'data.source="synthetic"', 'data.tokenizer="byte"', 'model.preset="tiny"', "model.seq_len=128",
        "model.microbatch_size=8", "model.stages=3", "train.data_holders=2", "train.microbatches=4",
        f"train.iterations={iterations}", "train.eval_every=0", "train.eval_microbatches=0",
        "train.checkpoint_every=0", "runtime.torch_threads=1", "protocol.checkpoint_every=1000",
        "protocol.mb_deadline_floor_s=120.0", "protocol.deadline_floor_s=10.0",
    ]


def tokens_per_s(rows: list[dict[str, Any]]) -> float:
    """Steady-state throughput: tokens of iterations WARMUP.. over their wall time."""
    rows = sorted(rows, key=lambda r: r["iteration"])
    start = rows[WARMUP - 1]["time_s"]
    tokens = sum(r["tokens"] for r in rows[WARMUP:])
    return tokens / max(1e-9, rows[-1]["time_s"] - start)


def bench_local(iterations: int, out: Path) -> float:
    cores = os.cpu_count() or 1
    cfg = load_config(None, [*overrides(iterations), f"train.torch_threads={cores}"])
    torch.set_num_threads(cores)
    result = train_local(cfg, out)
    return tokens_per_s(result.metrics)


def bench_swarm(iterations: int, out: Path) -> float:
    ov = overrides(iterations)
    cfg = load_config(None, ov)
    opts = SwarmOptions(out_dir=out, replicas=1, overrides=tuple(ov), timeout_s=600)
    with Swarm(cfg, opts, say=lambda s: None) as swarm:
        swarm.start()
        if not swarm.run_until(iterations, timeout_s=600):
            raise SystemExit(f"swarm did not finish:\n{swarm.log_tails()}")
        rows = list(swarm.metrics.rows)
    return tokens_per_s(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--skip-wire", action="store_true", help="do not run benchmarks/wire_throughput.py")
    args = parser.parse_args()
    if args.iterations <= WARMUP + 1:
        parser.error(f"--iterations must be > {WARMUP + 1}")
    with tempfile.TemporaryDirectory() as tmp:
        local = bench_local(args.iterations, Path(tmp) / "local")
        swarm = bench_swarm(args.iterations, Path(tmp) / "swarm")
    rows = [
        (f"gwtf train --local ({os.cpu_count()} torch threads, 1 process)", f"{local:,.0f} tok/s"),
        ("gwtf swarm (4 node processes x 1 thread, loopback TCP)", f"{swarm:,.0f} tok/s"),
        ("swarm / local (target >= 0.7)", f"{swarm / local:.2f}x"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>14}")
    sys.stdout.flush()
    if not args.skip_wire:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wire_throughput.py"), "--frames", "50",
                        "--repeat", "20"], check=False, timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
