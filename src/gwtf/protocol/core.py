"""NodeCore: the sans-IO state machine of one node, driven by the simulator and the runtime.

Owns: the public API both drivers call (`on_start`, `on_message`, `on_timer`,
`on_compute_done`, `on_send_failed`, `on_leave`), event dispatch (messages by TYPE prefix:
"flow."/"swarm." to the router, the rest to the part whose `@handles` method claims it;
timers by key[0]), loopback delivery of messages a node sends to itself, and reliable resending
of control messages whose send failed. The behaviour lives in the parts, objects the node
holds (`NodeCore.PARTS`), each owning its state and reaching the rest of the node through a
typed `node` reference: `members` (`membership.Membership`: directory, failure detection,
election, join, leave, state transfer), `plane` (`training.DataPlane`: microbatch data plane,
its ledger and in-flight recovery), `agg` (`aggregation.Aggregation`: replica side of the
barrier, with the butterfly all-reduce as `agg.bf`) and `coord` (`leader.Coordinator`: the
leader's side). What every part reads (identity, directory, term and leader, suspects, link
estimates, iteration and version) is the node's own (`ledger.CoreState`), each fact written by
one part. The systems (`systems.SYSTEMS`) subclass NodeCore only for their hooks
(`rebalance`, `choose_join_stage`). `docs/protocol.md` is the narrative.

Every call returns a list of effects: base `Send`/`SetTimer`/`CancelTimer`/`Log` plus
`messages.Compute`/`Record`/`FreeIteration`. A driver runs a node's `Compute`s one at a time in
the order they were emitted and answers each with `on_compute_done`.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from operator import attrgetter
from typing import Any, ClassVar, cast

from gwtf.config import FlowConfig, ProtocolConfig
from gwtf.protocol import messages as m
from gwtf.protocol.aggregation import Aggregation
from gwtf.protocol.base import Message, NodeId, Send, log
from gwtf.protocol.dispatch import Fence, Route, Sender, Termed, router_route, routes_of
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.leader import Coordinator
from gwtf.protocol.ledger import CoreState, Effect, LinkPrior, Policy, TrainParams
from gwtf.protocol.membership import MAX_COMPUTE_S, Membership
from gwtf.protocol.messages import record
from gwtf.protocol.router import PeerInfo, Router
from gwtf.protocol.simple_router import GreedyRouter
from gwtf.protocol.training import DataPlane
from gwtf.protocol.view import Roster

__all__ = ["NodeCore", "Policy", "Sender", "TrainParams", "make_router", "message_routes"]

_ROUTER = object()  # dispatch marks: the router's message, or a message nobody handles
_UNKNOWN = object()

RELIABLE = (m.Report, m.Have, m.GradShare, m.Ready, m.Commit, m.Step, m.IterStart, m.Deal, m.Finish, m.Collect, m.Reset,
            m.MemberUp, m.MemberDown, m.Rollback, m.StateTransfer, m.StateRequest, m.Welcome, m.JoinRequest)

COMPUTE_READVERTISE = 0.1
"""`on_compute_measured`: a measured compute time is advertised only when it moved by more than
this fraction of the advertised one (no message per job for noise) ..."""
COMPUTE_ADVERT_GAP_S = 2.0
"""... and at least this long after the previous advertisement (the first one is at once)."""

"""What a node believes of the link from one node to another before measuring it; a function of
the two nodes' regions (the simulator's region table), which the leader's planning relies on."""


def make_router(name: str, me: PeerInfo, train: TrainParams, rng: random.Random,
                flow_cfg: FlowConfig | None = None) -> Router:
    """The router `protocol.router` names: "greedy" (`simple_router`) or "flow" (gwtf's FlowAgent)."""
    if name == "flow":
        from gwtf.protocol.routing import FlowAgent

        return FlowAgent(me, train.stages, train.route_bytes, flow_cfg or FlowConfig(), rng)
    return GreedyRouter(me, train.stages, train.route_bytes)


class NodeCore(CoreState):
    """One node's protocol brain: events in, effects out (see the module docstring)."""

    def __init__(self, me: PeerInfo, cfg: ProtocolConfig, train: TrainParams, rng: random.Random,
                 router: Router | None = None, policy: Policy | None = None,
                 link_prior: LinkPrior | None = None,
                 router_factory: Callable[[PeerInfo], Router] | None = None) -> None:
        """`router_factory` (optional) builds a fresh router when a joiner picks its stage;
        without it a router's optional `set_me(me)` is called instead."""
        if router is None and router_factory is None:
            router_rng = random.Random(rng.getrandbits(64))

            def default_factory(info: PeerInfo) -> Router:
                return make_router(cfg.router, info, train, router_rng)

            router_factory = default_factory
        if router is None:
            assert router_factory is not None
            # A joiner has no stage yet (-1): it routes nothing until `on_welcome` gives it one
            # and builds its real router; the greedy router is a harmless placeholder meanwhile.
            router = router_factory(me) if me.stage >= 0 else GreedyRouter(me, train.stages, train.route_bytes)
        CoreState.__init__(self, me, cfg, train, rng, router, policy or Policy())
        self.link_prior = link_prior
        self.members = Membership(self)
        self.coord = Coordinator(self)
        self.agg = Aggregation(self)
        self.plane = DataPlane(self)
        self.router_factory = router_factory
        self._resends: dict[int, tuple[NodeId, Message]] = {}
        self._resend_seq = 0
        self.init_parts()

    def init_parts(self) -> None:
        """A subclass's own parts and state (its `PARTS` beyond the core's), built last in
        `__init__`: the one constructor signature stays the core's."""

    # Set by drivers that start a swarm of operator-placed nodes (the runtime: `--stage K`,
    # `runtime.start_members`); the simulator leaves both at their neutral defaults.
    fixed_stage: int | None = None  # a joiner keeps this stage instead of the bottleneck stage
    start_members: int = 0  # leader of a fresh swarm: hold iteration 0 until this many members
    start_version: int = 0  # a resumed swarm's first version (its bootstrap node loaded it)
    compute_advertised_s: float = -math.inf  # when on_compute_measured last advertised (driver time)

    def rebalance(self, now: float) -> list[Effect]:
        """Policy hook (`Policy.rebalance_every`), called by the coordinator when an iteration
        starts: the systems move replicas between stages here (`rebalance.GwtfCore`, `swarm.SwarmCore`)."""
        return []

    def choose_join_stage(self, utilisation: tuple[float, ...]) -> int:
        if self.fixed_stage is not None:
            return self.fixed_stage
        return self.members.join_stage(utilisation)

    # ---- driver API --------------------------------------------------------------------

    def on_start(self, now: float, known_peers: list[PeerInfo] | Roster) -> list[Effect]:
        """Bootstrap: sim passes the initial members (as a shared `Roster` with bounded views); a
        joiner (stage -1) passes one contact. A resumed swarm's node starts at `start_version`."""
        self.version = self.iteration = self.start_version
        self.started_s = now
        out = self.members.membership_start(now, known_peers)
        out += list(self.router.on_start(now))
        if self.me.stage == 0 and self.leader == self.me.id:
            out.append(m.record(RecordName.LEADER_TERM, node=self.me.id, term=self.term))
            out += self.coord.leader_init(now, recovering=False)
        return self._drain(out, now)

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[Effect]:
        if not self.alive:
            return []
        return self._drain(self._handle(sender, msg, now), now)

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[Effect]:
        if not self.alive:
            return []
        return self._drain(self._timer(key, now), now)

    def on_compute_done(self, job_id: int, now: float) -> list[Effect]:
        entry = self.jobs.pop(job_id, None)
        if entry is None or not self.alive:
            return []
        kind, ref = entry
        out = self.plane.training_compute_done(kind, ref, now)
        out += self.members.membership_compute_done(kind, ref, now)
        out += self.agg.aggregation_compute_done(kind, ref, now)
        return self._drain(out, now)

    def on_compute_failed(self, job_id: int, reason: str, now: float) -> list[Effect]:
        """A `Compute` raised in the driver (an exception in the stage worker). State jobs are
        retried through the join path (another source, or the checkpoint); a failed export (or a
        data holder's checkpoint read) answers the requester with a refusal; a checkpoint copy
        for the data holders that failed to export or be stored is only recorded; anything else means this node cannot serve its
        stage: it announces a leave (peers recover its work as after a crash) and stops with
        reason "compute_failed", which the runtime turns into a non-zero exit."""
        entry = self.jobs.pop(job_id, None)
        if entry is None or not self.alive:
            return []
        kind, ref = entry
        out: list[Effect] = [record(RecordName.COMPUTE_FAILED, node=self.me.id, kind=kind, reason=reason[:200])]
        if kind in (ComputeKind.EXPORT_STATE, ComputeKind.READ_CHECKPOINT):
            to, key, _version = ref
            return self._drain(out + [self.send(to, m.StateTransfer(stage=key[1], version=-1, key=(),
                                                                     ok=False))], now)
        if kind in (ComputeKind.EXPORT_CHECKPOINT, ComputeKind.STORE_CHECKPOINT):
            return out  # a data holder's copy of a checkpoint is missing; training goes on
        if kind in (ComputeKind.IMPORT_STATE, ComputeKind.LOAD_CHECKPOINT) and not self.active:
            return self._drain(out + self.members.state_failed(kind, now), now)
        return self._drain(out + self.members.leave(now) + self.members.stop("compute_failed", now), now)

    def on_compute_measured(self, now: float, compute_s: float) -> list[Effect]:
        """The driver measured this node's compute seconds per microbatch of its stage (the
        runtime: a moving average of its stage's job times, `docs/runtime.md`; the simulator
        never calls it, its nodes keep the compute time they started with). A value that moved
        by more than `COMPUTE_READVERTISE` (relative) from the one advertised, at least
        `COMPUTE_ADVERT_GAP_S` after the previous advertisement, becomes this node's
        `me.compute_s`, re-prices its own edges and is sent to the members that price it
        (`Membership.compute_changed`); smaller or earlier moves, a node without a stage
        and a value that is not a positive finite number of seconds change nothing."""
        if not self.alive or self.me.stage < 0 or not 0.0 < compute_s <= MAX_COMPUTE_S:
            return []
        old = self.me.compute_s
        if abs(compute_s - old) <= COMPUTE_READVERTISE * old or now - self.compute_advertised_s < COMPUTE_ADVERT_GAP_S:
            return []
        self.compute_advertised_s = now
        return self._drain(self.members.compute_changed(compute_s, now), now)

    def on_send_failed(self, to: NodeId, msg: Message, now: float) -> list[Effect]:
        if not self.alive:
            return []
        return self._drain(self._send_failed(to, msg, now), now)

    def on_leave(self, now: float) -> list[Effect]:
        """Graceful leave: announce it (an announced crash); in-flight work is recovered by peers."""
        if not self.alive:
            return []
        return self._drain(self.members.leave(now), now)

    # ---- dispatch ----------------------------------------------------------------------

    PARTS: ClassVar[dict[str, type]] = {"members": Membership, "coord": Coordinator, "agg": Aggregation, "plane": DataPlane}
    """The parts that are objects of their own (attribute name -> class): their `@handles`
    methods are dispatched to the object."""
    _routes: ClassVar[dict[type, Route]] = {}  # per concrete class: message class -> route (dispatch.routes_of)
    _dispatch: ClassVar[dict[type, tuple[Any, Callable[[Any], Any] | None, Sender | None, Fence]]] = {}
    """... resolved once: (handler, the getter of its part or None for the core's own, rule, fence)"""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._routes = routes_of(cls, cls.PARTS)
        cls._dispatch = {}

    @classmethod
    def _resolve(cls, mcls: type) -> tuple[Any, Callable[[Any], Any] | None, Sender | None, Fence]:
        """(handler, its part, who may send it, term check) of a message class: a core part's
        handler (`@handles`), the router's ("flow."/"swarm." messages nobody claims) or unknown."""
        route = cls._routes.get(mcls) or router_route(mcls)
        if route is None:
            return _UNKNOWN, None, None, Fence.NONE
        if route.handler is None:
            return _ROUTER, None, route.sender, route.fence
        if not route.part:
            return getattr(cls, route.handler), None, route.sender, route.fence
        return getattr(cls.PARTS[route.part], route.handler), attrgetter(route.part), route.sender, route.fence

    def authorized(self, sender: NodeId, rule: Sender | None) -> bool:
        """May `sender` send a message of `rule`'s kind to me now? (`dispatch.Sender`)"""
        if rule is None or rule is Sender.ANYONE or rule is Sender.LEADER or sender == self.me.id:
            return True  # LEADER: the fence decides, with the term
        info = self.directory.get(sender)
        if info is None:
            return sender == self.leader or not self.active
        if rule is Sender.MEMBER or not self.active:
            return True
        if rule is Sender.REPLICA:
            return info.stage == self.me.stage
        return info.stage in ((self.me.stage - 1) % self.S, (self.me.stage + 1) % self.S)

    def _handle(self, sender: NodeId, msg: Message, now: float) -> list[Effect]:
        out: list[Effect] = []
        if sender in self.suspects:
            self.suspects.discard(sender)
            info = self.directory.get(sender)
            if info is not None and self.members.in_view(info):
                out += list(self.router.on_peer_up(info, self.link(sender), now))
        mcls = type(msg)
        try:
            fn, part, rule, fence = self._dispatch[mcls]
        except KeyError:
            fn, part, rule, fence = self._dispatch[mcls] = self._resolve(mcls)
        if not self.authorized(sender, rule):
            return out + [record(RecordName.UNAUTHORIZED, node=self.me.id, sender=sender, type=msg.TYPE,
                                 allowed=str(rule))]
        if fence:
            accept, said = self.members.fence(sender, cast(Termed, msg).term, fence is Fence.FROM_LEADER, now)
            out += said
            if not accept:
                return out
        if fn is _ROUTER:
            out.extend(self.router.on_message(sender, msg, now))
            return out
        if fn is _UNKNOWN:
            return out + [log("warning", "unknown_message", type=msg.TYPE, sender=sender)]
        result: list[Effect] = fn(self if part is None else part(self), sender, msg, now)
        return out + result if out else result

    def _drain(self, effects: list[Effect], now: float) -> list[Effect]:
        """Deliver messages addressed to this node at once; return the rest."""
        me = self.me.id
        for e in effects:  # fast path: nothing addressed to me (Send has no subclasses)
            if type(e) is Send and e.to == me:
                break
        else:
            return list(effects)
        out: list[Effect] = []
        queue = list(effects)
        i = 0
        while i < len(queue):
            e = queue[i]
            i += 1
            if isinstance(e, Send) and e.to == self.me.id:
                if self.alive:
                    queue.extend(self._handle(self.me.id, e.msg, now))
            else:
                out.append(e)
        return out

    def _timer(self, key: tuple[Any, ...], now: float) -> list[Effect]:
        kind = key[0]
        if kind in ("flow", "swarm"):
            return list(self.router.on_timer(key, now))
        if kind == "hb":
            out = self.members.on_heartbeat_timer(now)
            return out + (self.coord.leader_tick(now) if self.is_leader else [])
        if kind == "probe":
            return self.members.on_probe_timer(key[1], key[2], now)
        handlers: dict[str, Callable[[Any, float], list[Effect]]] = {
            "ackf": self.plane.on_ack_timeout, "ackb": self.plane.bwd_failed, "redo": self.plane.redo_failed, "gget": self.plane.chain_failed,
            "retry": self.plane.on_retry, "mb": self.plane.on_mb_deadline, "resend": self._resend_control,
            "unsuspect": self.members.on_unsuspect_timer, "ending": self.agg.on_ending_timer, "join": self.members.on_join_timer, "sget": self.members.on_state_timer,
        }
        handler = handlers.get(kind)
        return handler(key[1], now) if handler is not None else [log("warning", "unknown_timer", key=key)]

    def _send_failed(self, to: NodeId, msg: Message, now: float) -> list[Effect]:
        if isinstance(msg, m.Forward):
            ref: Any = msg.mb if self.me.stage == 0 and msg.path == (self.me.id,) else msg.legs[-1]
            return self.plane.fwd_failed(ref, to, now)
        if isinstance(msg, m.Backward):
            g = self.plane.gouts.get(msg.mb)
            return self.plane.bwd_failed(msg.mb, now) if g is not None and g.path[g.pos - 1] == to else []
        if isinstance(msg, m.Redo) and not msg.agg:
            return self.plane.redo_failed(msg.mb, now)
        if isinstance(msg, m.GradRequest):
            ref = msg.legs[-1] if self.me.stage != 0 else msg.mb
            return self.plane.chain_failed(ref, now)
        if isinstance(msg, m.LeaderVote):
            self.members.vote_failed_to(to)
            return []
        if isinstance(msg, RELIABLE):
            return self._schedule_resend(to, msg, now)
        return []

    def _known(self, peer: NodeId) -> bool:
        return peer in self.directory or peer == self.leader or peer in self.members.pending_joiners

    def _schedule_resend(self, to: NodeId, msg: Message, now: float) -> list[Effect]:
        """Control messages to a live member are retried until it is declared dead."""
        if not self._known(to):
            return []
        self._resend_seq += 1
        self._resends[self._resend_seq] = (to, msg)
        return [self.timer(("resend", self._resend_seq), self.cfg.retry_period_s, now)]

    def _resend_control(self, seq: int, now: float) -> list[Effect]:
        entry = self._resends.pop(seq, None)
        if entry is None or not self._known(entry[0]):
            return []
        msg = entry[1]
        if isinstance(msg, m.GradShare) and (self.agg.commit is None or self.agg.commit.round != msg.round):
            # a share of a round this node no longer reduces (stepped, or given up by a restart or
            # rollback): its tensor is freed and nobody waits for it
            return [log("debug", "stale_share_not_resent", round=msg.round, to=entry[0])]
        return [self.send(entry[0], msg)]


NodeCore._routes = routes_of(NodeCore, NodeCore.PARTS)  # subclasses: __init_subclass__


def message_routes(core: type[NodeCore] = NodeCore) -> dict[type, Route]:
    """Every message class a core class handles and its route (docs, tests, tests/sim/authtally.py)."""
    return dict(core._routes)
