"""The systems both drivers run: a named (core class, churn policy, router) and one way to build a node.

Owns: `System`, the registry `SYSTEMS` ("gwtf" and the "swarm" baseline; `register_system` adds
more), `get_system` (by name: `protocol.system`, or the simulator's `--systems`), `build_core`
(the one function the simulator and the runtime call to make a node's `NodeCore`) and
`iteration_params` (the core's `TrainParams` from a model's shape: the one formula both drivers
use). What the core does with a system is the same in both drivers: a stage move, SWARM's
wiring, bans and restarts are effects every driver carries out.

"gwtf" runs `GwtfCore` (rebalancing, PAPER.md 3.5) when `protocol.rebalance_period_s` > 0, else
plain `NodeCore`; "swarm" runs `SwarmCore` with SWARM's policy (restart a microbatch whose
backward lost a node), router and the paper's rebalancing every `swarm_rebalance_period_s`;
"swarm-released" is SWARM as its released code runs, without rebalancing. Importing this module registers every message type of every
system (`protocol.base.MESSAGE_TYPES`), so a node's wire codec decodes them all whichever
system it runs (a lazily imported `StageMove` was once refused as "unknown type").

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from gwtf.config import FlowConfig, ProtocolConfig
from gwtf.errors import UserError
from gwtf.protocol.core import NodeCore, make_router
from gwtf.protocol.ledger import LinkPrior, Policy, TrainParams
from gwtf.protocol.rebalance import GWTF_REBALANCE_POLICY, GwtfCore
from gwtf.protocol.router import PeerInfo, Router
from gwtf.protocol.routing import FlowAgent  # noqa: F401  (registers the flow messages)
from gwtf.protocol.simple_router import GreedyRouter
from gwtf.protocol.swarm import SWARM_POLICY, SwarmCore, swarm_router

__all__ = ["SYSTEMS", "ModelShape", "RouterFactory", "System", "build_core", "get_system",
           "iteration_params", "register_system"]

RouterFactory = Callable[[PeerInfo, TrainParams, ProtocolConfig, FlowConfig], Router]
"""Builds a node's router from its own description (deterministic: seeded from it)."""


@dataclass(frozen=True, slots=True)
class System:
    """What differs between compared systems: the core class, the churn policy and the router."""

    name: str
    policy: Policy
    router: RouterFactory
    core: Callable[..., NodeCore] = NodeCore  # a baseline extends NodeCore through its hooks


def _gwtf_router(me: PeerInfo, train: TrainParams, protocol: ProtocolConfig, flow: FlowConfig) -> Router:
    return make_router(protocol.router, me, train, random.Random(f"router:{me.id}"), flow)


def _gwtf(protocol: ProtocolConfig) -> System:
    if protocol.rebalance_period_s > 0:
        return System("gwtf", GWTF_REBALANCE_POLICY, _gwtf_router, GwtfCore)
    return System("gwtf", Policy(), _gwtf_router)


def _swarm_router(me: PeerInfo, train: TrainParams, protocol: ProtocolConfig, flow: FlowConfig) -> Router:
    return swarm_router(me, train, protocol)


def _swarm(protocol: ProtocolConfig) -> System:
    return System("swarm", SWARM_POLICY, _swarm_router, SwarmCore)


def _swarm_released(protocol: ProtocolConfig) -> System:
    """SWARM as its released code runs: no rebalancing (the paper describes it; the code has none)."""
    return System("swarm-released", replace(SWARM_POLICY, name="swarm-released", rebalance_every=0),
                  _swarm_router, SwarmCore)


SYSTEMS: dict[str, Callable[[ProtocolConfig], System]] = {
    "gwtf": _gwtf, "swarm": _swarm, "swarm-released": _swarm_released}


def register_system(name: str, factory: Callable[[ProtocolConfig], System]) -> None:
    SYSTEMS[name] = factory


def get_system(name: str, protocol: ProtocolConfig) -> System:
    """The named system for these protocol knobs. Raises UserError naming the known ones."""
    if name not in SYSTEMS:
        raise UserError(f"unknown system {name!r}; available: {', '.join(sorted(SYSTEMS))}")
    return SYSTEMS[name](protocol)


def build_core(system: System, me: PeerInfo, protocol: ProtocolConfig, flow: FlowConfig, train: TrainParams,
               rng: random.Random, link_prior: LinkPrior | None = None) -> NodeCore:
    """One node's core, the same way in every driver. A joiner (stage -1, before it picks a
    stage) is given no router: the core routes nothing until `on_welcome` gives it a stage and
    builds the real one through the system's router factory."""

    def factory(info: PeerInfo) -> Router:
        if info.stage < 0:
            return GreedyRouter(info, train.stages, train.route_bytes)
        return system.router(info, train, protocol, flow)

    return system.core(me, protocol, train, rng, None, system.policy, link_prior, factory)


class ModelShape(Protocol):
    """What `iteration_params` needs of a model (`gwtf.model.presets.ModelSpec` has it)."""

    def activation_bytes(self, microbatch_size: int, dtype_bytes: int = 4) -> int: ...

    def stage_flops_per_microbatch(self, stage: int, stages: int, microbatch_size: int) -> float: ...

    def stage_state_bytes(self, stage: int, stages: int, dtype_bytes: int = 4) -> int: ...

    def stage_param_count(self, stage: int, stages: int) -> int: ...


def _fp32_bytes(values: int) -> int:
    return 4 * values


def iteration_params(shape: ModelShape, *, stages: int, microbatch_size: int, seq_len: int,
                     microbatches: int, iterations: int, wire_bytes: tuple[int, int] | None = None,
                     data_holders: int = 0, grad_bytes: Callable[[int], int] | None = None,
                     update_delay: int = 0) -> TrainParams:
    """The core's view of an iteration: `microbatches` per data holder per iteration; weights,
    state and parameter gradients float32; activations and activation gradients `wire_bytes`
    = (activation, gradient) bytes on the wire (`gwtf.model.wire.boundary_bytes` of the [wire]
    section; None = float32); `data_holders`: the data shards a joiner may take (0: none);
    `grad_bytes`: the bytes of a stage gradient of n values in the within-stage reduction's
    format (`wire.stage_gradients`; None: float32); `update_delay`: `train.update_delay`."""
    act, grad = wire_bytes if wire_bytes is not None else (shape.activation_bytes(microbatch_size),) * 2
    return TrainParams(
        stages=stages, microbatches=microbatches, iterations=iterations,
        activation_bytes=act, activation_grad_bytes=grad,
        stage_flops=tuple(shape.stage_flops_per_microbatch(k, stages, microbatch_size) for k in range(stages)),
        stage_state_bytes=tuple(shape.stage_state_bytes(k, stages) for k in range(stages)),
        stage_grad_bytes=tuple((grad_bytes or _fp32_bytes)(shape.stage_param_count(k, stages)) for k in range(stages)),
        tokens_per_microbatch=microbatch_size * seq_len, data_holders=data_holders, update_delay=update_delay,
    )
