"""gwtf's decentralized flow agent (sans-IO): one per node, implements `protocol.router.Router`.

Owns: `FlowAgent`: neighbour tables (prev / same / next stage, each with its edge cost d(i,j)
from `flow.cost.edge_cost_s`), the flow table (one entry per flow through this node, named by
(origin data holder, flow id), with prev, next, up cost = route cost from the origin to here and
down cost = route cost from here back to the origin), phase A (distance-vector cost adverts and
hop-by-hop reservation), repairs (crash of a neighbour, push back, consistency checks) and
`next_hop` / `flow_slots`. Phase B (simulated annealing between same-stage peers) lives in
`protocol.flow_anneal`; docs/flow-protocol.md describes the whole protocol.

Invariants: a node never holds more flows (reserved or established) than its capacity; a flow is
either established end to end or being repaired / released by messages already under way.

Must not import torch, asyncio, socket, threading or time. Randomness only from the rng given.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from gwtf.config import FlowConfig
from gwtf.protocol.base import Message, NodeId, SetTimer
from gwtf.protocol.flow_anneal import FlowAnneal
from gwtf.protocol.flow_core import INF, FlowCore, FlowEntry, FlowKey
from gwtf.protocol.flow_messages import (
    FlowAdvert,
    FlowCancel,
    FlowCheck,
    FlowCheckFail,
    FlowCost,
    FlowPropose,
    FlowPushBack,
    FlowQuery,
    FlowRekey,
    FlowRequest,
    FlowRespond,
    FlowResponse,
    FlowSwapTail,
    FlowSwitch,
    FlowTable,
)
from gwtf.protocol.router import FlowSlot, LinkEstimate, PeerInfo

__all__ = ["FlowAgent", "FlowEntry", "FlowKey"]


EARLY_ADVERTS_KEPT = 64  # adverts kept from peers not yet up (joiners between Welcome and MemberUp)

class FlowAgent(FlowAnneal):
    """The flow router of one node. Every public method returns the effects to carry out."""

    def __init__(
        self, me: PeerInfo, stages: int, activation_bytes: int, cfg: FlowConfig, rng: random.Random
    ) -> None:
        FlowCore.__init__(self, me, stages, activation_bytes, cfg, rng)
        self._anneal_init()
        self._handlers: dict[type[Message], Any] = {
            FlowAdvert: self._on_advert,
            FlowRequest: self._on_request,
            FlowResponse: self._on_response,
            FlowCancel: self._on_cancel,
            FlowPushBack: self._on_push_back,
            FlowCost: self._on_cost,
            FlowSwitch: self._on_switch,
            FlowCheck: self._on_check,
            FlowCheckFail: self._on_check_fail,
            FlowQuery: self._on_query,
            FlowTable: self._on_table,
            FlowPropose: self._on_propose,
            FlowRespond: self._on_respond,
            FlowRekey: self._on_rekey,
            FlowSwapTail: self._on_swap_tail,
        }

    # ----------------------------------------------------------------------------- Router API

    def on_start(self, now: float) -> list[Any]:
        self.now = self.started_s = now
        self._tick_at = now + self.rng.uniform(0.0, self.cfg.tick_s)
        self._out.append(SetTimer(("flow", "tick"), self._tick_at))
        self._dirty = True
        return self._flush()

    def on_peer_up(self, info: PeerInfo, link: LinkEstimate, now: float) -> list[Any]:
        self.now = now
        self._add_peer(info, link)
        early = self._early_adverts.pop(info.id, None)
        if early is not None and info.id in self.next_peers:
            self._on_advert(info.id, early)
        if info.stage == self.prev_stage and info.id != self.me.id:
            self._advertised = None  # a new upstream peer must hear our costs
        self._reheat()
        return self._flush()

    def on_peer_down(self, peer: NodeId, now: float) -> list[Any]:
        self.now = now
        self._early_adverts.pop(peer, None)
        self._remove_peer(peer)
        for e in list(self.flows.values()):
            if e.next == peer:
                self._repair(e)
            elif e.prev == peer and not self.is_dh:
                self._drop(e, cancel_next=True)
        self._anneal_peer_down(peer)
        self._reheat()
        return self._flush()

    def on_link_update(self, peer: NodeId, link: LinkEstimate, now: float) -> list[Any]:
        self.now = now
        if self._update_link(peer, link):
            self._repriced(peer)
        return self._flush()

    def on_compute_update(self, peer: NodeId, compute_s: float, now: float) -> list[Any]:
        """A measured compute time (mine when `peer` is me): edge costs, the flows through those
        edges (FlowCost up and down their routes) and my cost adverts follow."""
        self.now = now
        if self._update_compute(peer, compute_s):
            self._repriced(None if peer == self.me.id else peer)
        return self._flush()

    def _repriced(self, peer: NodeId | None) -> None:
        """The edge to `peer` (every edge: None) changed cost: the flows over it take it up."""
        for e in self.flows.values():
            if e.pending:
                continue
            if e.next is not None and (peer is None or e.next == peer):
                self._set_down(e, e.down_next_s)
            if (peer is None or e.prev == peer) and not self.is_dh:
                self._set_up(e, e.up_prev_s)
        self._reheat()

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[Any]:
        self.now = now
        handler = self._handlers.get(type(msg))
        if handler is not None:
            self.messages_in += 1
            handler(sender, msg)
        return self._flush()

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[Any]:
        self.now = now
        if key == ("flow", "tick"):
            self._tick()
            self._next_tick()
        elif key == ("flow", "advert"):
            self._advert_timer_set = False
            self._dirty = True
        return self._flush()

    def flow_slots(self, now: float) -> list[FlowSlot]:
        """Data holders: one slot per established flow (in flow-table order)."""
        if not self.is_dh:
            return []
        return [FlowSlot(e.flow_id, e.next) for e in self.flows.values() if not e.pending and e.next]

    def next_hop(
        self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId], now: float
    ) -> tuple[NodeId, int] | None:
        banned = set(exclude)
        e = self.flows.get((origin, flow_id))
        if e is not None and not e.pending and e.next in self.next_peers and e.next not in banned:
            return e.next, flow_id
        if self.is_last:
            return (origin, flow_id) if origin not in banned else None
        best: tuple[int, float, NodeId] | None = None
        for pid, nb in self.next_peers.items():
            if pid in banned:
                continue
            adv = nb.cost_of(origin)
            rank = (0, nb.cost_s + adv, pid) if adv < INF else (1, nb.cost_s, pid)
            if best is None or rank < best:
                best = rank
        return (best[2], flow_id) if best is not None else None

    # ---------------------------------------------------------------------------------- tick

    def _tick(self) -> None:
        self.ticks += 1
        now = self.now
        for e in list(self.flows.values()):
            if e.pending and now - e.requested_s > self.cfg.request_timeout_s:
                self._forward(e)  # silence counts as a refusal; a late accept gets cancelled
        if self.is_dh:
            self._build_flows()
        if self.ticks % self.cfg.check_every_ticks == self._check_phase:
            self._send_checks()
        self._expire_tombstones()
        self._anneal_tick()

    def _build_flows(self) -> None:
        """Phase A at a data holder: reserve flows up to min(demand, capacity)."""
        pending = sum(1 for e in self.flows.values() if e.pending)
        while self._spare() > 0 and pending < self.cfg.max_pending_requests:
            if self._best_next(self.me.id, ()) is None:
                return
            fid = self._new_flow_id()
            e = FlowEntry(origin=self.me.id, flow_id=fid, prev=self.me.id, since_s=self.now)
            self.flows[e.key] = e
            pending += 1
            self._forward(e)

    # ----------------------------------------------------------------------- phase A messages

    def _on_advert(self, sender: NodeId, msg: FlowAdvert) -> None:
        nb = self.next_peers.get(sender)
        if nb is None:
            # A joiner advertises as soon as it has a stage, before its activation reaches us
            # (MemberUp): keep its latest advert for when it comes up. Dropped, a joiner of the
            # last relay stage (whose first advert is not held back) was never routed to: it
            # stays silent while its costs do not change (gwtf demo, r2a killed).
            early = self._early_adverts
            early.pop(sender, None)
            if len(early) >= EARLY_ADVERTS_KEPT:
                early.pop(next(iter(early)))
            early[sender] = msg
            return
        nb.has_capacity = msg.has_capacity
        if nb.set_advert(msg.targets, msg.costs_s):
            self._fresh_adverts.add(sender)
            self.costs_dirty = True
        self._dirty = True

    def _on_request(self, sender: NodeId, msg: FlowRequest) -> None:
        key = (msg.origin, msg.flow_id)
        e = self.flows.get(key)
        if e is not None:
            if e.prev == sender and not e.pending:
                self._send(sender, FlowResponse(msg.origin, msg.flow_id, True, e.down_s, self._last_of(e)))
            elif e.prev != sender:
                self._reject(sender, msg.origin, msg.flow_id)
            return
        if sender not in self.prev_peers or self.load >= self.me.capacity or self.is_dh:
            self._reject(sender, msg.origin, msg.flow_id)
            return
        e = FlowEntry(origin=msg.origin, flow_id=msg.flow_id, prev=sender, since_s=self.now)
        e.up_prev_s, e.up_s = msg.up_s, msg.up_s + self.link_s(sender)
        self.flows[key] = e
        self._dirty = True
        if self.is_last:
            if msg.origin not in self.next_peers:
                self._fail(e)
                return
            e.next = msg.origin
            e.down_next_s, e.down_s = 0.0, self.link_s(msg.origin)
            self._send(sender, FlowResponse(msg.origin, msg.flow_id, True, e.down_s, self.me.id))
        else:
            self._forward(e)

    def _on_response(self, sender: NodeId, msg: FlowResponse) -> None:
        e = self._find(msg.origin, msg.flow_id)
        if e is None or not e.pending or e.next != sender:
            if msg.accepted:
                self._send(sender, FlowCancel(msg.origin, msg.flow_id))
            return
        nb = self.next_peers.get(sender)
        if not msg.accepted:
            if nb is not None:
                nb.has_capacity = msg.has_capacity
                if nb.set_cost(msg.origin, msg.cost_s):
                    self.costs_dirty = True
                self._dirty = True
            self._forward(e)
            return
        e.pending = False
        e.since_s = self.now
        e.check_fails = 0
        e.down_next_s, e.down_s = msg.down_s, self.link_s(sender) + msg.down_s
        if self.is_dh:
            e.prev = msg.last
        elif e.repairing:
            self._send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, msg.last))
        else:
            self._send(e.prev, FlowResponse(e.origin, e.flow_id, True, e.down_s, msg.last))
        e.repairing = False
        e.tried.clear()

    def _on_cancel(self, sender: NodeId, msg: FlowCancel) -> None:
        e = self._find(msg.origin, msg.flow_id)
        if e is not None and (e.prev == sender or msg.force) and not self.is_dh:
            self._drop(e, cancel_next=True)

    def _on_push_back(self, sender: NodeId, msg: FlowPushBack) -> None:
        e = self._find(msg.origin, msg.flow_id)
        if e is not None and e.next == sender and not e.pending:
            self._repair(e)

    # ------------------------------------------------------------------------ reservations

    def _best_next(self, origin: NodeId, tried: Iterable[NodeId]) -> NodeId | None:
        """Cheapest next-stage peer with capacity for a new flow of `origin` (link + advertised)."""
        if self.is_last:
            return origin if origin in self.next_peers and origin not in tried else None
        skip = set(tried)
        best: tuple[float, NodeId] | None = None
        for pid, nb in self.next_peers.items():
            if not nb.has_capacity or pid in skip:
                continue
            adv = nb.cost_of(origin)
            if adv < INF and (best is None or (nb.cost_s + adv, pid) < best):
                best = (nb.cost_s + adv, pid)
        return best[1] if best is not None else None

    def _forward(self, e: FlowEntry) -> None:
        """Ask the best untried next-stage peer to carry `e`; give up after `request_tries`."""
        if e.next is not None and e.next not in e.tried:
            e.tried.append(e.next)
        nxt = None if len(e.tried) >= self.cfg.request_tries else self._best_next(e.origin, e.tried)
        if nxt is None:
            self._fail(e)
            return
        if self.is_last:  # the only next hop is the origin itself: nothing to reserve
            e.next, e.pending = nxt, False
            self._set_down(e, 0.0)
            return
        e.next, e.pending, e.requested_s = nxt, True, self.now
        self._send(nxt, FlowRequest(e.origin, e.flow_id, e.up_s))

    def _fail(self, e: FlowEntry) -> None:
        """No next hop for `e`: release it and tell upstream (refusal, or push back if it was live)."""
        self._forget(e)
        if self.is_dh:
            return
        if e.repairing:
            self._send(e.prev, FlowPushBack(e.origin, e.flow_id))
        else:
            self._reject(e.prev, e.origin, e.flow_id)

    def _repair(self, e: FlowEntry) -> None:
        """The next hop of `e` is gone or pushed back: reserve a new downstream part."""
        if e.pending:
            self._forward(e)
            return
        e.repairing = True
        e.tried = []
        self._forward(e)

    def _reject(self, to: NodeId, origin: NodeId, flow_id: int) -> None:
        cost = self.cost_to(origin)
        self._send(to, FlowResponse(origin, flow_id, False, cost_s=cost, has_capacity=self._has_capacity()))

    def _last_of(self, e: FlowEntry) -> str:
        return self.me.id if self.is_last else ""

    # ------------------------------------------------------------------- notices along flows

    def _on_cost(self, sender: NodeId, msg: FlowCost) -> None:
        e = self._find(msg.origin, msg.flow_id)
        if e is None or e.pending:
            return
        if msg.side == "prev" and e.prev == sender and not self.is_dh:
            self._set_up(e, msg.cost_s)
        elif msg.side == "next" and e.next == sender:
            if self.is_dh and msg.last:
                e.prev = msg.last
            self._set_down(e, msg.cost_s, msg.last)

    def _on_switch(self, sender: NodeId, msg: FlowSwitch) -> None:
        key = (msg.origin, msg.flow_id)
        e = self._find(*key)
        if e is None:
            stone = self.tombstones.get(key)
            if stone is not None and msg.ttl > 0:
                self._send(stone[0], FlowSwitch(*_switch_fields(msg), ttl=msg.ttl - 1))
            return
        if msg.side == "prev" and e.prev in (msg.old, msg.new):
            e.prev = msg.new
            e.since_s = self.now
            if not self.is_dh:
                self._set_up(e, msg.cost_s)
        elif msg.side == "next" and e.next in (msg.old, msg.new) and not e.pending:
            e.next = msg.new
            e.since_s = self.now
            self._set_down(e, msg.cost_s)

    def _send_checks(self) -> None:
        """Check every settled flow with its next and prev. A check to a peer reported down
        (a notice or a check reply may have pointed the flow at it after the report) would go
        unanswered for good: it counts as failed, as a 'do not hold it' reply would."""
        down = self.down_peers
        for e in list(self.flows.values()):
            if e.pending or e.locked or e.next is None:
                continue
            if e.next != e.origin:
                if e.next in down:
                    self._check_failed(e, "prev")
                    if self.flows.get(e.key) is not e or e.pending:
                        continue
                else:
                    self._send(e.next, FlowCheck(e.origin, e.flow_id, "prev", 0.0 if self.is_dh else e.up_s))
            if not self.is_dh:
                if e.prev in down:
                    self._check_failed(e, "next")
                else:
                    self._send(e.prev, FlowCheck(e.origin, e.flow_id, "next", e.down_s))

    def _on_check(self, sender: NodeId, msg: FlowCheck) -> None:
        key = (msg.origin, msg.flow_id)
        e = self._find(*key)
        ok = e is not None and (e.prev == sender if msg.side == "prev" else e.next == sender)
        if not ok or e is None:
            stone = self.tombstones.get(key)
            self._send(sender, FlowCheckFail(msg.origin, msg.flow_id, msg.side, stone[0] if stone else ""))
            return
        if e.pending or e.locked:
            return
        if msg.side == "prev" and not self.is_dh:
            self._set_up(e, msg.cost_s)
        elif msg.side == "next":
            self._set_down(e, msg.cost_s)

    def _on_check_fail(self, sender: NodeId, msg: FlowCheckFail) -> None:
        e = self._find(msg.origin, msg.flow_id)
        if e is None or e.pending or e.locked:
            return
        mine = e.next if msg.side == "prev" else e.prev
        if mine != sender:
            return
        if msg.holder and msg.holder != self.me.id:
            if msg.holder in self.down_peers:  # handed over to a peer that has died since: lost
                self._flow_lost(e, msg.side)
            elif msg.side == "prev":
                e.next = msg.holder
            else:
                e.prev = msg.holder
            return
        self._check_failed(e, msg.side)

    def _check_failed(self, e: FlowEntry, side: str) -> None:
        """A check of `e` on `side` (as in FlowCheck: "prev" = the one sent to my next) failed;
        the second failure gives the flow up there."""
        e.check_fails += 1
        if e.check_fails >= 2:
            self._flow_lost(e, side)

    def _flow_lost(self, e: FlowEntry, side: str) -> None:
        if side == "prev":
            self._repair(e)  # my next does not hold the flow: rebuild downstream
        elif not self.is_dh:
            self._drop(e, cancel_next=True)  # my prev does not hold it: release it


def _switch_fields(msg: FlowSwitch) -> tuple[str, int, str, str, str, float]:
    return msg.origin, msg.flow_id, msg.side, msg.old, msg.new, msg.cost_s
