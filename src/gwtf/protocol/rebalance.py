"""Moving a relay between stages (shared by gwtf and the SWARM baseline) and gwtf's move rule.

Owns: `StageMover` (the move mechanics
both systems use: the leader's period gate and link-based transfer estimates, the relay's
announced leave + rejoin through the ordinary join path, which downloads the target stage's
weights + optimizer state, `stage_state_bytes`, before serving), `plan_gwtf_move` (gwtf's
decision rule, pure) and `GwtfCore` (NodeCore with gwtf's rebalancing, used by the simulator's
"gwtf" system). The SWARM decision rule stays in `protocol/swarm.py`; the messages that move a
relay (`StageMove`, SWARM's `SwarmMove`) are in `protocol/messages.py` with the others (plain
dataclasses there: this module may be compiled, `gwtf simulate --compiled`).

gwtf's rule (PAPER.md 3.5 and 5, "Joining"): per relay stage, the estimated time per microbatch
is 1 / (sum over its replicas of 1 / (compute_s + the replica's network time per microbatch)),
and a stage whose routed demand exceeds its capacity (flow utilisation > 1) counts as the
bottleneck before any other. The estimated cost per microbatch is the largest stage time. A
replica of another stage moves to the bottleneck only if the move (1) leaves its stage a
replica and enough capacity for the flow, (2) lowers the cost per microbatch by at least
`rebalance_min_gain` (hysteresis: no back-and-forth on noise) and (3) saves, over the
remaining iterations, more time than its state download costs (measured iteration time x
relative gain vs stage_state_bytes / the mover's link bandwidth). One move per period, at an
iteration boundary; none while a join or move is still under way.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from gwtf.protocol.base import NodeId
from gwtf.protocol.core import NodeCore
from gwtf.protocol.dispatch import Fence, Sender, handles
from gwtf.protocol.kinds import RecordName
from gwtf.protocol.ledger import Effect, Policy
from gwtf.protocol.messages import LeaveNotice, StageMove, record
from gwtf.protocol.router import LinkEstimate, PeerInfo

__all__ = ["GWTF_REBALANCE_POLICY", "GwtfCore", "StageMove", "StageMover", "plan_gwtf_move", "stage_times_s"]

GWTF_REBALANCE_POLICY = Policy(name="gwtf", rebalance_every=1)
"""gwtf's churn policy with the rebalance hook run at every iteration start (GwtfCore acts only
every `rebalance_period_s`)."""


class StageMover:
    """Move mechanics shared by the systems that rebalance (`GwtfCore`, `swarm.SwarmCore`: their
    `node.mover`, a part like the others): the leader's period gate and transfer estimates, the
    relay's side of a move. It owns the move under way; the node it reaches through `node`."""

    def __init__(self, node: NodeCore) -> None:
        self.node = node
        self.move_target = -1  # relay: the stage a StageMove sent it to (until it rejoins there)
        self.last_rebalance_s = 0.0  # leader: when a rebalancing period last began

    def rebalance_due(self, now: float, period_s: float) -> bool:
        """Leader: a period has passed (the first counts from this node's start, whatever the
        driver's clock epoch) and no join (or previous move) is under way."""
        if period_s <= 0 or now - max(self.last_rebalance_s, self.node.started_s) < period_s:
            return False
        if self.node.members.pending_joiners or self.node.coord.lead.waiting:
            return False
        self.last_rebalance_s = now
        return True

    def transfer_estimates(self, members: Sequence[PeerInfo]) -> dict[NodeId, float]:
        """Per peer: network seconds of one microbatch (activation in, gradient out), averaged
        over the links from every other member (priors where known, else our measured link)."""
        size = self.node.train.route_bytes
        return self.mean_over_links(
            members, lambda lk: 2.0 * (lk.latency_s + size / max(lk.bandwidth_bytes_per_s, 1.0)))

    def mean_over_links(self, members: Sequence[PeerInfo], f: Callable[[LinkEstimate], float]) -> dict[NodeId, float]:
        """Per member p: the mean of f(prior(q, p)) over every other member q, or f(our measured
        link to p) without a prior. A prior is a function of the two regions (`core.LinkPrior`),
        so the others are counted per region: O(N x regions) per call, not O(N^2) (a 10,000-node
        leader plans every period). Summed with `math.fsum`, so the order does not matter."""
        prior = self.node.link_prior
        if prior is None or len(members) < 2:
            return {p.id: f(self.node.link(p.id)) for p in members}
        count: dict[str, int] = {}
        first: dict[str, PeerInfo] = {}
        for q in members:
            count[q.region] = count.get(q.region, 0) + 1
            first.setdefault(q.region, q)
        regions = sorted(count)
        cache: dict[tuple[str, str], float] = {}
        out: dict[NodeId, float] = {}
        for p in members:
            terms = []
            for r in regions:
                n = count[r] - (r == p.region)
                if n:
                    v = cache.get((r, p.region))
                    if v is None:
                        v = cache[(r, p.region)] = f(prior(first[r], p))
                    terms.append(n * v)
            out[p.id] = math.fsum(terms) / (len(members) - 1)
        return out

    @handles(StageMove, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_stage_move(self, sender: NodeId, msg: StageMove, now: float) -> list[Effect]:
        """Leave the current stage (announced: peers recover our work) and rejoin at `stage`."""
        if self.node.me.stage < 1 or not self.node.active or self.node.is_leader \
                or not 1 <= msg.stage < self.node.S:
            return []
        event = RecordName.SWARM_MOVE if msg.TYPE.startswith("swarm.") else RecordName.STAGE_MOVE
        out: list[Effect] = [record(event, node=self.node.me.id, stage=self.node.me.stage, to=msg.stage)]
        self.move_target = msg.stage
        self.node.active = False
        self.node.plane.clear_iteration()
        self.node.jobs.clear()
        self.node.plane.pending_fwd.clear()
        self.node.suspects.clear()
        self.node.me = replace(self.node.me, stage=-1)
        out.append(self.node.send(self.node.leader, LeaveNotice()))
        self.node.members.join_tries = 0
        self.node.members.move_to = msg.stage
        return out + self.node.members.send_join(now)

    def take_move_target(self) -> int:
        """The stage a moving peer was sent to (once), or -1 for an ordinary joiner."""
        target, self.move_target = self.move_target, -1
        return target


# ---------------------------------------------------------------------------------------------
# gwtf's decision rule
# ---------------------------------------------------------------------------------------------


def _rate(compute_s: float, transfer_s: float) -> float:
    """Microbatches per second one replica serves."""
    return 1.0 / max(compute_s + transfer_s, 1e-12)


def _stage_rates(members: Sequence[PeerInfo], stages: int, transfer_s: dict[NodeId, float]) -> list[float]:
    rate = [0.0] * stages
    for p in members:
        if p.stage >= 1:
            rate[p.stage] += _rate(p.compute_s, transfer_s.get(p.id, 0.0))
    return rate


def _times(rate: list[float]) -> list[float]:
    return [1.0 / r if r > 0 and k >= 1 else float("inf") for k, r in enumerate(rate)]


def stage_times_s(members: Sequence[PeerInfo], stages: int, transfer_s: dict[NodeId, float]) -> list[float]:
    """Estimated seconds per microbatch of each relay stage (stage 0 and empty stages: inf)."""
    return _times(_stage_rates(members, stages, transfer_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveInputs:
    """What the leader knows when it plans a move."""

    members: Sequence[PeerInfo]
    stage_flops: Sequence[float]
    demand: int  # microbatches per iteration (routed flow)
    transfer_s: dict[NodeId, float]
    download_s: dict[NodeId, float]  # per peer: seconds to download the bottleneck stage's state
    iteration_s: float  # measured duration of the last iteration (0: unknown)
    remaining_iterations: int
    min_gain: float


def _worst(rate: list[float], cap: list[int], demand: int) -> tuple[bool, float, int]:
    """(some stage over capacity, largest stage time, that stage) from per-stage service rates
    (microbatches/s) and capacities."""
    stages = len(rate)
    times = _times(rate)
    over = [k for k in range(1, stages) if cap[k] < demand]
    worst = max(range(1, stages), key=lambda k: (k in over, times[k], -k))
    return bool(over), times[worst], worst


def plan_gwtf_move(inp: MoveInputs) -> tuple[NodeId, int] | None:
    """(peer, target stage) or None (see the module docstring for the rule).

    A move changes only two stages' rates and capacities, so each candidate is priced from the
    per-stage totals: O(members x stages), not O(members^2) (a 10,000-node leader plans too)."""
    stages = len(inp.stage_flops)
    rate = _stage_rates(inp.members, stages, inp.transfer_s)
    cap = [0] * stages
    count = [0] * stages
    for p in inp.members:
        count[p.stage] += 1
        cap[p.stage] += p.capacity
    over, cost, bottleneck = _worst(rate, cap, inp.demand)
    best: tuple[tuple[bool, float], NodeId] | None = None
    for p in sorted(inp.members, key=lambda q: q.id):
        a = p.stage
        if a < 1 or a == bottleneck or count[a] < 2:
            continue
        extra = inp.transfer_s.get(p.id, 0.0)
        speed = inp.stage_flops[a] / max(p.compute_s, 1e-12)
        r, c = list(rate), list(cap)
        r[a] -= _rate(p.compute_s, extra)
        r[bottleneck] += _rate(inp.stage_flops[bottleneck] / speed, extra)
        c[a] -= p.capacity
        c[bottleneck] += p.capacity
        key = _worst(r, c, inp.demand)[:2]
        if best is None or key < best[0]:
            best = (key, p.id)
    if best is None:
        return None
    (new_over, new_cost), pid = best
    if new_over and not over:
        return None  # never trade a time gain for a stage that cannot hold the flow
    gain = 1.0 - new_cost / cost if cost > 0 else 0.0
    if not (over and not new_over) and gain < inp.min_gain:
        return None
    if inp.iteration_s > 0 and inp.remaining_iterations > 0:
        saved_s = inp.iteration_s * gain * inp.remaining_iterations
        if saved_s <= inp.download_s.get(pid, 0.0):
            return None
    return pid, bottleneck


class GwtfCore(NodeCore):
    """NodeCore with gwtf's rebalancing (pass `policy=GWTF_REBALANCE_POLICY`): its hooks
    (`rebalance`, `choose_join_stage`) and the move mechanics part (`mover`)."""

    PARTS: ClassVar[dict[str, type]] = {**NodeCore.PARTS, "mover": StageMover}

    def init_parts(self) -> None:
        self.mover = StageMover(self)
        self.iter_started_s = -1.0
        self.iteration_s = 0.0

    def rebalance(self, now: float) -> list[Effect]:
        """Called by the leader at iteration starts; acts every `rebalance_period_s`."""
        if self.iter_started_s >= 0:
            self.iteration_s = now - self.iter_started_s
        self.iter_started_s = now
        if not self.mover.rebalance_due(now, self.cfg.rebalance_period_s):
            return []
        members = [self.directory[p] for p in sorted(self.directory)]
        demand = sum(min(self.train.microbatches, p.capacity) for p in members if p.stage == 0)
        transfer = self.mover.transfer_estimates(members)
        inp = MoveInputs(members=members, stage_flops=self.train.stage_flops, demand=demand,
                         transfer_s=transfer, download_s=self._download_estimates(members),
                         iteration_s=self.iteration_s, min_gain=self.cfg.rebalance_min_gain,
                         remaining_iterations=max(self.train.iterations - self.coord.lead.t, 0) if self.train.iterations
                         else max(int(self.cfg.rebalance_period_s / max(self.iteration_s, 1e-9)), 1))
        move = plan_gwtf_move(inp)
        if move is None:
            return [record(RecordName.REBALANCE, moved="", to=-1)]
        pid, target = move
        return [record(RecordName.REBALANCE, moved=pid, to=target), self.send(pid, StageMove(term=self.term, stage=target))]

    def _download_estimates(self, members: Sequence[PeerInfo]) -> dict[NodeId, float]:
        """Per peer: seconds to fetch the largest stage state at its mean link bandwidth."""
        biggest = max(self.train.stage_state_bytes)
        bw = self.mover.mean_over_links(members, lambda lk: lk.bandwidth_bytes_per_s)
        return {pid: biggest / max(b, 1.0) for pid, b in bw.items()}

    def choose_join_stage(self, utilisation: tuple[float, ...]) -> int:
        """A moving peer serves the stage it was sent to; a new node joins the bottleneck."""
        target = self.mover.take_move_target()
        return target if target >= 1 else super().choose_join_stage(utilisation)
