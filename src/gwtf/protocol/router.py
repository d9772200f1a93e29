"""The seam between the training protocol and routing: what a node's router must answer.

Owns: `PeerInfo` (what a node knows of a neighbour), `LinkEstimate`, `FlowSlot`, and the `Router`
protocol. The training part of `NodeCore` asks its router where each microbatch goes next; the
router (gwtf's decentralized flow agent, or the SWARM baseline's wiring) keeps whatever tables it
needs, exchanges its own messages (TYPE names starting with "flow." / "swarm.") and timers (keys
whose first element is "flow" / "swarm") through the effects it returns.

Local knowledge only: a router learns neighbours (previous, same and next stage) through
`on_peer_up`, loses them through `on_peer_down`, and hears measured link quality through
`on_link_update` and measured compute times through `on_compute_update`. It never sees a global view.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gwtf.protocol.base import Message, NodeId, RouterEffect, fast_init


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a node tells others about itself when it introduces itself."""

    id: NodeId
    stage: int
    region: str
    compute_s: float  # seconds of forward+backward compute per microbatch of its stage
    capacity: int  # max microbatches in flight
    demand: int = 0  # data holders only: microbatches per iteration
    shard: int = -1  # data holders only: the data shard it serves (0..D-1; -1: none)


@fast_init
@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """Measured (moving-average) link quality from this node to a peer."""

    latency_s: float  # one-way
    bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class FlowSlot:
    """A data holder's reserved route slot: send a microbatch to `next` tagged with `flow_id`."""

    flow_id: int
    next: NodeId


class Router(Protocol):
    """Routing decisions for one node. All methods are pure state transitions: events in, effects out."""

    def on_start(self, now: float) -> list[RouterEffect]: ...

    def on_peer_up(self, info: PeerInfo, link: LinkEstimate, now: float) -> list[RouterEffect]: ...

    def on_peer_down(self, peer: NodeId, now: float) -> list[RouterEffect]: ...

    def on_link_update(self, peer: NodeId, link: LinkEstimate, now: float) -> list[RouterEffect]: ...

    def on_compute_update(self, peer: NodeId, compute_s: float, now: float) -> list[RouterEffect]:
        """`peer`'s compute seconds per microbatch changed (my own when `peer` is my id): re-price
        the edges that use it. Only the runtime measures compute; a peer the router does not
        know is ignored."""
        ...

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[RouterEffect]: ...

    def set_me(self, me: PeerInfo) -> None:
        """This node changed stage (a join or a stage move) without a new router being built."""
        ...

    def on_release(self, peer: NodeId) -> None:
        """One microbatch handed to `peer` is finished there (or abandoned)."""
        ...

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[RouterEffect]: ...

    def flow_slots(self, now: float) -> list[FlowSlot]:
        """Data holders: the routes this node owns now (one microbatch in flight per slot)."""
        ...

    def next_hop(
        self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId], now: float
    ) -> tuple[NodeId, int] | None:
        """Where a microbatch of `origin` that came from `prev` on `flow_id` goes next.

        Relays call it for every forward; a data holder calls it (prev = itself) to reroute a
        first hop that failed.

        Returns (next node, flow id to tag it with), or None when no live next-stage peer is known.
        `exclude` holds peers that failed for this microbatch: the router must pick another one
        (rerouting), even if that means leaving the reserved flow. The last relay stage's next hop
        is always the origin data holder; the training protocol handles that without asking.
        """
        ...
