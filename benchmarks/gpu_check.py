"""GPU check (docs/gpu.md): the GPU tests, then tokens/s and peak memory on one GPU.

On a machine with CUDA (`benchmarks/gpu_check.sh`):
1. runs the GPU tests (`pytest -m gpu tests/gpu`);
2. trains the 124m preset with the local trainer (`gwtf train --local`'s `train_local`), once per
   precision (fp32, bf16-autocast);
3. runs a one-GPU local swarm of the same model (one data holder and one replica per relay stage,
   every node process on the same GPU: `gwtf swarm --replicas 1 --device cuda`), per precision;
and prints one table: tokens/s (median over the iterations after the first `skip`, which warm
up kernels and allocators) and peak memory (`peak_memory_bytes` of the metrics rows and of the
nodes' step records: CUDA max allocated, per process; for the swarm the largest node and the sum
over its nodes, which share the GPU).

`--dry-run` does the same on the CPU with the tiny preset and a few iterations (the GPU tests
are then collected and skipped; the swarm runs once, in the first precision, since starting its
processes is most of the time): CI runs it (`.ci/run`) so the script cannot rot on machines
without a GPU. Its numbers mean nothing. Without CUDA and without `--dry-run`: one line, exit 2.

Usage: benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--json PATH] [--precisions fp32,bf16-autocast]
       [--skip-tests] [--skip-swarm] [--skip-local]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """One mode's sizes: the model, the data and how many iterations each run takes."""

    name: str
    device: str
    overrides: tuple[str, ...]  # config overrides shared by the local and the swarm runs
    local_iterations: int
    swarm_iterations: int
    skip: int  # warm-up iterations left out of the tokens/s median
    swarm_timeout_s: float


# 124m (GPT-2 small dimensions) at GPT-2's context: 1 data holder x 4 microbatches x 8 x 1024
# tokens per iteration; synthetic text with a 32768-token BPE (no download: the GPU machine may
# be offline); checkpoints only at the end; failure detection as test_join_124m's (a 124m step
# and state copy take seconds).
GPU = Profile(
    name="gpu", device="cuda", local_iterations=12, swarm_iterations=8, skip=2, swarm_timeout_s=420.0,
    overrides=('model.preset="124m"', "model.seq_len=1024", "model.microbatch_size=8", "model.stages=3",
               'data.source="synthetic"', 'data.tokenizer="bpe"', "data.vocab_size=32768",
               "data.synthetic_bytes=2000000", "train.data_holders=1", "train.microbatches=4",
               "train.warmup_iterations=2", "train.eval_every=0", "train.eval_microbatches=1",
               "train.checkpoint_every=0", "protocol.checkpoint_every=1000",
               "protocol.heartbeat_period_s=2.0", "protocol.suspect_after_s=6.0", "protocol.evict_after_s=12.0",
               "runtime.ready_timeout_s=180.0", "runtime.torch_threads=0"),
)
DRY = Profile(
    name="dry-run", device="cpu", local_iterations=3, swarm_iterations=3, skip=1, swarm_timeout_s=180.0,
    overrides=('model.preset="tiny"', "model.seq_len=16", "model.microbatch_size=2", "model.stages=3",
               'data.source="synthetic"', 'data.tokenizer="byte"', "data.synthetic_bytes=20000",
               "train.data_holders=1", "train.microbatches=2", "train.warmup_iterations=1",
               "train.eval_every=0", "train.eval_microbatches=1", "train.checkpoint_every=0",
               "train.torch_threads=1", "protocol.checkpoint_every=1000", "protocol.heartbeat_period_s=0.3",
               "protocol.suspect_after_s=3.0", "protocol.evict_after_s=6.0", "protocol.mb_deadline_floor_s=15.0",
               "runtime.ready_timeout_s=180.0", "runtime.torch_threads=1"),  # a loaded CI box starts slowly
)


def _overrides(profile: Profile, precision: str, iterations: int) -> list[str]:
    return [*profile.overrides, f'train.device="{profile.device}"', f'train.precision="{precision}"',
            f"train.iterations={iterations}"]


def run_gpu_tests() -> dict[str, Any]:
    """`pytest -m gpu tests/gpu` in a subprocess; its exit code and summary line."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-2000:])
    return {"rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr.strip()[-200:]}


def _median_tps(rows: list[dict[str, Any]], skip: int) -> float:
    kept = [float(r["tokens_per_s"]) for r in rows[skip:]] or [float(r["tokens_per_s"]) for r in rows]
    return statistics.median(kept) if kept else float("nan")


def run_local(profile: Profile, precision: str, out: Path) -> dict[str, Any]:
    """The local trainer on the profile's device; tokens/s and the process's peak memory."""
    import torch

    from gwtf.config import load_config
    from gwtf.model.trainer import train_local

    cfg = load_config(None, _overrides(profile, precision, profile.local_iterations))
    if profile.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    result = train_local(cfg, out, say=lambda _: None)
    rows = result.metrics
    peak = max((int(r["peak_memory_bytes"]) for r in rows), default=0)
    return _result("local trainer", precision, profile, rows, result.dataset.vocab_size, t0, peak, None)


def _result(run: str, precision: str, profile: Profile, rows: list[dict[str, Any]], vocab: int, t0: float,
            peak: int, peak_total: int | None) -> dict[str, Any]:
    """One table row: tokens/s is the median over the iterations after the warm-up ones."""
    return {"run": run, "precision": precision, "iterations": len(rows),
            "tokens_per_iteration": rows[-1]["tokens"] if rows else 0, "vocab": vocab,
            "tokens_per_s": _median_tps(rows, profile.skip), "loss_last": rows[-1]["loss"] if rows else None,
            "peak_memory_bytes": peak, "peak_memory_total_bytes": peak_total,
            "wall_s": round(time.monotonic() - t0, 1)}


def run_swarm(profile: Profile, precision: str, out: Path) -> dict[str, Any]:
    """A local swarm (one replica per stage, every node on the profile's device)."""
    from gwtf.config import load_config
    from gwtf.model.tokenizer import vocab_size_for
    from gwtf.runtime.launcher import NodeStartError
    from gwtf.runtime.swarm import Swarm, SwarmOptions

    overrides = _overrides(profile, precision, profile.swarm_iterations)
    cfg = load_config(None, overrides)
    opts = SwarmOptions(out_dir=out, replicas=1, timeout_s=profile.swarm_timeout_s, overrides=tuple(overrides))
    t0 = time.monotonic()
    with Swarm(cfg, opts, say=lambda _: None) as swarm:
        try:
            swarm.start()
            done = swarm.run_until(profile.swarm_iterations, timeout_s=profile.swarm_timeout_s)
        except NodeStartError as exc:
            sys.stderr.write(f"swarm ({precision}) did not start: {exc}\n")
            done = False
        if not done:
            sys.stderr.write(f"swarm ({precision}) did not finish in {profile.swarm_timeout_s:.0f} s\n"
                             f"{swarm.log_tails()}\n")
        swarm.metrics.poll(swarm.group.procs)
        rows = list(swarm.metrics.rows)
        peaks: dict[str, int] = {}
        for name, records in swarm.metrics.records.items():
            for r in records:
                if r.get("event") == "stepped" and "peak_memory_bytes" in r:
                    peaks[name] = max(peaks.get(name, 0), int(r["peak_memory_bytes"]))
    return {**_result("local swarm (1 replica/stage)", precision, profile, rows, vocab_size_for(cfg.data), t0,
                      max(peaks.values(), default=0), sum(peaks.values())), "finished": done}


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f}"


def table(env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    head = ("| run | precision | device | tokens/iteration | tokens/s | peak memory MiB (largest process) "
            "| peak memory MiB (all nodes) | iterations | wall s |")
    lines = [f"gwtf GPU check ({env['mode']}): {env['device_name']}, torch {env['torch']}, preset "
             f"{env['preset']}", "", head, "|" + "---|" * 9]
    for r in results:
        lines.append(f"| {r['run']} | {r['precision']} | {env['device']} | {r['tokens_per_iteration']} | "
                     f"{r['tokens_per_s']:,.0f} | {_mib(r['peak_memory_bytes'])} | "
                     f"{_mib(r['peak_memory_total_bytes'])} | {r['iterations']} | {r['wall_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, few iterations (CI)")
    ap.add_argument("--out", metavar="DIR", help="run folders (default: a temporary folder, removed)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--precisions", default="fp32,bf16-autocast", help="comma-separated train.precision values")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--skip-local", action="store_true", help="no local-trainer runs")
    ap.add_argument("--skip-swarm", action="store_true", help="no swarm runs")
    args = ap.parse_args(argv)
    profile = DRY if args.dry_run else GPU
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in ("fp32", "bf16-autocast")]
    if bad:
        sys.stderr.write(f"gpu_check: error: --precisions {','.join(bad)}: expected fp32 and/or bf16-autocast\n")
        return 2
    import torch

    if profile.device == "cuda" and not torch.cuda.is_available():
        from gwtf.model.device import cuda_unavailable_reason

        sys.stderr.write(f"gpu_check: error: CUDA is not available ({cuda_unavailable_reason()}); "
                         "use --dry-run for the CPU check\n")
        return 2
    os.environ.setdefault("MPLBACKEND", "Agg")
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="gwtf-gpu-check-")
    out = Path(args.out) if args.out else Path(tmp.name)  # type: ignore[union-attr]
    os.environ.setdefault("GWTF_CACHE", str(out / "cache"))  # node processes inherit it
    env = {"mode": profile.name, "device": profile.device, "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(0) if profile.device == "cuda" else "CPU",
           "preset": next(o for o in profile.overrides if o.startswith("model.preset")).split("=")[1].strip('"')}
    code = 0
    tests = None
    if not args.skip_tests:
        tests = run_gpu_tests()
        print(f"GPU tests (pytest -m gpu tests/gpu): {tests['summary']}", flush=True)
        code = code or (1 if tests["rc"] != 0 else 0)
    results = []
    for precision in precisions:
        if not args.skip_local:
            results.append(run_local(profile, precision, out / f"local-{precision}"))
            print(f"local trainer {precision}: {results[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        if not args.skip_swarm and not (args.dry_run and precision != precisions[0]):  # dry run: one swarm
            results.append(run_swarm(profile, precision, out / f"swarm-{precision}"))
            print(f"local swarm {precision}: {results[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
            code = code or (0 if results[-1]["finished"] else 1)
    print()
    print(table(env, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "gpu_tests": tests, "results": results}, indent=2) + "\n",
                                   encoding="utf-8")
    if tmp is not None:
        tmp.cleanup()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
