"""The SWARM baseline (Ryabinin et al., ICML 2023) as a router + policy inside NodeCore.

Owns: `SwarmRouter` (SWARM's stochastic wiring and peer banning, implementing `Router`),
`plan_move` (SWARM's adaptive rebalancing decision, pure), `SwarmMove` (the message that tells a
relay to switch stage), `SwarmCore` (NodeCore plus the rebalancing hooks: nothing of the core is
copied) and `SWARM_POLICY` (backward crash -> restart the microbatch from its data holder).
docs/baselines.md explains every modelling choice and why it is fair.

What SWARM does, and where it lives here (ANCHORS.md 2.1, PAPER.md 6.5):
- wiring: SWARM's `ExpertBalancer` keeps, per stage, a min-heap of peers keyed by virtual busy
  time; each task goes to the least-loaded peer, whose key grows by the task's expected time
  (size / the peer's EMA throughput). The result is an interleaved round-robin weighted by
  throughput. `SwarmRouter.next_hop` does exactly that per next stage; the expected time is the
  peer's declared compute time plus the measured link's transfer time both ways (SWARM measures
  its EMA on the RPC, so it sees the network too). Memory is ignored, as in SWARM;
- a peer that failed (ack deadline, send failure, eviction) is banned for `swarm_ban_s` (SWARM:
  until its DHT record expires), even if it is heard from again meanwhile; the microbatch is
  retried on another peer of the stage from the sender's activation (forward), or restarted
  from the data holder (backward: `Policy.backward_recovery = "restart"`);
- rebalancing: every `swarm_rebalance_period_s` (SWARM: T = 300 s) the leader looks at per-stage
  throughput (sum of 1 / compute time of the live replicas); if moving one peer of the
  least-loaded stage to the bottleneck stage raises the minimum, that peer leaves its stage (an
  announced leave: its in-flight work is recovered like a crash) and rejoins the bottleneck stage
  through the ordinary join path, downloading the stage's weights + optimizer state first.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from gwtf.config import ProtocolConfig
from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.core import NodeCore
from gwtf.protocol.dispatch import Fence, Sender, handles
from gwtf.protocol.kinds import RecordName
from gwtf.protocol.ledger import Effect, Policy, TrainParams
from gwtf.protocol.messages import SwarmMove, record
from gwtf.protocol.rebalance import StageMover
from gwtf.protocol.router import FlowSlot, LinkEstimate, PeerInfo

__all__ = ["SWARM_POLICY", "SwarmCore", "SwarmMove", "SwarmRouter", "plan_move", "stage_throughputs"]

SWARM_POLICY = Policy(name="swarm", backward_recovery="restart", rebalance_every=1)
"""Backward crash: restart from the data holder; the rebalance hook runs at every iteration start
(SwarmCore itself only acts every `swarm_rebalance_period_s` of time)."""


# ---------------------------------------------------------------------------------------------
# Stochastic wiring
# ---------------------------------------------------------------------------------------------


class SwarmRouter:
    """Throughput-weighted interleaved round-robin over next-stage peers, with a ban list."""

    def __init__(self, me: PeerInfo, stages: int, activation_bytes: int, ban_s: float,
                 rng: random.Random) -> None:
        self.me = me
        self.stages = stages
        self.activation_bytes = activation_bytes
        self.ban_s = ban_s
        self.rng = rng
        self._peers: dict[NodeId, PeerInfo] = {}
        self._links: dict[NodeId, LinkEstimate] = {}
        self._vt: dict[NodeId, float] = {}  # virtual busy time: SWARM's heap key
        self._tie: dict[NodeId, float] = {}  # random tie-break, as SWARM's heap entries carry
        self.banned: dict[NodeId, float] = {}  # peer -> ban expiry (s)
        self.picks: dict[NodeId, int] = {}  # microbatches handed to each peer (for tests/metrics)

    # -- Router protocol ---------------------------------------------------------------------

    def on_start(self, now: float) -> list[Any]:
        return []

    def set_me(self, me: PeerInfo) -> None:
        """The node changed stage (join or rebalancing move): forget the old next stage."""
        if me.stage != self.me.stage:
            self._peers.clear()
            self._links.clear()
            self._vt.clear()
            self._tie.clear()
            self.banned.clear()
        self.me = me

    def _next_stage(self) -> int:
        return (self.me.stage + 1) % self.stages

    def on_peer_up(self, info: PeerInfo, link: LinkEstimate, now: float) -> list[Any]:
        if info.id == self.me.id or self.me.stage < 0 or info.stage != self._next_stage():
            self._peers.pop(info.id, None)  # it moved to another stage (rebalancing)
            return []
        if self._next_stage() == 0:
            return []  # the last relay returns to the origin data holder: no choice to make
        self._peers[info.id] = info
        self._links[info.id] = link
        if info.id not in self._vt:
            self._admit(info.id)
        return []

    def _admit(self, pid: NodeId) -> None:
        """A new (or unbanned) peer enters near the top of the heap so it is measured soon."""
        others = [self._vt[p] for p in self._vt if p != pid and p in self._peers]
        top = min(others) if others else 0.0
        self._vt[pid] = max(self._vt.get(pid, top), top)
        self._tie[pid] = self.rng.random()

    def on_peer_down(self, peer: NodeId, now: float) -> list[Any]:
        """Ban the peer; it is used again only once the ban expired *and* it was announced again
        (`on_peer_up`: heard from, or re-admitted), as a SWARM peer's fresh DHT record."""
        if self._peers.pop(peer, None) is not None:
            self.banned[peer] = now + self.ban_s
        return []

    def on_link_update(self, peer: NodeId, link: LinkEstimate, now: float) -> list[Any]:
        if peer in self._peers:
            self._links[peer] = link
        return []

    def on_compute_update(self, peer: NodeId, compute_s: float, now: float) -> list[Any]:
        """A next-stage peer's measured compute time weighs its throughput (`expected_s`)."""
        if peer == self.me.id:
            self.me = replace(self.me, compute_s=compute_s)
        elif peer in self._peers:
            self._peers[peer] = replace(self._peers[peer], compute_s=compute_s)
        return []

    def on_message(self, sender: NodeId, msg: Message, now: float) -> list[Any]:
        return []

    def on_timer(self, key: tuple[Any, ...], now: float) -> list[Any]:
        return []

    def flow_slots(self, now: float) -> list[FlowSlot]:
        return []  # no reservations: every microbatch asks next_hop

    def expected_s(self, pid: NodeId) -> float:
        """Expected seconds of one microbatch at `pid`: its fwd+bwd compute + both transfers."""
        info, link = self._peers[pid], self._links[pid]
        transfer_s = link.latency_s + self.activation_bytes / max(link.bandwidth_bytes_per_s, 1.0)
        return info.compute_s + 2.0 * transfer_s

    def usable(self, now: float) -> list[NodeId]:
        """Known next-stage peers whose ban (if any) has expired; expired bans are lifted here."""
        out = []
        for pid in sorted(self._peers):
            until = self.banned.get(pid)
            if until is not None:
                if until > now:
                    continue
                del self.banned[pid]
                self._admit(pid)
            out.append(pid)
        return out

    def next_hop(self, flow_id: int, prev: NodeId, origin: NodeId, exclude: Iterable[NodeId],
                 now: float) -> tuple[NodeId, int] | None:
        skip = set(exclude)
        cands = [p for p in self.usable(now) if p not in skip]
        if not cands:
            return None
        pid = min(cands, key=lambda p: (self._vt[p], self._tie[p], p))
        self._vt[pid] += self.expected_s(pid)
        self.picks[pid] = self.picks.get(pid, 0) + 1
        return pid, flow_id

    def on_release(self, peer: NodeId) -> None:
        """SWARM keeps no per-peer in-flight count (it ignores memory): nothing to do."""


# ---------------------------------------------------------------------------------------------
# Adaptive rebalancing
# ---------------------------------------------------------------------------------------------


def stage_throughputs(members: Iterable[PeerInfo], stages: int,
                      transfer_s: Mapping[NodeId, float] | None = None) -> list[float]:
    """Microbatches per second each relay stage can process: sum over its replicas of
    1 / (compute_s + transfer_s) (stage 0: 0)."""
    net = transfer_s or {}
    tp = [0.0] * stages
    for p in members:
        if p.stage >= 1:
            tp[p.stage] += 1.0 / max(p.compute_s + net.get(p.id, 0.0), 1e-12)
    return tp


def plan_move(members: Sequence[PeerInfo], stage_flops: Sequence[float],
              transfer_s: Mapping[NodeId, float] | None = None) -> tuple[NodeId, int] | None:
    """SWARM's rebalancing step: (peer, target stage) or None when no move helps.

    A peer's throughput at stage k is 1 / (its compute time there + `transfer_s[peer]`, the
    network time of one microbatch to and from it: SWARM measures throughput on the RPC, so
    the network counts). The bottleneck is the relay stage with the least throughput, the donor
    the one with the most (it must keep a replica). The donor's peer that leaves the highest
    minimum after the move is chosen (ties: lowest id); it moves only if the minimum rises.
    """
    stages = len(stage_flops)
    net = transfer_s or {}
    tp = stage_throughputs(members, stages, net)
    relay = range(1, stages)
    count = {k: sum(1 for p in members if p.stage == k) for k in relay}
    bottleneck = min(relay, key=lambda k: (tp[k], k))
    donors = [k for k in relay if k != bottleneck and count[k] >= 2]
    if not donors:
        return None
    donor = max(donors, key=lambda k: (tp[k], -k))
    best: tuple[float, str] | None = None
    for p in sorted(members, key=lambda q: q.id):
        if p.stage != donor:
            continue
        speed = stage_flops[donor] / max(p.compute_s, 1e-12)
        extra = net.get(p.id, 0.0)
        after = list(tp)
        after[donor] -= 1.0 / max(p.compute_s + extra, 1e-12)
        after[bottleneck] += 1.0 / (stage_flops[bottleneck] / speed + extra)
        new_min = min(after[k] for k in relay)
        if best is None or new_min > best[0]:
            best = (new_min, p.id)
    if best is None or best[0] <= tp[bottleneck] * (1.0 + 1e-9):
        return None
    return best[1], bottleneck


class SwarmCore(NodeCore):
    """NodeCore with SWARM's rebalancing: the leader plans moves, a relay carries them out
    (the move mechanics are shared with gwtf: `protocol.rebalance.StageMover`, `mover`)."""

    PARTS: ClassVar[dict[str, type]] = {**NodeCore.PARTS, "mover": StageMover}

    def init_parts(self) -> None:
        self.mover = StageMover(self)

    # -- leader side -------------------------------------------------------------------------

    def rebalance(self, now: float) -> list[Effect]:
        """Called by the leader at iteration starts; acts every `swarm_rebalance_period_s`."""
        if not self.mover.rebalance_due(now, self.cfg.swarm_rebalance_period_s):
            return []  # not yet, or a join (or the previous move) is still under way
        members = [self.directory[p] for p in sorted(self.directory)]
        move = plan_move(members, self.train.stage_flops, self.mover.transfer_estimates(members))
        if move is None:
            return [record(RecordName.REBALANCE, moved="", to=-1)]
        pid, target = move
        return [record(RecordName.REBALANCE, moved=pid, to=target), self.send(pid, SwarmMove(term=self.term, stage=target))]

    # -- relay side --------------------------------------------------------------------------

    @handles(SwarmMove, sender=Sender.MEMBER, fence=Fence.FROM_LEADER)  # a router-type name: the member rule
    def on_swarm_move(self, sender: NodeId, msg: SwarmMove, now: float) -> list[Effect]:
        """Leave the current stage (announced: peers recover our work) and rejoin at `stage`."""
        return self.mover.on_stage_move(sender, msg, now)

    def choose_join_stage(self, utilisation: Sequence[float]) -> int:
        """A moving peer serves the stage it was sent to; a joiner an operator placed
        (`fixed_stage`, the runtime's `--stage K`) keeps it; a new SWARM peer joins the stage
        with the least throughput (relay stages only; ties: lowest)."""
        target = self.mover.take_move_target()
        if target >= 1:
            return target
        if self.fixed_stage is not None:
            return self.fixed_stage
        members = [p for p in self.directory.values() if p.id != self.me.id]
        tp = stage_throughputs(members, self.S)
        return min(range(1, self.S), key=lambda k: (tp[k], k))


def swarm_router(me: PeerInfo, train: TrainParams, cfg: ProtocolConfig) -> SwarmRouter:
    """The router a SWARM node runs (seeded from the node's own description: deterministic)."""
    rng = random.Random(f"swarm:{me.id}:{me.region}:{me.compute_s!r}")
    return SwarmRouter(me, train.stages, train.route_bytes, cfg.swarm_ban_s, rng)


def describe(members: Mapping[NodeId, PeerInfo], stages: int) -> str:
    """One line: replicas and throughput per relay stage (for logs and docs)."""
    tp = stage_throughputs(members.values(), stages)
    parts = [f"s{k}:{sum(1 for p in members.values() if p.stage == k)}@{tp[k]:.2f}/s" for k in range(1, stages)]
    return " ".join(parts)
