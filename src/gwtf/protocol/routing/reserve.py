"""Phase A of gwtf's flow protocol and the repairs that keep routes whole (PAPER.md 3.3).

Owns: `Reservation`, the part of `routing.agent.FlowAgent` that builds and mends routes over the
agent's `FlowState`: data holders reserve flows up to their demand hop by hop (FlowRequest /
FlowResponse, each hop choosing the cheapest next-stage peer with capacity by link cost + its
advertised distance vector), refusals refresh the requester's view, a lost or pushed-back next
hop is rebuilt downstream, cost and switch notices travel along flows, and periodic consistency
checks (FlowCheck / FlowCheckFail) find and release half-routes.

Messages per node: a FlowAdvert to each previous-stage peer when its costs change (at most once
per `advert_interval_s`), one request / response per hop of each reservation or repair, and two
checks per settled flow every `check_every_ticks` ticks.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.routing.messages import (
    FlowAdvert,
    FlowCancel,
    FlowCheck,
    FlowCheckFail,
    FlowCost,
    FlowPushBack,
    FlowRequest,
    FlowResponse,
    FlowSwitch,
)
from gwtf.protocol.routing.state import INF, FlowEntry, FlowState

if TYPE_CHECKING:
    from gwtf.protocol.routing.moves import Claim

EARLY_ADVERTS_KEPT = 64  # adverts kept from peers not yet up (joiners between Welcome and MemberUp)


class Reservation:
    """Route building (phase A), repairs, notices along flows and consistency checks."""

    def __init__(self, state: FlowState, claims: Claim | None = None) -> None:
        self.state = state
        self.claims = claims  # blocked data holders' claims (routing.moves.Claim); None: none

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        return {
            FlowAdvert: self.on_advert,
            FlowRequest: self._on_request,
            FlowResponse: self._on_response,
            FlowCancel: self._on_cancel,
            FlowPushBack: self._on_push_back,
            FlowCost: self._on_cost,
            FlowSwitch: self._on_switch,
            FlowCheck: self._on_check,
            FlowCheckFail: self._on_check_fail,
        }

    # ---------------------------------------------------------------------------------- tick

    def on_tick(self) -> None:
        """Time out silent reservations, build a data holder's missing flows, check flows."""
        st = self.state
        now = st.now
        for e in list(st.flows.values()):
            if e.pending and now - e.requested_s > st.cfg.request_timeout_s:
                self.forward(e)  # silence counts as a refusal; a late accept gets cancelled
        if st.is_dh:
            self._build_flows()
        if st.ticks % st.cfg.check_every_ticks == st.check_phase:
            self._send_checks()

    def _build_flows(self) -> None:
        """Phase A at a data holder: reserve flows up to min(demand, capacity)."""
        st = self.state
        pending = sum(1 for e in st.flows.values() if e.pending)
        while st.spare() > 0 and pending < st.cfg.max_pending_requests:
            claim = False
            if self._best_next(st.me.id, ()) is None:
                # blocked: no next hop has capacity; maybe claim a full relay's slot instead
                claim = pending == 0 and self.claims is not None and self.claims.may_claim()
                if not claim or self._best_next(st.me.id, (), blind=True) is None:
                    return
            fid = st.new_flow_id()
            e = FlowEntry(origin=st.me.id, flow_id=fid, prev=st.me.id, since_s=st.now)
            st.flows[e.key] = e
            pending += 1
            if claim and self.claims is not None:
                self.claims.launched(e)
            self.forward(e)
            if claim:
                return

    def on_peer_down(self, peer: NodeId) -> None:
        """`peer` is gone: rebuild the flows it was next on, release those it fed (relays)."""
        st = self.state
        for e in list(st.flows.values()):
            if e.next == peer:
                self.repair(e)
            elif e.prev == peer and not st.is_dh:
                st.drop(e, cancel_next=True)

    # ----------------------------------------------------------------------- phase A messages

    def on_advert(self, sender: NodeId, msg: FlowAdvert) -> None:
        st = self.state
        nb = st.next_peers.get(sender)
        if nb is None:
            # A joiner advertises as soon as it has a stage, before its activation reaches us
            # (MemberUp): keep its latest advert for when it comes up. Dropped, a joiner of the
            # last relay stage (whose first advert is not held back) was never routed to: it
            # stays silent while its costs do not change (gwtf demo, r2a killed).
            early = st.early_adverts
            early.pop(sender, None)
            if len(early) >= EARLY_ADVERTS_KEPT:
                early.pop(next(iter(early)))
            early[sender] = msg
            return
        nb.has_capacity = msg.has_capacity
        if nb.set_advert(msg.targets, msg.costs_s):
            st.costs_dirty = True
        st.dirty = True

    def _on_request(self, sender: NodeId, msg: FlowRequest) -> None:
        st = self.state
        key = (msg.origin, msg.flow_id)
        e = st.flows.get(key)
        if e is not None:
            if e.prev == sender and not e.pending:
                st.send(sender, FlowResponse(msg.origin, msg.flow_id, True, e.down_s, self._last_of(e)))
            elif e.prev != sender:
                self._reject(sender, msg.origin, msg.flow_id)
            return
        claims = None if st.is_dh else self.claims
        if msg.displace_origin and claims is not None and claims.take(sender, msg):
            return  # a claim taking a costlier route's slots here too (routing.moves.Claim)
        if sender not in st.prev_peers or st.load >= st.me.capacity or st.is_dh:
            # full: a claim may still take the slot of a costlier route
            if not (msg.claim and claims is not None and claims.take(sender, msg)):
                self._reject(sender, msg.origin, msg.flow_id)
            return
        e = FlowEntry(origin=msg.origin, flow_id=msg.flow_id, prev=sender, since_s=st.now)
        e.up_prev_s, e.up_s = msg.up_s, msg.up_s + st.link_s(sender)
        e.claim = msg.claim and not st.is_last  # a relay with room passes the claim on
        st.flows[key] = e
        st.dirty = True
        if st.is_last:
            if msg.origin not in st.next_peers:
                self._fail(e)
                return
            e.next = msg.origin
            e.down_next_s, e.down_s = 0.0, st.link_s(msg.origin)
            st.send(sender, FlowResponse(msg.origin, msg.flow_id, True, e.down_s, st.me.id))
        else:
            self.forward(e)

    def _on_response(self, sender: NodeId, msg: FlowResponse) -> None:
        st = self.state
        e = st.find(msg.origin, msg.flow_id)
        if e is None and self.claims is not None and self.claims.probing((msg.origin, msg.flow_id)):
            self.claims.on_probe_response(sender, msg)
            return
        if e is None or not e.pending or e.next != sender:
            if msg.accepted:
                st.send(sender, FlowCancel(msg.origin, msg.flow_id))
            return
        nb = st.next_peers.get(sender)
        if not msg.accepted:
            if nb is not None:
                nb.has_capacity = msg.has_capacity
                if nb.set_cost(msg.origin, msg.cost_s):
                    st.costs_dirty = True
                st.dirty = True
            self.forward(e)
            return
        e.pending = False
        e.claim = False
        e.since_s = st.now
        e.check_fails = 0
        e.down_next_s, e.down_s = msg.down_s, st.link_s(sender) + msg.down_s
        if st.is_dh:
            e.prev = msg.last
        elif e.repairing:
            st.send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, msg.last))
        else:
            st.send(e.prev, FlowResponse(e.origin, e.flow_id, True, e.down_s, msg.last))
        e.repairing = False
        e.tried.clear()

    def _on_cancel(self, sender: NodeId, msg: FlowCancel) -> None:
        st = self.state
        e = st.find(msg.origin, msg.flow_id)
        if e is not None and (e.prev == sender or msg.force) and not st.is_dh:
            st.drop(e, cancel_next=True)
            if self.claims is not None:
                self.claims.on_released(e.key)
        elif e is None and self.claims is not None and self.claims.probing((msg.origin, msg.flow_id)):
            self.claims.cancel_probe(sender, (msg.origin, msg.flow_id), msg.force)

    def _on_push_back(self, sender: NodeId, msg: FlowPushBack) -> None:
        st = self.state
        e = st.find(msg.origin, msg.flow_id)
        if e is None or e.next != sender or e.pending:
            return
        if not msg.release:
            self.repair(e)
            return
        st.forget(e)  # released below for a claim: up to the data holder, which builds anew
        if not st.is_dh:
            st.send(e.prev, FlowPushBack(e.origin, e.flow_id, release=True))

    # ------------------------------------------------------------------------ reservations

    def _best_next(self, origin: NodeId, tried: Iterable[NodeId], blind: bool = False) -> NodeId | None:
        """Cheapest next-stage peer with capacity for a new flow of `origin` (link + advertised);
        `blind`: capacity or not (where a claim goes when no next hop has capacity)."""
        st = self.state
        if st.is_last:
            return origin if origin in st.next_peers and origin not in tried else None
        skip = set(tried)
        best: tuple[float, NodeId] | None = None
        for pid, nb in st.next_peers.items():
            if not (nb.has_capacity or blind) or pid in skip:
                continue
            adv = nb.cost_of(origin)
            if adv < INF and (best is None or (nb.cost_s + adv, pid) < best):
                best = (nb.cost_s + adv, pid)
        return best[1] if best is not None else None

    def forward(self, e: FlowEntry) -> None:
        """Ask the best untried next-stage peer to carry `e`; give up after `request_tries`."""
        st = self.state
        if e.next is not None and e.next not in e.tried:
            e.tried.append(e.next)
        nxt = None if len(e.tried) >= st.cfg.request_tries else self._best_next(e.origin, e.tried)
        if e.claim and not st.is_last:
            if nxt is not None:
                e.claim = False  # a next hop has capacity: an ordinary reservation from here
            elif len(e.tried) < st.cfg.request_tries:
                nxt = self._best_next(e.origin, e.tried, blind=True)
        if nxt is None:
            self._fail(e)
            return
        if st.is_last:  # the only next hop is the origin itself: nothing to reserve
            e.next, e.pending = nxt, False
            st.set_down(e, 0.0)
            return
        e.next, e.pending, e.requested_s = nxt, True, st.now
        st.send(nxt, FlowRequest(e.origin, e.flow_id, e.up_s, e.claim))

    def _fail(self, e: FlowEntry) -> None:
        """No next hop for `e`: release it and tell upstream (refusal, or push back if it was live)."""
        st = self.state
        st.forget(e)
        if st.is_dh:
            return
        if e.repairing:
            st.send(e.prev, FlowPushBack(e.origin, e.flow_id))
        else:
            self._reject(e.prev, e.origin, e.flow_id)

    def repair(self, e: FlowEntry) -> None:
        """The next hop of `e` is gone or pushed back: reserve a new downstream part."""
        if e.pending:
            self.forward(e)
            return
        e.repairing = True
        e.tried = []
        self.forward(e)

    def _reject(self, to: NodeId, origin: NodeId, flow_id: int) -> None:
        st = self.state
        cost = st.cost_to(origin)
        st.send(to, FlowResponse(origin, flow_id, False, cost_s=cost, has_capacity=st.has_capacity()))

    def _last_of(self, e: FlowEntry) -> str:
        return self.state.me.id if self.state.is_last else ""

    # ------------------------------------------------------------------- notices along flows

    def _on_cost(self, sender: NodeId, msg: FlowCost) -> None:
        st = self.state
        e = st.find(msg.origin, msg.flow_id)
        if e is None or e.pending:
            return
        if msg.side == "prev" and e.prev == sender and not st.is_dh:
            st.set_up(e, msg.cost_s)
        elif msg.side == "next" and e.next == sender:
            if st.is_dh and msg.last:
                e.prev = msg.last
            st.set_down(e, msg.cost_s, msg.last)

    def _on_switch(self, sender: NodeId, msg: FlowSwitch) -> None:
        st = self.state
        key = (msg.origin, msg.flow_id)
        e = st.find(*key)
        if e is None:
            stone = st.tombstones.get(key)
            if stone is not None and msg.ttl > 0:
                st.send(stone[0], FlowSwitch(*_switch_fields(msg), ttl=msg.ttl - 1))
            return
        if msg.side == "prev" and e.prev in (msg.old, msg.new):
            e.prev = msg.new
            e.since_s = st.now
            if not st.is_dh:
                st.set_up(e, msg.cost_s)
        elif msg.side == "next" and e.next in (msg.old, msg.new) and not e.pending:
            e.next = msg.new
            e.since_s = st.now
            st.set_down(e, msg.cost_s)

    def _send_checks(self) -> None:
        """Check every settled flow with its next and prev. A check to a peer reported down
        (a notice or a check reply may have pointed the flow at it after the report) would go
        unanswered for good: it counts as failed, as a 'do not hold it' reply would."""
        st = self.state
        down = st.down_peers
        for e in list(st.flows.values()):
            if e.pending or e.locked or e.next is None:
                continue
            if e.next != e.origin:
                if e.next in down:
                    self._check_failed(e, "prev")
                    if st.flows.get(e.key) is not e or e.pending:
                        continue
                else:
                    st.send(e.next, FlowCheck(e.origin, e.flow_id, "prev", 0.0 if st.is_dh else e.up_s))
            if not st.is_dh:
                if e.prev in down:
                    self._check_failed(e, "next")
                else:
                    st.send(e.prev, FlowCheck(e.origin, e.flow_id, "next", e.down_s))

    def _on_check(self, sender: NodeId, msg: FlowCheck) -> None:
        st = self.state
        key = (msg.origin, msg.flow_id)
        e = st.find(*key)
        ok = e is not None and (e.prev == sender if msg.side == "prev" else e.next == sender)
        if not ok or e is None:
            stone = st.tombstones.get(key)
            st.send(sender, FlowCheckFail(msg.origin, msg.flow_id, msg.side, stone[0] if stone else ""))
            return
        if e.pending or e.locked:
            return
        if msg.side == "prev" and not st.is_dh:
            st.set_up(e, msg.cost_s)
        elif msg.side == "next":
            st.set_down(e, msg.cost_s)

    def _on_check_fail(self, sender: NodeId, msg: FlowCheckFail) -> None:
        st = self.state
        e = st.find(msg.origin, msg.flow_id)
        if e is None or e.pending or e.locked:
            return
        mine = e.next if msg.side == "prev" else e.prev
        if mine != sender:
            return
        if msg.holder and msg.holder != st.me.id:
            if msg.holder in st.down_peers:  # handed over to a peer that has died since: lost
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
            self.repair(e)  # my next does not hold the flow: rebuild downstream
        elif not self.state.is_dh:
            self.state.drop(e, cancel_next=True)  # my prev does not hold it: release it


def _switch_fields(msg: FlowSwitch) -> tuple[str, int, str, str, str, float]:
    return msg.origin, msg.flow_id, msg.side, msg.old, msg.new, msg.cost_s
