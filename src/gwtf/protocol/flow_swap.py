"""Swap of next hops between two same-stage relays (PAPER.md 3.3.4 Move 1), part of gwtf's flow agent.

Owns: `FlowSwap`, mixed into `protocol.flow_anneal.FlowAnneal`: scoring of the move, the peer's
accept, the proposer's completion, and the renaming of both tails (`flow.swap_tail`).

Relays A and B of one stage carry flows of the same origin, fa = ha -> A -> na -> ta and
fb = hb -> B -> nb -> tb. The move rewires A -> nb and B -> na: the routes become ha A nb tb and
hb B na ta, so two routes trade their whole tails, which single-stage moves (redirect, exchange)
cannot do when every intermediate step is worse. It is scored on the min-max rule like the
other moves (both route costs before and after are known from A's flow, B's table and the two
cross links d(A, nb), d(B, na)).

Flows are named end to end, so the tails trade names too: every node after the swap stage
exchanges the names (origin, a) and (origin, b). A node on both tails swaps both entries at
once (the renaming never collides); a nonce makes the second notice a cost update only. The
first hops (na, nb) also replace their prev (`old_prev`); the last relays report themselves to
the data holder (`FlowCost.last`), which records its routes' new last relays.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from gwtf.protocol.base import NodeId
from gwtf.protocol.flow_core import INF, FlowCore, FlowEntry, FlowKey
from gwtf.protocol.flow_messages import (
    FlowCancel,
    FlowCost,
    FlowPropose,
    FlowRespond,
    FlowSwapTail,
    FlowSwitch,
    FlowTable,
)

Score = tuple[float, float]  # (decrease of the max of the affected routes, decrease of their sum)


class FlowSwap(FlowCore):
    """The swap-next-hops move and the tail renaming; mixed into FlowAnneal."""

    _swaps: dict[int, float]  # nonce of a tail swap already applied here -> until
    _deferred: list[tuple[NodeId, FlowSwapTail]]  # notices held while a move of mine names the flows
    tail_swaps: int
    swap_aliases: dict[FlowKey, tuple[FlowKey, float]]
    """At A and B: my flow -> (the name its new tail has until the notice renames it, until)."""

    def _swap_init(self) -> None:
        self._swaps = {}
        self._deferred = []
        self.swap_aliases = {}
        self.tail_swaps = 0  # swap_next moves this node completed as proposer

    def _expire_swaps(self) -> None:
        for nonce in [n for n, until in self._swaps.items() if until < self.now]:
            del self._swaps[nonce]
        for key in [k for k, (_, until) in self.swap_aliases.items() if until < self.now]:
            del self.swap_aliases[key]

    def _swap_blocked(self, keys: set[FlowKey]) -> bool:
        """Hook: a move of mine under way names one of `keys` (FlowAnneal); rename after it ends."""
        return False

    def _replay_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for sender, msg in deferred:
            self._on_swap_tail(sender, msg)

    # --------------------------------------------------------------------------- A: score

    def _swap_moves(self, msg: FlowTable, own: list[FlowEntry], links_b: dict[NodeId, float]) -> Iterator[
        tuple[Score, int, FlowEntry]
    ]:
        """Every swap of one of my flows with a same-origin flow of the peer, with its score."""
        if self.is_dh or self.is_last or not self.cfg.anneal_swap_next:
            return
        for i, (origin, fid) in enumerate(zip(msg.origins, msg.flow_ids)):
            n_b = msg.nexts[i]
            a_nb = self.link_s(n_b)
            if a_nb == INF:
                continue
            up_b = msg.up_prev_s[i] + msg.link_prev_s[i]
            c_b = up_b + msg.link_next_s[i] + msg.down_next_s[i]
            for e in own:
                if e.origin != origin or e.flow_id == fid or e.next in (None, n_b):
                    continue
                b_na = links_b.get(e.next or "", INF)
                if b_na == INF:
                    continue
                c_a = e.up_s + e.down_s
                c_a_new = e.up_s + a_nb + msg.down_next_s[i]
                c_b_new = up_b + b_na + e.down_next_s
                yield (max(c_a, c_b) - max(c_a_new, c_b_new), c_a + c_b - c_a_new - c_b_new), i, e

    def _swap_proposal(self, msg: FlowTable, i: int, e: FlowEntry, nonce: int) -> FlowPropose:
        return FlowPropose(
            "swap_next", msg.origins[i], msg.flow_ids[i], msg.prevs[i], msg.nexts[i],
            e.origin, e.flow_id, e.prev, e.next or "", e.up_s, e.down_next_s, nonce,
        )

    # ---------------------------------------------------------------------------- B: accept

    def _swap_ok(self, e: FlowEntry, msg: FlowPropose) -> bool:
        return (
            not (self.is_dh or self.is_last) and msg.my_origin == msg.origin
            and msg.my_next in self.next_peers and msg.my_next != e.next
            and (msg.my_origin, msg.my_flow_id) not in self.flows
        )

    def _accept_swap(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> FlowRespond:
        """Rewire my flow to the proposer's next hop; its tail gets my flow's name."""
        old_next, old_down = e.next or "", e.down_next_s
        e.next, e.since_s = msg.my_next, self.now
        self._set_down(e, msg.my_down_next_s)
        self.swap_aliases[e.key] = ((e.origin, msg.my_flow_id), self.now + self.cfg.request_timeout_s)
        self._send(msg.my_next, FlowSwapTail(
            e.origin, msg.my_flow_id, e.flow_id, msg.nonce, e.flow_id, self.me.id, sender, e.up_s))
        return FlowRespond(True, e.origin, e.flow_id, e.prev, old_next, e.up_prev_s, old_down)

    # -------------------------------------------------------------------------- A: finish

    def _finish_swap(self, sender: NodeId, my_key: FlowKey, my_next: NodeId, nonce: int, msg: FlowRespond) -> None:
        """The peer rewired; rewire mine to its old next hop (msg.next), whose tail takes my name."""
        mine = self.flows.get(my_key)
        if mine is None or mine.pending:  # my flow is gone meanwhile: release the headless tail
            self._send(msg.next, FlowCancel(msg.origin, msg.flow_id, force=True))
            return
        # (if my next hop handed my tail over meanwhile, the peer's notice followed its tombstone)
        mine.next, mine.since_s = msg.next, self.now
        self.tail_swaps += 1
        self._set_down(mine, msg.down_next_s)
        self.swap_aliases[mine.key] = ((mine.origin, msg.flow_id), self.now + self.cfg.request_timeout_s)
        self._send(msg.next, FlowSwapTail(
            mine.origin, mine.flow_id, msg.flow_id, nonce, mine.flow_id, self.me.id, sender, mine.up_s))

    # ------------------------------------------------------------------------- tail nodes

    def _on_swap_tail(self, sender: NodeId, msg: FlowSwapTail) -> None:
        renamed: list[FlowEntry] = []
        fresh = msg.nonce not in self._swaps
        if fresh:
            if self._swap_blocked({(msg.origin, msg.a), (msg.origin, msg.b)}):
                self._deferred.append((sender, msg))
                return
            renamed = self._swap_names(msg.origin, msg.a, msg.b)
            if renamed:
                self._swaps[msg.nonce] = self.now + self.cfg.tombstone_s
        e = self.flows.get((msg.origin, msg.flow_id))
        if e is None:  # handed over before the notice came: pass it to the holder
            before = msg.b if msg.flow_id == msg.a else msg.a
            stone = self.tombstones.get((msg.origin, before))
            if stone is not None and msg.ttl > 0:
                self._send(stone[0], dataclasses.replace(msg, ttl=msg.ttl - 1))
        elif not self.is_dh:
            if msg.old_prev and e.prev == msg.old_prev:
                e.prev, e.since_s = msg.prev, self.now
                if sender != msg.prev:  # came along a tombstone: my new prev points at the forwarder
                    self._send(e.prev, FlowSwitch(e.origin, e.flow_id, "next", sender, self.me.id, e.down_s))
            if e.prev == msg.prev:
                if fresh:
                    e.up_prev_s, e.up_s = msg.up_s, msg.up_s + self.link_s(e.prev)
                else:
                    self._set_up(e, msg.up_s)
            if self.is_last:  # the data holder learns its route's (new) last relay and cost
                self._send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, self.me.id))
        for f in renamed:
            if f.next is not None and not f.pending and f.next != f.origin:
                self._send(f.next, FlowSwapTail(
                    f.origin, msg.a, msg.b, msg.nonce, f.flow_id, self.me.id, "", f.up_s))

    def _swap_names(self, origin: NodeId, a: int, b: int) -> list[FlowEntry]:
        """Exchange the names (origin, a) and (origin, b) of whatever I hold; the renamed entries."""
        ka, kb = (origin, a), (origin, b)
        ea, eb = self.flows.pop(ka, None), self.flows.pop(kb, None)
        out: list[FlowEntry] = []
        for e, fid in ((ea, b), (eb, a)):
            if e is not None:
                e.flow_id, e.since_s = fid, self.now
                self.flows[e.key] = e
                out.append(e)
        self._dirty = self._dirty or bool(out)
        return out
