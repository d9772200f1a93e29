"""A greedy `Router`: the cheapest live next-stage peer with spare capacity (deterministic ties).

Owns: `GreedyRouter`, the router NodeCore uses when `protocol.router = "greedy"` (and the
fallback every test can rely on). It keeps a table of next-stage peers with their measured link,
counts the microbatches it has handed to each (released through `on_release`, an optional hook
NodeCore calls when the backward from that peer arrives or the hop is abandoned), and picks the
peer minimising `(over capacity, d(me, peer), peer id)` with d the flow cost of `flow.cost`.

It exchanges no messages and sets no timers. Must not import torch, asyncio, socket, threading
or time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from gwtf.flow.cost import edge_cost_s
from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.router import FlowSlot, LinkEstimate, PeerInfo


class GreedyRouter:
    """Lowest edge-cost next-stage peer that still has spare in-flight capacity."""

    def __init__(self, me: PeerInfo, stages: int, activation_bytes: int) -> None:
        self.me = me
        self.stages = stages
        self.activation_bytes = activation_bytes
        self._peers: dict[NodeId, tuple[PeerInfo, LinkEstimate]] = {}
        self._cost: dict[NodeId, float] = {}
        self._assigned: dict[NodeId, int] = {}

    # -- Router protocol ---------------------------------------------------------------------

    def on_start(self, now: float) -> list[Any]:
        return []

    def set_me(self, me: PeerInfo) -> None:
        """The node changed stage (join): forget peers of the old next stage."""
        if me.stage != self.me.stage:
            self._peers.clear()
            self._cost.clear()
            self._assigned.clear()
        self.me = me

    def _next_stage(self) -> int:
        return (self.me.stage + 1) % self.stages

    def on_peer_up(self, info: PeerInfo, link: LinkEstimate, now: float) -> list[Any]:
        if info.id == self.me.id or info.stage != self._next_stage() or self._next_stage() == 0:
            return []
        self._peers[info.id] = (info, link)
        self._cost[info.id] = self._edge_cost(info, link)
        self._assigned.setdefault(info.id, 0)
        return []

    def on_peer_down(self, peer: NodeId, now: float) -> list[Any]:
        self._peers.pop(peer, None)
        self._cost.pop(peer, None)
        return []

    def on_link_update(self, peer: NodeId, link: LinkEstimate, now: float) -> list[Any]:
        entry = self._peers.get(peer)
        if entry is not None:
            self._peers[peer] = (entry[0], link)
            self._cost[peer] = self._edge_cost(entry[0], link)
        return []

    def on_compute_update(self, peer: NodeId, compute_s: float, now: float) -> list[Any]:
        if peer == self.me.id:
            self.me = replace(self.me, compute_s=compute_s)
            self._cost = {pid: self._edge_cost(info, link) for pid, (info, link) in self._peers.items()}
            return []
        entry = self._peers.get(peer)
        if entry is not None:
            info = replace(entry[0], compute_s=compute_s)
            self._peers[peer] = (info, entry[1])
            self._cost[peer] = self._edge_cost(info, entry[1])
        return []

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[Any]:
        return []

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[Any]:
        return []

    def flow_slots(self, now: float) -> list[FlowSlot]:
        return []  # no reservations: data holders ask next_hop for every microbatch

    def next_hop(
        self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId], now: float
    ) -> tuple[NodeId, int] | None:
        # the least (over capacity, cost x (1 + load / capacity), id), compared field by field
        banned = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        peers, assigned = self._peers, self._assigned
        best: NodeId | None = None
        b_full, b_cost = True, 0.0
        for pid, cost in self._cost.items():
            if pid in banned:
                continue
            cap = peers[pid][0].capacity
            load = assigned.get(pid, 0)
            full = load >= cap
            c = cost * (1.0 + load / max(1, cap))
            if best is None or (full < b_full) or (
                    full == b_full and (c < b_cost or (c == b_cost and pid < best))):
                best, b_full, b_cost = pid, full, c
        if best is None:
            return None
        assigned[best] = assigned.get(best, 0) + 1
        return best, flow_id

    # -- optional hook -----------------------------------------------------------------------

    def on_release(self, peer: NodeId) -> None:
        """One microbatch handed to `peer` is finished there (or abandoned)."""
        n = self._assigned.get(peer, 0)
        if n > 0:
            self._assigned[peer] = n - 1

    def _edge_cost(self, info: PeerInfo, link: LinkEstimate) -> float:
        bw = max(link.bandwidth_bytes_per_s, 1.0)
        return edge_cost_s(self.me.compute_s, info.compute_s, link.latency_s, link.latency_s,
                           bw, bw, self.activation_bytes)
