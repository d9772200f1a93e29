"""Prediction, measured: one scenario in real node processes and in the simulator, side by side.

Usage: `python benchmarks/sim_vs_real.py [--iterations 30] [--kill-at 10] [--kill-lag-s 1] [--join-at 18]
[--preset tiny] [--wan geo10] [--regions Oregon,Frankfurt,Tokyo] [--out DIR]`.

Real: a local swarm (`gwtf.runtime.swarm.Swarm`, configs/swarm-test.toml with the demo's short
timeouts) of 2 data holders and 3 stages with 2 replicas each, on loopback with WAN emulation
between the regions the launcher draws (`runtime.wan`); when iteration `--kill-at` is done a
serving relay is killed (kill -9), when `--join-at` is done a joiner starts.
Simulated: the same nodes (names, stages, regions, capacities), the same protocol knobs, the kill
and the join at the times they happened in the real run, and compute times calibrated from a
short profile of this machine: forward + backward of one microbatch of each stage, timed with the
same torch modules (`gwtf.model.stage.build_stage`), fastest of a few repeats after a warm-up.

Printed: per-iteration time (median, p90), throughput (microbatches/s), recovery (the extra time
of the iteration in which the kill happened, over the median) and join time (the joiner's node
up -> its first contribution; the real joiner's process start is printed apart), real vs
simulated, with the ratio. The simulated kill and join happen at the same progress as the real
ones (after the same iteration, with the same lag), not at the same wall time. Residuals to expect: the simulator
charges no Python, serialisation or encryption cost per message and no optimizer step time.
The machine may be shared: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gwtf.config import Config, load_config  # noqa: E402
from gwtf.flow.instance import Instance, NodeSpec  # noqa: E402
from gwtf.flow.network import load_network  # noqa: E402
from gwtf.model.presets import model_spec  # noqa: E402
from gwtf.model.stage import FirstStage, build_stage  # noqa: E402
from gwtf.protocol.systems import get_system  # noqa: E402
from gwtf.runtime.drive import train_params, vocab_size_of  # noqa: E402
from gwtf.runtime.swarm import Swarm, SwarmOptions  # noqa: E402
from gwtf.sim.scenario import Fault, load_scenario  # noqa: E402
from gwtf.sim.simulator import Simulator  # noqa: E402

TEST_CONFIG = str(ROOT / "configs" / "swarm-test.toml")
DEMO_TIMEOUTS = ("protocol.heartbeat_period_s=0.25", "protocol.suspect_after_s=0.75", "protocol.evict_after_s=1.5",
                 "protocol.deadline_multiplier=4.0", "protocol.deadline_floor_s=1.0",
                 "protocol.mb_deadline_floor_s=20.0", "protocol.retry_period_s=0.2",
                 "protocol.partition_timeout_s=30.0")
"""The demo's short timeouts (also benchmarks/wire_real.py's)."""
TIMEOUTS = (*DEMO_TIMEOUTS, "protocol.checkpoint_every=5")


def profile_stages(cfg: Config, repeats: int = 5) -> list[float]:
    """Seconds of forward + backward of one microbatch per stage on this machine (fastest repeat)."""
    torch.set_num_threads(cfg.runtime.torch_threads)
    spec = model_spec(cfg.model, vocab_size_of(cfg))
    mb, seq, stages = cfg.model.microbatch_size, cfg.model.seq_len, cfg.model.stages
    out = []
    for k in range(stages):
        mod = build_stage(spec, k, stages, seed=0)
        best = float("inf")
        for i in range(repeats + 2):  # two warm-up calls
            t0 = time.perf_counter()
            if isinstance(mod, FirstStage):
                tokens = torch.randint(0, spec.vocab_size, (mb, seq))
                hidden = mod.embed(tokens)
                final = hidden.detach().requires_grad_(True)
                mod.head_loss(final, tokens).backward()
                hidden.backward(torch.ones_like(hidden))
            else:
                x = torch.randn(mb, seq, spec.d_model, requires_grad=True)
                y = mod(x)
                y.backward(torch.ones_like(y))
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


def run_real(cfg: Config, overrides: tuple[str, ...], out: Path, regions: tuple[str, ...], kill_at: int,
             join_at: int, iterations: int, kill_lag_s: float = 0.0) -> dict[str, Any]:
    opts = SwarmOptions(out_dir=out, replicas=2, config_path=TEST_CONFIG, overrides=overrides, regions=regions)
    swarm = Swarm(cfg, opts, say=lambda s: None)
    kill_s = join_s = join_unix = seen_s = -1.0
    victim = joiner = ""
    with swarm:
        swarm.start()
        t0 = time.monotonic()
        while not swarm.complete(iterations):
            swarm.step()
            done = swarm.metrics.next_iteration
            if seen_s < 0 and done >= kill_at:
                seen_s = time.monotonic()
            if kill_s < 0 and seen_s >= 0 and time.monotonic() - seen_s >= kill_lag_s:
                p = swarm.kill_random_relay()
                if p is not None:
                    victim, kill_s = p.name, time.monotonic() - t0
            if join_s < 0 and done >= join_at:
                joiner, join_s, join_unix = swarm.join_node().name, time.monotonic() - t0, time.time()
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"real swarm: only {done}/{iterations} iterations in 600 s\n{swarm.log_tails()}")
            time.sleep(0.05)  # polling period of a bounded wait
        rows = list(swarm.metrics.rows)
        first = _first_contribution(swarm.metrics.records.get(joiner, []))
        started = _join_started(swarm.metrics.records.get(joiner, []))
        plans = {p.name: (p.plan.role, p.plan.region, int(p.plan.stage) if p.plan.stage.isdigit() else -1)
                 for p in swarm.group.procs}
    ends = [float(r["time_s"]) for r in rows]
    return {"ends": ends, "microbatches": sum(int(r["microbatches"]) for r in rows), "kill_s": kill_s,
            "victim": victim, "join_s": join_s, "joiner": joiner, "plans": plans,
            "join_done_s": join_s + (first - join_unix) if first and join_unix > 0 else -1.0,
            "join_ready_s": join_s + (started - join_unix) if started and join_unix > 0 else -1.0}


def _first_contribution(rows: list[dict[str, Any]]) -> float:
    return next((float(r["unix_s"]) for r in rows if r.get("event") == "contribute"), 0.0)


def _join_started(rows: list[dict[str, Any]]) -> float:
    """When the joiner's node core started (its process is up: Python, torch and the config
    loaded), which the simulator's joiner does at once."""
    return next((float(r["unix_s"]) for r in rows if r.get("event") == "join_start"), 0.0)


def _durations(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]


def run_sim(cfg: Config, real: dict[str, Any], compute_s: list[float], wan: str, iterations: int,
            kill_at: int, join_at: int) -> dict[str, Any]:
    """The simulated run, with the kill and the join where the real run had them in *progress*:
    the real swarm kills when iteration `kill_at` is done (and joins when `join_at` is), so a
    first pass without faults finds when the simulated iterations end and the second puts the
    faults there, plus the real run's lag after that iteration's end. Matching wall-clock
    times instead would hit the simulated run in a different phase of its iteration (its
    iterations are not exactly as long), which the recovery measure is sensitive to."""
    plain = _sim_once(cfg, real, compute_s, wan, iterations, -1.0, -1.0)
    ends, real_ends = plain["ends"], real["ends"]

    def at(k: int, real_s: float) -> float:
        if real_s < 0 or not 0 < k <= min(len(ends), len(real_ends)):
            return real_s
        return ends[k - 1] + max(0.0, real_s - real_ends[k - 1])

    kill_s, join_s = at(kill_at, real["kill_s"]), at(join_at, real["join_s"])
    out = _sim_once(cfg, real, compute_s, wan, iterations, kill_s, join_s)
    return {**out, "kill_s": kill_s, "join_s": join_s}


def _sim_once(cfg: Config, real: dict[str, Any], compute_s: list[float], wan: str, iterations: int,
              kill_s: float, join_s: float) -> dict[str, Any]:
    spec = model_spec(cfg.model, vocab_size_of(cfg))
    train = dataclasses.replace(train_params(cfg, spec), iterations=iterations)
    nodes = tuple(NodeSpec(id=name, stage=stage if role == "relay" else 0, region=region, profile="measured",
                           compute_s=compute_s[stage if role == "relay" else 0],
                           capacity=max(1, cfg.train.microbatches),
                           demand=cfg.train.microbatches if role == "data-holder" else 0)
                  for name, (role, region, stage) in sorted(real["plans"].items())
                  if name != real["joiner"] and stage >= 0)
    inst = Instance(nodes=nodes, stages=cfg.model.stages, network=load_network(wan), activation_bytes=train.activation_bytes)
    faults = [Fault(event="crash", node=real["victim"], time_s=kill_s)] if real["victim"] and kill_s >= 0 else []
    faults += [Fault(event="join", time_s=join_s)] if real["joiner"] and join_s >= 0 else []
    sc = load_scenario(None, [f'model.preset="{cfg.model.preset}"', f"model.stages={cfg.model.stages}",
                              f"train.iterations={iterations}", "sim.max_time_s=3600"])
    sc = dataclasses.replace(sc, protocol=cfg.protocol, flow=cfg.flow, faults=tuple(faults))
    sim = Simulator(sc, 0, get_system(cfg.protocol.system, cfg.protocol), (inst, train))
    initial = {n.id for n in nodes}
    joined: list[float] = []
    record = sim._record

    def on_record(node: str, rec: Any, now: float) -> None:  # the joiner's first contribution
        if rec.event == "contribute" and node not in initial and not joined:
            joined.append(now)
        record(node, rec, now)

    sim._record = on_record  # type: ignore[method-assign]
    summary = sim.run()
    rows = sim.metrics.timeline_rows()
    return {"ends": [float(r["end_s"]) for r in rows], "microbatches": sum(int(r["microbatches"]) for r in rows),
            "summary": summary, "join_done_s": joined[0] if joined else -1.0}


def _stats(ends: list[float], kill_s: float) -> dict[str, float]:
    d = _durations(ends)
    med = statistics.median(d)
    p90 = sorted(d)[min(len(d) - 1, int(0.9 * len(d)))]
    hit = next((i for i, e in enumerate(ends) if e >= kill_s), len(d) - 1) if kill_s >= 0 else -1
    return {"median_s": med, "p90_s": p90, "recovery_s": (d[hit] - med) if hit >= 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--join-at", type=int, default=18)
    ap.add_argument("--kill-lag-s", type=float, default=1.0,
                    help="kill this long after iteration --kill-at is done (default 1 s: mid-iteration, with work on the victim; 0: at the boundary, where it costs nothing)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--wan", default="geo10")
    ap.add_argument("--regions", default="Oregon,Frankfurt,Tokyo")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    overrides = (*TIMEOUTS, f'model.preset="{args.preset}"', "model.seq_len=128", "model.microbatch_size=4",
                 "train.microbatches=8", "train.iterations=100000", f'runtime.wan="{args.wan}"')
    cfg = load_config(TEST_CONFIG, list(overrides))
    compute_s = profile_stages(cfg)
    print("profile (fwd+bwd per microbatch): " + ", ".join(f"stage {k} {c * 1e3:.1f} ms" for k, c in enumerate(compute_s)),
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "swarm"
        real = run_real(cfg, overrides, out, tuple(args.regions.split(",")), args.kill_at, args.join_at,
                        args.iterations, args.kill_lag_s)
    sim = run_sim(cfg, real, compute_s, args.wan, args.iterations, args.kill_at, args.join_at)
    r, s = _stats(real["ends"], real["kill_s"]), _stats(sim["ends"], sim["kill_s"])
    rt = real["microbatches"] / real["ends"][-1]
    st = sim["microbatches"] / sim["ends"][-1] if sim["ends"] else 0.0
    rj = real["join_done_s"] - real["join_ready_s"] if real["join_done_s"] > 0 and real["join_ready_s"] > 0 else float("nan")
    rp = real["join_ready_s"] - real["join_s"] if real["join_ready_s"] > 0 else float("nan")
    sj = sim["join_done_s"] - sim["join_s"] if sim["join_done_s"] > 0 else float("nan")
    print(f"\n{args.preset}, {cfg.model.stages} stages x 2 replicas, 2 data holders, --wan {args.wan} "
          f"({args.regions}); kill of {real['victim']} at {real['kill_s']:.1f} s, join at {real['join_s']:.1f} s; "
          f"{args.iterations} iterations; sim finished={sim['summary']['finished']}\n")
    print("| measure | real | simulated | sim / real |")
    print("|---|---|---|---|")
    for name, a, b in (("iteration time, median (s)", r["median_s"], s["median_s"]),
                       ("iteration time, p90 (s)", r["p90_s"], s["p90_s"]),
                       ("throughput (microbatches/s)", rt, st),
                       ("recovery after the kill (s)", r["recovery_s"], s["recovery_s"]),
                       ("join time, node up -> first contribution (s)", rj, sj)):
        print(f"| {name} | {a:.3f} | {b:.3f} | {b / a if a else float('nan'):.2f} |")
    print(f"| joiner process start (spawn -> node up; the simulator has none) (s) | {rp:.3f} | - | - |")
    # a recovery near 0 s on both sides makes the ratio meaningless: the gap over an iteration says more
    print(f"\nrecovery: sim - real = {s['recovery_s'] - r['recovery_s']:+.3f} s = "
          f"{(s['recovery_s'] - r['recovery_s']) / r['median_s']:+.1%} of the real median iteration")


if __name__ == "__main__":
    main()
