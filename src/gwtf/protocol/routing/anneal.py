"""Phase B of gwtf's flow protocol: simulated annealing between same-stage peers (PAPER.md 3.3.4).

Owns: `Annealer`, the part of `routing.agent.FlowAgent` that improves established flows with
local moves between a node A and a same-stage peer B (the moves are strategies,
`routing.moves`: redirect, exchange, swap of next hops), and the claims of blocked data holders
(`routing.moves.Claim`, which travel as marked reservations through `routing.reserve`).

A pulls B's table (FlowQuery / FlowTable, with B's link costs to A's flows' neighbours), every
move scores its candidates on the min-max rule of PAPER.md 3.3.4 [I-adapt] (M_old = max cost of
the affected routes, M_new after; the sum breaks ties), and A proposes the best one if it
improves, else with probability exp(delta / T); T starts at `anneal_t0_s` and cools
geometrically per table scored. B re-checks that the flow is still as offered and hands it over;
the new holder notifies the flow's prev and next (FlowSwitch), the old holder keeps a tombstone
to forward late notices. Between data holders a route changes owner by renaming (FlowRekey).

Messages per node: one query / table pair per tick with probability `anneal_probability`, one
propose / respond pair per move tried, and the notices (switch, rekey, tail swap) of a move done.
Claims: a blocked data holder sends at most one at a time (waiting 2 .. 32 ticks after a failed
one); each hop it passes costs one request / response pair, and a release one cancel per hop
of the released route's downstream part and one push back (then a repair's requests) upstream.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.routing.messages import (
    FlowCancel,
    FlowCost,
    FlowPropose,
    FlowQuery,
    FlowRekey,
    FlowRespond,
    FlowSwitch,
    FlowTable,
)
from gwtf.protocol.routing.moves import Busy, Choice, Claim, Exchange, Move, Offer, Redirect, SwapNext
from gwtf.protocol.routing.state import COST_EPS_S, INF, FlowEntry, FlowState


class Annealer:
    """Simulated-annealing moves between same-stage peers, over the agent's `FlowState`."""

    def __init__(self, state: FlowState) -> None:
        self.state = state
        self.temperature_s = state.cfg.anneal_t0_s
        self.accepted_moves = 0
        self.busy: Busy | None = None
        self._cooldown: dict[NodeId, float] = {}
        self._peer_max: dict[NodeId, float] = {}  # dearest route each same-stage peer showed in its last table
        self.swap = SwapNext(self)
        self.claim = Claim(self)
        self.moves: tuple[Move, ...] = (Redirect(self), Exchange(self), self.swap, self.claim)
        self._by_kind: dict[str, Move] = {kind: m for m in self.moves for kind in m.kinds}

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        out: dict[type[Message], Callable[[NodeId, Any], None]] = {
            FlowQuery: self._on_query,
            FlowTable: self._on_table,
            FlowPropose: self._on_propose,
            FlowRespond: self._on_respond,
            FlowRekey: self._on_rekey,
        }
        for m in self.moves:
            out.update(m.handlers())
        return out

    def reheat(self) -> None:
        cfg = self.state.cfg
        self.temperature_s = max(self.temperature_s, cfg.anneal_reheat * cfg.anneal_t0_s)

    def movable(self) -> list[FlowEntry]:
        """Flows this node may offer or trade: established, settled, not in another move, and not
        under suspicion (a failed consistency check: moving it would reset the evidence)."""
        st = self.state
        horizon = st.now - st.cfg.stable_s
        return [
            e for e in st.flows.values()
            if not (e.pending or e.locked or e.repairing or e.check_fails)
            and e.next is not None and e.since_s <= horizon
        ]

    def blocked(self) -> bool:
        """A data holder that wants more flows but no next-stage peer can take one (claims)."""
        return self._dh_blocked()

    def _dh_blocked(self) -> bool:
        """A data holder that wants more flows but no next-stage peer can take one."""
        st = self.state
        return st.spare() > 0 and not any(
            nb.has_capacity and nb.cost_of(st.me.id) < INF for nb in st.next_peers.values()
        )

    def _cool(self, peer: NodeId) -> None:
        st = self.state
        self._cooldown[peer] = st.now + st.cfg.cooldown_ticks * st.cfg.tick_s

    def up_prev(self, e: FlowEntry) -> float:
        """Route cost before entering me; at a data holder -d(last relay, me) (see _on_query)."""
        return -self.state.link_s(e.prev) if self.state.is_dh else e.up_prev_s

    # ------------------------------------------------------------------------------- A side

    def on_tick(self) -> None:
        st = self.state
        for m in self.moves:
            m.on_tick()
        if not st.same_peers:
            return
        busy = self.busy
        if busy is not None:
            if st.now - busy.since_s > st.cfg.request_timeout_s:
                self._abort_busy()
            return
        if st.rng.random() >= st.cfg.anneal_probability:
            return
        peers = [p for p in sorted(st.same_peers) if self._cooldown.get(p, -INF) <= st.now]
        own = self.movable()
        spare = st.spare() if not st.is_dh or self._dh_blocked() else 0
        if not peers or (not own and spare <= 0):
            return
        peer = self._pick_peer(peers)
        nodes = sorted({e.prev for e in own} | {e.next for e in own if e.next is not None})
        st.send(peer, FlowQuery(tuple(nodes)))
        self.busy = Busy("query", peer, st.now)

    def _pick_peer(self, peers: list[NodeId]) -> NodeId:
        """Tournament of `anneal_tournament` random peers: the one whose dearest route was dearest.

        Peers never queried count as dearest, so every peer gets looked at; after that the
        search concentrates where the expensive routes are, which is what min-max needs.
        """
        k = min(len(peers), self.state.cfg.anneal_tournament)
        return max(self.state.rng.sample(peers, k), key=lambda p: (self._peer_max.get(p, INF), p))

    def _on_table(self, sender: NodeId, msg: FlowTable) -> None:
        st = self.state
        busy = self.busy
        if busy is None or busy.kind != "query" or busy.peer != sender:
            return
        self._peer_max[sender] = max(
            (u + d + lp + ln for u, d, lp, ln in zip(msg.up_prev_s, msg.down_next_s, msg.link_prev_s, msg.link_next_s)),
            default=0.0,
        )
        self.busy = None
        self._cool(sender)
        move = self.best_move(msg, sender)
        t = self.temperature_s
        self.temperature_s *= st.cfg.anneal_cooling
        if move is None or abs(move.delta_s) <= COST_EPS_S:
            return
        if move.delta_s < 0:
            if st.is_dh or t < st.cfg.anneal_min_t_s or st.rng.random() >= math.exp(move.delta_s / t):
                return
        self.propose(sender, msg, move)

    def best_move(self, msg: FlowTable, sender: NodeId = "") -> Choice | None:
        """The best move any strategy finds in a peer's table (ties: the first in table order)."""
        st = self.state
        links_b = dict(zip(msg.link_nodes, msg.link_costs_s))
        own = [(e, links_b.get(e.prev, INF), links_b.get(e.next or "", INF)) for e in self.movable()]
        rows: list[tuple[int, float, float]] = []
        for i, key in enumerate(zip(msg.origins, msg.flow_ids)):
            if key in st.flows:
                continue
            a_prev, a_next = st.link_s(msg.prevs[i]), st.link_s(msg.nexts[i])
            if a_prev == INF or a_next == INF:
                continue
            outer_b = msg.up_prev_s[i] + msg.down_next_s[i]
            rows.append((i, outer_b + msg.link_prev_s[i] + msg.link_next_s[i], outer_b + a_prev + a_next))
        spare = st.spare() if not st.is_dh or self._dh_blocked() else 0
        offer = Offer(msg, links_b, own, rows, spare, st.redirect_adjust_s(sender))
        found = [c for c in (m.best(offer) for m in self.moves) if c is not None]
        best = None
        for c in sorted(found, key=lambda c: c.order):
            if best is None or c.score > best.score:
                best = c
        if best is None:
            return None
        delta = best.score[0] if abs(best.score[0]) > COST_EPS_S else best.score[1]
        return Choice(delta, best.kind, best.index, best.mine)

    def propose(self, peer: NodeId, msg: FlowTable, choice: Choice) -> None:
        i = choice.index
        busy = Busy(choice.kind, peer, self.state.now, their_key=(msg.origins[i], msg.flow_ids[i]))
        prop = self._by_kind[choice.kind].propose(busy, msg, choice)
        self.busy = busy
        self.state.send(peer, prop)

    def _on_respond(self, sender: NodeId, msg: FlowRespond) -> None:
        busy = self.busy
        if busy is None or busy.peer != sender or busy.their_key != (msg.origin, msg.flow_id):
            return
        self._abort_busy()
        if not msg.accepted:
            return
        self.accepted_moves += 1
        self._by_kind[busy.kind].finish(sender, busy, msg)

    def take_route(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        """Data holders: the peer's route is mine now (renamed); the one I offered is its (it
        adopted it under its own name, keeping mine as an alias), with what moved meanwhile."""
        st = self.state
        self.adopt(msg.origin, msg.flow_id, msg.prev, msg.next, msg.up_prev_s, msg.down_next_s)
        mine = st.find(*busy.my_key) if busy.my_key is not None else None
        if mine is not None:
            st.forget(mine)
            st.tombstones[mine.key] = (sender, st.now + st.cfg.tombstone_s)
            self._moved_meanwhile(busy, mine, sender)

    def take_flow(self, sender: NodeId, msg: FlowRespond) -> None:
        """Relays: install the peer's flow here and tell its prev and next."""
        st = self.state
        e = st.install(msg.origin, msg.flow_id, msg.prev, msg.next, msg.up_prev_s, msg.down_next_s)
        st.announce(e, old=sender)

    def hand_over(self, busy: Busy, peer: NodeId) -> None:
        """Exchange accepted: my offered flow now lives at `peer`; fix anything that moved meanwhile."""
        st = self.state
        assert busy.my_key is not None
        mine = st.find(*busy.my_key)
        if mine is None:
            st.send(peer, FlowCancel(busy.my_key[0], busy.my_key[1], force=True))
            return
        st.forget(mine)
        st.tombstones[mine.key] = (peer, st.now + st.cfg.tombstone_s)
        if mine.key != busy.my_key:  # renamed (yielded to another data holder) meanwhile
            st.send(peer, FlowRekey(*busy.my_key, *mine.key, mine.up_prev_s))
        self._moved_meanwhile(busy, mine, peer)

    def _moved_meanwhile(self, busy: Busy, mine: FlowEntry, peer: NodeId) -> None:
        """My offered flow's neighbours as the switches that reached me while it was locked left
        them: `peer` took it with the ones I offered (a neighbour that handed the flow over
        meanwhile told me, not `peer`)."""
        st = self.state
        if mine.prev != busy.my_prev:
            st.send(peer, FlowSwitch(mine.origin, mine.flow_id, "prev", busy.my_prev, mine.prev, mine.up_prev_s))
        if mine.next is not None and mine.next != busy.my_next:
            st.send(peer, FlowSwitch(
                mine.origin, mine.flow_id, "next", busy.my_next, mine.next, mine.down_next_s))

    def _abort_busy(self) -> None:
        busy, self.busy = self.busy, None
        if busy is None:
            return
        self._cool(busy.peer)
        st = self.state
        if busy.reserved:
            st.reserved -= 1
            st.dirty = True
        if busy.my_key is not None:
            mine = st.find(*busy.my_key)
            if mine is not None:
                mine.locked = False

    def on_peer_down(self, peer: NodeId) -> None:
        self._cooldown.pop(peer, None)
        self._peer_max.pop(peer, None)
        if self.busy is not None and self.busy.peer == peer:
            self._abort_busy()

    # ------------------------------------------------------------------------------- B side

    def _on_query(self, sender: NodeId, msg: FlowQuery) -> None:
        st = self.state
        rows = self.movable()
        # At a data holder the route is prev(last relay) -> me -> next(first relay); writing the
        # "cost before me" as -d(last, me) makes up_prev + down_next the route minus my two edges.
        ups = [-st.link_s(e.prev) if st.is_dh else e.up_prev_s for e in rows]
        st.send(sender, FlowTable(
            origins=tuple(e.origin for e in rows),
            flow_ids=tuple(e.flow_id for e in rows),
            prevs=tuple(e.prev for e in rows),
            nexts=tuple(e.next or "" for e in rows),
            up_prev_s=tuple(ups),
            down_next_s=tuple(e.down_next_s for e in rows),
            link_prev_s=tuple(st.link_s(e.prev) for e in rows),
            link_next_s=tuple(st.link_s(e.next or "") for e in rows),
            spare=max(0, st.me.capacity - st.load),
            link_nodes=msg.nodes,
            link_costs_s=tuple(st.link_s(n) for n in msg.nodes),
        ))

    def _on_propose(self, sender: NodeId, msg: FlowPropose) -> None:
        st = self.state
        e = st.flows.get((msg.origin, msg.flow_id))
        move = self._by_kind.get(msg.kind)
        ok = (
            e is not None and move is not None and sender in st.same_peers
            and not (e.pending or e.locked or e.repairing)
            and e.prev == msg.expect_prev and e.next == msg.expect_next
        )
        if not ok or e is None or move is None or not move.acceptable(e, msg):
            st.send(sender, FlowRespond(False, msg.origin, msg.flow_id))
            return
        self._cool(sender)
        move.accept(sender, e, msg)

    def give(self, sender: NodeId, e: FlowEntry) -> None:
        """My flow `e` goes to `sender`; a tombstone forwards late notices to it."""
        st = self.state
        st.forget(e)
        st.tombstones[e.key] = (sender, st.now + st.cfg.tombstone_s)

    def answer_given(self, sender: NodeId, e: FlowEntry) -> None:
        """Accept a move that took `e`: its neighbours and outer costs, for the taker to install."""
        self.state.send(sender, FlowRespond(
            True, e.origin, e.flow_id, e.prev, e.next or "", self.up_prev(e), e.down_next_s
        ))

    # ---------------------------------------------------------------------- yield (rename)

    def adopt(self, origin: NodeId, flow_id: int, prev: NodeId, nxt: NodeId, up_prev_s: float,
              down_next_s: float) -> None:
        """A peer data holder's route becomes mine: name it mine and rename it downstream."""
        st = self.state
        fid = st.new_flow_id()
        e = FlowEntry(origin=st.me.id, flow_id=fid, prev=prev, next=nxt, since_s=st.now)
        e.renamed_from = (origin, flow_id)
        st.aliases[(origin, flow_id)] = (e.key, st.now + st.cfg.tombstone_s)
        # estimate until the last relay reports: the peer's closing edge replaced by mine
        e.down_next_s = down_next_s + up_prev_s + st.link_s(prev)
        e.down_s = st.link_s(nxt) + e.down_next_s
        st.flows[e.key] = e
        st.dirty = True
        st.send(nxt, FlowRekey(origin, flow_id, st.me.id, fid, 0.0))

    def _on_rekey(self, sender: NodeId, msg: FlowRekey) -> None:
        st = self.state
        old, new = (msg.origin, msg.flow_id), (msg.new_origin, msg.new_flow_id)
        e = st.flows.get(old)
        if e is None:
            stone = st.tombstones.get(old)
            if stone is not None and msg.ttl > 0:
                st.send(stone[0], FlowRekey(*old, *new, msg.up_s, ttl=msg.ttl - 1))
            return
        del st.flows[old]
        e.origin, e.flow_id, e.since_s = msg.new_origin, msg.new_flow_id, st.now
        st.flows[new] = e
        st.aliases[old] = (new, st.now + st.cfg.tombstone_s)
        if e.prev == msg.origin:
            e.prev = msg.new_origin
        e.up_prev_s, e.up_s = msg.up_s, msg.up_s + st.link_s(e.prev)
        if e.next == msg.origin:  # last relay: close the route at the new origin
            e.next = msg.new_origin
            e.down_next_s, e.down_s = 0.0, st.link_s(e.next)
            st.send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, st.me.id))
        elif e.next is not None:
            st.send(e.next, FlowRekey(*old, *new, e.up_s))
