"""gwtf's decentralized flow agent (sans-IO): one per node, implements `protocol.router.Router`.

Owns: `FlowAgent`, composed of three parts over one `FlowState` (routing.state: neighbour tables,
flow table, distance-vector costs, effect buffer): `Reservation` (routing.reserve: phase A
hop-by-hop reservation, repairs, notices along flows, consistency checks) and `Annealer`
(routing.anneal: phase B, local moves between same-stage peers, each move a strategy in
routing.moves). The agent answers the router API (`next_hop`, `flow_slots`), turns events into
calls on its parts, dispatches flow messages by class to the part that registered them, and
returns the effects. docs/flow-protocol.md describes the whole protocol.

Local knowledge only: a node knows its previous, same and next-stage peers and nothing else.

Invariants: a node never holds more flows (reserved or established) than its capacity; a flow is
either established end to end or being repaired / released by messages already under way.

Must not import torch, asyncio, socket, threading or time. Randomness only from the rng given.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

from gwtf.config import FlowConfig
from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.router import FlowSlot, LinkEstimate, PeerInfo
from gwtf.protocol.routing.anneal import Annealer
from gwtf.protocol.routing.messages import FlowLoad
from gwtf.protocol.routing.reserve import Reservation
from gwtf.protocol.routing.state import INF, FlowState


class FlowAgent:
    """The flow router of one node. Every public method returns the effects to carry out."""

    def __init__(
        self, me: PeerInfo, stages: int, activation_bytes: int, cfg: FlowConfig, rng: random.Random
    ) -> None:
        self.state = FlowState(me, stages, activation_bytes, cfg, rng)
        self.anneal = Annealer(self.state)
        self.reservation = Reservation(self.state, claims=self.anneal.claim)
        self._handlers: dict[type[Message], Callable[[NodeId, Any], None]] = {
            **self.reservation.handlers(), **self.anneal.handlers(), FlowLoad: self._on_load}

    # ----------------------------------------------------------------------------- Router API

    def on_start(self, now: float) -> list[Any]:
        st = self.state
        st.now = st.started_s = now
        st.tick_at = now + st.rng.uniform(0.0, st.cfg.tick_s)
        st.timer(("flow", "tick"), st.tick_at)
        st.dirty = True
        return self._flush()

    def on_peer_up(self, info: PeerInfo, link: LinkEstimate, now: float) -> list[Any]:
        st = self.state
        st.now = now
        st.add_peer(info, link)
        if st.cfg.load_aware and st.load_level and any(info.id in t for t in (st.prev_peers, st.same_peers, st.next_peers)):
            st.send(info.id, FlowLoad(st.load_level))  # a new neighbour has not heard my load
        early = st.early_adverts.pop(info.id, None)
        if early is not None and info.id in st.next_peers:
            self.reservation.on_advert(info.id, early)
        if info.stage == st.prev_stage and info.id != st.me.id:
            st.advertised = None  # a new upstream peer must hear our costs
        self.anneal.reheat()
        return self._flush()

    def on_peer_down(self, peer: NodeId, now: float) -> list[Any]:
        st = self.state
        st.now = now
        st.early_adverts.pop(peer, None)
        st.remove_peer(peer)
        self.reservation.on_peer_down(peer)
        self.anneal.on_peer_down(peer)
        self.anneal.reheat()
        return self._flush()

    def on_link_update(self, peer: NodeId, link: LinkEstimate, now: float) -> list[Any]:
        st = self.state
        st.now = now
        if st.update_link(peer, link):
            self._repriced(peer)
        return self._flush()

    def on_compute_update(self, peer: NodeId, compute_s: float, now: float) -> list[Any]:
        """A measured compute time (mine when `peer` is me): edge costs, the flows through those
        edges (FlowCost up and down their routes) and my cost adverts follow."""
        st = self.state
        st.now = now
        if st.update_compute(peer, compute_s):
            self._repriced(None if peer == st.me.id else peer)
        return self._flush()

    # ------------------------------------------------------------------ load (flow.load_aware)

    def _on_load(self, sender: NodeId, msg: FlowLoad) -> None:
        if self.state.set_peer_load(sender, msg.load):
            self._repriced(sender, reheat=False)

    def _flush(self) -> list[Any]:
        """The effects so far; with `flow.load_aware`, first announce my load if it changed
        (at most once per `advert_interval_s`: later changes wait for the ("flow", "load") timer)."""
        st = self.state
        if st.cfg.load_aware and (carried := st.carried) != st.load_level:
            due = st.last_load_s + st.cfg.advert_interval_s
            if st.now >= due:
                st.last_load_s = st.now
                st.load_level = carried
                st.reprice_all()
                self._repriced(None, reheat=False)
                msg = FlowLoad(carried)
                for pid in st.load_peers():
                    st.send(pid, msg)
            elif not st.load_timer_set:
                st.load_timer_set = True
                st.timer(("flow", "load"), due)
        return st.flush()

    def _repriced(self, peer: NodeId | None, reheat: bool = True) -> None:
        """The edge to `peer` (every edge: None) changed cost: the flows over it take it up.
        `reheat`: annealing warms up again (not for a load change, which moves themselves cause)."""
        st = self.state
        for e in st.flows.values():
            if e.pending:
                continue
            if e.next is not None and (peer is None or e.next == peer):
                st.set_down(e, e.down_next_s)
            if (peer is None or e.prev == peer) and not st.is_dh:
                st.set_up(e, e.up_prev_s)
        if reheat:
            self.anneal.reheat()

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[Any]:
        st = self.state
        st.now = now
        handler = self._handlers.get(type(msg))
        if handler is not None:
            st.messages_in += 1
            handler(sender, msg)
        return self._flush()

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[Any]:
        st = self.state
        st.now = now
        if key == ("flow", "tick"):
            st.ticks += 1
            self.reservation.on_tick()
            st.expire_tombstones()
            self.anneal.on_tick()
            st.next_tick()
        elif key == ("flow", "advert"):
            st.advert_timer_set = False
            st.dirty = True
        elif key == ("flow", "load"):
            st.load_timer_set = False
        return self._flush()

    def set_me(self, me: PeerInfo) -> None:
        """A flow agent is rebuilt (`router_factory`) when its node changes stage."""

    def on_release(self, peer: NodeId) -> None:
        """Flow slots are reserved per route, not counted per microbatch."""

    def flow_slots(self, now: float) -> list[FlowSlot]:
        """Data holders: one slot per established flow (in flow-table order)."""
        st = self.state
        if not st.is_dh:
            return []
        return [FlowSlot(e.flow_id, e.next) for e in st.flows.values() if not e.pending and e.next]

    def next_hop(
        self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId], now: float
    ) -> tuple[NodeId, int] | None:
        st = self.state
        banned = set(exclude)
        e = st.flows.get((origin, flow_id))
        if e is not None and not e.pending and e.next in st.next_peers and e.next not in banned:
            return e.next, flow_id
        if st.is_last:
            return (origin, flow_id) if origin not in banned else None
        best: tuple[int, float, NodeId] | None = None
        for pid, nb in st.next_peers.items():
            if pid in banned:
                continue
            adv = nb.cost_of(origin)
            rank = (0, nb.cost_s + adv, pid) if adv < INF else (1, nb.cost_s, pid)
            if best is None or rank < best:
                best = rank
        return (best[2], flow_id) if best is not None else None
