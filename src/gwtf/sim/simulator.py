"""The simulated driver: one NodeCore per node on the discrete-event Engine.

Owns: `Simulator` (turns effects into engine events through the network and compute models;
crashes, leaves, joins, link windows and scripted faults (`protocol.faults.FaultWatch` says when
one fires: the grammar and trigger semantics every driver shares); feeds Records to the invariant
checker and the metrics) and `run_scenario` (one seeded run -> summary dict + timeline rows).
The systems it runs (gwtf, the SWARM baseline) and the way a node's core is built are
`gwtf.protocol.systems`: the runtime runs the same.

A crash is silent and may happen at any moment: the core is deleted, messages still on its
uplink are lost, deliveries to it fail (the sender's `on_send_failed` after
`sim.send_fail_delay_s`), its timers and compute completions are dropped. A graceful leave calls
`on_leave` first and lets the node's uplink drain.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, assert_never

from gwtf.flow.instance import Instance
from gwtf.protocol.base import CancelTimer, Log, Message, Send, SetTimer
from gwtf.protocol.core import NodeCore
from gwtf.protocol.faults import Fault, FaultWatch, Firing
from gwtf.protocol.invariants import InvariantChecker
from gwtf.protocol.kinds import DISK_KINDS, ComputeKind, RecordName
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.messages import Compute, Effect, FreeIteration, Record
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.systems import System, build_core, get_system
from gwtf.protocol.view import Roster
from gwtf.sim.bound import iteration_bound
from gwtf.sim.churn import ChurnEvent, join_times, link_windows, node_lifetime_event, read_trace
from gwtf.sim.engine import Engine
from gwtf.sim.metrics import Metrics, iteration_fields
from gwtf.sim.models import ComputeModel, LinkWindow, NetworkModel
from gwtf.sim.scenario import ScenarioConfig, build


class Simulator:
    """Runs one scenario for one system and seed (see the module docstring)."""

    def __init__(self, sc: ScenarioConfig, seed: int, system: System,
                 built: tuple[Instance, TrainParams] | None = None) -> None:
        self.sc, self.seed, self.system = sc, seed, system
        self.inst, self.train = built if built is not None else build(sc, seed)
        self.engine = Engine()
        self.rng = random.Random(f"sim:{seed}")
        self.net = NetworkModel(self.inst.network, sc.sim.control_bytes, sc.nodes.downlink_bytes_per_s)
        self.compute = ComputeModel(random.Random(f"compute:{seed}"), sc.sim.compute_jitter,
                                    sc.sim.checkpoint_bandwidth_bytes_per_s)
        self.checker = InvariantChecker(self.train.stages, sc.sim.progress_bound_s, self.train.iterations,
                                        leaderless_stops=sc.protocol.view_size > 0,
                                        full_batch=self.train.data_holders * self.train.microbatches,
                                        microbatches=self.train.microbatches)
        # the global batch's account is the checker's (one implementation, the runtime audit's too)
        self.metrics = Metrics(self.train.tokens_per_microbatch, batch=self.checker.batch)
        self.cores: dict[str, NodeCore] = {}
        self.dead_at: dict[str, float] = {}
        self.timers: dict[tuple[str, Any], int] = {}  # (node, key) -> engine handle of its pending timer
        self._joins = 0
        self.finished = False
        self.stage_lost = False
        self.watch = FaultWatch(())  # which scripted faults fire (docs/faults.md); armed by start()
        self.events_out = 0
        self.pending_steps = 0
        self._priors: dict[tuple[str, str], LinkEstimate] = {}
        self.on_iteration: Callable[[int, float], None] | None = None  # progress hook (CLI)
        self._iterations_done = 0

    # ---- setup -------------------------------------------------------------------------

    def _prior(self, me: PeerInfo, peer: PeerInfo) -> LinkEstimate:
        """What a node believes of a link before measuring it: the region table's value."""
        key = (me.region, peer.region)
        est = self._priors.get(key)
        if est is None:
            net = self.inst.network
            est = LinkEstimate(net.latency_s(*key), net.bandwidth_bytes_per_s(*key))
            self._priors[key] = est
        return est

    def start(self) -> None:
        shard = {n: d for d, n in enumerate(self.inst.by_stage[0])}  # data holder d serves shard d
        infos = [PeerInfo(id=n.id, stage=n.stage, region=n.region, compute_s=n.compute_s,
                          capacity=n.capacity, demand=n.demand, shard=shard.get(n.id, -1)) for n in self.inst.nodes]
        for info in infos:
            flops = self.train.stage_flops[info.stage]
            self._add_core(info, flops / info.compute_s)
        # with bounded views every core builds its tables from one shared index (O(N K), not O(N^2))
        known: list[PeerInfo] | Roster = Roster(infos) if self.sc.protocol.view_size > 0 else infos
        for info in infos:
            self._apply(info.id, self.cores[info.id].on_start(0.0, known))
        horizon = self.sc.sim.max_time_s
        if self.sc.churn.trace:
            for ev in read_trace(self.sc.churn.trace):
                self.engine.schedule(ev.time_s, self._churn, ev)
        else:
            for t in join_times(self.sc.churn, self.rng, horizon):
                self.engine.schedule(t, self._churn, ChurnEvent(t, "join"))
            for info in infos:
                self._draw_lifetime(info.id, 0.0)
        for w in link_windows(self.sc.links, [i.id for i in infos], self.rng, horizon):
            self.net.add_window(w)
        # armed only now: what the initial swarm records in on_start (t=0) counts toward no trigger
        self.watch = FaultWatch(self.sc.faults)
        for f in self.watch.timed:
            self.engine.schedule(f.time_s, self._fault, f, f.node)

    def _add_core(self, info: PeerInfo, speed: float) -> None:
        core = build_core(self.system, info, self.sc.protocol, self.sc.flow, self.train,
                          random.Random(f"{self.seed}:{info.id}"), self._prior)
        self.cores[info.id] = core
        self.net.add_node(info.id, info.region)
        self.compute.add_node(info.id, speed)
        self.metrics.node_up(info.id, self.engine.now)

    def _draw_lifetime(self, node: str, now: float) -> None:
        if self.sc.churn.spare_leader and node == self.inst.by_stage[0][0]:
            return
        ev = node_lifetime_event(self.sc.churn, self.rng, now)
        if ev is not None:
            self.engine.schedule(ev.time_s, self._churn, ChurnEvent(ev.time_s, ev.event, node))

    # ---- effects -----------------------------------------------------------------------

    def _apply(self, node: str, effects: list[Effect]) -> None:
        now = self.engine.now
        fired: list[Firing] = []
        for e in effects:
            if isinstance(e, Send):
                self._send(node, e.to, e.msg, now)
            elif isinstance(e, SetTimer):  # one pending timer per (node, key): a new one replaces it
                key = (node, e.key)
                old = self.timers.get(key)
                if old is not None:
                    self.engine.cancel(old)
                self.timers[key] = self.engine.schedule(e.at, self._fire, node, e.key)
            elif isinstance(e, CancelTimer):
                old = self.timers.pop((node, e.key), None)
                if old is not None:
                    self.engine.cancel(old)
            elif isinstance(e, Compute):
                if self.watch.computes:
                    fired += self.watch.on_compute(e, node)
                if e.kind == ComputeKind.STEP:
                    self.pending_steps += 1
                size = e.size_bytes if e.kind in DISK_KINDS else 0  # checkpoint reads/writes: disk bandwidth
                start, end = self.compute.schedule(node, e.flops, size, now)
                self.engine.schedule(end, self._compute_done, node, e, end - start)
            elif isinstance(e, Record):
                self._record(node, e, now)
            elif isinstance(e, (Log, FreeIteration)):
                pass  # nothing to do: the simulator keeps no log and no tensors
            else:
                assert_never(e)  # raises on an effect type this driver does not know
        core = self.cores.get(node)
        if core is not None and not core.alive:
            self._remove(node, now, crashed=False)
        for firing in fired:  # a compute trigger: the node is hit right after issuing the job (it is lost)
            self.engine.schedule(now, self._fault, firing.fault, firing.node)

    def _send(self, src: str, dst: str, msg: Message, now: float) -> None:
        self.events_out += 1
        net = self.net
        if dst not in net.region:
            self.engine.schedule(now + self.sc.sim.send_fail_delay_s, self._failed, src, dst, msg)
            return
        r = net.send(src, dst, msg.tensor_bytes, now)
        if r is None:
            self.engine.schedule(now + self.sc.sim.send_fail_delay_s, self._failed, src, dst, msg)
            return
        self.engine.schedule(r[1], self._deliver, src, dst, msg, r[0])

    def _deliver(self, src: str, dst: str, msg: Message, left_s: float) -> None:
        died = self.dead_at.get(src)
        if died is not None and died < left_s:
            return  # the sender crashed while the bytes were still on its uplink
        core = self.cores.get(dst)
        if core is None:
            self.engine.after(self.sc.sim.send_fail_delay_s, self._failed, src, dst, msg)
            return
        self._apply(dst, core.on_message(src, msg, self.engine.now))

    def _failed(self, src: str, dst: str, msg: Message) -> None:
        core = self.cores.get(src)
        if core is not None:
            self._apply(src, core.on_send_failed(dst, msg, self.engine.now))

    def _fire(self, node: str, key: Any) -> None:
        del self.timers[(node, key)]  # a replaced or cancelled timer never fires (Engine.cancel)
        core = self.cores.get(node)
        if core is not None:
            self._apply(node, core.on_timer(key, self.engine.now))

    def _compute_done(self, node: str, job: Compute, dur_s: float) -> None:
        core = self.cores.get(node)
        if core is None:
            return
        self.metrics.on_job(node, job.kind, job.mb, dur_s)
        if job.kind == ComputeKind.STEP:
            self.pending_steps -= 1
        self._apply(node, core.on_compute_done(job.job_id, self.engine.now))

    def _record(self, node: str, rec: Record, now: float) -> None:
        f = dict(rec.fields)
        self.checker.on_record(now, node, rec.event, f)
        self.metrics.on_record(now, node, rec.event, f)
        if rec.event == RecordName.ITERATION_DONE:
            self._iterations_done += 1
            if self.on_iteration is not None:
                self.on_iteration(self._iterations_done, now)
        elif rec.event == RecordName.TRAINING_DONE:
            self.finished = True
        elif rec.event == RecordName.STAGE_LOST:
            self.stage_lost = True
        elif rec.event == RecordName.ROLLBACK:
            self.stage_lost = False
        if self.watch.records:
            for firing in self.watch.on_record(rec.event, node, f):
                self.engine.schedule(now, self._fault, firing.fault, firing.node)

    # ---- churn -------------------------------------------------------------------------

    def _remove(self, node: str, now: float, crashed: bool) -> None:
        if node not in self.cores:
            return
        self.pending_steps -= sum(1 for j in self.cores[node].jobs.values() if j[0] == ComputeKind.STEP)
        del self.cores[node]
        self.dead_at[node] = now if crashed else max(now, self.net.uplink_free_s.get(node, now))
        self.checker.on_dead(node, now)
        self.metrics.node_down(node, now)
        if crashed:
            self.metrics.node_crashed(node, now)

    def crash(self, node: str) -> None:
        if node in self.cores:
            self.metrics.bump("crashes_injected")
            self._remove(node, self.engine.now, crashed=True)

    def leave(self, node: str) -> None:
        core = self.cores.get(node)
        if core is not None:
            self.metrics.bump("leaves")
            self._apply(node, core.on_leave(self.engine.now))
            self._remove(node, self.engine.now, crashed=False)

    def join(self) -> None:
        now = self.engine.now
        relays = [n for n in self.inst.nodes if n.stage > 0]
        tmpl = self.rng.choice(relays)
        speed = self.train.stage_flops[tmpl.stage] / tmpl.compute_s
        self._joins += 1
        info = PeerInfo(id=f"j{self._joins}", stage=-1, region=tmpl.region,
                        compute_s=self.train.stage_flops[1] / speed, capacity=tmpl.capacity)
        live = sorted(self.cores)
        if not live:
            return
        contact = self.rng.choice(live)
        self.metrics.bump("joins_started")
        self._add_core(info, speed)
        self._apply(info.id, self.cores[info.id].on_start(now, [self.cores[contact].me]))
        self._draw_lifetime(info.id, now)

    def _churn(self, ev: ChurnEvent) -> None:
        if ev.event == "crash":
            self.crash(ev.node)
        elif ev.event == "leave":
            self.leave(ev.node)
        else:
            self.join()

    def _fault(self, f: Fault, node: str) -> None:
        now = self.engine.now
        if f.event == "crash":
            self.crash(node)
        elif f.event == "leave":
            self.leave(node)
        elif f.event == "join":
            self.join()
        elif f.event == "crash_stage":
            for nid in sorted(n for n, c in self.cores.items() if c.me.stage == f.stage):
                self.crash(nid)
        elif f.event in ("cut", "degrade"):  # the scenario requires a peer for both
            cut = f.event == "cut"
            self.net.add_window(LinkWindow(node, f.peer, now, now + f.duration_s,
                                           1.0 if cut else self.sc.links.latency_factor,
                                           1.0 if cut else self.sc.links.bandwidth_divisor, cut))

    # ---- run ---------------------------------------------------------------------------

    def _done(self) -> bool:
        """Training finished and every live replica has applied the last step."""
        if not self.finished:
            return False
        target = self.train.iterations
        return self.pending_steps == 0 and all(c.version >= target for c in self.cores.values() if c.active)

    def run(self) -> dict[str, Any]:
        with _quiet_gc():
            self.start()
            gc.freeze()  # the swarm built at start lives all run: keep it out of every collection
            self.engine.run(until_s=self.sc.sim.max_time_s, stop=self._done)
        now = self.engine.now
        leaders = [c for _, c in sorted(self.cores.items()) if c.is_leader]
        members = leaders[0].directory if leaders else self.cores
        versions = {n: c.version for n, c in sorted(self.cores.items()) if c.active and n in members}
        covered = {c.me.stage for c in self.cores.values() if c.active}
        lost = self.stage_lost or len(covered) < self.train.stages
        live = {n: (c.me.stage, c.active) for n, c in sorted(self.cores.items()) if c.alive}
        self.checker.finish(now, self.finished, lost, versions, live)
        out = self.metrics.summary(now, self.train.iterations)
        out["microbatches_dropped"] = self.metrics.counters.get("microbatches_dropped", 0)
        out["invariant_violations"] = self.checker.count
        out["stop_reason"] = "" if self.finished else self.checker.stop_reason
        out["violations"] = self.checker.violations[:10]
        out["events"] = self.engine.events_run
        out["nodes_end"] = len(self.cores)
        # the initial instance's bound (cached: every system of one scenario + seed shares it)
        bound = iteration_bound(self.inst, self.train, self.sc.nodes.downlink_bytes_per_s)
        out.update(iteration_fields(out["training_time_s"], out["iterations"], bound))
        return out


@contextmanager
def _quiet_gc() -> Iterator[None]:
    """Collect cycles less often while the event loop runs. A run allocates millions of short-lived
    messages and effects; with CPython's default threshold (700) every few thousand events a
    young collection walks the young objects, and older ones the whole multi-GB swarm. Measured
    on scale-10k, 5 iterations: 190 s -> 164 s wall with the swarm frozen after start and a young
    threshold of 200,000, same events. Restored (and unfrozen) afterwards."""
    before = gc.get_threshold()
    gc.set_threshold(200_000, 50, 1000)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def run_scenario(sc: ScenarioConfig, seed: int, system: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One seeded run of `system` (default: the scenario's `protocol.system`): (summary, timeline rows)."""
    sim = Simulator(sc, seed, get_system(system or sc.protocol.system, sc.protocol))
    summary = sim.run()
    return summary, sim.metrics.timeline_rows()
