"""Real tensors under simulated churn: the simulator's compute effects run on real torch stages.

Owns `TensorSimulator` (a `sim.simulator.Simulator` whose nodes each carry a runtime `Host`:
the simulator still decides WHEN a message arrives and WHEN a compute finishes; the Host, the
very seam the real node process uses, does the math), `relay_crash_schedule` (seeded crashes of
relays only, one never-crashed replica per stage, as `protocol.faults.Fault`s: a time, a record or
a compute trigger), `reference_stages` (the `gwtf train --local`
iterations on the same data) and `compare_stages` (max abs / rel parameter differences).

Tensor life cycle (what a real crash loses, and only that):
- every simulated node has its own tensor store (its Host's worker); a crash deletes it;
- a tensor-carrying message snapshots the sender's tensor when it is SENT (the bytes are on the
  wire) and stores it at the receiver when it is DELIVERED; a message the simulator drops (the
  sender crashed while the bytes were still on its uplink) stores nothing;
- a `Compute` runs when the simulator completes it (per-node FIFO, the order the core emitted
  them); a node that crashed before completion never runs it; `FreeIteration` frees at once.

Everything runs in one process and one thread; `dtype` (float64 by default) is the default torch
dtype for the duration of `run()`, so summation order is the only difference left between runs.
docs/real-tensors.md is the narrative. Must not import asyncio or socket.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gwtf.config import Config
from gwtf.flow.instance import Instance
from gwtf.model.data import TokenDataset
from gwtf.model.presets import model_spec
from gwtf.model.pretrained import resolve_init
from gwtf.model.stage import build_stage
from gwtf.model.trainer import StageGrads, StageOptimizer, apply_steps, iteration_grads, take_steps
from gwtf.protocol.base import Message
from gwtf.protocol.faults import Fault
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.messages import Compute, Effect, FreeIteration, Record
from gwtf.protocol.router import PeerInfo
from gwtf.protocol.systems import get_system
from gwtf.runtime.drive import Host
from gwtf.runtime.node import NodeIdentity
from gwtf.sim.scenario import ScenarioConfig, build
from gwtf.sim.simulator import Simulator

StageWeights = dict[str, Tensor]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Set torch's default float dtype for a block (restored after, even on error)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass(slots=True)
class TensorRun:
    """What a run leaves: the simulator's summary and the live replicas' tensors."""

    summary: dict[str, Any]
    stage_of: dict[str, int]  # live active node -> stage
    version_of: dict[str, int]  # live active node -> optimizer steps applied
    weights: dict[str, StageWeights]  # live active node -> its stage module's state dict
    step_hashes: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)  # (stage, it) -> node -> hash
    losses: dict[int, list[float]] = field(default_factory=dict)  # iteration -> losses computed
    crashed: list[str] = field(default_factory=list)  # nodes crashed, in order
    crash_points: list[str] = field(default_factory=list)  # "node:kind#n" of compute-triggered faults that fired
    contract_violations: list[str] = field(default_factory=list)
    # versions the leader restarted at with the weights held (`rollback` records; train.update_delay 1)
    restarts: list[int] = field(default_factory=list)


def config_for(sc: ScenarioConfig, base: Config) -> Config:
    """The torch side's config, made consistent with the scenario (model, D, M, K, protocol,
    wire). With `base.model.init_from` the model's shape and tokenizer are that source's
    (`pretrained.resolve_init`, as every node process resolves them) and the scenario gives only
    the windows and the cut (seq_len, microbatch_size, stages); its family and preset then size
    the simulated compute alone."""
    m = sc.model
    if base.model.init_from:
        base = resolve_init(base)
        model = replace(base.model, seq_len=m.seq_len, microbatch_size=m.microbatch_size, stages=m.stages)
    else:
        model = replace(base.model, family=m.family, preset=m.preset, seq_len=m.seq_len,
                        microbatch_size=m.microbatch_size, stages=m.stages)
    train = replace(base.train, data_holders=sc.nodes.data_holders,
                    microbatches=sc.nodes.demand_per_dh or sc.train.microbatches, iterations=sc.train.iterations,
                    update_delay=sc.train.update_delay)
    return replace(base, model=model, train=train, protocol=sc.protocol, wire=sc.wire)


class TensorSimulator(Simulator):
    """A Simulator whose compute effects run on real stage modules (see the module docstring)."""

    def __init__(self, sc: ScenarioConfig, seed: int, cfg: Config, dataset: TokenDataset, *,
                 out_dir: str | Path, built: tuple[Instance, TrainParams] | None = None,
                 dtype: torch.dtype = torch.float64, system: str = "gwtf") -> None:
        super().__init__(sc, seed, get_system(system, sc.protocol), built if built is not None else build(sc, seed))
        self.cfg = config_for(sc, cfg)
        self.dataset = dataset
        self.spec = model_spec(self.cfg.model, dataset.vocab_size)
        self.out_dir = Path(out_dir)
        self.dtype = dtype
        self.hosts: dict[str, Host] = {}
        self.shard_of = {n: d for d, n in enumerate(self.inst.by_stage[0])}
        if len(self.shard_of) != self.cfg.train.data_holders:
            raise ValueError("scenario data holders and config train.data_holders differ")
        self._wire: dict[tuple[str, str, int], tuple[Message, list[list[np.ndarray]]]] = {}
        self.result = TensorRun(summary={}, stage_of={}, version_of={}, weights={})

    # ---- nodes --------------------------------------------------------------------------

    def _add_core(self, info: PeerInfo, speed: float) -> None:
        super()._add_core(info, speed)
        shard = self.shard_of.get(info.id)
        ident = NodeIdentity(
            name=info.id, role="data-holder" if shard is not None else "relay",
            stage=info.stage if info.stage >= 0 else None, region=info.region, shard=shard, listen="",
            join=None, device="cpu", out_dir=self.out_dir / info.id)
        # every host gets the corpus: a joiner may be made a data holder (it serves its Welcome's shard)
        self.hosts[info.id] = Host(self.cfg, ident, info.id, self.cores[info.id], self.spec, self.dataset, "cpu")

    def _remove(self, node: str, now: float, crashed: bool) -> None:
        if node in self.cores and crashed:
            self.result.crashed.append(node)
        self.hosts.pop(node, None)  # its tensor store, graphs and weights die with it
        super()._remove(node, now, crashed)

    # ---- tensors on the wire ------------------------------------------------------------

    def _send(self, src: str, dst: str, msg: Message, now: float) -> None:
        host = self.hosts.get(src)
        if host is not None and msg.tensor_bytes > 0:
            arrays = [np.array(a, copy=True) for a in host.tensors_for(msg)]
            if not arrays:
                self.result.contract_violations.append(
                    f"t={now:.3f} {src} sent {msg.TYPE} key={getattr(msg, 'key', None)} without the tensor")
            entry = self._wire.setdefault((src, dst, id(msg)), (msg, []))
            entry[1].append(arrays)
        super()._send(src, dst, msg, now)

    def _take(self, src: str, dst: str, msg: Message) -> list[np.ndarray] | None:
        entry = self._wire.get((src, dst, id(msg)))
        if entry is None:
            return None
        arrays = entry[1].pop(0)
        if not entry[1]:
            del self._wire[(src, dst, id(msg))]
        return arrays

    def _deliver(self, src: str, dst: str, msg: Message, left_s: float) -> None:
        arrays = self._take(src, dst, msg)
        died = self.dead_at.get(src)
        host = self.hosts.get(dst)
        if arrays and host is not None and (died is None or died >= left_s):
            host.store_tensors(msg, arrays)
        super()._deliver(src, dst, msg, left_s)

    def _failed(self, src: str, dst: str, msg: Message) -> None:
        self._take(src, dst, msg)
        super()._failed(src, dst, msg)

    # ---- effects and compute ------------------------------------------------------------

    def _apply(self, node: str, effects: list[Effect]) -> None:
        host = self.hosts.get(node)
        if host is not None:
            for e in effects:
                if type(e) is FreeIteration:
                    host.free_iteration(e)
        super()._apply(node, effects)  # compute-triggered faults: the base driver's FaultWatch

    def _record(self, node: str, rec: Record, now: float) -> None:
        if rec.event == RecordName.ROLLBACK:
            f = dict(rec.fields)
            if f.get("restart"):
                self.result.restarts.append(int(f["version"]))
        super()._record(node, rec, now)

    def _compute_done(self, node: str, job: Compute, dur_s: float) -> None:
        host = self.hosts.get(node)
        if host is not None and node in self.cores:
            try:
                res = host.compute(job)
            except Exception as exc:  # a protocol bug: name where it happened
                raise RuntimeError(f"t={self.engine.now:.3f} node {node}: compute {job.kind} "
                                   f"stage={job.stage} mb={job.mb} failed: {exc!r}") from exc
            for event, f in res.records:
                if event == RecordName.STEPPED:
                    self.result.step_hashes.setdefault((f["stage"], f["iteration"]), {})[node] = f["hash"]
                elif event == RecordName.LOSS:
                    self.result.losses.setdefault(f["iteration"], []).append(f["loss"])
        super()._compute_done(node, job, dur_s)

    # ---- run ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        with default_dtype(self.dtype):
            summary = super().run()
        r = self.result
        r.summary = summary
        r.crash_points = [f"{x.node}:{x.point}#{x.fault.count}" for x in self.watch.fired
                          if x.fault.trigger == "compute"]
        for node in sorted(self.cores):
            core, host = self.cores[node], self.hosts[node]
            if not core.active or host.worker is None:
                continue
            r.stage_of[node] = core.me.stage
            r.version_of[node] = core.version
            r.weights[node] = {k: v.detach().clone() for k, v in host.worker.module.state_dict().items()}
        return summary


def run_with_tensors(sc: ScenarioConfig, seed: int, cfg: Config, dataset: TokenDataset, *,
                     built: tuple[Instance, TrainParams] | None = None,
                     dtype: torch.dtype = torch.float64, out_dir: str | Path | None = None,
                     system: str = "gwtf") -> TensorRun:
    """One seeded simulation with real tensors; checkpoints (if any) go to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="gwtf-tensorsim-") as tmp:
        sim = TensorSimulator(sc, seed, cfg, dataset, out_dir=out_dir or tmp, built=built,
                              dtype=dtype, system=system)
        sim.run()
        return sim.result


# ---- crash schedules, the reference, comparison ------------------------------------------

RECORD_POINTS = (RecordName.CONTRIBUTE, RecordName.ITER_SEEN, RecordName.STEP, RecordName.REDO, RecordName.REROUTE)
COMPUTE_POINTS = (ComputeKind.FORWARD, ComputeKind.BACKWARD, ComputeKind.EXPORT_GRAD, ComputeKind.STEP)


def relay_crash_schedule(rng: random.Random, by_stage: Sequence[Sequence[str]], max_time_s: float,
                         max_count: int, victims: int = 2) -> tuple[list[Fault], list[str]]:
    """Crash up to `victims` relays at random protocol points; one replica per stage never crashes.

    Each victim gets one of: a crash at a random time in [0, max_time_s) (any phase), a crash
    right after its n-th protocol record (`RECORD_POINTS`; "contribute" = mid-backward), or a
    crash when it issues its n-th compute (`COMPUTE_POINTS`: mid-forward, mid-backward,
    mid-aggregation, mid-step). Data holders never crash. Returns (faults, victims).
    """
    pool: list[str] = []
    for stage_nodes in by_stage[1:]:
        nodes = sorted(stage_nodes)
        rng.shuffle(nodes)
        pool += nodes[1:]  # nodes[0] is this stage's survivor
    chosen = sorted(rng.sample(pool, min(victims, len(pool))))
    faults: list[Fault] = []
    for node in chosen:
        how = rng.choice(("time", "record", "compute", "compute"))
        count = rng.randint(1, max_count)
        if how == "time":
            faults.append(Fault(event="crash", node=node, time_s=rng.uniform(0.0, max_time_s)))
        elif how == "record":
            faults.append(Fault(event="crash", node=node, after_event=rng.choice(RECORD_POINTS), count=count))
        else:
            faults.append(Fault(event="crash", node=node, after_compute=rng.choice(COMPUTE_POINTS), count=count))
    return faults, chosen


def reference_stages(cfg: Config, dataset: TokenDataset, iterations: int,
                     dtype: torch.dtype = torch.float64,
                     restarts: Collection[int] = ()) -> tuple[list[StageWeights], list[float]]:
    """`gwtf train --local` semantics (train_iteration) for `iterations`: stage weights, losses.
    With `train.update_delay` 1, its delayed steps; `restarts`: versions v at which the swarm
    restarted with the weights held (`Coordinator._restart`): the pending step is applied before
    iteration v, which then runs on the weights it makes (the gradient of the iteration given
    up is not used)."""
    delay = cfg.train.update_delay
    with default_dtype(dtype):
        spec = model_spec(cfg.model, dataset.vocab_size)
        stages = [build_stage(spec, k, cfg.model.stages, cfg.train.seed) for k in range(cfg.model.stages)]
        opts = [StageOptimizer(s, cfg.train) for s in stages]
        losses: list[float] = []
        pending: StageGrads | None = None
        for t in range(iterations):
            if pending is not None and t in restarts:
                apply_steps(opts, t - 1, pending)
                pending = None
            stats, grads = iteration_grads(stages, opts, dataset, t, cfg.train)
            losses.append(stats.loss)
            pending = take_steps(opts, t, grads, pending, delay)
        if pending is not None:
            apply_steps(opts, iterations - 1, pending)
    return [{k: v.detach().clone() for k, v in s.state_dict().items()} for s in stages], losses


def replica_problems(run: TensorRun, want: Mapping[int, StageWeights] | Sequence[StageWeights], iterations: int,
                     atol: float, rtol: float) -> list[str]:
    """What is wrong with the live replicas of a finished run, as readable lines (empty: none):
    a replica not at version `iterations`, weights off `want[stage]` beyond (`atol`, `rtol`)
    (`compare_stages`), replicas of a stage whose weights hashes differ after a step."""
    out: list[str] = []
    for node, weights in sorted(run.weights.items()):
        stage = run.stage_of[node]
        if run.version_of[node] != iterations:
            out.append(f"{node} (stage {stage}) at version {run.version_of[node]}, want {iterations}")
        d_abs, d_rel = compare_stages(weights, want[stage])
        if d_abs > atol or d_rel > rtol:
            out.append(f"{node} (stage {stage}) differs: max abs {d_abs:.3e}, rel {d_rel:.3e}")
    for (stage, it), hashes in sorted(run.step_hashes.items()):
        if len(set(hashes.values())) != 1:
            out.append(f"stage {stage} iteration {it}: replicas diverged {hashes}")
    return out


def compare_stages(got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> tuple[float, float]:
    """(max abs difference, max relative difference = abs / max|want| per tensor) over a stage."""
    if set(got) != set(want):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(want))[:4]}")
    max_abs = max_rel = 0.0
    for name, w in want.items():
        d = float((got[name].double() - w.double()).abs().max()) if w.numel() else 0.0
        scale = float(w.double().abs().max()) if w.numel() else 0.0
        max_abs = max(max_abs, d)
        max_rel = max(max_rel, d / scale if scale > 0 else d)
    return max_abs, max_rel
