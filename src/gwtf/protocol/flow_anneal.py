"""Phase B of gwtf's flow protocol: simulated annealing between same-stage peers (PAPER.md 3.3.4).

Owns: `FlowAnneal`, the part of `protocol.flow.FlowAgent` that improves established flows with
two local moves between a node A and a same-stage peer B:

- redirect: A (spare capacity) takes over B's flow p -> B -> n, which becomes p -> A -> n;
- exchange: A and B swap one flow each (p_a -> A -> n_a becomes p_a -> B -> n_a and vice versa),
  capacity-neutral, so full nodes can still trade;
- swap_next: A and B swap the next hops of two flows of the same origin, so two routes trade
  their whole tails (`protocol.flow_swap`).

A pulls B's table (FlowQuery / FlowTable, with B's link costs to A's flows' neighbours), scores
every move on the min-max rule of PAPER.md 3.3.4 [I-adapt] (M_old = max cost of the affected
routes, M_new after; the sum breaks ties), proposes the best one if it improves, else with
probability exp(delta / T); T starts at `anneal_t0_s` and cools geometrically per accepted move.
B re-checks that the flow is still as offered and hands it over; the new holder notifies the
flow's prev and next (FlowSwitch), the old holder keeps a tombstone to forward late notices.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gwtf.protocol.base import NodeId
from gwtf.protocol.flow_core import COST_EPS_S, INF, FlowEntry, FlowKey
from gwtf.protocol.flow_messages import (
    FlowCancel,
    FlowCost,
    FlowPropose,
    FlowQuery,
    FlowRekey,
    FlowRespond,
    FlowSwitch,
    FlowTable,
)
from gwtf.protocol.flow_swap import FlowSwap


@dataclass(slots=True)
class _Busy:
    """The one annealing interaction a node has under way."""

    kind: str  # "query" | "redirect" | "exchange"
    peer: NodeId
    since_s: float
    their_key: FlowKey | None = None
    my_key: FlowKey | None = None
    my_prev: NodeId = ""
    my_next: NodeId = ""
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class _Move:
    delta_s: float  # improvement of max(affected) (or of the sum when the max ties); > 0 is better
    kind: str
    index: int  # row of the peer's table
    mine: FlowEntry | None


class FlowAnneal(FlowSwap):
    """Simulated-annealing moves; mixed into FlowAgent."""

    temperature_s: float
    accepted_moves: int
    _busy: _Busy | None
    _cooldown: dict[NodeId, float]
    _peer_max: dict[NodeId, float]  # dearest route each same-stage peer showed in its last table

    def _anneal_init(self) -> None:
        self.temperature_s = self.cfg.anneal_t0_s
        self.accepted_moves = 0
        self._busy = None
        self._cooldown = {}
        self._peer_max = {}
        self._swap_init()

    def _reheat(self) -> None:
        self.temperature_s = max(self.temperature_s, self.cfg.anneal_reheat * self.cfg.anneal_t0_s)

    def _movable(self) -> list[FlowEntry]:
        """Flows this node may offer or trade: established, settled, not in another move, and not
        under suspicion (a failed consistency check: moving it would reset the evidence)."""
        horizon = self.now - self.cfg.stable_s
        return [
            e for e in self.flows.values()
            if not (e.pending or e.locked or e.repairing or e.check_fails)
            and e.next is not None and e.since_s <= horizon
        ]

    def _dh_blocked(self) -> bool:
        """A data holder that wants more flows but no next-stage peer can take one."""
        return self._spare() > 0 and not any(
            nb.has_capacity and nb.cost_of(self.me.id) < INF for nb in self.next_peers.values()
        )

    def _cool(self, peer: NodeId) -> None:
        self._cooldown[peer] = self.now + self.cfg.cooldown_ticks * self.cfg.tick_s

    # ------------------------------------------------------------------------------- A side

    def _swap_blocked(self, keys: set[FlowKey]) -> bool:
        busy = self._busy
        return busy is not None and busy.my_key in keys or any(
            e.locked for e in (self.flows.get(k) for k in keys) if e is not None
        )

    def _anneal_tick(self) -> None:
        self._expire_swaps()
        if self._deferred and self._busy is None:
            self._replay_deferred()
        if not self.same_peers:
            return
        busy = self._busy
        if busy is not None:
            if self.now - busy.since_s > self.cfg.request_timeout_s:
                self._abort_busy()
            return
        if self.rng.random() >= self.cfg.anneal_probability:
            return
        peers = [p for p in sorted(self.same_peers) if self._cooldown.get(p, -INF) <= self.now]
        own = self._movable()
        spare = self._spare() if not self.is_dh or self._dh_blocked() else 0
        if not peers or (not own and spare <= 0):
            return
        peer = self._pick_peer(peers)
        nodes = sorted({e.prev for e in own} | {e.next for e in own if e.next is not None})
        self._send(peer, FlowQuery(tuple(nodes)))
        self._busy = _Busy("query", peer, self.now)

    def _pick_peer(self, peers: list[NodeId]) -> NodeId:
        """Tournament of `anneal_tournament` random peers: the one whose dearest route was dearest.

        Peers never queried count as dearest, so every peer gets looked at; after that the
        search concentrates where the expensive routes are, which is what min-max needs.
        """
        k = min(len(peers), self.cfg.anneal_tournament)
        return max(self.rng.sample(peers, k), key=lambda p: (self._peer_max.get(p, INF), p))

    def _on_table(self, sender: NodeId, msg: FlowTable) -> None:
        busy = self._busy
        if busy is None or busy.kind != "query" or busy.peer != sender:
            return
        self._peer_max[sender] = max(
            (u + d + lp + ln for u, d, lp, ln in zip(msg.up_prev_s, msg.down_next_s, msg.link_prev_s, msg.link_next_s)),
            default=0.0,
        )
        self._busy = None
        self._cool(sender)
        move = self._best_move(msg)
        t = self.temperature_s
        self.temperature_s *= self.cfg.anneal_cooling
        if move is None or abs(move.delta_s) <= COST_EPS_S:
            return
        if move.delta_s < 0:
            if self.is_dh or t < self.cfg.anneal_min_t_s or self.rng.random() >= math.exp(move.delta_s / t):
                return
        self._propose(sender, msg, move)

    def _best_move(self, msg: FlowTable) -> _Move | None:
        links_b = dict(zip(msg.link_nodes, msg.link_costs_s))
        own = [(e, links_b.get(e.prev, INF), links_b.get(e.next or "", INF)) for e in self._movable()]
        spare = self._spare() if not self.is_dh or self._dh_blocked() else 0
        take = "yield" if self.is_dh else "redirect"
        best: tuple[float, float] | None = None
        move: _Move | None = None
        for i, key in enumerate(zip(msg.origins, msg.flow_ids)):
            if key in self.flows:
                continue
            a_prev, a_next = self.link_s(msg.prevs[i]), self.link_s(msg.nexts[i])
            if a_prev == INF or a_next == INF:
                continue
            outer_b = msg.up_prev_s[i] + msg.down_next_s[i]
            c_b = outer_b + msg.link_prev_s[i] + msg.link_next_s[i]
            c_b_new = outer_b + a_prev + a_next
            if spare > 0 and (best is None or (c_b - c_b_new, c_b - c_b_new) > best):
                best = (c_b - c_b_new, c_b - c_b_new)
                move = _Move(0.0, take, i, None)
            for e, b_prev, b_next in own:
                if b_prev == INF or b_next == INF:
                    continue
                c_a = e.up_s + e.down_s
                c_a_new = self._up_prev(e) + b_prev + b_next + e.down_next_s
                score = (max(c_a, c_b) - max(c_a_new, c_b_new), c_a + c_b - c_a_new - c_b_new)
                if best is None or score > best:
                    best, move = score, _Move(0.0, "exchange", i, e)
        for score, i, e in self._swap_moves(msg, [e for e, _, _ in own], links_b):
            if best is None or score > best:
                best, move = score, _Move(0.0, "swap_next", i, e)
        if best is None or move is None:
            return None
        delta = best[0] if abs(best[0]) > COST_EPS_S else best[1]
        return _Move(delta, move.kind, move.index, move.mine)

    def _propose(self, peer: NodeId, msg: FlowTable, move: _Move) -> None:
        i = move.index
        key = (msg.origins[i], msg.flow_ids[i])
        busy = _Busy(move.kind, peer, self.now, their_key=key)
        if move.kind == "swap_next" and move.mine is not None:
            e = move.mine
            e.locked = True
            busy.my_key, busy.my_prev, busy.my_next = e.key, e.prev, e.next or ""
            busy.nonce = self.rng.getrandbits(31)
            prop = self._swap_proposal(msg, i, e, busy.nonce)
        elif move.mine is None:
            self.reserved += 1
            self._dirty = True
            prop = FlowPropose(move.kind, key[0], key[1], msg.prevs[i], msg.nexts[i])
        else:
            e = move.mine
            e.locked = True
            busy.my_key, busy.my_prev, busy.my_next = e.key, e.prev, e.next or ""
            prop = FlowPropose(
                "exchange", key[0], key[1], msg.prevs[i], msg.nexts[i],
                e.origin, e.flow_id, e.prev, e.next or "", self._up_prev(e), e.down_next_s,
            )
        self._busy = busy
        self._send(peer, prop)

    def _on_respond(self, sender: NodeId, msg: FlowRespond) -> None:
        busy = self._busy
        if busy is None or busy.peer != sender or busy.their_key != (msg.origin, msg.flow_id):
            return
        self._abort_busy()
        if not msg.accepted:
            return
        self.accepted_moves += 1
        if busy.kind == "swap_next":
            assert busy.my_key is not None
            self._finish_swap(sender, busy.my_key, busy.my_next, busy.nonce, msg)
            return
        if busy.kind == "yield" or self.is_dh:  # data holders trade whole routes by renaming them
            self._adopt(msg.origin, msg.flow_id, msg.prev, msg.next, msg.up_prev_s, msg.down_next_s)
            mine = self._find(*busy.my_key) if busy.my_key is not None else None
            if mine is not None:
                self._forget(mine)
                self.tombstones[mine.key] = (sender, self.now + self.cfg.tombstone_s)
            return
        e = self._install(msg.origin, msg.flow_id, msg.prev, msg.next, msg.up_prev_s, msg.down_next_s)
        self._announce(e, old=sender)
        if busy.my_key is not None:
            self._hand_over(busy, sender)

    def _hand_over(self, busy: _Busy, peer: NodeId) -> None:
        """Exchange accepted: my offered flow now lives at `peer`; fix anything that moved meanwhile."""
        assert busy.my_key is not None
        mine = self._find(*busy.my_key)
        if mine is None:
            self._send(peer, FlowCancel(busy.my_key[0], busy.my_key[1], force=True))
            return
        self._forget(mine)
        self.tombstones[mine.key] = (peer, self.now + self.cfg.tombstone_s)
        if mine.key != busy.my_key:  # renamed (yielded to another data holder) meanwhile
            self._send(peer, FlowRekey(*busy.my_key, *mine.key, mine.up_prev_s))
        if mine.prev != busy.my_prev:
            self._send(peer, FlowSwitch(mine.origin, mine.flow_id, "prev", busy.my_prev, mine.prev, mine.up_prev_s))
        if mine.next is not None and mine.next != busy.my_next:
            self._send(peer, FlowSwitch(
                mine.origin, mine.flow_id, "next", busy.my_next, mine.next, mine.down_next_s))

    def _abort_busy(self) -> None:
        busy, self._busy = self._busy, None
        if busy is None:
            return
        self._cool(busy.peer)
        if busy.kind in ("redirect", "yield"):
            self.reserved -= 1
            self._dirty = True
        if busy.my_key is not None:
            mine = self._find(*busy.my_key)
            if mine is not None:
                mine.locked = False

    def _anneal_peer_down(self, peer: NodeId) -> None:
        self._cooldown.pop(peer, None)
        self._peer_max.pop(peer, None)
        if self._busy is not None and self._busy.peer == peer:
            self._abort_busy()

    # ------------------------------------------------------------------------------- B side

    def _on_query(self, sender: NodeId, msg: FlowQuery) -> None:
        rows = self._movable()
        # At a data holder the route is prev(last relay) -> me -> next(first relay); writing the
        # "cost before me" as -d(last, me) makes up_prev + down_next the route minus my two edges.
        ups = [-self.link_s(e.prev) if self.is_dh else e.up_prev_s for e in rows]
        self._send(sender, FlowTable(
            origins=tuple(e.origin for e in rows),
            flow_ids=tuple(e.flow_id for e in rows),
            prevs=tuple(e.prev for e in rows),
            nexts=tuple(e.next or "" for e in rows),
            up_prev_s=tuple(ups),
            down_next_s=tuple(e.down_next_s for e in rows),
            link_prev_s=tuple(self.link_s(e.prev) for e in rows),
            link_next_s=tuple(self.link_s(e.next or "") for e in rows),
            spare=max(0, self.me.capacity - self.load),
            link_nodes=msg.nodes,
            link_costs_s=tuple(self.link_s(n) for n in msg.nodes),
        ))

    def _on_propose(self, sender: NodeId, msg: FlowPropose) -> None:
        e = self.flows.get((msg.origin, msg.flow_id))
        ok = (
            e is not None and sender in self.same_peers
            and not (e.pending or e.locked or e.repairing)
            and e.prev == msg.expect_prev and e.next == msg.expect_next
        )
        if msg.kind == "exchange":
            ok = ok and (msg.my_origin, msg.my_flow_id) not in self.flows
            ok = ok and msg.my_prev in self.prev_peers and msg.my_next in self.next_peers
        if msg.kind == "swap_next" and e is not None:
            ok = ok and self._swap_ok(e, msg)
        if not ok or e is None:
            self._send(sender, FlowRespond(False, msg.origin, msg.flow_id))
            return
        self._cool(sender)
        if msg.kind == "swap_next":
            self._send(sender, self._accept_swap(sender, e, msg))
            return
        if self.is_dh:  # yield or exchange between data holders: routes change owner by renaming
            self._forget(e)
            self.tombstones[e.key] = (sender, self.now + self.cfg.tombstone_s)
            if msg.kind == "exchange":
                self._adopt(msg.my_origin, msg.my_flow_id, msg.my_prev, msg.my_next, msg.my_up_prev_s,
                            msg.my_down_next_s)
            self._send(sender, FlowRespond(
                True, msg.origin, msg.flow_id, e.prev, e.next or "", -self.link_s(e.prev), e.down_next_s
            ))
            return
        self._forget(e)
        self.tombstones[e.key] = (sender, self.now + self.cfg.tombstone_s)
        if msg.kind == "exchange":
            mine = self._install(
                msg.my_origin, msg.my_flow_id, msg.my_prev, msg.my_next, msg.my_up_prev_s, msg.my_down_next_s
            )
            self._announce(mine, old=sender)
        self._send(sender, FlowRespond(
            True, msg.origin, msg.flow_id, e.prev, e.next or "", e.up_prev_s, e.down_next_s
        ))

    # ---------------------------------------------------------------------- yield (rename)

    def _up_prev(self, e: FlowEntry) -> float:
        """Route cost before entering me; at a data holder -d(last relay, me) (see _on_query)."""
        return -self.link_s(e.prev) if self.is_dh else e.up_prev_s

    def _adopt(self, origin: NodeId, flow_id: int, prev: NodeId, nxt: NodeId, up_prev_s: float,
               down_next_s: float) -> None:
        """A peer data holder's route becomes mine: name it mine and rename it downstream."""
        fid = self._new_flow_id()
        e = FlowEntry(origin=self.me.id, flow_id=fid, prev=prev, next=nxt, since_s=self.now)
        e.renamed_from = (origin, flow_id)
        self.aliases[(origin, flow_id)] = (e.key, self.now + self.cfg.tombstone_s)
        # estimate until the last relay reports: the peer's closing edge replaced by mine
        e.down_next_s = down_next_s + up_prev_s + self.link_s(prev)
        e.down_s = self.link_s(nxt) + e.down_next_s
        self.flows[e.key] = e
        self._dirty = True
        self._send(nxt, FlowRekey(origin, flow_id, self.me.id, fid, 0.0))

    def _on_rekey(self, sender: NodeId, msg: FlowRekey) -> None:
        old, new = (msg.origin, msg.flow_id), (msg.new_origin, msg.new_flow_id)
        e = self.flows.get(old)
        if e is None:
            stone = self.tombstones.get(old)
            if stone is not None and msg.ttl > 0:
                self._send(stone[0], FlowRekey(*old, *new, msg.up_s, ttl=msg.ttl - 1))
            return
        del self.flows[old]
        e.origin, e.flow_id, e.since_s = msg.new_origin, msg.new_flow_id, self.now
        self.flows[new] = e
        self.aliases[old] = (new, self.now + self.cfg.tombstone_s)
        if e.prev == msg.origin:
            e.prev = msg.new_origin
        e.up_prev_s, e.up_s = msg.up_s, msg.up_s + self.link_s(e.prev)
        if e.next == msg.origin:  # last relay: close the route at the new origin
            e.next = msg.new_origin
            e.down_next_s, e.down_s = 0.0, self.link_s(e.next)
            self._send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, self.me.id))
        elif e.next is not None:
            self._send(e.next, FlowRekey(*old, *new, e.up_s))

    def _new_flow_id(self) -> int:
        while True:
            fid = self.rng.getrandbits(31)
            if (self.me.id, fid) not in self.flows and (self.me.id, fid) not in self.tombstones:
                return fid
