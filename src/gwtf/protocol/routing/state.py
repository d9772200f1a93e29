"""The state a flow agent's parts share: neighbour tables, flow table, cost adverts, effects.

Owns: `Neighbour`, `FlowEntry`, and `FlowState`: the node's view of its previous / same /
next-stage peers (edge cost d(i,j) from `flow.cost.edge_cost_s` with a symmetric estimate built
from this node's own measurements), the flow table and hand-over tombstones, the distance-vector
cost to every target data holder (recomputed at most once per `advert_interval_s`, advertised to
the previous stage when it changes), cost propagation along flows, tick quiescence, and the
effect buffer every part fills. The parts that act on it (`routing.reserve.Reservation`,
`routing.anneal.Annealer` and its moves) hold a reference to the one `FlowState` of their agent.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gwtf.config import FlowConfig
from gwtf.flow.cost import edge_cost_s, queue_factor
from gwtf.protocol.base import IdentityMemo, Message, NodeId, Send, SetTimer
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.routing.messages import INF_COST_S, FlowAdvert, FlowCancel, FlowCost, FlowSwitch

INF = INF_COST_S
COST_EPS_S = 1e-9
FlowKey = tuple[NodeId, int]
"""A flow's name: (origin data holder, flow id chosen by that data holder)."""
DOWN_PEERS_KEPT = 4096  # peers reported down and not up since, remembered (oldest forgotten first)


_TARGETS: dict[tuple[str, ...], tuple[str, ...]] = {}  # one shared object per target tuple


def shared_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The one tuple object equal to `targets` (every node of a swarm advertises the same sorted
    data holders: one object, one position index, instead of one per advert)."""
    hit = _TARGETS.get(targets)
    if hit is None:
        if len(_TARGETS) > 4096:
            _TARGETS.clear()
        hit = _TARGETS[targets] = targets
    return hit


_position: IdentityMemo[tuple[str, ...], dict[str, int]] = IdentityMemo(
    lambda targets: {t: i for i, t in enumerate(targets)})
"""target -> its index in a target tuple (one dict per shared tuple object)."""


def _frozen_array(costs: tuple[float, ...]) -> Any:
    a = np.asarray(costs, dtype=np.float64)
    a.flags.writeable = False
    return a


_arrays: IdentityMemo[tuple[float, ...], Any] = IdentityMemo(_frozen_array, limit=8192)
"""A cost tuple as a read-only float64 array, once per tuple object. The advertiser seeds it
with the array its tuple came from, so in a simulation the ~32 receivers of one advert (and the
advertiser's own tolerance test) convert nothing; the values are the tuple's exactly."""


@dataclass(slots=True)
class Neighbour:
    """A prev / same / next-stage peer and what this node knows of it.

    Its advertised costs are kept as the advert's columns (`vec`); the dict view `adv` is built
    only when first needed, since most adverts are superseded before anything looks them up.
    After a single-entry update (a refusal's fresh cost) the dict is the only truth and `vec` is
    None.
    """

    info: PeerInfo
    link: LinkEstimate
    cost_s: float  # d(me, peer), the edge cost of the flow model
    has_capacity: bool = True
    load: int = 0  # the flows it carries, as it last announced (flow.load; `flow.load_aware` only)
    vec: tuple[tuple[str, ...], tuple[float, ...]] | None = None  # its last advert: targets, costs
    adv_dict: dict[NodeId, float] | None = None  # vec as a dict, when built

    @property
    def adv(self) -> dict[NodeId, float]:
        """Its advertised cost to each target."""
        d = self.adv_dict
        if d is None:
            d = self.adv_dict = dict(zip(*self.vec)) if self.vec is not None else {}
        return d

    def cost_of(self, target: NodeId) -> float:
        """Its advertised cost to `target` (inf when it advertised none), without building `adv`."""
        vec = self.vec
        if vec is not None:
            i = _position(vec[0]).get(target)
            return INF if i is None else vec[1][i]
        d = self.adv_dict
        return d.get(target, INF) if d else INF

    def heard(self) -> bool:
        """Has it advertised anything (that I still hold)?"""
        return self.vec is not None or bool(self.adv_dict)

    def set_advert(self, targets: tuple[str, ...], costs: tuple[float, ...]) -> bool:
        """A new advert from it; True when its costs changed."""
        vec = self.vec
        if vec is not None:
            if (costs is vec[1] or vec[1] == costs) and vec[0] == targets:
                return False
        elif self.adv_dict:
            if self.adv_dict == dict(zip(targets, costs)):
                return False
        elif not targets or not costs:
            return False  # nothing known before, nothing now (no dict of the advert needed)
        self.vec, self.adv_dict = (targets, costs), None
        return True

    def set_cost(self, target: NodeId, cost_s: float) -> bool:
        """One fresh entry (from a refusal); True when it changed."""
        adv = self.adv
        if adv.get(target) == cost_s:
            return False
        adv[target] = cost_s
        self.vec = None
        return True


@dataclass(slots=True)
class FlowEntry:
    """One flow through this node. At the origin data holder prev is the flow's last relay."""

    origin: NodeId
    flow_id: int
    prev: NodeId
    next: NodeId | None = None
    up_prev_s: float = 0.0  # route cost from the origin to prev
    up_s: float = 0.0  # ... to me (= up_prev_s + d(prev, me)); 0 at the origin
    down_next_s: float = 0.0  # route cost from next back to the origin
    down_s: float = 0.0  # ... from me (= d(me, next) + down_next_s)
    pending: bool = False  # a reservation of the downstream part is under way
    repairing: bool = False  # the pending reservation replaces a lost downstream part
    locked: bool = False  # offered in an annealing move that is under way
    tried: list[NodeId] = field(default_factory=list)
    since_s: float = 0.0  # last change of prev / next
    requested_s: float = 0.0
    check_fails: int = 0
    renamed_from: tuple[NodeId, int] | None = None  # data holder: the name it had before I adopted it
    claim: bool = False  # pending reservation that may take a full relay's slot (routing.moves.Claim)

    @property
    def key(self) -> FlowKey:
        return (self.origin, self.flow_id)

    @property
    def cost_s(self) -> float:
        """The whole route's cost as this node knows it: up + down."""
        return self.up_s + self.down_s


class FlowState:
    """What one node's flow agent knows, and the helpers every part of the agent uses on it."""

    def __init__(
        self, me: PeerInfo, stages: int, activation_bytes: int, cfg: FlowConfig, rng: random.Random
    ) -> None:
        if not 0 <= me.stage < stages:
            raise ValueError(f"node {me.id} stage {me.stage} outside 0..{stages - 1}")
        self.me = me
        self.stages = stages
        self.activation_bytes = activation_bytes
        self.cfg = cfg
        self.rng = rng
        self.is_dh = me.stage == 0
        self.is_last = me.stage == stages - 1
        self.prev_stage = (me.stage - 1) % stages
        self.next_stage = (me.stage + 1) % stages
        self.prev_peers: dict[NodeId, Neighbour] = {}
        self.same_peers: dict[NodeId, Neighbour] = {}
        self.next_peers: dict[NodeId, Neighbour] = {}
        self.down_peers: dict[NodeId, None] = {}  # reported down (on_peer_down), not up since; in order
        self.flows: dict[FlowKey, FlowEntry] = {}
        self.tombstones: dict[FlowKey, tuple[NodeId, float]] = {}  # handed over -> (holder, until)
        self.now = 0.0
        self.ticks = 0
        self.reserved = 0  # capacity held for an annealing take-over under way
        self.aliases: dict[FlowKey, tuple[FlowKey, float]] = {}  # renamed flow -> (new name, until)
        self.messages_in = 0
        self.messages_out = 0
        self.check_phase = rng.randrange(cfg.check_every_ticks)
        self._out: list[Any] = []
        self.dirty = False
        self.advertised: tuple[tuple[str, ...], tuple[float, ...], bool] | None = None
        self.early_adverts: dict[NodeId, Any] = {}  # adverts of peers not (yet) up, latest per sender
        self._last_advert_s = -INF
        self.advert_timer_set = False
        self._costs: tuple[tuple[str, ...], tuple[float, ...]] = ((), ())
        self.costs_dirty = True  # neighbour costs, links or membership changed since last recompute
        self.started_s = 0.0
        self._first_advert = True
        self.tick_gap = cfg.tick_s  # current tick period (grows while quiet, see _next_tick)
        self.tick_at = 0.0  # when the pending tick fires
        self._changed = False  # flows, peers or costs changed since the last tick
        self.load_level = 0  # the load my edge costs use and my peers last heard (flow.load_aware)
        self.last_load_s = -INF  # when I last announced my load (flow.load_aware)
        self.load_timer_set = False

    # ------------------------------------------------------------------------------ effects

    def send(self, to: NodeId, msg: Message) -> None:
        self.messages_out += 1
        self._out.append(Send(to, msg))

    def timer(self, key: tuple[Any, ...], at: float) -> None:
        self._out.append(SetTimer(key, at))

    def flush(self) -> list[Any]:
        if self.dirty:
            self.dirty = False
            self._stirred()
            self._maybe_advert()
        out, self._out = self._out, []
        return out

    # --------------------------------------------------------------------- tick quiescence

    def next_tick(self) -> None:
        """Schedule the next tick. With `tick_max_s` > `tick_s`, a tick after which nothing changed
        (no flow, peer, link or cost change, no reservation under way, no unmet data-holder demand)
        doubles the period up to `tick_max_s`, as Trickle (RFC 6206) does for gossip; any change
        brings it back to `tick_s` at once (`_stirred`). A converged swarm then stops probing."""
        cfg = self.cfg
        if cfg.tick_max_s > cfg.tick_s:
            busy = self._changed or self.dirty or any(e.pending or e.locked for e in self.flows.values())
            if not busy and self.is_dh:
                busy = self.spare() > 0
            self.tick_gap = cfg.tick_s if busy else min(2.0 * self.tick_gap, cfg.tick_max_s)
            self._changed = False
        self.tick_at = self.now + self.tick_gap
        self._out.append(SetTimer(("flow", "tick"), self.tick_at))

    def _stirred(self) -> None:
        """Something changed: the coming tick is not quiet, and a backed-off tick comes back."""
        self._changed = True
        if self.tick_gap > self.cfg.tick_s:
            self.tick_gap = self.cfg.tick_s
            at = self.now + self.cfg.tick_s
            if at < self.tick_at:
                self.tick_at = at
                self._out.append(SetTimer(("flow", "tick"), at))

    # ------------------------------------------------------------------------------- peers

    def add_peer(self, info: PeerInfo, link: LinkEstimate) -> None:
        if info.id == self.me.id:
            return
        self.down_peers.pop(info.id, None)
        nb = Neighbour(info, link, self._edge_cost(info, link))
        if info.stage == self.next_stage:
            self.next_peers[info.id] = nb
        if info.stage == self.prev_stage:
            self.prev_peers[info.id] = nb
        if info.stage == self.me.stage:
            self.same_peers[info.id] = nb
        self.dirty = self.costs_dirty = True

    def remove_peer(self, peer: NodeId) -> None:
        down = self.down_peers
        down.pop(peer, None)
        if len(down) >= DOWN_PEERS_KEPT:
            down.pop(next(iter(down)))
        down[peer] = None
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            table.pop(peer, None)
        self.dirty = self.costs_dirty = True

    def update_link(self, peer: NodeId, link: LinkEstimate) -> bool:
        """Re-price the edge to `peer`; False if the peer is unknown."""
        found = False
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            nb = table.get(peer)
            if nb is not None:
                nb.link = link
                nb.cost_s = self._edge_cost(nb.info, link, nb.load)
                found = True
        self.dirty = self.costs_dirty = found
        return found

    def update_compute(self, peer: NodeId, compute_s: float) -> bool:
        """Re-price the edges that use `peer`'s compute time (every edge when `peer` is me);
        False if the peer is unknown."""
        mine = peer == self.me.id
        if mine:
            self.me = replace(self.me, compute_s=compute_s)
        found = mine
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            for pid, nb in table.items():
                if pid == peer:
                    nb.info = replace(nb.info, compute_s=compute_s)
                elif not mine:
                    continue
                nb.cost_s = self._edge_cost(nb.info, nb.link, nb.load)
                found = True
        self.dirty = self.costs_dirty = found
        return found

    def _edge_cost(self, info: PeerInfo, link: LinkEstimate, load: int = 0) -> float:
        lat, bw = link.latency_s, link.bandwidth_bytes_per_s
        c_me, c_peer = self.me.compute_s, info.compute_s
        if self.cfg.load_aware:
            c_me *= queue_factor(self.load_level)
            c_peer *= queue_factor(load)
        return edge_cost_s(c_me, c_peer, lat, lat, bw, bw, self.activation_bytes)

    def set_peer_load(self, peer: NodeId, load: int) -> bool:
        """`peer` announced the flows it carries: re-price my edges to it; False if unknown or unchanged."""
        found = False
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            nb = table.get(peer)
            if nb is not None and nb.load != load:
                nb.load = load
                nb.cost_s = self._edge_cost(nb.info, nb.link, load)
                found = True
        if found:
            self.dirty = self.costs_dirty = True
        return found

    def reprice_all(self) -> None:
        """My own announced load changed: every edge of mine takes it up."""
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            for nb in table.values():
                nb.cost_s = self._edge_cost(nb.info, nb.link, nb.load)
        self.dirty = self.costs_dirty = True

    def take_extra_s(self) -> float:
        """`flow.load_aware`: a flow I take on top of my load pays my compute at the next queue
        place, while my edge costs price me at the load my peers heard (`load_level`). Its
        route passes me once (half my compute on each of its two edges here)."""
        if not self.cfg.load_aware:
            return 0.0
        return self.me.compute_s * (queue_factor(self.carried + 1) - queue_factor(self.load_level))

    @property
    def carried(self) -> int:
        """Established flows: the ones whose microbatches queue on my GPU (`flow.load_aware`'s
        load; reservations under way and slots held for a move are not traffic yet)."""
        return sum(1 for e in self.flows.values() if not e.pending)

    def redirect_adjust_s(self, peer: NodeId) -> float:
        """`flow.load_aware`: a redirect (I take one of `peer`'s flows into my spare capacity)
        changes both loads, so it is scored by the change of the load-aware sum, whose node
        part c k (k + 1) / 2 (flow.load_optimum) makes it: the moved route's link change, plus
        c_peer k_peer saved there, minus c_me (k_me + 1) added here. The row costs price both of
        us at our announced loads; this is what turns their difference into that change. With
        every redirect lowering that sum, redirects cannot cycle."""
        nb = self.same_peers.get(peer)
        if not self.cfg.load_aware or nb is None:
            return 0.0
        c_b, k_b = nb.info.compute_s, nb.load
        c_a = self.me.compute_s
        return (c_b * (k_b - queue_factor(k_b)) + c_a * queue_factor(self.load_level)
                - c_a * (self.carried + 1))

    def load_peers(self) -> list[NodeId]:
        """Who prices my compute: my previous, same and next-stage peers (each once, in order)."""
        seen: dict[NodeId, None] = {}
        for table in (self.prev_peers, self.same_peers, self.next_peers):
            for pid in table:
                seen[pid] = None
        return list(seen)

    def link_s(self, peer: NodeId) -> float:
        """d(me, peer) for a prev- or next-stage peer; inf when unknown."""
        nb = self.next_peers.get(peer) or self.prev_peers.get(peer)
        return nb.cost_s if nb is not None else INF

    # --------------------------------------------------------------------------- capacity

    @property
    def load(self) -> int:
        return len(self.flows) + self.reserved

    def spare(self) -> int:
        """Flows I could still take: relays up to capacity, data holders up to their demand."""
        limit = min(self.me.demand, self.me.capacity) if self.is_dh else self.me.capacity
        return limit - self.load

    def has_capacity(self) -> bool:
        """Can I take one more new flow: spare capacity here and some next-stage peer that can?"""
        if self.load >= self.me.capacity:
            return False
        return self.is_last or any(nb.has_capacity for nb in self.next_peers.values())

    def forget(self, e: FlowEntry) -> None:
        if self.flows.get(e.key) is e:
            del self.flows[e.key]
            self.dirty = True

    def drop(self, e: FlowEntry, cancel_next: bool) -> None:
        """Release `e` here; with `cancel_next`, release it downstream too (not at the origin)."""
        self.forget(e)
        if cancel_next and e.next is not None and e.next != e.origin:
            self.send(e.next, FlowCancel(e.origin, e.flow_id))

    def find(self, origin: NodeId, flow_id: int) -> FlowEntry | None:
        """The entry of a flow, following a rename (a yielded flow keeps its old name a while)."""
        e = self.flows.get((origin, flow_id))
        if e is None:
            alias = self.aliases.get((origin, flow_id))
            if alias is not None:
                e = self.flows.get(alias[0])
        return e

    def expire_tombstones(self) -> None:
        for table in (self.tombstones, self.aliases):
            dead = [k for k, (_, until) in table.items() if until < self.now]
            for k in dead:
                del table[k]

    # ----------------------------------------------------------------------- cost adverts

    def cost_vector(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """(targets, costs) sorted by target; recomputed only when something it depends on changed."""
        if self.costs_dirty:
            self.costs_dirty = False
            fast = None if self.is_last else self._one_group_costs()
            if fast is not None:
                self._costs = fast
            else:
                costs = self.current_costs()
                targets = shared_targets(tuple(sorted(costs)))
                self._costs = (targets, tuple(costs[t] for t in targets))
        return self._costs

    def _one_group_costs(self) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
        """`current_costs` for the usual case, kept in numpy end to end: every next peer that
        advertised named the same targets, one shared sorted tuple (`shared_targets`), so the
        result is already in target order. None when that does not hold (the general path then
        runs). Same floats as the general path: the same adds and mins, in IEEE double."""
        peers: list[Neighbour] = []
        targets: tuple[str, ...] | None = None
        for nb in self.next_peers.values():
            vec = nb.vec
            if vec is None:
                if nb.adv_dict:
                    return None  # a peer known by single entries only
                continue
            if targets is None:
                targets = vec[0]
                if _TARGETS.get(targets) is not targets:
                    return None  # not a tuple this process sorted and shared
            elif vec[0] is not targets:
                return None
            peers.append(nb)
        if targets is None:
            return None
        mins = self._group_mins(peers)
        finite = mins < INF
        if not bool(finite.all()):
            targets = shared_targets(tuple(t for t, ok in zip(targets, finite.tolist()) if ok))
            mins = mins[finite]
        costs = tuple(mins.tolist())
        mins.flags.writeable = False
        _arrays.put(costs, mins)
        return targets, costs

    def cost_to(self, target: NodeId) -> float:
        targets, costs = self.cost_vector()
        for t, c in zip(targets, costs):
            if t == target:
                return c
        return INF

    def current_costs(self) -> dict[NodeId, float]:
        """Least cost from me to each target data holder over live peers (distance vector).

        Capacity is deliberately left out of the costs (it travels as the `has_capacity` flag):
        costs then change only when links or membership do, so annealing moves, which shift load
        all the time, do not set off waves of advertisements.
        """
        if self.is_last:
            return {t: nb.cost_s for t, nb in self.next_peers.items() if nb.info.stage == 0}
        # Peers whose adverts name the same targets (the usual case: one sorted tuple of the data
        # holders) are reduced together, one column-wise min in numpy; exact, as float adds and
        # mins are, so the result equals the plain per-entry loop kept for the others.
        groups: dict[tuple[str, ...], list[Neighbour]] = {}
        loose: list[Neighbour] = []
        for nb in self.next_peers.values():
            vec = nb.vec
            if vec is not None:
                group = groups.get(vec[0])
                if group is None:
                    groups[vec[0]] = [nb]
                else:
                    group.append(nb)
            elif nb.adv_dict:
                loose.append(nb)
        best: dict[NodeId, float] = {}
        for targets, peers in groups.items():
            mins = self._group_mins(peers).tolist()
            if not best:
                best = {t: v for t, v in zip(targets, mins) if v < INF}
                continue
            for t, v in zip(targets, mins):
                if v < best.get(t, INF):
                    best[t] = v
        for nb in loose:
            c0 = nb.cost_s
            for t, c in nb.adv.items():
                v = c0 + c
                if v < best.get(t, INF):
                    best[t] = v
        return best

    @staticmethod
    def _group_mins(peers: list[Neighbour]) -> Any:
        """Per target: the least d(me, peer) + the peer's advertised cost over `peers`, which all
        advertised the same targets (a fresh numpy array; IEEE adds and mins, so equal to the
        per-entry loop). Row by row into one accumulator: no table of the peers' rows is kept
        between calls (one per node was 32 x 1,000 floats at 10,000 nodes: 2 GB of the swarm's
        memory, for patching the rows of peers that had advertised since; docs/simulator.md)."""
        first = peers[0]
        acc = first.cost_s + _arrays(first.vec[1])  # type: ignore[index]
        if len(peers) > 1:
            row = np.empty_like(acc)
            for nb in peers[1:]:
                np.add(_arrays(nb.vec[1]), nb.cost_s, out=row)  # type: ignore[index]
                np.minimum(acc, row, out=acc)
        return acc

    def _maybe_advert(self) -> None:
        """Advertise my costs to the previous stage if they changed (at most once per interval)."""
        if self.is_dh or not self.prev_peers:
            return
        if self._hold_first_advert():
            return
        due = self._last_advert_s + self.cfg.advert_interval_s
        if self.now < due:
            if not self.advert_timer_set:
                self.advert_timer_set = True
                self._out.append(SetTimer(("flow", "advert"), due))
            return
        self._last_advert_s = self.now
        targets, costs = self.cost_vector()
        extra = self.take_extra_s()
        if extra > 0.0:  # flow.load_aware: a new flow takes my next queue place
            costs = tuple(c + extra for c in costs)
        state = (targets, costs, self.has_capacity())
        if state == self.advertised or self._within_tolerance(state):
            return
        self.advertised = state
        msg = FlowAdvert(*state)
        for pid in self.prev_peers:
            self.send(pid, msg)

    def _within_tolerance(self, state: tuple[tuple[str, ...], tuple[float, ...], bool]) -> bool:
        """Same targets and capacity flag, and every cost within `advert_tolerance` (relative) of
        what was last advertised: not worth a message to every previous-stage peer. The
        comparison is with the advertised costs, so slow drift is still sent once it adds up."""
        tol = self.cfg.advert_tolerance
        old = self.advertised
        if tol <= 0.0 or old is None or old[0] != state[0] or old[2] != state[2]:
            return False
        new_c = _arrays(state[1])
        old_c = _arrays(old[1])
        return bool(np.all(np.abs(new_c - old_c) <= tol * old_c))  # the same IEEE ops as per entry

    def _hold_first_advert(self) -> bool:
        """At start, wait (up to 3 ticks) until every next-stage peer has advertised: one complete
        advert instead of a burst of partial ones (this is most of the start-up traffic)."""
        if not self._first_advert or self.is_last:
            return False
        hold_until = self.started_s + 3 * self.cfg.tick_s
        silent = not self.next_peers or any(not nb.heard() for nb in self.next_peers.values())
        if self.now < hold_until and silent:
            if not self.advert_timer_set:
                self.advert_timer_set = True
                self._out.append(SetTimer(("flow", "advert"), hold_until))
            return True
        self._first_advert = False
        return False

    # ------------------------------------------------------------------- costs along flows

    def set_up(self, e: FlowEntry, up_prev_s: float) -> None:
        """New cost at my prev: update my up cost and pass a change downstream."""
        e.up_prev_s = up_prev_s
        up = up_prev_s + self.link_s(e.prev)
        if abs(up - e.up_s) <= COST_EPS_S:
            return
        e.up_s = up
        if e.next is not None and e.next != e.origin and not e.pending:
            self.send(e.next, FlowCost(e.origin, e.flow_id, "prev", up))

    def set_down(self, e: FlowEntry, down_next_s: float, last: str = "") -> None:
        """New cost at my next: update my down cost and pass a change upstream."""
        e.down_next_s = down_next_s
        down = (self.link_s(e.next) if e.next is not None else INF) + down_next_s
        if abs(down - e.down_s) <= COST_EPS_S and not last:
            return
        e.down_s = down
        if not self.is_dh:
            self.send(e.prev, FlowCost(e.origin, e.flow_id, "next", down, last))

    # --------------------------------------------------------------- moves: hand-over

    def install(
        self, origin: NodeId, flow_id: int, prev: NodeId, nxt: NodeId, up_prev_s: float, down_next_s: float
    ) -> FlowEntry:
        e = FlowEntry(origin=origin, flow_id=flow_id, prev=prev, next=nxt, since_s=self.now)
        e.up_prev_s, e.up_s = up_prev_s, up_prev_s + self.link_s(prev)
        e.down_next_s, e.down_s = down_next_s, self.link_s(nxt) + down_next_s
        self.flows[e.key] = e
        self.tombstones.pop(e.key, None)
        self.dirty = True
        return e

    def announce(self, e: FlowEntry, old: NodeId) -> None:
        """Tell the flow's prev and next that I replaced `old` on it."""
        me = self.me.id
        self.send(e.prev, FlowSwitch(e.origin, e.flow_id, "next", old, me, e.down_s))
        if e.next is not None:
            self.send(e.next, FlowSwitch(e.origin, e.flow_id, "prev", old, me, e.up_s))

    def new_flow_id(self) -> int:
        """A fresh flow id of mine: not held, and not a recent hand-over's tombstone."""
        while True:
            fid = self.rng.getrandbits(31)
            if (self.me.id, fid) not in self.flows and (self.me.id, fid) not in self.tombstones:
                return fid
