"""The annealing moves of gwtf's flow agent, one strategy object each (PAPER.md 3.3.4).

Owns: the `Move` protocol and its three strategies, which `routing.anneal.Annealer` asks to
score a same-stage peer's table, to propose, to accept (at the peer) and to finish:

- `Redirect`: A (spare capacity) takes over B's flow p -> B -> n, which becomes p -> A -> n
  (kind "yield" between data holders, where the route changes owner by renaming);
- `Exchange`: A and B swap one flow each (p_a -> A -> n_a becomes p_a -> B -> n_a and vice
  versa), capacity-neutral, so full nodes can still trade;
- `SwapNext` (`flow.anneal_swap_next`, PAPER.md 3.3.4 Move 1): A and B swap the next hops of two
  flows of the same origin, so two routes trade their whole tails, which single-stage moves
  cannot do when every intermediate step is worse; every node after the swap stage then trades
  the two flows' names (FlowSwapTail);
- `Claim` (`flow.anneal_claim`): a data holder with unmet demand and no next hop with capacity
  sends a reservation marked `claim` (FlowRequest.claim) along its own cheapest hops; the first
  full relay on the way takes the slot of its costliest flow for it (and, if its next stage is
  full too, that flow's next slot as well, FlowRequest.displace_*) and releases that flow once
  the claimer's route is reserved and costs less than it (`flow.claim_margin`). Released route
  and new route are one move, scored at that relay with real costs: flow stays the same, the
  max of the two routes drops. No FlowPropose kind: it travels along stages.

Each strategy scores its candidates on the min-max rule (decrease of the max cost of the
affected routes, the decrease of their sum breaking ties) and names each with an order key; the
annealer takes the best score, the lowest key among equals, so the choice does not depend on
how the strategies are listed.

Tail renaming: relays A and B of one stage carry fa = ha -> A -> na -> ta and fb = hb -> B -> nb
-> tb of one origin; the swap rewires A -> nb and B -> na. A node on both tails swaps both entries
at once (the renaming never collides); a nonce makes the second notice a cost update only. The
first hops (na, nb) also replace their prev (`old_prev`); the last relays report themselves to
the data holder (`FlowCost.last`), which records its routes' new last relays.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.routing.messages import (
    FlowCancel,
    FlowCost,
    FlowPropose,
    FlowPushBack,
    FlowRequest,
    FlowRespond,
    FlowResponse,
    FlowSwapTail,
    FlowSwitch,
    FlowTable,
)
from gwtf.protocol.routing.state import COST_EPS_S, INF, FlowEntry, FlowKey

if TYPE_CHECKING:
    from gwtf.protocol.routing.anneal import Annealer

Score = tuple[float, float]  # (decrease of the max of the affected routes, decrease of their sum)
Order = tuple[int, ...]  # where a candidate stands in the scan of a table (ties go to the lowest)


@dataclass(slots=True)
class Busy:
    """The one annealing interaction a node has under way."""

    kind: str  # "query" or the proposed move's kind
    peer: NodeId
    since_s: float
    their_key: FlowKey | None = None
    my_key: FlowKey | None = None
    my_prev: NodeId = ""
    my_next: NodeId = ""
    nonce: int = 0
    reserved: bool = False  # a slot of my capacity is held for the flow I take

    def hold(self, e: FlowEntry) -> None:
        """Lock my flow `e` for the move I propose, remembering its route ends."""
        e.locked = True
        self.my_key, self.my_prev, self.my_next = e.key, e.prev, e.next or ""


@dataclass(frozen=True, slots=True)
class Choice:
    """A move picked from a peer's table."""

    delta_s: float  # improvement of max(affected) (or of the sum when the max ties); > 0 is better
    kind: str
    index: int  # row of the peer's table
    mine: FlowEntry | None


@dataclass(frozen=True, slots=True)
class Candidate:
    order: Order
    score: Score
    kind: str
    index: int
    mine: FlowEntry | None


@dataclass(slots=True)
class Offer:
    """A same-stage peer's table as the moves score it, with what every move needs computed once."""

    msg: FlowTable
    links_b: dict[NodeId, float]  # the peer's link costs to my flows' neighbours
    own: list[tuple[FlowEntry, float, float]]  # my movable flows, with the peer's d(prev), d(next)
    rows: list[tuple[int, float, float]]  # (row, its route cost, its cost were it mine), rows I could host
    spare: int  # flows I could take without giving one
    redirect_adjust_s: float = 0.0  # `flow.load_aware`: added to a redirect's gain (FlowState.redirect_adjust_s)


class Move(Protocol):
    """One kind of annealing move: scored at A, accepted at B, finished at A."""

    kinds: tuple[str, ...]

    def best(self, offer: Offer) -> Candidate | None:
        """The best of this move's candidates in `offer` (the first in order among equal scores)."""
        ...

    def propose(self, busy: Busy, msg: FlowTable, choice: Choice) -> FlowPropose:
        """A: lock or reserve what the move needs (recorded in `busy`); the proposal to send."""
        ...

    def acceptable(self, e: FlowEntry, msg: FlowPropose) -> bool:
        """B: the move's own conditions, beyond "my flow is still as offered"."""
        ...

    def accept(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> None:
        """B: carry the move out and answer."""
        ...

    def finish(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        """A: the peer accepted; carry out my side."""
        ...

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        """Messages of its own beyond the annealing exchange."""
        ...

    def on_tick(self) -> None: ...


def _pick(best: Candidate | None, order: Order, score: Score, kind: str, i: int, mine: FlowEntry | None
          ) -> Candidate | None:
    return Candidate(order, score, kind, i, mine) if best is None or score > best.score else best


class Redirect:
    """Take one of the peer's flows into my spare capacity."""

    kinds: tuple[str, ...] = ("redirect", "yield")

    def __init__(self, anneal: Annealer) -> None:
        self.anneal = anneal

    def best(self, offer: Offer) -> Candidate | None:
        if offer.spare <= 0:
            return None
        kind = "yield" if self.anneal.state.is_dh else "redirect"
        best: Candidate | None = None
        adjust = offer.redirect_adjust_s
        for i, c_b, c_b_new in offer.rows:
            gain = c_b - c_b_new + adjust
            best = _pick(best, (0, i, 0, 0), (gain, gain), kind, i, None)
        return best

    def propose(self, busy: Busy, msg: FlowTable, choice: Choice) -> FlowPropose:
        st = self.anneal.state
        st.reserved += 1
        st.dirty = True
        busy.reserved = True
        i = choice.index
        return FlowPropose(choice.kind, msg.origins[i], msg.flow_ids[i], msg.prevs[i], msg.nexts[i])

    def acceptable(self, e: FlowEntry, msg: FlowPropose) -> bool:
        return True

    def accept(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> None:
        self.anneal.give(sender, e)
        self.anneal.answer_given(sender, e)

    def finish(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        if busy.kind == "yield" or self.anneal.state.is_dh:
            self.anneal.take_route(sender, busy, msg)
        else:
            self.anneal.take_flow(sender, msg)

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        return {}

    def on_tick(self) -> None:
        pass


class Exchange:
    """Trade one of my flows for one of the peer's (capacity-neutral)."""

    kinds: tuple[str, ...] = ("exchange",)

    def __init__(self, anneal: Annealer) -> None:
        self.anneal = anneal

    def best(self, offer: Offer) -> Candidate | None:
        up_prev = self.anneal.up_prev
        # flow.load_aware: the sum first (redirects score by it too), so every move lowers one
        # potential (the load-aware sum) and moves cannot cycle; the max breaks ties
        by_sum = self.anneal.state.cfg.load_aware
        best: Candidate | None = None
        for i, c_b, c_b_new in offer.rows:
            for j, (e, b_prev, b_next) in enumerate(offer.own):
                if b_prev == INF or b_next == INF:
                    continue
                c_a = e.up_s + e.down_s
                c_a_new = up_prev(e) + b_prev + b_next + e.down_next_s
                score = (max(c_a, c_b) - max(c_a_new, c_b_new), c_a + c_b - c_a_new - c_b_new)
                if by_sum:
                    score = (score[1], score[0])
                best = _pick(best, (0, i, 1, j), score, "exchange", i, e)
        return best

    def propose(self, busy: Busy, msg: FlowTable, choice: Choice) -> FlowPropose:
        e, i = choice.mine, choice.index
        assert e is not None
        busy.hold(e)
        return FlowPropose(
            "exchange", msg.origins[i], msg.flow_ids[i], msg.prevs[i], msg.nexts[i],
            e.origin, e.flow_id, e.prev, e.next or "", self.anneal.up_prev(e), e.down_next_s,
        )

    def acceptable(self, e: FlowEntry, msg: FlowPropose) -> bool:
        st = self.anneal.state
        return ((msg.my_origin, msg.my_flow_id) not in st.flows
                and msg.my_prev in st.prev_peers and msg.my_next in st.next_peers)

    def accept(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> None:
        a = self.anneal
        st = a.state
        a.give(sender, e)
        if st.is_dh:  # between data holders routes change owner by renaming
            a.adopt(msg.my_origin, msg.my_flow_id, msg.my_prev, msg.my_next, msg.my_up_prev_s, msg.my_down_next_s)
        else:
            mine = st.install(msg.my_origin, msg.my_flow_id, msg.my_prev, msg.my_next, msg.my_up_prev_s,
                              msg.my_down_next_s)
            st.announce(mine, old=sender)
        a.answer_given(sender, e)

    def finish(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        if self.anneal.state.is_dh:
            self.anneal.take_route(sender, busy, msg)
        else:
            self.anneal.take_flow(sender, msg)
            self.anneal.hand_over(busy, sender)

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        return {}

    def on_tick(self) -> None:
        pass


class SwapNext:
    """Swap the next hops of two same-origin flows (whole tails), and rename the tails after it."""

    kinds: tuple[str, ...] = ("swap_next",)

    def __init__(self, anneal: Annealer) -> None:
        self.anneal = anneal
        self._swaps: dict[int, float] = {}  # nonce of a tail swap already applied here -> until
        self._deferred: list[tuple[NodeId, FlowSwapTail]] = []  # notices held while a move of mine names the flows
        self.aliases: dict[FlowKey, tuple[FlowKey, float]] = {}
        """At A and B: my flow -> (the name its new tail has until the notice renames it, until)."""
        self.tail_swaps = 0  # swaps this node completed as proposer

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        return {FlowSwapTail: self._on_swap_tail}

    def on_tick(self) -> None:
        now = self.anneal.state.now
        for nonce in [n for n, until in self._swaps.items() if until < now]:
            del self._swaps[nonce]
        for key in [k for k, (_, until) in self.aliases.items() if until < now]:
            del self.aliases[key]
        if self._deferred and self.anneal.busy is None:
            deferred, self._deferred = self._deferred, []
            for sender, msg in deferred:
                self._on_swap_tail(sender, msg)

    def _blocked(self, keys: set[FlowKey]) -> bool:
        """A move of mine under way names one of `keys`: rename after it ends."""
        busy = self.anneal.busy
        flows = self.anneal.state.flows
        return busy is not None and busy.my_key in keys or any(
            e.locked for e in (flows.get(k) for k in keys) if e is not None
        )

    # --------------------------------------------------------------------------- A: score

    def best(self, offer: Offer) -> Candidate | None:
        best: Candidate | None = None
        for score, order, i, e in self.moves(offer.msg, [e for e, _, _ in offer.own], offer.links_b):
            best = _pick(best, order, score, "swap_next", i, e)
        return best

    def moves(self, msg: FlowTable, own: list[FlowEntry], links_b: dict[NodeId, float]) -> Iterator[
        tuple[Score, Order, int, FlowEntry]
    ]:
        """Every swap of one of my flows with a same-origin flow of the peer, with its score."""
        st = self.anneal.state
        if st.is_dh or st.is_last or not st.cfg.anneal_swap_next:
            return
        for i, (origin, fid) in enumerate(zip(msg.origins, msg.flow_ids)):
            n_b = msg.nexts[i]
            a_nb = st.link_s(n_b)
            if a_nb == INF:
                continue
            up_b = msg.up_prev_s[i] + msg.link_prev_s[i]
            c_b = up_b + msg.link_next_s[i] + msg.down_next_s[i]
            for j, e in enumerate(own):
                if e.origin != origin or e.flow_id == fid or e.next in (None, n_b):
                    continue
                b_na = links_b.get(e.next or "", INF)
                if b_na == INF:
                    continue
                c_a = e.up_s + e.down_s
                c_a_new = e.up_s + a_nb + msg.down_next_s[i]
                c_b_new = up_b + b_na + e.down_next_s
                yield (max(c_a, c_b) - max(c_a_new, c_b_new), c_a + c_b - c_a_new - c_b_new), (1, i, j), i, e

    def propose(self, busy: Busy, msg: FlowTable, choice: Choice) -> FlowPropose:
        e, i = choice.mine, choice.index
        assert e is not None
        busy.hold(e)
        busy.nonce = self.anneal.state.rng.getrandbits(31)
        return FlowPropose(
            "swap_next", msg.origins[i], msg.flow_ids[i], msg.prevs[i], msg.nexts[i],
            e.origin, e.flow_id, e.prev, e.next or "", e.up_s, e.down_next_s, busy.nonce,
        )

    # ---------------------------------------------------------------------------- B: accept

    def acceptable(self, e: FlowEntry, msg: FlowPropose) -> bool:
        st = self.anneal.state
        return (
            not (st.is_dh or st.is_last) and msg.my_origin == msg.origin
            and msg.my_next in st.next_peers and msg.my_next != e.next
            and (msg.my_origin, msg.my_flow_id) not in st.flows
        )

    def accept(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> None:
        """Rewire my flow to the proposer's next hop; its tail gets my flow's name."""
        st = self.anneal.state
        old_next, old_down = e.next or "", e.down_next_s
        e.next, e.since_s = msg.my_next, st.now
        st.set_down(e, msg.my_down_next_s)
        self.aliases[e.key] = ((e.origin, msg.my_flow_id), st.now + st.cfg.request_timeout_s)
        st.send(msg.my_next, FlowSwapTail(
            e.origin, msg.my_flow_id, e.flow_id, msg.nonce, e.flow_id, st.me.id, sender, e.up_s))
        st.send(sender, FlowRespond(True, e.origin, e.flow_id, e.prev, old_next, e.up_prev_s, old_down))

    # -------------------------------------------------------------------------- A: finish

    def finish(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        """The peer rewired; rewire mine to its old next hop (msg.next), whose tail takes my name."""
        st = self.anneal.state
        assert busy.my_key is not None
        mine = st.flows.get(busy.my_key)
        if mine is None or mine.pending:  # my flow is gone meanwhile: release the headless tail
            st.send(msg.next, FlowCancel(msg.origin, msg.flow_id, force=True))
            return
        # (if my next hop handed my tail over meanwhile, the peer's notice followed its tombstone)
        mine.next, mine.since_s = msg.next, st.now
        self.tail_swaps += 1
        st.set_down(mine, msg.down_next_s)
        self.aliases[mine.key] = ((mine.origin, msg.flow_id), st.now + st.cfg.request_timeout_s)
        st.send(msg.next, FlowSwapTail(
            mine.origin, mine.flow_id, msg.flow_id, busy.nonce, mine.flow_id, st.me.id, sender, mine.up_s))

    # ------------------------------------------------------------------------- tail nodes

    def _on_swap_tail(self, sender: NodeId, msg: FlowSwapTail) -> None:
        st = self.anneal.state
        renamed: list[FlowEntry] = []
        fresh = msg.nonce not in self._swaps
        if fresh:
            if self._blocked({(msg.origin, msg.a), (msg.origin, msg.b)}):
                self._deferred.append((sender, msg))
                return
            renamed = self._swap_names(msg.origin, msg.a, msg.b)
            if renamed:
                self._swaps[msg.nonce] = st.now + st.cfg.tombstone_s
        e = st.flows.get((msg.origin, msg.flow_id))
        if e is None:  # handed over before the notice came: pass it to the holder
            before = msg.b if msg.flow_id == msg.a else msg.a
            stone = st.tombstones.get((msg.origin, before))
            if stone is not None and msg.ttl > 0:
                st.send(stone[0], dataclasses.replace(msg, ttl=msg.ttl - 1))
        elif not st.is_dh:
            if msg.old_prev and e.prev == msg.old_prev:
                e.prev, e.since_s = msg.prev, st.now
                if sender != msg.prev:  # came along a tombstone: my new prev points at the forwarder
                    st.send(e.prev, FlowSwitch(e.origin, e.flow_id, "next", sender, st.me.id, e.down_s))
            if e.prev == msg.prev:
                if fresh:
                    e.up_prev_s, e.up_s = msg.up_s, msg.up_s + st.link_s(e.prev)
                else:
                    st.set_up(e, msg.up_s)
            if st.is_last:  # the data holder learns its route's (new) last relay and cost
                st.send(e.prev, FlowCost(e.origin, e.flow_id, "next", e.down_s, st.me.id))
        for f in renamed:
            if f.next is not None and not f.pending and f.next != f.origin:
                st.send(f.next, FlowSwapTail(
                    f.origin, msg.a, msg.b, msg.nonce, f.flow_id, st.me.id, "", f.up_s))

    def _swap_names(self, origin: NodeId, a: int, b: int) -> list[FlowEntry]:
        """Exchange the names (origin, a) and (origin, b) of whatever I hold; the renamed entries."""
        st = self.anneal.state
        ka, kb = (origin, a), (origin, b)
        ea, eb = st.flows.pop(ka, None), st.flows.pop(kb, None)
        out: list[FlowEntry] = []
        for e, fid in ((ea, b), (eb, a)):
            if e is not None:
                e.flow_id, e.since_s = fid, st.now
                st.flows[e.key] = e
                out.append(e)
        st.dirty = st.dirty or bool(out)
        return out


@dataclass(slots=True)
class Probe:
    """A claim a full relay takes a slot for, while its downstream part is being reserved."""

    entry: FlowEntry  # the claim's entry here (pending until the answer; then kept out of the table)
    victim: FlowKey  # the locked flow whose slot it takes
    chained: bool  # the victim was named by my prev: the top of the take decides, not me
    answered: bool = False
    last: str = ""  # the new route's last relay, from the answer


CLAIM_WAIT_MAX_TICKS = 32  # a data holder whose claims keep failing waits up to this long between two
CLAIM_BLOCKED_TICKS = 5  # a data holder claims only once blocked this long (routes settle first)


class Claim:
    """Take a full relay's slot from a costlier route for a data holder with unmet demand.

    Why a move of its own: when a bottleneck stage is full, a data holder that is served less
    than in the optimum can only get a route by another data holder's route giving up its slot,
    and the route it would then build (its own first and last hops, and everything between) has
    nothing in common with the released one but that slot. The existing moves change one stage
    of one or two routes, or hand a whole route over with its hops, so every step of that chain
    scores worse on its own (docs/flow-protocol.md, "Known gaps", seed 2002).

    At the data holder (`Reservation._build_flows` asks `may_claim`): once blocked for
    `CLAIM_BLOCKED_TICKS` ticks (the routes of the first reservations settle first), one claim
    at a time, a flow entry marked `claim`, sent to the next hop with the lowest d + advertised
    cost, capacity or not (the distance vector leaves capacity out). A relay with spare capacity
    accepts it and passes it on the same way, unless some next hop has capacity (it is then an
    ordinary reservation). A full relay (`take`, the top of the take) estimates the claimer's
    route through it: the claim's up cost + d(prev, me) + its cheapest next hop with capacity
    (d + advertised cost), or, if no next hop has capacity, the victim's own next hop. If its
    costliest settled flow (the victim) costs more than (1 + claim_margin) x that, it locks the
    victim and reserves the claimer's downstream part (FlowRequest), keeping the claim's entry
    out of its flow table meanwhile (its capacity is not exceeded). Sent to the victim's next
    hop, the request names the victim (`displace_*`): that relay gives the claim its slot of the
    victim the same way (a chained take, again possibly onward), and answers without deciding.
    On the answer the top knows the new route's real cost: if the victim still costs more than
    (1 + claim_margin) x that, it releases the victim (FlowCancel downstream, which also commits
    the chained takes below; FlowPushBack(release) upstream, up to its data holder, which drops it
    and rebuilds a whole route if capacity is left) and puts the claim in its slot, answering
    upstream as for any reservation; otherwise it cancels the claim's downstream part (which
    aborts the chained takes). One release per completed claim, so flow never drops; a relay
    that refuses leaves everything as it was. A data holder whose claim failed waits 2, 4, ...
    `CLAIM_WAIT_MAX_TICKS` ticks before the next.

    Messages: one request / response pair per hop the claim passes (a refused one costs the pairs
    up to the relay that refused), and for a release one cancel per hop of the victim's
    downstream part, one push back per hop of its upstream part.
    """

    kinds: tuple[str, ...] = ()  # travels as FlowRequest.claim, not as a FlowPropose

    def __init__(self, anneal: Annealer) -> None:
        self.anneal = anneal
        self.preempted = 0  # flows this relay released for a claim
        self.claimed = 0  # claims of this data holder that were accepted end to end
        self.probes: dict[FlowKey, Probe] = {}
        """Full relay: claim -> its take under way (the claim's entry is not in my flow table yet)."""
        self._key: FlowKey | None = None  # my last claim (data holder)
        self._wait_ticks = 0
        self._next_s = -INF
        self._blocked_since: float | None = None  # data holder: blocked without a break since

    # ------------------------------------------------------------------ data holder: launch

    def may_claim(self) -> bool:
        """Data holder with unmet demand and no next hop with capacity: start a claim now?"""
        st = self.anneal.state
        if not st.cfg.anneal_claim:
            return False
        self._settle()
        if self._key is not None or st.now < self._next_s or self._blocked_since is None:
            return False
        if st.now - self._blocked_since < CLAIM_BLOCKED_TICKS * st.cfg.tick_s:
            return False
        return st.rng.random() < st.cfg.anneal_probability

    def launched(self, e: FlowEntry) -> None:
        e.claim = True
        self._key = e.key

    def _settle(self) -> None:
        """The outcome of my last claim: accepted (pending no more) or gone (refused)."""
        if self._key is None:
            return
        st = self.anneal.state
        e = st.flows.get(self._key)
        if e is not None and e.pending:
            return
        self._key = None
        if e is not None:
            self.claimed += 1
            self._wait_ticks = 0
            return
        self._wait_ticks = min(max(2, 2 * self._wait_ticks), CLAIM_WAIT_MAX_TICKS)
        self._next_s = st.now + self._wait_ticks * st.cfg.tick_s

    # --------------------------------------------------------------------- full relay: take

    def take(self, sender: NodeId, msg: FlowRequest) -> bool:
        """A claim reached me while I am full: lock a flow whose slot it may take and reserve the
        claimer's downstream part; False: not here (refuse it).

        Top of a take (no `displace` in the request): the flow is my costliest settled one, if it
        costs more than (1 + claim_margin) x the claimer's estimated route through me; I decide
        on the answer (`_settle_probe`), with the real cost. Chained (the request names a flow
        to displace, which my prev locked): the named flow, if my prev on it is the sender; the
        top decides, and its release (FlowCancel of that flow) commits me (`on_released`).
        Downstream goes to my cheapest next hop with capacity; if none has any, to the locked
        flow's own next hop, asking it to displace that flow as well (its slot there comes free
        with the release): a costly route that fills consecutive full stages can be claimed."""
        st = self.anneal.state
        key = (msg.origin, msg.flow_id)
        if not st.cfg.anneal_claim or sender not in st.prev_peers or key in self.probes:
            return False
        up_s = msg.up_s + st.link_s(sender)
        chained = bool(msg.displace_origin)
        victim: FlowEntry | None
        if chained:
            victim = st.flows.get((msg.displace_origin, msg.displace_flow_id))
            if victim is not None and (victim.prev != sender or victim.pending or victim.locked
                                       or victim.repairing):
                victim = None
        else:
            victim = max((e for e in self.anneal.movable() if e.key != key),
                         key=lambda e: (e.cost_s, e.key), default=None)
        if victim is None:
            return False
        nxt, down_s = self._down(msg.origin)
        displace: FlowEntry | None = None
        if nxt is None:
            v_next = victim.next or ""
            nb = st.next_peers.get(v_next)
            if st.is_last or nb is None or victim.next == victim.origin:
                return False
            nxt, down_s, displace = v_next, nb.cost_s + nb.cost_of(msg.origin), victim
        if not chained and victim.cost_s <= (1.0 + st.cfg.claim_margin) * (up_s + down_s) + COST_EPS_S:
            return False
        e = FlowEntry(origin=msg.origin, flow_id=msg.flow_id, prev=sender, since_s=st.now)
        e.up_prev_s, e.up_s = msg.up_s, up_s
        e.next, e.requested_s = nxt, st.now
        probe = Probe(e, victim.key, chained)
        victim.locked = True
        self.probes[key] = probe
        if st.is_last:
            e.down_next_s, e.down_s = 0.0, down_s
            self._answered(probe, st.me.id)
            return True
        e.pending = True
        d_origin, d_id = displace.key if displace is not None else ("", -1)
        st.send(nxt, FlowRequest(e.origin, e.flow_id, e.up_s, displace_origin=d_origin, displace_flow_id=d_id))
        return True

    def _down(self, origin: NodeId) -> tuple[NodeId | None, float]:
        """My cheapest next hop with capacity for a new flow of `origin` and its cost back there
        (d + advertised cost; the last stage: the origin itself), as an ordinary request picks it."""
        st = self.anneal.state
        if st.is_last:
            return (origin, st.link_s(origin)) if origin in st.next_peers else (None, INF)
        best: tuple[float, NodeId] | None = None
        for pid, nb in st.next_peers.items():
            adv = nb.cost_of(origin)
            if nb.has_capacity and adv < INF and (best is None or (nb.cost_s + adv, pid) < best):
                best = (nb.cost_s + adv, pid)
        return (None, INF) if best is None else (best[1], best[0])

    def probing(self, key: FlowKey) -> bool:
        return key in self.probes

    def on_probe_response(self, sender: NodeId, msg: FlowResponse) -> None:
        """The answer to a claim's downstream reservation (Reservation hands it over)."""
        st = self.anneal.state
        probe = self.probes[(msg.origin, msg.flow_id)]
        e = probe.entry
        if e.next != sender or probe.answered:
            return
        if not msg.accepted:
            del self.probes[e.key]
            self._unlock(probe.victim)
            self._refuse(e)
            return
        e.pending = False
        e.down_next_s, e.down_s = msg.down_s, st.link_s(sender) + msg.down_s
        self._answered(probe, msg.last)

    def _answered(self, probe: Probe, last: str) -> None:
        """The claimer's route through me is reserved below me: decide (top) or pass it up."""
        st = self.anneal.state
        probe.answered, probe.last = True, last
        probe.entry.requested_s = st.now
        if probe.chained:  # the top decides; its release of the victim commits me
            st.send(probe.entry.prev, FlowResponse(probe.entry.origin, probe.entry.flow_id, True,
                                                   probe.entry.down_s, last))
            return
        self._settle_probe(probe)

    def cancel_probe(self, sender: NodeId, key: FlowKey, force: bool) -> None:
        """FlowCancel of a claim I am reserving downstream for: give it up."""
        if force or self.probes[key].entry.prev == sender:
            self.abort_probe(key)

    def abort_probe(self, key: FlowKey) -> None:
        """The claim was cancelled upstream (or timed out): release its downstream part."""
        probe = self.probes.pop(key)
        self._unlock(probe.victim)
        e = probe.entry
        if e.next is not None and e.next != e.origin:
            self.anneal.state.send(e.next, FlowCancel(e.origin, e.flow_id, force=True))

    def on_released(self, key: FlowKey) -> None:
        """Flow `key` left my table (a cancel from its prev): a chained probe waiting for that
        release commits, its claim takes the slot (Reservation tells me)."""
        for ck, probe in list(self.probes.items()):
            if probe.victim == key and probe.chained:
                del self.probes[ck]
                if probe.answered:
                    self._install(probe.entry)
                else:  # released before the answer came (not by the top): give the claim up
                    self.probes[ck] = probe
                    self.abort_probe(ck)
                    self._refuse(probe.entry)

    def _settle_probe(self, probe: Probe) -> None:
        """Top of a take: the claimer's route is reserved and costs e.cost_s; trade or give up."""
        st = self.anneal.state
        del self.probes[probe.entry.key]
        e = probe.entry
        victim = st.flows.get(probe.victim)
        self._unlock(probe.victim)
        trade = victim is not None and not victim.pending and (
            victim.cost_s > (1.0 + st.cfg.claim_margin) * e.cost_s + COST_EPS_S)
        if not trade or victim is None:
            if e.next is not None and e.next != e.origin:
                st.send(e.next, FlowCancel(e.origin, e.flow_id, force=True))
            self._refuse(e)
            return
        self._release(victim)  # (its FlowCancel commits the chained probes below me, if any)
        self._install(e)
        st.send(e.prev, FlowResponse(e.origin, e.flow_id, True, e.down_s, probe.last))

    def _install(self, e: FlowEntry) -> None:
        st = self.anneal.state
        e.pending, e.since_s = False, st.now
        st.flows[e.key] = e
        st.tombstones.pop(e.key, None)
        st.dirty = True

    def _release(self, victim: FlowEntry) -> None:
        """Give my slot of `victim` up: cancel downstream, release upstream up to its data holder."""
        st = self.anneal.state
        st.forget(victim)
        if victim.next is not None and victim.next != victim.origin:
            st.send(victim.next, FlowCancel(victim.origin, victim.flow_id))
        st.send(victim.prev, FlowPushBack(victim.origin, victim.flow_id, release=True))
        self.preempted += 1

    def _unlock(self, key: FlowKey) -> None:
        v = self.anneal.state.flows.get(key)
        if v is not None:
            v.locked = False

    def _refuse(self, e: FlowEntry) -> None:
        st = self.anneal.state
        st.send(e.prev, FlowResponse(e.origin, e.flow_id, False, cost_s=st.cost_to(e.origin),
                                     has_capacity=st.has_capacity()))

    # ------------------------------------------------------------- Move protocol (unused parts)

    def best(self, offer: Offer) -> Candidate | None:
        return None  # not scored from a same-stage peer's table

    def propose(self, busy: Busy, msg: FlowTable, choice: Choice) -> FlowPropose:
        raise AssertionError("a claim is never proposed to a same-stage peer")

    def acceptable(self, e: FlowEntry, msg: FlowPropose) -> bool:
        return False

    def accept(self, sender: NodeId, e: FlowEntry, msg: FlowPropose) -> None:
        raise AssertionError("a claim is never proposed to a same-stage peer")

    def finish(self, sender: NodeId, busy: Busy, msg: FlowRespond) -> None:
        raise AssertionError("a claim is never proposed to a same-stage peer")

    def handlers(self) -> dict[type[Message], Callable[[NodeId, Any], None]]:
        return {}

    def on_tick(self) -> None:
        st = self.anneal.state
        if st.is_dh:
            self._settle()
            if self._key is None and not self.anneal.blocked():  # (my pending claim takes my spare)
                self._blocked_since = None
            elif self._blocked_since is None:
                self._blocked_since = st.now
        # unanswered probes time out like any reservation (refused upstream); an answered chained
        # one waits longer for the top's decision (commit by release, or abort by cancel)
        timeout = st.cfg.request_timeout_s
        late = [k for k, p in self.probes.items() if st.now - p.entry.requested_s > (3 * timeout if p.answered else timeout)]
        for key in late:
            probe = self.probes[key]
            self.abort_probe(key)
            if not probe.answered:
                self._refuse(probe.entry)
