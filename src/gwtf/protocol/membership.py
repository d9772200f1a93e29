"""Membership part of NodeCore: directory, failure detection, leader choice, join and leave.

Owns:
- the directory (data holders keep every member, relays the data holders and their
  previous, same and next stage) and the link priors/estimates the router sees;
- failure detection: every node heartbeats the leader (lowest-id live data holder; with none, a
  member: docs/protocol.md, no irreplaceable class); the leader
  declares a node dead after `evict_after_s` of silence and broadcasts `MemberDown`; nodes
  declare the leader dead the same way and fail over to the next data holder by id. Per-message
  ack deadlines (training part) only *suspect* a peer: it is skipped for routing until it is
  heard from again (an unreachable link is treated like a crash for routing);
- join (DESIGN.md 5): a new node asks any member, the leader answers with the directory and
  per-stage utilisation; the node picks the bottleneck stage, fetches weights + optimizer state
  from a live replica (or, when the stage is empty, the last checkpoint: a data holder's copy,
  else its own disk), says `Ready`, and the
  leader activates it at an iteration boundary whose version matches;
- graceful leave: an announced crash (`LeaveNotice`); the leader evicts at once.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gwtf.protocol import messages as msgs
from gwtf.protocol.base import NodeId, log
from gwtf.protocol.dispatch import Fence, Sender, handles
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.ledger import Effect, Leg, Origin, checkpoint_due
from gwtf.protocol.messages import (
    NONE,
    Compute,
    ComputeUpdate,
    Evicted,
    Heartbeat,
    HeartbeatAck,
    IterStart,
    JoinRequest,
    LeaderVote,
    LeaveNotice,
    MemberDown,
    MemberUp,
    PeerTuple,
    Probe,
    Ready,
    Refetch,
    StateRequest,
    StateTransfer,
    SuspectNotice,
    TermNotice,
    Welcome,
    record,
)
from gwtf.protocol.router import PeerInfo
from gwtf.protocol.view import Roster, mark, min_id, near_stages, pair_score, stage_sizes, stage_threshold

if TYPE_CHECKING:
    from gwtf.protocol.core import NodeCore

UNKNOWN_STAGE_LOAD = 1e9  # utilisation reported for a stage with no live replica
JOIN_TRIES = 8  # JoinRequests a joiner sends (each after a deadline) before it gives up
STATE_TRIES = 6  # state requests to replicas before a joiner restores from the checkpoint
STATE_DEADLINE_FACTOR = 4.0  # x the transfer's ack deadline: a state source that took longer failed
MAX_COMPUTE_S = 1e6  # the largest compute seconds per microbatch a node advertises or is believed


def to_tuple(p: PeerInfo) -> PeerTuple:
    return (p.id, p.stage, p.region, p.compute_s, p.capacity, p.demand, p.shard)


def from_tuple(t: PeerTuple) -> PeerInfo:
    return PeerInfo(id=t[0], stage=t[1], region=t[2], compute_s=t[3], capacity=t[4], demand=t[5], shard=t[6])


class Membership:
    """Directory upkeep, heartbeats, eviction, leader failover, join, leave, state transfer (see
    the module docstring), one per node. It owns failure detection's, the election's and the
    join's state; it is the only writer of the node's shared facts (`directory`, `leader`,
    `term`, `suspects`), which every part reads on `node`."""

    def __init__(self, node: NodeCore) -> None:
        self.node = node
        me = node.me
        self.last_leader_s = 0.0  # when the leader was last heard from
        self.last_hb: dict[NodeId, float] = {}  # leader: member -> when its heartbeat came
        self.pending_joiners: set[NodeId] = set()  # leader: joiners admitted, not yet members
        self.welcomed_with: dict[NodeId, frozenset[NodeId]] = {}  # leader: members a joiner's Welcome listed
        # leader: joiner -> (assigned stage, capacity, shard: a data holder's, else NONE)
        self.pending_stage: dict[NodeId, tuple[int, int, int]] = {}
        self.probing: set[tuple[str, NodeId]] = set()
        self.votes: dict[int, dict[NodeId, float]] = {}  # candidate: term -> voter -> when last heard
        self.vote_failed: set[NodeId] = set()
        self.voted_for: NodeId = ""  # the candidate this node voted for in `vote_term`
        self.vote_term = 0
        self.join_tries = 0  # joiner: JoinRequests sent without reaching a Welcome
        self.contact: NodeId = ""  # joiner: the member it asks to join
        self.assigned_stage = -1  # joiner: the stage its Welcome assigned
        self.move_to = NONE  # joiner: the relay stage a rebalancing move sends it to (its JoinRequest's `want`)
        self.restore_version = 0  # joiner: the checkpoint its Welcome (or last Refetch) named
        self.state_source: NodeId = ""  # joiner: the replica a StateRequest went to
        self.state_tries = 0
        self.state_failed_from: set[NodeId] = set()  # joiner: sources that refused or failed it
        self.speed_flops_per_s = node.train.stage_flops[max(me.stage, 1)] / max(me.compute_s, 1e-9)
        self.view_sizes: dict[int, int] = {}  # stage sizes when this node started or joined (views)
        self.live_sizes: dict[int, int] = {}  # ... and now, in its directory (kept with views only)
        self._view_seen: dict[int, int | None] = {}  # most inclusive view threshold used, per stage

    def membership_start(self, now: float, known: list[PeerInfo] | Roster) -> list[Effect]:
        self.last_leader_s = now
        members: Sequence[PeerInfo] = known.members if isinstance(known, Roster) else known
        self.contact = members[0].id if self.node.me.stage < 0 and members else ""
        me = self.node.me  # (a driver may have set it since the constructor)
        self.speed_flops_per_s = self.node.train.stage_flops[max(me.stage, 1)] / max(me.compute_s, 1e-9)
        out: list[Effect] = [self.node.timer(("hb",), self.node.cfg.heartbeat_period_s, now)]
        if self.node.me.stage < 0:
            out.append(record(RecordName.JOIN_START, node=self.node.me.id))
            return out + self.send_join(now)
        if self.node.cfg.view_size > 0:
            # bounded views (protocol.view): O(what this node keeps) from the shared roster
            roster = known if isinstance(known, Roster) else Roster(members)
            self.view_sizes = dict(roster.sizes)
            self.node.directory = roster.directory(self.node.me.stage, self.node.S)
            self.node.directory[self.node.me.id] = self.node.me
            self.node.dhs_cache = roster.data_holders  # every node keeps exactly the roster's data holders
            kept = range(self.node.S) if self.node.me.stage == 0 else self._near_stages() | {0}
            self.live_sizes = {t: roster.sizes[t] for t in kept if t in roster.sizes}
            self._view_seen = {t: self._view_threshold(t) for t in self._near_stages()}
            for p in roster.view(self.node.me, self.node.S, self.node.cfg.view_size):
                out += list(self.node.router.on_peer_up(p, self.node.link(p.id), now))
        else:
            self.node.directory = {p.id: p for p in members if self.keeps(p)}
            self.node.directory[self.node.me.id] = self.node.me
            self.node.dhs_cache = None
            for p in members:
                out += self._peer_up(p, now)
        self.node.leader = self._choose_leader()
        return out

    def keeps(self, p: PeerInfo) -> bool:
        """Whom this node keeps in its directory. Without bounded views every node keeps every
        member: any may have to lead (the data holders first; a relay when none is left, issue
        42: no irreplaceable class). With views (`protocol.view_size`, thousands of nodes) a
        data holder keeps everyone; a relay keeps the data holders and its previous, same and
        next stage."""
        if self.node.cfg.view_size <= 0 or self.node.me.stage == 0 or p.stage == 0 or p.id == self.node.me.id:
            return True
        return (p.stage - self.node.me.stage) % self.node.S in (0, 1, self.node.S - 1)

    def _peer_up(self, p: PeerInfo, now: float) -> list[Effect]:
        """Tell the router about a neighbour: previous, same or next stage (cyclic) only, and
        in this node's view (`protocol.view_size`)."""
        if p.id == self.node.me.id:
            return []
        gap = (p.stage - self.node.me.stage) % self.node.S
        if gap not in (0, 1, self.node.S - 1) or not self.in_view(p):
            return []
        return list(self.node.router.on_peer_up(p, self.node.link(p.id), now))

    def in_view(self, p: PeerInfo) -> bool:
        """Does the router see `p`? Always without `view_size`; else a symmetric hash of the two ids
        against the stage pair's threshold (`_view_threshold`, protocol.view)."""
        if self.node.cfg.view_size <= 0 or p.id == self.node.me.id:
            return True
        thr = self._view_threshold(p.stage)
        return thr is None or pair_score(mark(self.node.me.id), mark(p.id)) < thr

    def _near_stages(self) -> set[int]:
        return near_stages(self.node.me.stage, self.node.S)

    def _view_threshold(self, stage: int) -> int | None:
        """The view threshold between my stage and `stage`, from each stage's size when I started
        or joined, or its live size in my directory when that is smaller: a stage that lost most
        of its nodes is seen by more of its neighbours (whole once it is no larger than K)."""
        frozen, live = self.view_sizes, self.live_sizes
        sizes = {t: min(frozen.get(t, 0), live.get(t, 0)) for t in (self.node.me.stage, stage)}
        return stage_threshold(self.node.cfg.view_size, sizes, self.node.me.stage, stage, self.node.S)

    def _dir_set(self, p: PeerInfo) -> None:
        """Put `p` in the directory, keeping the data-holder cache and live stage sizes right."""
        old = self.node.directory.get(p.id)
        self.node.directory[p.id] = p
        self.node.dhs_cache = None
        if self.node.cfg.view_size > 0:
            live = self.live_sizes
            if old is not None:
                live[old.stage] = live.get(old.stage, 0) - 1
            live[p.stage] = live.get(p.stage, 0) + 1

    def _dir_drop(self, pid: NodeId) -> PeerInfo | None:
        """Take `pid` out of the directory (the counterpart of `_dir_set`)."""
        info = self.node.directory.pop(pid, None)
        self.node.dhs_cache = None
        if info is not None and self.node.cfg.view_size > 0:
            self.live_sizes[info.stage] = self.live_sizes.get(info.stage, 0) - 1
        return info

    def _widen(self, now: float) -> list[Effect]:
        """A neighbouring stage shrank: where its threshold grew by a quarter or more (or became
        'everyone'), tell the router of the peers that just came into view. Views never shrink
        back when a stage regrows; new members are then drawn at the current threshold."""
        out: list[Effect] = []
        for t in sorted(self._near_stages()):
            seen = self._view_seen.get(t)
            if seen is None:
                continue
            new = self._view_threshold(t)
            if new is not None and new < seen * 1.25:
                continue
            self._view_seen[t] = new
            a = mark(self.node.me.id)
            for pid in sorted(self.node.directory):
                p = self.node.directory[pid]
                if p.stage == t and pid != self.node.me.id and pid not in self.node.suspects:
                    score = pair_score(a, mark(pid))
                    if score >= seen and (new is None or score < new):
                        out += self._peer_up(p, now)
        return out

    def _choose_leader(self) -> NodeId:
        """The lowest-id data holder; with none left (and every member kept: no bounded views),
        the lowest-id member."""
        dhs = self.node.data_holders()
        if dhs:
            return min_id(dhs)
        return min(self.node.directory) if self.node.cfg.view_size <= 0 and self.node.directory else ""

    # ---- heartbeats --------------------------------------------------------------------

    def on_heartbeat_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = [self.node.timer(("hb",), self.node.cfg.heartbeat_period_s, now)]
        if self.node.coord.finished():
            return out  # members stop as told (Finish): their silence is no crash
        if self.node.is_leader:
            horizon = now - self.node.cfg.evict_after_s
            for pid in sorted(p for p, t in self.last_hb.items() if t < horizon):
                if pid in self.node.directory:
                    out += self.evict(pid, False, now)
                else:
                    self.last_hb.pop(pid, None)
                    self.pending_joiners.discard(pid)
                    self.pending_stage.pop(pid, None)
                    self._forget_waiting(pid)  # a silent joiner is gone
            return out
        if not self.node.active:
            return out + self._joiner_tick(now)
        silent_s = now - self.last_leader_s
        if silent_s > self.node.cfg.partition_timeout_s:
            return out + self.stop("partitioned", now)
        if not self.node.leader:
            return out  # deposed, or told of a newer term without its leader: wait for it to speak
        if silent_s > self.node.cfg.evict_after_s and self.node.leader in self.node.directory:
            out += self._vote(now)
        elif silent_s > self.node.cfg.suspect_after_s:
            out.append(log("info", "leader_suspected", leader=self.node.leader))
        if self.node.leader != self.node.me.id:
            out.append(self.node.send(self.node.leader, Heartbeat(term=self.node.term, version=self.node.version)))
        return out

    def _vote(self, now: float) -> list[Effect]:
        """The leader is silent: vote for the lowest-id data holder we can still reach, in a term
        above every term we know (Raft, section 5.2: one vote per voter per term, so a different
        candidate takes a new term). The candidate leads only with a strict majority of the
        members other than the old leader, so a node cut off from a live leader by one bad link
        cannot start a second leader, and no two nodes lead the same term."""
        candidates = sorted(p for p, i in self.node.directory.items()
                            if i.stage == 0 and p != self.node.leader and p not in self.vote_failed)
        if not candidates and self.node.cfg.view_size <= 0:
            # no data holder to lead (every one gone or unreachable): the lowest-id member does;
            # the swarm pauses (stage 0 is lost) until joiners take the data holders' role
            candidates = sorted(p for p in self.node.directory if p != self.node.leader and p not in self.vote_failed)
        if not candidates:
            return []
        out: list[Effect] = []
        if self.voted_for != candidates[0] or self.vote_term <= self.node.term:
            self.vote_term = max(self.vote_term, self.node.term) + 1
            self.voted_for = candidates[0]
            out.append(record(RecordName.LEADER_LOST, node=self.node.me.id, leader=self.node.leader, vote=candidates[0],
                              term=self.vote_term))
        return out + [self.node.send(candidates[0], LeaderVote(term=self.vote_term, old=self.node.leader))]

    @handles(msgs.LeaderVote, sender=Sender.MEMBER)
    def on_leader_vote(self, sender: NodeId, msg: LeaderVote, now: float) -> list[Effect]:
        if sender not in self.node.directory:  # a pending joiner or a stranger is no voter
            return [log("info", "vote_refused", voter=sender, reason="not a member")]
        if self.node.is_leader or msg.term <= self.node.term or msg.old != self.node.leader or msg.old not in self.node.directory:
            return []
        if self.vote_term > msg.term or (self.vote_term == msg.term and self.voted_for != self.node.me.id):
            return []  # this node voted for another candidate in that term (or a later one)
        ballots = self.votes.setdefault(msg.term, {})
        ballots[sender] = now
        # a ballot counts while its voter keeps resending it (every heartbeat while the leader is
        # silent to it): a voter that heard from the leader again stops renewing its vote
        horizon = now - self.node.cfg.evict_after_s
        live = sum(1 for p, t in ballots.items() if t >= horizon and p in self.node.directory and p != msg.old)
        if 2 * live <= len(self.node.directory) - 1:
            return []
        old = self.node.leader
        self._adopt_term(msg.term, self.node.me.id, now)
        self.vote_term, self.voted_for = msg.term, self.node.me.id
        out: list[Effect] = [record(RecordName.LEADER_CHANGE, node=self.node.me.id, leader=self.node.me.id, votes=live, term=msg.term),
                             record(RecordName.LEADER_TERM, node=self.node.me.id, term=msg.term)]
        out += self.node.coord.become_leader(now)
        return out + self.evict(old, False, now)

    def _adopt_term(self, term: int, leader: NodeId, now: float) -> None:
        """A newer term (or the leader of ours) is known: follow it; a leader of an older term
        steps down."""
        self.node.term = term
        self.node.leader = leader
        self.last_leader_s = now
        self.votes = {t: v for t, v in self.votes.items() if t > term}
        if self.node.is_leader and leader != self.node.me.id:
            self.node.is_leader = False

    def fence(self, sender: NodeId, term: int, from_leader: bool, now: float) -> tuple[bool, list[Effect]]:
        """The term check every control message passes before its handler: (accept, effects).

        From a leader (IterStart, Collect, Commit, Step, Reset, Rollback, MemberUp, MemberDown,
        Evicted, Welcome, ...): an older term is refused and answered with ours; a newer one is
        adopted with the sender as its leader (only a node elected for a term sends in it); in
        our term only the term's leader is obeyed. To a leader (Report, Have, Heartbeat): an
        older term is refused and answered; a newer one deposes this node."""
        if sender == self.node.me.id:
            return True, []
        if term > self.node.term and self.node.active and sender not in self.node.directory:
            # only a member's word raises the term: a stranger (or an evicted node) cannot depose
            return False, [record(RecordName.UNAUTHORIZED, node=self.node.me.id, sender=sender, type="term", allowed="a member")]
        if term < self.node.term:
            return False, [log("info", "stale_term_refused", sender=sender, term=term, current=self.node.term),
                           self.node.send(sender, TermNotice(term=self.node.term, leader=self.node.leader))]
        if from_leader:
            if term > self.node.term or not self.node.leader:
                return True, self._follow(term, sender, now)
            if sender != self.node.leader:
                return False, [log("warning", "control_refused", sender=sender, term=term, leader=self.node.leader)]
            self.last_leader_s = now
            return True, []
        if term > self.node.term:
            return True, self._follow(term, "", now)
        return True, []

    def _follow(self, term: int, leader: NodeId, now: float) -> list[Effect]:
        was_leader = self.node.is_leader
        self._adopt_term(term, leader, now)
        return [record(RecordName.LEADER_STEPDOWN, node=self.node.me.id, term=term, leader=leader)] if was_leader else []

    @handles(msgs.TermNotice, sender=Sender.MEMBER)
    def on_term_notice(self, sender: NodeId, msg: TermNotice, now: float) -> list[Effect]:
        if msg.term > self.node.term or (msg.term == self.node.term and not self.node.leader and msg.leader):
            return self._follow(msg.term, msg.leader, now)
        return []

    def _forget_waiting(self, pid: NodeId, reassigned: bool = False) -> None:
        """The leader's record of a joiner waiting (or sent to join again) is void."""
        lead = self.node.coord.lead
        if reassigned:
            lead.reassigned.pop(pid, None)
        else:
            lead.waiting.discard(pid)

    def vote_failed_to(self, peer: NodeId) -> None:
        self.vote_failed.add(peer)

    @handles(msgs.Heartbeat, sender=Sender.ANYONE, fence=Fence.TO_LEADER)
    def on_heartbeat(self, sender: NodeId, msg: Heartbeat, now: float) -> list[Effect]:
        if not self.node.is_leader:
            # the sender takes us for its leader: tell it whom we follow
            return [self.node.send(sender, TermNotice(term=self.node.term, leader=self.node.leader))] if self.node.leader else []
        if sender not in self.node.directory and sender not in self.pending_joiners:
            return [self.node.send(sender, Evicted(term=self.node.term))]  # a zombie the leader evicted: stop it
        self.last_hb[sender] = now
        return [self.node.send(sender, HeartbeatAck(term=self.node.term, leader=self.node.me.id, iteration=self.node.iteration))]

    @handles(msgs.HeartbeatAck, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_heartbeat_ack(self, sender: NodeId, msg: HeartbeatAck, now: float) -> list[Effect]:
        if sender == self.node.leader:
            self.last_leader_s = now
        return []

    # ---- measured compute (runtime) ----------------------------------------------------

    def compute_changed(self, compute_s: float, now: float) -> list[Effect]:
        """`NodeCore.on_compute_measured` accepted a new compute time: it becomes `me.compute_s`
        (and the speed a joiner's stage choice converts it with), the router re-prices my edges,
        and the members that price me hear it: my previous, same and next stage (their routers'
        edge costs and annealing) and the data holders (the leader's plans, a new leader's, and
        the directory a joiner is welcomed with). Not a broadcast: a relay's directory is
        exactly these; a data holder skips the relays of the stages not next to it."""
        old = self.node.me.compute_s
        self.node.me = replace(self.node.me, compute_s=compute_s)
        if self.node.me.id in self.node.directory:
            self.node.directory[self.node.me.id] = self.node.me
        self.speed_flops_per_s = self.node.train.stage_flops[max(self.node.me.stage, 1)] / compute_s
        out: list[Effect] = [record(RecordName.COMPUTE_ADVERTISED, node=self.node.me.id, stage=self.node.me.stage,
                                    compute_s=compute_s, previous_s=old)]
        out += list(self.node.router.on_compute_update(self.node.me.id, compute_s, now))
        msg = ComputeUpdate(compute_s=compute_s)
        near = ((self.node.me.stage - 1) % self.node.S, self.node.me.stage, (self.node.me.stage + 1) % self.node.S, 0)
        return out + [self.node.send(pid, msg) for pid in sorted(self.node.directory)
                      if pid != self.node.me.id and self.node.directory[pid].stage in near]

    @handles(msgs.ComputeUpdate, sender=Sender.MEMBER)
    def on_compute_update(self, sender: NodeId, msg: ComputeUpdate, now: float) -> list[Effect]:
        """A member's new compute time: my directory keeps it (so what I tell joiners, and plan
        as a leader, is current) and my router re-prices its edges to the sender (a no-op for a
        peer it does not route to). A value that is not a positive finite number of seconds
        (at most `MAX_COMPUTE_S`) is refused."""
        info = self.node.directory.get(sender)
        if info is None or sender == self.node.me.id or info.compute_s == msg.compute_s:
            return []
        if not 0.0 < msg.compute_s <= MAX_COMPUTE_S:
            return [record(RecordName.MESSAGE_REFUSED, node=self.node.me.id, sender=sender, type=msg.TYPE,
                           reason=f"compute_s {msg.compute_s!r} not in (0, {MAX_COMPUTE_S:g}]")]
        self._dir_set(replace(info, compute_s=msg.compute_s))
        return list(self.node.router.on_compute_update(sender, msg.compute_s, now))

    # ---- failures ----------------------------------------------------------------------

    def evict(self, pid: NodeId, graceful: bool, now: float) -> list[Effect]:
        """Leader: declare `pid` dead and tell everyone, the joiners still pending included (one
        of them may be fetching its state from `pid`)."""
        self.last_hb.pop(pid, None)
        self.pending_stage.pop(pid, None)
        out: list[Effect] = [record(RecordName.EVICT, node=pid, by=self.node.me.id, graceful=graceful)]
        msg = MemberDown(term=self.node.term, node=pid, graceful=graceful)
        out += [self.node.send(q, msg) for q in sorted(self.node.directory) if q not in (pid, self.node.me.id)]
        out += [self.node.send(q, msg) for q in sorted(self.pending_joiners) if q != pid and q not in self.node.directory]
        return out + self.peer_down(pid, now)

    def suspect(self, peer: NodeId, now: float) -> list[Effect]:
        """A missed ack deadline or failed send: skip `peer` for routing until heard from; ask the
        leader to probe it (the leader evicts it if the probe goes unanswered)."""
        if peer in self.node.suspects or peer not in self.node.directory or peer == self.node.me.id:
            return []
        self.node.suspects.add(peer)
        out: list[Effect] = [record(RecordName.SUSPECT, node=self.node.me.id, peer=peer),
                             self.node.timer(("unsuspect", peer), self.node.cfg.evict_after_s, now)]
        out += list(self.node.router.on_peer_down(peer, now))
        if self.node.leader:
            out.append(self.node.send(self.node.leader, SuspectNotice(node=peer)))
        return out

    def on_unsuspect_timer(self, peer: NodeId, now: float) -> list[Effect]:
        """The leader did not evict a peer we suspected: it is alive (slow, or the link was bad)."""
        info = self.node.directory.get(peer)
        if peer not in self.node.suspects or info is None:
            return []
        self.node.suspects.discard(peer)
        return list(self.node.router.on_peer_up(info, self.node.link(peer), now)) if self.in_view(info) else []

    @handles(msgs.SuspectNotice, sender=Sender.MEMBER)
    def on_suspect_notice(self, sender: NodeId, msg: SuspectNotice, now: float) -> list[Effect]:
        if not self.node.is_leader or msg.node not in self.node.directory or msg.node == self.node.me.id:
            return []
        if ("probe", msg.node) in self.probing:
            return []
        self.probing.add(("probe", msg.node))
        return [self.node.send(msg.node, Probe(term=self.node.term)), self.node.timer(("probe", msg.node, now), self.node.cfg.deadline_floor_s, now)]

    @handles(msgs.Probe, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_probe(self, sender: NodeId, msg: Probe, now: float) -> list[Effect]:
        return [self.node.send(sender, Heartbeat(term=self.node.term, version=self.node.version))]

    def on_probe_timer(self, peer: NodeId, sent_s: float, now: float) -> list[Effect]:
        self.probing.discard(("probe", peer))
        if self.node.is_leader and peer in self.node.directory and self.last_hb.get(peer, now) < sent_s:
            return self.evict(peer, False, now)
        return []

    @handles(msgs.MemberDown, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_member_down(self, sender: NodeId, msg: MemberDown, now: float) -> list[Effect]:
        # (a new leader's MemberDown of the old one passed `fence`, which made the sender our leader)
        if msg.node == self.node.me.id:
            return self.on_evicted(sender, Evicted(term=msg.term), now)
        out = self.peer_down(msg.node, now)
        if not self.node.active and self.node.me.stage >= 0 and msg.node == self.state_source:
            out += [record(RecordName.STATE_SOURCE_LOST, node=self.node.me.id, source=msg.node)]
            out += self.fetch_state(self.restore_point(), now)
        return out

    @handles(msgs.Evicted, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_evicted(self, sender: NodeId, msg: Evicted, now: float) -> list[Effect]:
        """A member the leader declared dead stops (a zombie); a joiner that never served
        (e.g. silent too long while it built its stage) joins again instead, boundedly."""
        if not self.node.active:
            return self.rejoin("evicted", now)
        return self.stop("evicted", now)

    def stop(self, reason: str, now: float) -> list[Effect]:
        self.node.alive = False
        return [record(RecordName.SELF_STOP, node=self.node.me.id, reason=reason)]

    def peer_down(self, pid: NodeId, now: float) -> list[Effect]:
        """`pid` is gone: drop it, recover every piece of in-flight work that waited on it."""
        info = self._dir_drop(pid)
        if info is None:
            return []
        self.node.suspects.discard(pid)
        if info.stage == 0:
            self.node.plane.lose_origin(pid)
        out: list[Effect] = list(self.node.router.on_peer_down(pid, now))
        if self.node.cfg.view_size > 0:
            out += self._widen(now)
        for n in sorted(self.node.plane.legs):
            leg = self.node.plane.legs[n]
            out += self._recover_rec(leg, n, pid, now)
        for mb in sorted(self.node.plane.origins):
            out += self._recover_rec(self.node.plane.origins[mb], mb, pid, now)
        for mb in sorted(self.node.plane.gouts):
            g = self.node.plane.gouts.get(mb)
            if g is None:
                continue
            if g.redo_start == NONE and g.path[g.pos - 1] == pid:
                out += self.node.plane.bwd_failed(mb, now)
            elif g.redo_start != NONE and g.path[g.redo_start - 1] == pid:
                out += self.node.plane.redo_failed(mb, now)
        successor = False
        if pid == self.node.leader:
            # the leader left gracefully: it hands the next term to the next data holder by id
            # (every node keeps every data holder, so all name the same successor)
            self._adopt_term(self.node.term + 1, self._choose_leader(), now)
            successor = self.node.leader == self.node.me.id
            out.append(record(RecordName.LEADER_CHANGE, node=self.node.me.id, leader=self.node.leader, term=self.node.term))
            if successor:
                self.vote_term, self.voted_for = self.node.term, self.node.me.id
                out.append(record(RecordName.LEADER_TERM, node=self.node.me.id, term=self.node.term))
        out += self.node.coord.on_member_dead(pid, info.stage, now, info.shard)
        return out + (self.node.coord.become_leader(now) if successor else [])

    def _recover_rec(self, rec: Leg | Origin, ref: int | tuple[str, int, int], pid: NodeId,
                     now: float) -> list[Effect]:
        if rec.phase in ("out", "got") and rec.next == pid:
            return self.node.plane.fwd_failed(ref, pid, now)
        if rec.phase == "gradwait" and rec.holder == pid:
            return self.node.plane.chain_failed(ref, now)
        return []

    @handles(msgs.MemberUp, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_member_up(self, sender: NodeId, msg: MemberUp, now: float) -> list[Effect]:
        p = from_tuple(msg.peer)
        if p.id == self.node.me.id:
            if self.node.me.stage < 0 or p.stage != self.node.me.stage:
                return []  # an activation for a stage we left (we were sent to join again)
            if p.shard != self.node.me.shard:  # the leader gave us another vacant shard (ours was served)
                self.node.me = replace(self.node.me, shard=p.shard)
                self._dir_set(self.node.me)
            if not self.node.active:
                # (only at activation: a resent MemberUp to an active member must not move its
                # iteration back to its version, which with train.update_delay 1 is one behind;
                # SWARM seed 3 of paper-gpt-high then never reported again: a 6,000 s stall)
                self.node.iteration = self.node.version
            self.node.active = True
            out: list[Effect] = [record(RecordName.ACTIVATED, node=self.node.me.id, stage=self.node.me.stage,
                                        version=self.node.version)]
            if msg.start != NONE and msg.start == self.node.version and self.node.me.stage == 0:
                # a data holder activated mid-iteration: its IterStart went out before it was a member
                start = IterStart(term=msg.term, iteration=msg.start, leader=sender)
                out += self.node.agg.on_iter_start(sender, start, now, own=msg.own)
            return out
        if self.keeps(p):
            self._dir_set(p)
        return self._peer_up(p, now)

    @handles(msgs.LeaveNotice, sender=Sender.MEMBER)
    def on_leave_notice(self, sender: NodeId, msg: LeaveNotice, now: float) -> list[Effect]:
        if self.node.is_leader and sender in self.node.directory:
            return self.evict(sender, True, now)
        return []

    def leave(self, now: float) -> list[Effect]:
        out: list[Effect] = [record(RecordName.LEAVE, node=self.node.me.id)]
        if self.node.leader and self.node.leader != self.node.me.id:
            out.append(self.node.send(self.node.leader, LeaveNotice()))
        elif self.node.is_leader:
            out += [self.node.send(q, MemberDown(term=self.node.term, node=self.node.me.id, graceful=True))
                    for q in sorted(self.node.directory) if q != self.node.me.id]
        self.node.alive = False
        return out

    # ---- join --------------------------------------------------------------------------

    def join_deadline_s(self) -> float:
        """How long a joiner waits for a Welcome (or a relay's state) before it asks again."""
        return max(2.0 * self.node.cfg.evict_after_s, 4.0 * self.node.cfg.deadline_floor_s)

    def send_join(self, now: float) -> list[Effect]:
        """Joiner: ask to join through the leader, a data holder or the contact, in turn (each of
        them forwards to its leader), with a deadline; after JOIN_TRIES without a Welcome it
        gives up loudly (`self_stop` reason join_failed)."""
        self.join_tries += 1
        if self.join_tries > JOIN_TRIES:
            return self.stop("join_failed", now)
        dhs = sorted(p for p, i in self.node.directory.items() if i.stage == 0 and p != self.node.me.id)
        ways = ([self.node.leader] if self.node.leader and self.node.leader != self.node.me.id else []) + dhs + \
            ([self.contact] if self.contact else [])
        out: list[Effect] = [self.node.timer(("join", 0), self.join_deadline_s(), now)]
        if ways:
            want = self.move_to if self.move_to >= 1 else \
                self.node.fixed_stage if self.node.fixed_stage is not None else NONE
            out.append(self.node.send(ways[(self.join_tries - 1) % len(ways)],
                                      JoinRequest(peer=to_tuple(self.node.me), want=want)))
        return out

    def on_join_timer(self, _: object, now: float) -> list[Effect]:
        if self.node.active or self.node.me.stage >= 0 or not self.node.alive:
            return []
        return [record(RecordName.JOIN_RETRY, node=self.node.me.id, tries=self.join_tries)] + self.send_join(now)

    def rejoin(self, reason: str, now: float) -> list[Effect]:
        """A joiner that lost its leader, or was evicted before it served, starts over."""
        self.node.me = replace(self.node.me, stage=-1)
        self.state_source = ""
        self.node.leader = ""
        return [record(RecordName.REJOIN, node=self.node.me.id, reason=reason)] + self.send_join(now)

    def _joiner_tick(self, now: float) -> list[Effect]:
        """Heartbeat timer of a node that is not (yet) a member: a pending joiner keeps the
        leader informed, and joins again when its leader fell silent."""
        if self.node.me.stage < 0 or not self.node.leader:
            return []  # waiting for a Welcome: the join timer drives this phase
        if now - self.last_leader_s > self.node.cfg.evict_after_s:
            return self.rejoin("leader_lost", now)
        return [self.node.send(self.node.leader, Heartbeat(term=self.node.term, version=self.node.version))]

    @handles(msgs.JoinRequest, sender=Sender.ANYONE)
    def on_join_request(self, sender: NodeId, msg: JoinRequest, now: float) -> list[Effect]:
        if not self.node.is_leader:
            return [self.node.send(self.node.leader, msg)] if self.node.leader else []
        joiner = msg.peer[0]
        self._forget_waiting(joiner, reassigned=True)
        self.pending_joiners.add(joiner)
        self.last_hb[joiner] = now
        self.pending_stage.pop(joiner, None)  # a retry: assign afresh
        members = tuple(to_tuple(self.node.directory[p]) for p in sorted(self.node.directory))
        self.welcomed_with[joiner] = frozenset(self.node.directory)
        util = self.utilisation()
        stage, shard = self.join_assignment(msg, util)
        self.pending_stage[joiner] = (stage, msg.peer[4], shard)
        welcome = Welcome(term=self.node.term, stage=stage, members=members, utilisation=util,
                          iteration=self.node.iteration, checkpoint_iteration=self.checkpoint_version(), shard=shard)
        return [self.node.send(joiner, welcome)]

    def vacant_shards(self) -> list[int]:
        """Leader: the data shards (0..D-1) no live data holder serves and no pending one was given."""
        held = {p.shard for p in self.node.directory.values() if p.stage == 0}
        held.update(s for j, (st, _, s) in self.pending_stage.items() if st == 0 and j not in self.node.directory)
        return [s for s in range(self.node.train.data_holders) if s not in held]

    def vacant_extras(self, t: int) -> tuple[tuple[NodeId, int, int], ...]:
        """Leader, at iteration `t`'s start: every microbatch (shard, index) of a shard no live data
        holder serves, dealt round-robin (from an offset that turns with t) to the live data
        holders in id order, so the iteration trains the whole global batch, D x M
        (`protocol.hold_batch`; DESIGN.md 3, the batch belongs to the swarm). Pending joiners do
        not serve yet. None while some data holder's shard is unknown (-1)."""
        dhs = self.dealers()
        held = {self.node.directory[p].shard for p in dhs}
        return self.deal([(s, i) for s in range(self.node.train.data_holders) if s not in held
                          for i in range(self.node.train.microbatches)], dhs, t)

    def dealers(self) -> list[NodeId]:
        """The live data holders, in id order, that the batch's microbatches may be dealt to
        (`protocol.hold_batch`); none while some data holder's shard is unknown (-1)."""
        dhs = sorted(self.node.data_holders())
        if not self.node.cfg.hold_batch or any(self.node.directory[p].shard < 0 for p in dhs):
            return []
        return dhs

    @staticmethod
    def deal(items: list[tuple[int, int]], dhs: list[NodeId], t: int) -> tuple[tuple[NodeId, int, int], ...]:
        """`items` (shard, index) dealt round-robin to `dhs` from an offset that turns with
        iteration `t`: (data holder, shard, index) each."""
        return tuple((dhs[(t + k) % len(dhs)], s, i) for k, (s, i) in enumerate(items)) if dhs else ()

    def join_assignment(self, msg: JoinRequest, util: tuple[float, ...]) -> tuple[int, int]:
        """Leader: (stage, shard) for a joiner (DESIGN.md 5, data holder crash). The stage it must
        serve (`want`: an operator's `--stage`, 0 for `--role data-holder`, with its own shard when it
        names one); else, while a data shard is vacant (fewer than train.data_holders live or
        joining, `protocol.data_holder_joins`) and no relay stage is lost, the data holder's role on
        the lowest vacant shard; else the bottleneck relay stage. Shard NONE: not a data holder."""
        vacant = self.vacant_shards() if msg.want <= 0 else []
        if msg.want == 0:
            own = msg.peer[6]
            return 0, own if own >= 0 or not vacant else vacant[0]
        if msg.want >= 1:
            return msg.want, NONE
        relay = bottleneck_stage(util)
        if vacant and self.node.cfg.data_holder_joins and util[relay] < UNKNOWN_STAGE_LOAD:
            return 0, vacant[0]
        return relay, NONE

    def utilisation(self) -> tuple[float, ...]:
        """Per stage: microbatches per iteration / the stage's live capacity, counting the
        joiners still pending at the stage they were assigned (so nodes that join together
        spread over the stages that need them)."""
        cap = [0] * self.node.S
        demand = 0
        for p in self.node.directory.values():
            cap[p.stage] += p.capacity
            if p.stage == 0:
                demand += min(self.node.train.microbatches, p.capacity)
        for pid, (stage, capacity, _) in self.pending_stage.items():
            if pid not in self.node.directory and 0 <= stage < self.node.S:
                cap[stage] += capacity
        return tuple(demand / c if c else UNKNOWN_STAGE_LOAD for c in cap)

    def checkpoint_version(self) -> int:
        return self.node.version - self.node.version % self.node.cfg.checkpoint_every


    def restore_point(self) -> int:
        """The checkpoint a joiner restores when no replica serves it: the one the leader named
        (a joiner's own version is not the swarm's; it was 0, and a retry loaded the initial model)."""
        return self.restore_version

    @handles(msgs.Welcome, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_welcome(self, sender: NodeId, msg: Welcome, now: float) -> list[Effect]:
        if self.node.me.stage >= 0 or self.node.active:
            return []
        util = msg.utilisation
        self.assigned_stage = msg.stage
        self.move_to = NONE
        members = list(map(from_tuple, msg.members))
        self.node.directory = {i.id: i for i in members}  # what a policy's stage choice may look at (SWARM)
        # the data holder's role the leader assigns (a vacant shard) comes before any policy's choice
        holder = msg.stage == 0 and msg.shard >= 0 and self.node.fixed_stage in (None, 0)
        stage = 0 if holder else self.node.choose_join_stage(util)
        me = self.node.me
        if stage == 0:
            me = replace(me, shard=msg.shard if holder else me.shard, demand=self.node.train.microbatches)
        else:
            me = replace(me, shard=NONE, demand=0)
        self.node.me = replace(me, stage=stage, compute_s=self.node.train.stage_flops[stage] / self.speed_flops_per_s)
        factory = self.node.router_factory
        if factory is not None:
            self.node.router = factory(self.node.me)
        else:
            self.node.router.set_me(self.node.me)
        self.node.directory = {i.id: i for i in members if self.keeps(i)}
        self.node.directory[self.node.me.id] = self.node.me
        self.node.dhs_cache = None
        if self.node.cfg.view_size > 0:
            self.view_sizes = stage_sizes(members)
            self.live_sizes = stage_sizes(self.node.directory.values())
            self._view_seen = {t: self._view_threshold(t) for t in self._near_stages()}
        self.node.leader = sender
        self.last_leader_s = now
        self.node.iteration = msg.iteration
        # (a node moved to another stage kept the IterStart it took at its old one: with a
        # restart in between, the same iteration's IterStart here was then ignored for good,
        # SWARM seed 3 of paper-gpt-high with train.update_delay 1: a 6,000 s stall)
        self.node.agg.forget_rounds()
        self.state_tries = 0
        self.restore_version = msg.checkpoint_iteration
        out: list[Effect] = [record(RecordName.JOIN_STAGE, node=self.node.me.id, stage=stage, utilisation=util[stage])]
        if factory is not None:
            out += list(self.node.router.on_start(now))
        for pid in sorted(self.node.directory):
            out += self._peer_up(self.node.directory[pid], now)
        return out + self.fetch_state(msg.checkpoint_iteration, now)


    def join_stage(self, utilisation: tuple[float, ...]) -> int:
        """The stage the leader assigned (it counts the joiners still pending), else the
        bottleneck relay stage (highest utilisation; ties: lowest): `NodeCore.choose_join_stage`'s
        default (the systems may override that hook)."""
        if 1 <= self.assigned_stage < self.node.S:
            return self.assigned_stage
        return bottleneck_stage(utilisation)

    def fetch_state(self, checkpoint: int, now: float) -> list[Effect]:
        """Ask a live replica of our stage for its state (with a deadline: a source that dies
        or stalls is replaced by another, `on_state_timer`), or load the stage's checkpoint
        when it has no replica (or every replica failed us STATE_TRIES times)."""
        failed = self.state_failed_from
        replicas = sorted(p for p, info in self.node.directory.items()
                          if info.stage == self.node.me.stage and p != self.node.me.id and p not in failed)
        size = self.node.train.stage_state_bytes[self.node.me.stage]
        self.state_tries += 1
        if replicas and self.state_tries <= STATE_TRIES:
            return self._ask_state(self.node.rng.choice(replicas), StateRequest(stage=self.node.me.stage), size, now)
        if self.node.me.stage == 0:  # no data holder lives: the relays that may keep copies of stage 0
            holders = [p for p in self.stage0_copy_holders(everyone=True) if p not in failed]
        else:
            holders = sorted(p for p in self.node.data_holders() if p != self.node.me.id and p not in failed)
        if self.node.cfg.checkpoint_replicate and checkpoint > 0 and holders:
            # several hosts: the data holders keep the newest checkpoint of every stage (a few
            # relays stage 0's); our own disk (below) is the last resort once every holder
            # refused or failed
            return self._ask_state(holders[0], StateRequest(stage=self.node.me.stage, checkpoint=checkpoint), size, now)
        self.state_source = "checkpoint"
        key = ("state", self.node.me.stage, checkpoint, "checkpoint")
        job = self.node.job(ComputeKind.LOAD_CHECKPOINT, checkpoint)
        return [Compute(job, ComputeKind.LOAD_CHECKPOINT, self.node.me.stage, None, 0.0, (), (key,), size)]

    def stage0_copy_holders(self, everyone: bool = False) -> list[NodeId]:
        """The relays that keep copies of stage 0's checkpoints, in order: the lowest-id member
        of stage 1, of stage 2, ... (`Aggregation._replicate_checkpoint` sends to the first
        `protocol.stage0_copies`); `everyone`: then every other relay, by id (a stage-0 joiner
        with no data holder alive asks them in this order: the first were the likeliest
        holders, but members have changed since)."""
        by_stage: dict[int, list[NodeId]] = {}
        for p in sorted(self.node.directory):
            st = self.node.directory[p].stage
            if 1 <= st < self.node.S and p != self.node.me.id:
                by_stage.setdefault(st, []).append(p)
        first = [by_stage[k][0] for k in sorted(by_stage)]
        if not everyone:
            return first
        return first + sorted(p for k in sorted(by_stage) for p in by_stage[k][1:])

    def _ask_state(self, src: NodeId, req: StateRequest, size: int, now: float) -> list[Effect]:
        """Send a state request to `src` with the state deadline (`on_state_timer`)."""
        self.state_source = src
        deadline = max(self.join_deadline_s(), STATE_DEADLINE_FACTOR * self.node.ack_deadline_s(src, size))
        return [self.node.send(src, req), self.node.timer(("sget", 0), deadline, now)]

    def on_state_timer(self, _: object, now: float) -> list[Effect]:
        src = self.state_source
        if self.node.active or self.node.me.stage < 0 or src in ("", "checkpoint"):
            return []
        self._state_failed(src)
        return [record(RecordName.STATE_TIMEOUT, node=self.node.me.id, source=src)] + \
            self.fetch_state(self.restore_point(), now)

    def _state_failed(self, src: NodeId) -> None:
        self.state_failed_from.add(src)

    @handles(msgs.StateRequest, sender=Sender.ANYONE)
    def on_state_request(self, sender: NodeId, msg: StateRequest, now: float) -> list[Effect]:
        if msg.checkpoint != NONE:
            return self._checkpoint_request(sender, msg)
        if msg.stage != self.node.me.stage or not self.node.active:
            return [self.node.send(sender, StateTransfer(stage=msg.stage, version=NONE, key=(), ok=False))]
        key = ("state", self.node.me.stage, self.node.version, self.node.me.id)
        size = self.node.train.stage_state_bytes[self.node.me.stage]
        job = self.node.job(ComputeKind.EXPORT_STATE, (sender, key, self.node.version))
        return [Compute(job, ComputeKind.EXPORT_STATE, self.node.me.stage, None, 0.0, (), (key,), size)]

    def _checkpoint_request(self, sender: NodeId, msg: StateRequest) -> list[Effect]:
        """A data holder answers a joiner with its copy of checkpoint `msg.checkpoint` of
        `msg.stage` (read from disk by the driver; a missing or corrupt file fails the job,
        which refuses the request: `core.on_compute_failed`); a relay likewise with its copy of
        stage 0's, if it stored that version (else it refuses at once)."""
        mine = 1 <= msg.stage < self.node.S if self.node.me.stage == 0 else \
            msg.stage == 0 and self.node.agg.copies.get(0, NONE) >= msg.checkpoint
        if not self.node.active or not mine or msg.checkpoint < 1:
            return [self.node.send(sender, StateTransfer(stage=msg.stage, version=NONE, key=(), ok=False))]
        key = ("ckpt", msg.stage, msg.checkpoint, self.node.me.id)
        size = self.node.train.stage_state_bytes[msg.stage]
        job = self.node.job(ComputeKind.READ_CHECKPOINT, (sender, key, msg.checkpoint))
        return [Compute(job, ComputeKind.READ_CHECKPOINT, self.node.me.stage, None, 0.0, (), (key,), size)]

    def _keep_checkpoint(self, sender: NodeId, msg: StateTransfer) -> list[Effect]:
        """A data holder receives a relay stage's checkpoint from one of its replicas: keep it."""
        k, v = msg.stage, msg.version
        info = self.node.directory.get(sender)
        mine = 1 <= k < self.node.S if self.node.me.stage == 0 else k == 0  # (relays keep stage 0's)
        ok = (mine and msg.ok and info is not None and info.stage == k
              and checkpoint_due(v, self.node.cfg.checkpoint_every, self.node.train.iterations) and msg.key == ("ckpt", k, v, sender))
        if not ok:
            return [log("warning", "checkpoint_refused", sender=sender, stage=k, version=v)]
        job = self.node.job(ComputeKind.STORE_CHECKPOINT, msg.key)
        return [Compute(job, ComputeKind.STORE_CHECKPOINT, self.node.me.stage, None, 0.0, (msg.key,), (),
                        msg.size_bytes)]

    @handles(msgs.StateTransfer, sender=Sender.ANYONE)
    def on_state_transfer(self, sender: NodeId, msg: StateTransfer, now: float) -> list[Effect]:
        if self.node.active and msg.key[:1] == ("ckpt",):
            return self._keep_checkpoint(sender, msg)
        if self.node.active or msg.stage != self.node.me.stage or sender != self.state_source:
            return []
        self.state_source = ""
        if not msg.ok:
            self._state_failed(sender)
            return self.fetch_state(self.restore_point(), now)
        out: list[Effect] = []
        if msg.key[:1] == ("ckpt",):
            out.append(record(RecordName.CHECKPOINT_FETCHED, node=self.node.me.id, stage=msg.stage, version=msg.version,
                              source=sender))
        job = self.node.job(ComputeKind.IMPORT_STATE, msg.version)
        return out + [Compute(job, ComputeKind.IMPORT_STATE, self.node.me.stage, None, 0.0, (msg.key,), (),
                              msg.size_bytes)]

    def membership_compute_done(self, kind: ComputeKind, ref: Any, now: float) -> list[Effect]:
        if kind in (ComputeKind.EXPORT_STATE, ComputeKind.READ_CHECKPOINT):
            to, key, version = ref
            size = self.node.train.stage_state_bytes[key[1]]
            return [self.node.send_booked(to, StateTransfer(stage=key[1], version=version, key=key, size_bytes=size),
                                     now)]
        if kind == ComputeKind.EXPORT_CHECKPOINT:
            targets, key, version = ref
            size = self.node.train.stage_state_bytes[key[1]]
            msg = StateTransfer(stage=key[1], version=version, key=key, size_bytes=size)
            return [self.node.send_booked(d, msg, now) for d in targets]
        if kind == ComputeKind.STORE_CHECKPOINT:
            return self.node.agg.copy_stored(int(ref[1]), int(ref[2]), now)
        if kind in (ComputeKind.IMPORT_STATE, ComputeKind.LOAD_CHECKPOINT):
            if self.node.active or self.node.me.stage < 0:
                return []
            self.node.version = int(ref)
            self.state_source = ""
            return [self.node.send(self.node.leader, Ready(stage=self.node.me.stage, version=self.node.version, peer=to_tuple(self.node.me)))]
        return []

    def state_failed(self, kind: ComputeKind, now: float) -> list[Effect]:
        """Importing fetched state failed: fetch again (another source, then the checkpoint).

        Loading the checkpoint from our own disk failed: that version is missing or corrupt
        here (the stage's last replica died while writing it, before any data holder got a
        copy). Fetching it again would fail again, at once and forever (a joiner spun through
        half a million failed loads), so step back to the previous checkpoint (every node keeps
        the previous complete version), asking the data holders for it first; the leader rolls
        the swarm back to the version we restore (`Coordinator._activate`). Version 0 is the
        initial model; if even that fails this node cannot serve: it stops ("compute_failed")."""
        if kind is not ComputeKind.LOAD_CHECKPOINT:
            return self.fetch_state(self.restore_point(), now)
        failed = self.restore_version
        if failed <= 0:
            return self.stop("compute_failed", now)
        every = self.node.cfg.checkpoint_every
        self.restore_version = (failed - 1) - (failed - 1) % every
        self.state_tries = 0
        self.state_failed_from = set()
        out: list[Effect] = [record(RecordName.CHECKPOINT_FALLBACK, node=self.node.me.id, stage=self.node.me.stage,
                                    failed=failed, version=self.restore_version)]
        return out + self.fetch_state(self.restore_version, now)

    @handles(msgs.Refetch, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_refetch(self, sender: NodeId, msg: Refetch, now: float) -> list[Effect]:
        if self.node.active:
            return []
        if msg.stage >= 1 and msg.stage != self.node.me.stage:
            return self.rejoin("reassigned", now)  # our stage was lost meanwhile: take it over
        self.state_tries = 0
        self.state_failed_from = set()
        self.restore_version = msg.iteration - msg.iteration % self.node.cfg.checkpoint_every
        return self.fetch_state(self.restore_point(), now)


def bottleneck_stage(utilisation: Sequence[float]) -> int:
    """The relay stage with the highest utilisation (ties: the lowest stage)."""
    return max(range(1, len(utilisation)), key=lambda k: (utilisation[k], -k))
