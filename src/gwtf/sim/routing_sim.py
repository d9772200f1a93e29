"""Routing-only simulation: one `FlowAgent` per node of an `Instance`, driven on the DES engine.

Owns: `RoutingSim`, which delivers the agents' messages with delay = one-way latency +
bytes / bandwidth between the two nodes' regions (a constant size per control message), fires
their timers, tells each agent its prev / same / next-stage neighbours at start (with the true
link as if measured: both directions averaged, so the agent's d(i,j) equals the instance's), runs
until it is stable for `stable_ticks` ticks (or a virtual time limit), extracts the
routes by following every data holder's flows (each relay entry in at most one route, checked
against every node's limit and its flow entries on every snapshot), and crashes relays silently
(messages to them are lost; their neighbours get `on_peer_down` after `detection_delay_s` +
latency).

Instances read from a file may leave node pairs without a link (`Instance.linked`): such a
prev/next-stage node is never announced, and a control message between unlinked nodes takes the
slowest listed link's delay.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, assert_never

from gwtf.config import FlowConfig
from gwtf.flow.instance import Instance, NodeSpec, Route
from gwtf.flow.load_optimum import load_route_costs
from gwtf.protocol.base import CancelTimer, Message, NodeId, RouterEffect, Send, SetTimer
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.routing import FlowAgent
from gwtf.sim.engine import Engine

CONTROL_MESSAGE_BYTES = 200


@dataclass(frozen=True, slots=True)
class RoutingOutcome:
    """Where a run (or a re-run after a crash) ended."""

    routes: tuple[Route, ...]
    converged: bool  # the routes stopped changing before the time limit
    converged_at_s: float  # virtual time of the last route change (relative to the run's start)
    messages: int  # messages sent during this run
    end_s: float  # virtual time when the run stopped
    flow_reached_at_s: float | None = None  # first time the flow hit `target_flow` (if asked)
    routes_changed_at_s: float = 0.0  # last change of any route (= converged_at_s with stop_when="routes")
    check_routes: tuple[Route, ...] | None = None  # the best snapshot `check_s` into the run (if asked)


def peer_info(spec: NodeSpec) -> PeerInfo:
    return PeerInfo(spec.id, spec.stage, spec.region, spec.compute_s, spec.capacity, spec.demand)


class RoutingSim:
    """Seeded, deterministic driver of the decentralized flow protocol over one instance."""

    def __init__(
        self,
        instance: Instance,
        cfg: FlowConfig | None = None,
        seed: int = 0,
        message_bytes: int = CONTROL_MESSAGE_BYTES,
        detection_delay_s: float = 1.0,
        stable_ticks: int = 20,
        stop_when: str = "routes",
    ) -> None:
        """`stop_when`: "routes" = no route changed for `stable_ticks` ticks; "objective" = the flow
        and the max route cost (to 0.1%) did not change for that long, while annealing may still
        shuffle cheaper routes (large swarms keep finding small improvements for a long time)."""
        if stop_when not in ("routes", "objective"):
            raise ValueError(f"stop_when must be 'routes' or 'objective', got {stop_when!r}")
        self.stop_when = stop_when
        self._route_cost: dict[Route, float] = {}
        self.instance = instance
        self.cfg = cfg or FlowConfig()
        self.seed = seed
        self.message_bytes = message_bytes
        self.detection_delay_s = detection_delay_s
        self.stable_ticks = stable_ticks
        self.engine = Engine()
        self.dead: set[NodeId] = set()
        self.messages = 0
        self._delay: dict[tuple[str, str], float] = {}
        self._timers: dict[tuple[NodeId, Any], int] = {}
        self.agents: dict[NodeId, FlowAgent] = {
            n.id: FlowAgent(
                peer_info(n), instance.stages, instance.activation_bytes, self.cfg,
                random.Random(f"gwtf-route/{seed}/{n.id}"),
            )
            for n in instance.nodes
        }
        self._started = False

    # ------------------------------------------------------------------------------ public

    def run(self, time_limit_s: float = 600.0, target_flow: int | None = None,
            check_s: float | None = None) -> RoutingOutcome:
        """Start (first call) and run until the routes are stable or `time_limit_s` more virtual s.

        `check_s`: also keep the routes of the first tick `check_s` or more virtual s into the run
        (the same best recent snapshot the run returns; its end routes if it stopped before)."""
        if not self._started:
            self._start()
        start_s, msgs0 = self.engine.now, self.messages
        state = _Monitor(start_s, self.routes(), target_flow, self._max_cost)
        tick_s = self.cfg.tick_s
        stable_s = self.stable_ticks * tick_s
        by_objective = self.stop_when == "objective"

        def monitor() -> None:
            routes = self.routes()
            state.observe(self.engine.now, routes)
            if check_s is not None and state.checked is None and self.engine.now - start_s >= check_s - 1e-9:
                state.checked = tuple(state.best)
            last = state.objective_change_s if by_objective else state.last_change_s
            if state.routes and self.engine.now - last >= stable_s:
                state.done = True
            elif not state.routes and self.engine.now - start_s >= 3 * stable_s:
                state.done = True
            else:
                self.engine.after(tick_s, monitor)

        self.engine.after(tick_s, monitor)
        self.engine.run(until_s=start_s + time_limit_s, stop=lambda: state.done)
        reached = None if state.reached_s is None else state.reached_s - start_s
        last = state.objective_change_s if by_objective else state.last_change_s
        checked = state.checked if state.checked is not None or check_s is None else tuple(state.best)
        return RoutingOutcome(
            tuple(state.best), state.done, last - start_s,
            self.messages - msgs0, self.engine.now - start_s, reached, state.last_change_s - start_s, checked,
        )

    def _max_cost(self, routes: list[Route]) -> float:
        if self.cfg.load_aware:  # the cost the nodes route by: it depends on every route's load
            return max(load_route_costs(self.instance, routes), default=0.0)
        cache = self._route_cost
        best = 0.0
        for r in routes:
            c = cache.get(r)
            if c is None:
                c = cache[r] = self.instance.route_cost_s(r)
            best = max(best, c)
        return best

    def crash(self, fraction: float, rng: random.Random) -> list[NodeId]:
        """Crash `fraction` of the live relays now (at least one survivor per stage); returns them."""
        by_stage: dict[int, list[NodeId]] = {}
        for n in self.instance.nodes:
            if n.stage > 0 and n.id not in self.dead:
                by_stage.setdefault(n.stage, []).append(n.id)
        relays = sorted(nid for ids in by_stage.values() for nid in ids)
        want = round(fraction * len(relays))
        victims: list[NodeId] = []
        for nid in rng.sample(relays, len(relays)):
            if len(victims) >= want:
                break
            stage = self.instance.by_id[nid].stage
            if len(by_stage[stage]) > 1:
                by_stage[stage].remove(nid)
                victims.append(nid)
        for v in victims:
            self.dead.add(v)
        for v in victims:
            for peer in self._neighbours(v):
                lat = self.instance.latency_s(peer, v)
                delay = self.detection_delay_s + (lat if math.isfinite(lat) else self._delay_s(v, peer))
                self.engine.after(delay, self._peer_down, peer, v)
        return victims

    def surviving_instance(self) -> Instance:
        """The instance without crashed nodes (for the post-crash optimum)."""
        inst = self.instance
        nodes = tuple(n for n in inst.nodes if n.id not in self.dead)
        return Instance(nodes=nodes, stages=inst.stages, network=inst.network, activation_bytes=inst.activation_bytes)

    def routes(self) -> list[Route]:
        """Complete routes, following every live data holder's established flows hop by hop.

        Exact at any moment: each relay's flow entry belongs to at most one route. While a data
        holder exchange is under way the taker has adopted the giver's route (under a new name,
        `renamed_from` the old one) before the giver has let go of it, so both walk the same
        relay entries; the giver's walk, under the name the relays still use, keeps them, and the
        route is counted once. Checked: `_check_snapshot` raises if a node ever carries more
        routes than its limit or than the flow entries it holds.
        """
        walks: list[tuple[bool, Route, list[tuple[NodeId, Any]]]] = []
        for dh in self.instance.by_stage[0]:
            if dh in self.dead:
                continue
            for key, e in self.agents[dh].state.flows.items():
                if e.pending or e.next is None:
                    continue
                walked = self._walk(dh, key, e)
                if walked is not None:
                    walks.append((e.renamed_from is not None, *walked))
        out: list[Route] = []
        claimed: set[tuple[NodeId, Any]] = set()
        for _renamed, route, hops in sorted(walks, key=lambda w: w[0]):  # stable: originals first
            if claimed.isdisjoint(hops):
                claimed.update(hops)
                out.append(route)
        self._check_snapshot(out)
        return out

    def _walk(self, dh: NodeId, key: Any, e: Any) -> tuple[Route, list[tuple[NodeId, Any]]] | None:
        """The complete route of data holder `dh`'s flow `key` (entry `e`) and the relay entries
        (node, key there) it runs through, or None if it is not complete now."""
        keys = (key,) if e.renamed_from is None else (key, e.renamed_from)  # rename under way
        route, hops, prev, node = [dh], [], dh, e.next
        for _ in range(1, self.instance.stages):
            node, f = self._holder(node, keys, prev)
            if f is not None and f.key != key and prev == dh:
                prev = f.prev  # not renamed yet: still names the old origin as prev
            if f is None or f.pending or f.prev != prev or f.next is None:
                return None
            alias = self.agents[node].anneal.swap.aliases.get(f.key)
            if alias is not None:  # tails swapped here: below, the tail may still have its old name
                keys = (*keys, alias[0])
            route.append(node)
            hops.append((node, f.key))
            prev, node = node, f.next
        if node == dh or (e.renamed_from is not None and node == e.renamed_from[0]):
            return tuple(route), hops
        return None

    def _check_snapshot(self, routes: list[Route]) -> None:
        """Raise AssertionError if a snapshot puts more routes through a node than it may carry
        (min(demand, capacity) at a data holder), or more than the flow entries it holds (each
        route through a node takes one entry of its own there, whatever the node's spare
        capacity): a route counted twice is a measurement bug."""
        load = Counter(n for r in routes for n in r)
        by_id = self.instance.by_id
        for nid, n in load.items():
            spec = by_id[nid]
            limit = min(spec.demand, spec.capacity) if spec.is_data_holder else spec.capacity
            if n > limit:
                raise AssertionError(f"routing snapshot at {self.engine.now:.3f} s: {nid} carries {n} routes, "
                                     f"limit {limit}")
        for nid, n in load.items():
            held = len(self.agents[nid].state.flows)
            if n > held:
                raise AssertionError(f"routing snapshot at {self.engine.now:.3f} s: {nid} carries {n} routes "
                                     f"over {held} flow entries (a route counted twice)")

    def _holder(self, node: NodeId, keys: tuple[tuple[NodeId, int], ...], prev: NodeId) -> tuple[NodeId, Any]:
        """The node that holds the flow (under any of its names, preferring the one whose prev is
        `prev`) now, following hand-over tombstones (a switch notice may still be on its way)."""
        for _ in range(3):
            if node in self.dead:
                return node, None
            agent = self.agents[node]
            stone = None
            found = [f for f in (agent.state.flows.get(key) for key in keys) if f is not None]
            if found:
                return node, next((f for f in found if f.prev == prev), found[0])
            for key in keys:
                stone = stone or agent.state.tombstones.get(key)
            if stone is None:
                return node, None
            node = stone[0]
        return node, None

    def check_invariants(self) -> None:
        """Raise AssertionError if a live agent holds more flows than its capacity."""
        for nid, a in self.agents.items():
            if nid in self.dead:
                continue
            limit = min(a.state.me.demand, a.state.me.capacity) if a.state.is_dh else a.state.me.capacity
            if len(a.state.flows) > limit or a.state.load > a.state.me.capacity:
                raise AssertionError(f"{nid} holds {len(a.state.flows)} flows (+{a.state.reserved} reserved), limit {limit}")

    # ---------------------------------------------------------------------------- driving

    def _start(self) -> None:
        self._started = True
        inst = self.instance
        for n in inst.nodes:
            agent = self.agents[n.id]
            for peer in self._neighbours(n.id):
                self._apply(n.id, agent.on_peer_up(peer_info(inst.by_id[peer]), self._link(n.id, peer), 0.0))
        for n in inst.nodes:
            self._apply(n.id, self.agents[n.id].on_start(0.0))

    def _neighbours(self, nid: NodeId) -> list[NodeId]:
        inst = self.instance
        s, k = inst.by_id[nid].stage, inst.stages
        stages = sorted({(s - 1) % k, s, (s + 1) % k})
        return [p for st in stages for p in inst.by_stage[st] if p != nid and p not in self.dead
                and (st == s or inst.linked(nid, p))]  # no link: a prev/next node it cannot use

    def _link(self, a: NodeId, b: NodeId) -> LinkEstimate:
        inst = self.instance
        if not inst.linked(a, b):  # same-stage peers with no link talk over the control plane only
            return LinkEstimate(math.inf, math.inf)
        lat = (inst.latency_s(a, b) + inst.latency_s(b, a)) / 2.0
        bw = (inst.bandwidth_bytes_per_s(a, b) + inst.bandwidth_bytes_per_s(b, a)) / 2.0
        return LinkEstimate(lat, bw)

    def _delay_s(self, a: NodeId, b: NodeId) -> float:
        ra, rb = self.instance.by_id[a].region, self.instance.by_id[b].region
        d = self._delay.get((ra, rb))
        if d is None:
            net = self.instance.network
            lat = net.latency_s(ra, rb)
            d = (lat + self.message_bytes / net.bandwidth_bytes_per_s(ra, rb) if math.isfinite(lat)
                 else self._unlinked_delay_s())
            self._delay[(ra, rb)] = d
        return d

    def _unlinked_delay_s(self) -> float:
        """A control message between two nodes with no link (an instance file's `links` left the
        pair out) goes over the control plane: as slow as the slowest link, latency and bandwidth."""
        net = self.instance.network
        pairs = [(lat, bw) for lrow, brow in zip(net.latency_matrix_s, net.bandwidth_matrix_bytes_per_s)
                 for lat, bw in zip(lrow, brow) if math.isfinite(lat)]
        if not pairs:
            return 1.0
        return max(lat for lat, _ in pairs) + self.message_bytes / min(bw for _, bw in pairs)

    def _apply(self, nid: NodeId, effects: Sequence[RouterEffect]) -> None:
        engine = self.engine
        for eff in effects:
            if isinstance(eff, Send):
                self.messages += 1
                engine.after(self._delay_s(nid, eff.to), self._receive, nid, eff.to, eff.msg)
            elif isinstance(eff, SetTimer):
                tkey = (nid, eff.key)
                old = self._timers.get(tkey)
                if old is not None:
                    engine.cancel(old)
                self._timers[tkey] = engine.schedule(eff.at, self._fire, nid, eff.key)
            elif isinstance(eff, CancelTimer):
                old = self._timers.pop((nid, eff.key), None)
                if old is not None:
                    engine.cancel(old)
            else:
                assert_never(eff)  # raises on an effect a router may not return

    def _receive(self, src: NodeId, dst: NodeId, msg: Message) -> None:
        if dst not in self.dead:
            self._apply(dst, self.agents[dst].on_message(src, msg, self.engine.now))

    def _fire(self, nid: NodeId, key: Any) -> None:
        self._timers.pop((nid, key), None)
        if nid not in self.dead:
            self._apply(nid, self.agents[nid].on_timer(key, self.engine.now))

    def _peer_down(self, nid: NodeId, peer: NodeId) -> None:
        if nid not in self.dead:
            self._apply(nid, self.agents[nid].on_peer_down(peer, self.engine.now))


class _Monitor:
    """Tracks the last route change and the last objective change (flow, max cost) of a run.

    A hand-over under way hides its route for a fraction of a second, so the objective is read
    from the best snapshot (most routes, then lowest max cost) of the last `WINDOW` ticks, and
    that snapshot is what the run returns.
    """

    WINDOW = 5

    def __init__(self, start_s: float, routes: list[Route], target_flow: int | None,
                 max_cost: Callable[[list[Route]], float]) -> None:
        self.routes = sorted(routes)
        self.max_cost = max_cost
        self.top = max_cost(self.routes)
        self.window: deque[tuple[int, float, list[Route]]] = deque(maxlen=self.WINDOW)
        self.window.append((len(self.routes), self.top, self.routes))
        self.objective = (len(self.routes), self.top)
        self.last_change_s = self.objective_change_s = start_s
        self.target_flow = target_flow
        self.reached_s: float | None = None
        self.checked: tuple[Route, ...] | None = None  # the best snapshot at the run's check time
        self.done = False

    @property
    def best(self) -> list[Route]:
        return max(self.window, key=lambda w: (w[0], -w[1]))[2]

    def observe(self, now: float, routes: list[Route]) -> None:
        routes = sorted(routes)
        if routes != self.routes:
            self.routes = routes
            self.last_change_s = now
            self.top = self.max_cost(routes)
        self.window.append((len(routes), self.top, routes))
        flow, top, _ = max(self.window, key=lambda w: (w[0], -w[1]))
        old_flow, old_top = self.objective
        if flow != old_flow or abs(top - old_top) > 1e-3 * old_top:
            self.objective = (flow, top)
            self.objective_change_s = now
        if self.reached_s is None and self.target_flow is not None and flow >= self.target_flow:
            self.reached_s = now
