"""Simulator scenarios: the `ScenarioConfig` tree, its loader, and what it builds.

Owns: the scenario dataclasses (TOML files in configs/scenarios/, loaded strictly with
`gwtf.config.from_dict`: unknown key or bad value -> UserError naming the key), `load_scenario`
(file + `--set` overrides), and `build` (scenario + seed -> Instance, TrainParams, per-node
speeds). A scenario is data: nodes (with the GPU mix, FLOP/s and bandwidth scales, downlink),
model, iterations, churn rates, link instability, scripted faults (`gwtf.protocol.faults`:
the one fault grammar, re-exported here as `Fault`), protocol knobs, the wire formats of
activations and gradients (`[wire]`, as in the train config: message sizes follow them).

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gwtf.config import (
    FlowConfig,
    ModelConfig,
    ProtocolConfig,
    WireConfig,
    from_dict,
    merge_overrides,
    read_toml,
)
from gwtf.errors import UserError
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance import Instance
from gwtf.flow.network import CONTROL_BYTES
from gwtf.flow.profiles import resolve_mix
from gwtf.model.presets import model_spec
from gwtf.model.wire import boundary_bytes, wire_bytes
from gwtf.protocol.faults import Fault as Fault  # re-exported: the scenario's [[faults]] entries
from gwtf.protocol.faults import check_role, parse_fault, require
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.systems import iteration_params

SIM_ACTIONS = ("crash", "leave", "join", "cut", "degrade", "crash_stage")  # flip: the runtime's (wire bytes)
SIM_TRIGGERS = ("time", "record", "compute")


def _req(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise UserError(f"scenario: {key} {why}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSection:
    family: Literal["gpt", "llama"] = "gpt"  # model family (as model.family of the run config)
    preset: Literal["tiny", "small", "124m", "500m", "1b"] = "124m"  # model size whose compute and tensor sizes are simulated
    seq_len: int = 1024  # tokens per sequence
    microbatch_size: int = 8  # sequences per microbatch
    stages: int = 4  # pipeline stages incl. stage 0 (data holders)
    vocab_size: int = 2048  # vocabulary size (embedding and head sizes)

    def __post_init__(self) -> None:
        _req(self.stages >= 2, "model.stages", "must be >= 2")
        _req(self.seq_len >= 2, "model.seq_len", "must be >= 2")
        _req(self.microbatch_size >= 1, "model.microbatch_size", "must be >= 1")
        _req(self.vocab_size >= 260, "model.vocab_size", "must be >= 260")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodesSection:
    count: int = 16  # nodes in total (data holders + relays)
    data_holders: int = 4  # data holders (stage 0)
    network: str = "geo10"  # region table of latencies and bandwidths (gwtf/resources/NAME.toml)
    demand_per_dh: int = 0  # microbatches per data holder per iteration; 0 = train.microbatches
    relay_capacity: tuple[int, ...] = ()  # (lo, hi): uniform draw; () = memory model
    jitter_fraction: float = 0.0  # per-link noise on the network table
    gpu_mix: str | tuple[Any, ...] = "default"  # flow.profiles.NAMED_MIXES name, or [[profile, share], ...]
    gpu_flops_scale: float = 1.0  # multiplies every node's FLOP/s
    link_bandwidth_scale: float = 1.0  # multiplies every link's bandwidth (same-region links too)
    downlink_bytes_per_s: float = 0.0  # every node's downlink (a FIFO after the sender's uplink); 0 = unlimited

    def __post_init__(self) -> None:
        _req(self.count >= 2, "nodes.count", "must be >= 2")
        _req(1 <= self.data_holders < self.count, "nodes.data_holders", "must be in [1, nodes.count)")
        _req(self.demand_per_dh >= 0, "nodes.demand_per_dh", "must be >= 0")
        _req(len(self.relay_capacity) in (0, 2), "nodes.relay_capacity", "must be [] or [lo, hi]")
        _req(self.jitter_fraction >= 0, "nodes.jitter_fraction", "must be >= 0")
        for k in ("gpu_flops_scale", "link_bandwidth_scale"):
            _req(math.isfinite(getattr(self, k)) and getattr(self, k) > 0, f"nodes.{k}", "must be a finite number > 0")
        _req(math.isfinite(self.downlink_bytes_per_s) and self.downlink_bytes_per_s >= 0,
             "nodes.downlink_bytes_per_s", "must be a finite number >= 0 (0 = unlimited)")
        if not isinstance(self.gpu_mix, str):  # a hashable, TOML-writable value: tuples of (name, share)
            object.__setattr__(self, "gpu_mix", tuple(tuple(p) if isinstance(p, list) else p for p in self.gpu_mix))
        try:
            resolve_mix(self.gpu_mix, "nodes.gpu_mix")
        except UserError as e:
            raise UserError(f"scenario: {e}") from None

    def profile_mix(self) -> tuple[tuple[str, float], ...]:
        """`gpu_mix` as (profile, share) pairs."""
        return resolve_mix(self.gpu_mix, "nodes.gpu_mix")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSection:
    microbatches: int = 4  # M per data holder per iteration
    iterations: int = 10  # K: iterations to simulate
    update_delay: int = 0  # as the swarm config's train.update_delay (0 or 1)

    def __post_init__(self) -> None:
        _req(self.microbatches >= 1, "train.microbatches", "must be >= 1")
        _req(self.update_delay in (0, 1), "train.update_delay", "must be 0 or 1")
        _req(self.iterations >= 1, "train.iterations", "must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChurnSection:
    crash_rate_per_hour: float = 0.0  # per node: 0.10 = 10%/h
    leave_rate_per_hour: float = 0.0  # per node, graceful
    join_rate_per_hour: float = 0.0  # swarm-wide arrivals of new nodes
    trace: str = ""  # CSV file: time_s,event,node (crash|leave|join); overrides the rates
    spare_leader: bool = False  # never crash the first data holder (isolates other effects)

    def __post_init__(self) -> None:
        for k in ("crash_rate_per_hour", "leave_rate_per_hour", "join_rate_per_hour"):
            _req(getattr(self, k) >= 0, f"churn.{k}", "must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinksSection:
    events_per_hour: float = 0.0  # swarm-wide link instability windows
    duration_s: float = 60.0  # length of one instability window
    latency_factor: float = 3.0  # an unstable link's latency is multiplied by this
    bandwidth_divisor: float = 4.0  # an unstable link's bandwidth is divided by this
    cut_fraction: float = 0.2  # share of windows that cut the link entirely

    def __post_init__(self) -> None:
        _req(self.events_per_hour >= 0, "links.events_per_hour", "must be >= 0")
        _req(self.duration_s > 0, "links.duration_s", "must be > 0")
        _req(self.latency_factor >= 1, "links.latency_factor", "must be >= 1")
        _req(self.bandwidth_divisor >= 1, "links.bandwidth_divisor", "must be >= 1")
        _req(0 <= self.cut_fraction <= 1, "links.cut_fraction", "must be in [0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimSection:
    compute_jitter: float = 0.05  # +- share of every compute duration (seeded)
    control_bytes: int = CONTROL_BYTES  # header bytes of every message (the runtime's WAN emulation: the same)
    send_fail_delay_s: float = 1.0  # a send to a dead node / over a cut link fails after this
    checkpoint_bandwidth_bytes_per_s: float = 100e6  # speed of writing / fetching a stage checkpoint
    max_time_s: float = 86400.0  # stop the simulation at this virtual time
    progress_bound_s: float = 3600.0  # invariant: an iteration completes at least this often

    def __post_init__(self) -> None:
        _req(0 <= self.compute_jitter < 1, "sim.compute_jitter", "must be in [0, 1)")
        _req(self.control_bytes >= 0, "sim.control_bytes", "must be >= 0")
        _req(self.send_fail_delay_s > 0, "sim.send_fail_delay_s", "must be > 0")
        _req(self.checkpoint_bandwidth_bytes_per_s > 0, "sim.checkpoint_bandwidth_bytes_per_s", "must be > 0")
        _req(self.max_time_s > 0, "sim.max_time_s", "must be > 0")
        _req(self.progress_bound_s > 0, "sim.progress_bound_s", "must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScenarioConfig:
    name: str = "scenario"  # scenario name (output folder runs/sim-NAME-sSEED)
    description: str = ""  # free text shown nowhere but the file
    model: ModelSection = field(default_factory=ModelSection)
    nodes: NodesSection = field(default_factory=NodesSection)
    train: TrainSection = field(default_factory=TrainSection)
    churn: ChurnSection = field(default_factory=ChurnSection)
    links: LinksSection = field(default_factory=LinksSection)
    sim: SimSection = field(default_factory=SimSection)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)  # used when protocol.router = "flow"
    wire: WireConfig = field(default_factory=WireConfig)  # activation/gradient formats: message sizes
    faults: tuple[Fault, ...] = ()  # scripted faults: TOML tables or compact strings (docs/faults.md)

    def __post_init__(self) -> None:
        # the data holders n0..n{D-1} stay data holders (a relay may be made one: a vacant shard)
        holders = {f"n{k}" for k in range(self.nodes.data_holders)}
        for f in self.faults:
            require(f, SIM_ACTIONS, SIM_TRIGGERS, f"scenario: faults {f.spec()!r}")
            if f.node in holders:  # a fault a data holder can never fire (`faults.check_role`)
                check_role(f, "data-holder", f"scenario: faults {f.spec()!r} (node {f.node})", self.model.stages)
        relays = self.nodes.count - self.nodes.data_holders
        _req(relays >= self.model.stages - 1, "nodes.count",
             f"leaves {relays} relays for {self.model.stages - 1} relay stages: a stage with no node")


def load_scenario(path: str | Path | None, overrides: list[str] | None = None) -> ScenarioConfig:
    data: dict[str, Any] = read_toml(path) if path else {}
    data = merge_overrides(data, overrides or [])
    faults = data.get("faults")
    if isinstance(faults, list):  # each entry a [[faults]] table or a compact string: checked here
        data["faults"] = [parse_fault(f, "scenario", f"faults[{i}]").table() for i, f in enumerate(faults)]
    return from_dict(ScenarioConfig, data)


def build(sc: ScenarioConfig, seed: int) -> tuple[Instance, TrainParams]:
    """Instance (nodes, network) and iteration parameters for one seeded run."""
    m = sc.model
    demand = sc.nodes.demand_per_dh or sc.train.microbatches
    rc = sc.nodes.relay_capacity
    inst = generate_instance(
        sc.nodes.count, m.stages, sc.nodes.data_holders, network=sc.nodes.network, seed=seed, model=m.family,
        preset=m.preset, microbatch_size=m.microbatch_size, seq_len=m.seq_len, vocab_size=m.vocab_size,
        demand_per_dh=demand, relay_capacity=(rc[0], rc[1]) if rc else None,
        jitter_fraction=sc.nodes.jitter_fraction, mix=sc.nodes.profile_mix(),
        flops_scale=sc.nodes.gpu_flops_scale, bandwidth_scale=sc.nodes.link_bandwidth_scale,
    )
    cfg = ModelConfig(family=m.family, preset=m.preset, seq_len=m.seq_len, microbatch_size=m.microbatch_size,
                      stages=m.stages)
    spec = model_spec(cfg, m.vocab_size)
    w = sc.wire
    sizes = boundary_bytes(spec.activation_bytes(m.microbatch_size, dtype_bytes=1), w.activations, w.gradients,
                           w.block_values)
    train = iteration_params(spec, stages=m.stages, microbatch_size=m.microbatch_size, seq_len=m.seq_len,
                             microbatches=demand, iterations=sc.train.iterations, wire_bytes=sizes,
                             grad_bytes=lambda n: wire_bytes(n, w.stage_gradients, w.block_values),
                             data_holders=len(inst.by_stage[0]), update_delay=sc.train.update_delay)
    if train.route_bytes != inst.activation_bytes:  # the central optimum prices the same bytes
        inst = replace(inst, activation_bytes=train.route_bytes)
    return inst, train
