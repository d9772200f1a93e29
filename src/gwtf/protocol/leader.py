"""The leader's side of the iteration barrier: start, collect, plan, commit, step, pause.

Owns: `Coordinator` (`node.coord`), what the lowest-id live data holder does in addition to being a data
holder: start iterations, wait for every live data holder's report, collect every replica's
contributions, run `aggregation.plan_redo` (resets and redo chains) until every expected
microbatch is covered exactly once at every stage, then commit (two phases: Have, then Step).
It also pauses training when a whole stage is lost and resumes from the last checkpoint once a
node has taken the stage over, activates joiners at matching versions, and takes over from a
crashed leader by re-collecting every node's state.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from gwtf.protocol import messages as msgs
from gwtf.protocol.aggregation import Contrib, Plan, digest, plan_redo, tree_children
from gwtf.protocol.base import Message, NodeId, log
from gwtf.protocol.dispatch import Fence, Sender, handles
from gwtf.protocol.kinds import RecordName
from gwtf.protocol.ledger import Effect, checkpoint_due
from gwtf.protocol.membership import STATE_DEADLINE_FACTOR, bottleneck_stage, from_tuple, to_tuple
from gwtf.protocol.messages import (
    NONE,
    Collect,
    Commit,
    Have,
    IterStart,
    MemberUp,
    Ready,
    Redo,
    Refetch,
    Report,
    Reset,
    Rollback,
    Step,
    record,
)
from gwtf.protocol.router import PeerInfo

if TYPE_CHECKING:
    from gwtf.protocol.core import NodeCore

ROUND_GAP = 1000  # round numbers a crashed leader may have used unseen
ADMIT_AFTER_REFETCHES = 2  # a joiner stale at this many iteration starts is waited for at the next
STALLED_LOG_PERIOD_S = 5.0  # a paused leader repeats why it is stalled this often
CHAIN_DEADLINE_FACTOR = 6.0  # a redo chain not covered after this x ack deadline is planned again


class Phase(StrEnum):
    """Where the leader is in its iteration (the transitions: docs/protocol.md, iteration barrier)."""

    RUN = "run"  # data holders train their microbatches
    COLLECT = "collect"  # every member reports its contributions; redo chains until covered
    COMMIT = "commit"  # contributors' gradients are reduced; waiting for every Have
    RECOVER = "recover"  # a new leader re-collects every node's state
    PAUSED = "paused"  # a stage has no replica: no iteration until a node takes it over
    ADMIT = "admit"  # the next iteration waits (bounded) for joiners whose state kept going stale
    FINISHED = "finished"


@dataclass(slots=True)
class Overlap:
    """`train.update_delay` 1: a committed round still reducing while the next iteration runs."""

    iteration: int
    round: int
    commits: dict[int, Commit]  # stage -> its Commit
    commit_set: set[NodeId]  # the live replicas whose Have it waits for
    contributors: set[NodeId]
    expected: int  # the iteration's microbatches (its `iteration_done` record)
    haves: set[NodeId] = field(default_factory=set)


@dataclass(slots=True)
class LeaderState:
    """Everything a leader knows of its term's iterations, owned by the leadership alone: built
    when a node starts to lead (`leader_init`), consulted only while `is_leader`."""

    term: int
    t: int  # the iteration being run
    phase: Phase
    round: int  # the last commit round used (a new leader starts ROUND_GAP above any seen)
    stalled_log_s: float = 0.0
    started_s: float = 0.0  # when this node began to lead
    reports: dict[NodeId, Report] = field(default_factory=dict)
    expected: dict[NodeId, tuple[int, ...]] = field(default_factory=dict)  # data holder -> its microbatches
    haves: set[NodeId] = field(default_factory=set)
    commit_set: set[NodeId] = field(default_factory=set)
    pending: dict[Contrib, float] = field(default_factory=dict)  # aggregation redo chain -> deadline
    waiting: set[NodeId] = field(default_factory=set)  # joiners ready for an older version
    reassigned: dict[NodeId, int] = field(default_factory=dict)  # joiner told to join again -> the lost stage
    ready: dict[NodeId, tuple[PeerInfo, int]] = field(default_factory=dict)  # waiting joiner -> its Ready (peer, version)
    restored: dict[int, int] = field(default_factory=dict)  # paused: lost stage -> lowest version restored
    lost_from: int = NONE  # the iteration at which a stage was lost (paused)
    commits: dict[int, Commit] = field(default_factory=dict)  # stage -> the Commit of the current round
    contributors: set[NodeId] = field(default_factory=set)
    refetches: dict[NodeId, int] = field(default_factory=dict)  # joiner -> Refetches sent
    admitting: set[NodeId] = field(default_factory=set)  # joiners the held iteration start waits for
    admit_until_s: float = 0.0
    lost_shards: set[int] = field(default_factory=set)  # shards whose data holder died during this iteration
    # data holders lost during this round's commit whose gradient the commit still counted -> shard:
    # if the round breaks after all, their microbatches are lost like any dead data holder's
    standing: dict[NodeId, int] = field(default_factory=dict)
    dealt: dict[NodeId, list[tuple[int, int]]] = field(default_factory=dict)  # data holder -> (shard, index) dealt again
    # the last `plan_redo` inputs and result: while redo chains are out, most Reports change no
    # contribution, and the pure planner's answer to the same inputs is the same
    last_plan: tuple[dict[NodeId, tuple[int, frozenset[Contrib]]], dict[NodeId, tuple[int, ...]], Plan] | None = None
    # train.update_delay 1: the previous iteration's round, reducing beside this iteration's passes
    overlap: Overlap | None = None
    # ... and the round whose step the replicas hold pending (applied at the next Commit); NONE:
    # this iteration runs on the weights its predecessor stepped to (a fresh one)
    step_round: int = NONE


class Coordinator:
    """Leader behaviour (see the module docstring), one per node; inert unless the node
    `is_leader`. It owns its `LeaderState`; the rest of the node (directory, term, sends) it
    reaches through `node`."""

    def __init__(self, node: NodeCore) -> None:
        self.node = node
        # replaced by leader_init, read only while the node is_leader; until then an empty state
        # (no caller needs a None check: its collections are empty, its round 0)
        self.lead = LeaderState(term=-1, t=0, phase=Phase.FINISHED, round=0)

    def finished(self) -> bool:
        """This node led the run to its end (`_finish`): nobody is evicted any more."""
        return self.node.is_leader and self.lead.phase == Phase.FINISHED

    def leader_init(self, now: float, recovering: bool) -> list[Effect]:
        self.node.is_leader = True
        # a new leader's rounds must not collide with commits the old one may have sent
        seen = max(self.node.agg.have_round, self.node.agg.commit.round if self.node.agg.commit is not None else NONE)
        prev: LeaderState | None = self.lead
        last = prev.round if prev is not None else 0
        self.lead = LeaderState(term=self.node.term, t=self.node.iteration, phase=Phase.RECOVER if recovering else Phase.RUN,
                                round=max(last, seen) + (ROUND_GAP if recovering else 0), stalled_log_s=now,
                                started_s=now)
        self.node.members.last_hb = {pid: now for pid in self.node.directory if pid != self.node.me.id}
        if recovering:
            return self._broadcast(Collect(term=self.node.term, iteration=self.lead.t, leader=self.node.me.id), include_self=True)
        return self.start_iteration(self.lead.t, now)

    def become_leader(self, now: float) -> list[Effect]:
        return [record(RecordName.LEADER_TAKEOVER, node=self.node.me.id, iteration=self.node.iteration)] + \
            self.leader_init(now, recovering=True)

    def _broadcast(self, msg: Message, include_self: bool = False) -> list[Effect]:
        return [self.node.send(p, msg) for p in sorted(self.node.directory) if include_self or p != self.node.me.id]

    def _stage_members(self) -> list[list[NodeId]]:
        members: list[list[NodeId]] = [[] for _ in range(self.node.S)]
        for pid in sorted(self.node.directory):
            members[self.node.directory[pid].stage].append(pid)
        return members

    # ---- iteration lifecycle ----------------------------------------------------------

    def start_iteration(self, t: int, now: float) -> list[Effect]:
        if self.node.train.iterations and t >= self.node.train.iterations:
            return self._finish(t, now)
        self.lead.t = t
        self.lead.reports, self.lead.expected, self.lead.pending = {}, {}, {}
        self.lead.haves, self.lead.commit_set = set(), set()
        self.lead.lost_shards = set()
        self.lead.standing = {}
        self.lead.dealt = {}
        out: list[Effect] = [record(RecordName.ITER_START, iteration=t, members=len(self.node.directory))]
        held: list[NodeId] = []
        for j in sorted(self.lead.waiting):
            out.append(self.node.send(j, Refetch(term=self.node.term, iteration=t, stage=NONE)))
            self.lead.refetches[j] = self.lead.refetches.get(j, 0) + 1
            if self.lead.refetches[j] >= ADMIT_AFTER_REFETCHES:
                held.append(j)
        self.lead.waiting.clear()
        if any(not m for m in self._stage_members()):
            return out + self._pause(now)
        if held:
            # these joiners' state went stale again: fetching it takes longer than an iteration,
            # so hold this iteration's start until they are Ready at it (bounded) instead of
            # asking them to fetch again forever
            size = max(self.node.train.stage_state_bytes)
            wait_s = max(self.node.members.join_deadline_s(), STATE_DEADLINE_FACTOR * max(
                self.node.ack_deadline_s(j, size) for j in held))
            self.lead.phase = Phase.ADMIT
            self.lead.admitting = set(held)
            self.lead.admit_until_s = now + wait_s
            return out + [record(RecordName.ADMIT_HOLD, iteration=t, joiners=tuple(held), wait_s=round(wait_s, 3))]
        return out + self._begin(t, now)

    def _finish(self, t: int, now: float) -> list[Effect]:
        """The run's last step is done (sent): tell every member, the joiners still pending
        included, so each ends now (its own `training_over`) instead of taking the leader's exit
        for a crash and waiting out `partition_timeout_s`. After the Steps on every link, so a
        member applies the last one first."""
        self.lead.phase = Phase.FINISHED
        msg = msgs.Finish(term=self.node.term, version=t)
        pending = sorted(self.node.members.pending_joiners - set(self.node.directory))
        return [record(RecordName.TRAINING_DONE, iterations=t)] + self._broadcast(msg) + \
            [self.node.send(j, msg) for j in pending] + self.node.agg.end(t, now)

    def _iter_start(self, t: int) -> IterStart:
        """Iteration `t`'s start, with the vacant shards' microbatches dealt to the live data holders."""
        return IterStart(term=self.node.term, iteration=t, leader=self.node.me.id,
                         extra=self.node.members.vacant_extras(t), after=self.lead.step_round)

    def _begin(self, t: int, now: float) -> list[Effect]:
        """Iteration `t` starts: every member hears IterStart."""
        self.lead.phase = Phase.RUN
        out = self._broadcast(self._iter_start(t), include_self=True)
        every = self.node.policy.rebalance_every
        return out + (self.node.rebalance(now) if every > 0 and t % every == 0 else [])

    def _pause(self, now: float) -> list[Effect]:
        if self.lead.phase != Phase.PAUSED:
            self.lead.phase = Phase.PAUSED
            # (update_delay 1: an iteration beside an overlapped round runs on the version before)
            self.lead.lost_from = self.lead.t if self.lead.step_round == NONE else self.lead.t - 1
            self.lead.overlap = None
            self.lead.stalled_log_s = now
            empty = [k for k, m in enumerate(self._stage_members()) if not m]
            out: list[Effect] = [record(RecordName.STAGE_LOST, stages=tuple(empty), iteration=self.lead.t),
                                 log("warning", "stalled", reason=f"stage {empty[0]} has no node")]
            out += self._reassign_joiners(empty)
            # joiners that were ready but waiting for the next iteration are members now (a
            # paused swarm activates every Ready joiner; the rollback reloads their state)
            horizon = now - self.node.cfg.evict_after_s
            for j in sorted(self.lead.waiting):
                info, version = self.lead.ready.get(j, (None, NONE))
                heard = self.node.members.last_hb.get(j)
                if info is not None and heard is not None and heard >= horizon and self.lead.phase == Phase.PAUSED \
                        and j not in self.node.directory:
                    self.lead.waiting.discard(j)
                    self.node.members.pending_joiners.discard(j)
                    out += self._activate(j, info, now, version)
            return out
        return []

    def _reassign_joiners(self, empty: list[int]) -> list[Effect]:
        """A stage was lost while joiners were pending at stages that still have replicas: send
        one per lost stage that no pending joiner takes over to join again (it is then assigned
        the lost stage, the bottleneck), instead of leaving the swarm paused with them waiting."""
        pending = {j: st for j, (st, _, _) in self.node.members.pending_stage.items()
                   if j not in self.node.directory}
        spare = sorted(j for j, st in pending.items() if st not in empty)
        out: list[Effect] = []
        for stage in empty:
            if stage == 0 or stage in pending.values() or not spare:
                continue
            j = spare.pop(0)
            self.lead.waiting.discard(j)
            self.lead.reassigned[j] = stage  # its Ready for another stage, if in flight, is void
            out += [record(RecordName.JOINER_REASSIGNED, node=j, stage=stage),
                    self.node.send(j, Refetch(term=self.node.term, iteration=self.lead.t, stage=stage))]
        return out

    @handles(msgs.Report, sender=Sender.MEMBER, fence=Fence.TO_LEADER)
    def on_report(self, sender: NodeId, msg: Report, now: float) -> list[Effect]:
        if not self.node.is_leader or sender not in self.node.directory:
            return []
        if self.lead.phase == Phase.RECOVER:
            self.lead.reports[sender] = msg
            return self._recover_check(now)
        if msg.iteration != self.lead.t or self.lead.phase in (Phase.PAUSED, Phase.FINISHED):
            return []
        self.lead.reports[sender] = msg
        if msg.dh_done and self.node.directory[sender].stage == 0 and \
                set(self.lead.dealt.get(sender, ())) <= set(msg.dh_data):  # (not a report from before a Deal)
            self.lead.expected[sender] = msg.dh_completed
        return self._check(now)

    def _recover_check(self, now: float) -> list[Effect]:
        if not set(self.node.directory) <= set(self.lead.reports):
            return []
        reports = self.lead.reports
        top = max(r.version for r in reports.values())
        out: list[Effect] = []
        if self.node.train.update_delay and not (self.node.train.iterations and top >= self.node.train.iterations):
            # how far the old leader's overlapped round got is not known: start again at the
            # newest version (a replica one behind holds its pending step and applies it)
            self.lead.t = top
            return self._restart(top, now, "new leader")
        for pid, r in sorted(reports.items()):
            if r.version < top:  # the old leader died while sending Step: finish it
                out.append(self.node.send(pid, Step(term=self.node.term, iteration=r.version, round=r.have_round)))
        self.lead.t = top
        self.lead.reports, self.lead.expected, self.lead.pending = {}, {}, {}
        self.lead.dealt = {}
        if self.node.train.iterations and top >= self.node.train.iterations:
            # the old leader died after the last step (e.g. it exited when training was done):
            # nothing is left to run; an IterStart here trained one iteration past the end
            return out + self._finish(top, now)
        self.lead.phase = Phase.RUN
        out += self._broadcast(self._iter_start(top), include_self=True)
        for pid, r in sorted(reports.items()):
            if r.version == top and r.iteration == top:
                out += self.on_report(pid, r, now)
        return out

    def _check(self, now: float) -> list[Effect]:
        if self.lead.phase == Phase.RUN:
            dhs = self.node.data_holders()
            if len(self.lead.expected) < len(dhs) or not dhs <= self.lead.expected.keys():
                return []
            missing = self._unserved()
            if missing:
                return self._deal(missing)
            self.lead.phase = Phase.COLLECT
            out: list[Effect] = [record(RecordName.COLLECT, iteration=self.lead.t)]
            out += [self.node.send(p, Collect(term=self.node.term, iteration=self.lead.t, leader=self.node.me.id))
                    for p in sorted(self.node.directory) if p not in dhs]
            return out + self._check(now)
        if self.lead.phase == Phase.COLLECT:
            return self._plan(now)
        if self.lead.phase == Phase.COMMIT and self.lead.commit_set <= self.lead.haves:
            return self._step(now)
        return []

    def _unserved(self) -> list[tuple[int, int]]:
        """With the batch held: the microbatches (shard, index) of the global batch that no live
        data holder serves (a crashed one's, its dealt extras included), once every live data
        holder is done. Empty while a data holder's shard is unknown (as `vacant_extras`)."""
        node = self.node
        dhs = node.members.dealers()
        if not dhs:
            return []
        served = {tuple(d) for p in dhs for d in self.lead.reports[p].dh_data}
        return [(s, i) for s in range(node.train.data_holders) for i in range(node.train.microbatches)
                if (s, i) not in served]

    def _deal(self, missing: list[tuple[int, int]]) -> list[Effect]:
        """Deal the unserved microbatches round-robin to the live data holders, within this
        iteration (DESIGN.md 3: the batch belongs to the swarm); wait for each one's report
        that names them."""
        to: set[NodeId] = set()
        for dh, s, i in self.node.members.deal(missing, self.node.members.dealers(), self.lead.t):
            self.lead.dealt.setdefault(dh, []).append((s, i))
            to.add(dh)
        out: list[Effect] = [record(RecordName.DEAL, iteration=self.lead.t, items=len(missing), to=tuple(sorted(to)))]
        for dh in sorted(to):
            self.lead.expected.pop(dh, None)
            out.append(self.node.send(dh, msgs.Deal(term=self.node.term, iteration=self.lead.t,
                                                    items=tuple(self.lead.dealt[dh]))))
        return out

    def _plan(self, now: float) -> list[Effect]:
        # (the length test first: this runs on every Report, O(1) until the last ones arrive)
        if len(self.lead.reports) < len(self.node.directory) or not self.node.directory.keys() <= self.lead.reports.keys():
            return []
        contrib = {p: (r.stage, frozenset(r.contributed)) for p, r in self.lead.reports.items() if p in self.node.directory}
        last = self.lead.last_plan
        if last is not None and last[0] == contrib and last[1] == self.lead.expected:
            plan = last[2]
        else:
            plan = plan_redo(self.node.S, self.lead.expected, contrib, void=self.node.cfg.hold_batch)
            self.lead.last_plan = (contrib, dict(self.lead.expected), plan)
        out: list[Effect] = []
        for victim in plan.resets:
            self.lead.reports.pop(victim, None)
            out.append(self.node.send(victim, Reset(term=self.node.term, iteration=self.lead.t)))
        if plan.resets:
            return out + [record(RecordName.AGG_RESET, iteration=self.lead.t, nodes=plan.resets)]
        for ch in plan.chains:
            deadline = self.lead.pending.get(ch.mb)
            if deadline is not None and deadline > now:
                continue
            self.lead.pending[ch.mb] = now + CHAIN_DEADLINE_FACTOR * self.node.ack_deadline_s(ch.start_node, 0)
            mb = (ch.mb[0], self.lead.t, ch.mb[1])
            out.append(record(RecordName.REDO, node=self.node.me.id, mb=mb, start=ch.start, until=ch.until, mode="aggregation"))
            out.append(self.node.send(ch.start_node, Redo(mb=mb, path=ch.path, legs=(), start=ch.start, until=ch.until,
                                                     holder=ch.holder, agg=True)))
        if plan.chains:
            return out
        return out + self._commit(contrib, now)

    def _commit(self, contrib: dict[NodeId, tuple[int, frozenset[Contrib]]], now: float) -> list[Effect]:
        if self.lead.overlap is not None:
            return []  # update_delay 1: the previous round's Haves first (its step goes with this Commit)
        self.lead.round += 1
        self.lead.phase = Phase.COMMIT
        self.lead.haves = set()
        self.lead.commit_set = set(self.node.directory)
        out: list[Effect] = []
        self.lead.commits = {}
        self.lead.contributors = set()
        for stage, members in enumerate(self._stage_members()):
            contributors = tuple((p, len(contrib[p][1])) for p in members if contrib[p][1])
            self.lead.contributors.update(p for p, _ in contributors)
            mbs = {p: tuple(sorted(contrib[p][1])) for p, _ in contributors}
            out.append(record(RecordName.DECISION, iteration=self.lead.t, round=self.lead.round, stage=stage,
                              contributions=mbs, expected=tuple(sorted(self.lead.expected.items()))))
            msg = Commit(term=self.node.term, iteration=self.lead.t, round=self.lead.round, contributors=contributors,
                         replicas=tuple(members), step_round=self.lead.step_round)
            self.lead.commits[stage] = msg
            out += [self.node.send(p, msg) for p in members]
        return out + (self._overlap(now) if self._overlaps() else [])

    def _overlaps(self) -> bool:
        """`train.update_delay` 1: the next iteration starts now, beside this round's reduction,
        unless this is the last one, or a joiner waits (it is activated in an iteration whose
        passes run on stepped weights, holding no pending step: the boundary is synchronous)."""
        t, n = self.lead.t, self.node.train.iterations
        return bool(self.node.train.update_delay) and not (n and t + 1 >= n) and not self.lead.waiting

    def _overlap(self, now: float) -> list[Effect]:
        t = self.lead.t
        self.lead.overlap = Overlap(t, self.lead.round, self.lead.commits, set(self.lead.commit_set),
                                    set(self.lead.contributors), sum(len(v) for v in self.lead.expected.values()))
        self.lead.step_round = self.lead.round
        self.lead.commits, self.lead.commit_set, self.lead.contributors = {}, set(), set()
        return self.start_iteration(t + 1, now)

    def _overlap_check(self, now: float) -> list[Effect]:
        """Every live replica of the overlapped round holds its reduced gradient: that
        iteration is done (its step goes out with the next Commit); a Commit waiting for it goes."""
        ov = self.lead.overlap
        if ov is None or not ov.commit_set <= ov.haves:
            return []
        self.lead.overlap = None
        out: list[Effect] = [record(RecordName.ITERATION_DONE, iteration=ov.iteration, round=ov.round, expected=ov.expected)]
        if checkpoint_due(ov.iteration + 1, self.node.cfg.checkpoint_every, self.node.train.iterations):
            out.append(record(RecordName.CHECKPOINT, version=ov.iteration + 1))
        return out + self._check(now)

    def _overlap_dead(self, pid: NodeId) -> bool:
        """A member died and the overlapped round (if any) stands: it no longer waits for it.
        Whether that round is complete now."""
        ov = self.lead.overlap
        if ov is None:
            return False
        ov.haves.discard(pid)
        ov.commit_set.discard(pid)
        return ov.commit_set <= ov.haves

    def _restart(self, version: int, now: float, why: str) -> list[Effect]:
        """`train.update_delay` 1: a committed round broke after its replicas stepped past it (or
        a new leader does not know how far the rounds in flight got): every member restarts
        iteration `version` with the weights it holds (`Aggregation.on_rollback`: a replica that
        did not take the last Commit yet applies the step it held pending). The iterations given
        up are trained again; nothing of them counts."""
        self.lead.overlap = None
        self.lead.step_round = NONE
        self.lead.commits, self.lead.commit_set, self.lead.contributors = {}, set(), set()
        out: list[Effect] = [record(RecordName.ROLLBACK, lost_from=self.lead.t, version=version,
                                    lost_iterations=self.lead.t - version, restart=why)]
        out += self._broadcast(Rollback(term=self.node.term, version=version, lost_from=self.lead.t), include_self=True)
        self.lead.phase = Phase.RUN
        return out + self.start_iteration(version, now)

    def _commit_broken(self, pid: NodeId, stage: int, ov: Overlap | None = None) -> bool:
        """A death during commit forces a new round only if it was the stage's reducer, a
        contributor whose gradient the reducer may not hold yet (its Have not received), or a
        broadcast-tree parent with a child that has not said Have (it may never get the gradient).
        Butterfly: any replica of the stage while another has not said Have (module butterfly).
        `ov`: of that overlapped round instead of the current one."""
        commits, haves, contributors = (ov.commits, ov.haves, ov.contributors) if ov is not None else \
            (self.lead.commits, self.lead.haves, self.lead.contributors)
        c = commits.get(stage)
        if c is None:
            return False
        d = digest(c)
        if self.node.cfg.reduce == "butterfly":
            # every replica owns a part: a replica gone before all the others hold the reduced
            # gradient may have taken one with it (on its uplink, or not yet reduced)
            return (pid == d.reducer or pid in d.pos) and not all(
                r in haves for r in c.replicas if r != pid)
        if pid == d.reducer:
            return True
        if pid in contributors and d.reducer not in haves:
            return True
        return pid in d.pos and not set(tree_children(d, pid, self.node.cfg.reduce_fanout)) <= haves

    @handles(msgs.Have, sender=Sender.MEMBER, fence=Fence.TO_LEADER)
    def on_have(self, sender: NodeId, msg: Have, now: float) -> list[Effect]:
        ov = self.lead.overlap
        if self.node.is_leader and ov is not None and msg.round == ov.round:
            ov.haves.add(sender)
            return self._overlap_check(now)
        if not self.node.is_leader or self.lead.phase != Phase.COMMIT or msg.round != self.lead.round:
            return []
        self.lead.haves.add(sender)
        return self._check(now)

    def _step(self, now: float) -> list[Effect]:
        t = self.lead.t
        out: list[Effect] = [record(RecordName.ITERATION_DONE, iteration=t, round=self.lead.round,
                                    expected=sum(len(v) for v in self.lead.expected.values()))]
        out += [self.node.send(p, Step(term=self.node.term, iteration=t, round=self.lead.round)) for p in sorted(self.lead.commit_set)]
        self.lead.step_round = NONE  # the next iteration runs on the weights this Step makes
        if checkpoint_due(t + 1, self.node.cfg.checkpoint_every, self.node.train.iterations):
            out.append(record(RecordName.CHECKPOINT, version=t + 1))
        return out + self.start_iteration(t + 1, now)

    # ---- churn ------------------------------------------------------------------------

    def on_member_dead(self, pid: NodeId, stage: int, now: float, shard: int = NONE) -> list[Effect]:
        if not self.node.is_leader:
            return []
        self.lead.reports.pop(pid, None)
        self.lead.haves.discard(pid)
        self.lead.commit_set.discard(pid)
        out: list[Effect] = []
        ov = self.lead.overlap
        delay = self.node.train.update_delay
        if delay and self.lead.phase not in (Phase.PAUSED, Phase.FINISHED, Phase.RECOVER):
            if ov is not None and self._commit_broken(pid, stage, ov):
                # its replicas stepped to version ov.iteration (or hold that step pending)
                return self._restart(ov.iteration, now, "overlapped round broken")
            if self.lead.phase == Phase.COMMIT and self._commit_broken(pid, stage):
                return self._restart(self.lead.t, now, "round broken")
        done = self._overlap_dead(pid)
        broken = self.lead.phase == Phase.COMMIT and self._commit_broken(pid, stage)
        if stage == 0 and self.lead.phase == Phase.COMMIT and not broken:
            # its gradient is in the reduction already (the commit stands): its microbatches
            # are trained, and counted (the iteration's `expected`)
            out.append(record(RecordName.DH_LOST, node=pid, iteration=self.lead.t, started=0))
            self.lead.standing[pid] = shard
        elif stage == 0 and self.lead.phase in (Phase.RUN, Phase.COLLECT, Phase.COMMIT, Phase.RECOVER):
            dropped = self.lead.expected.pop(pid, None)
            self.lead.lost_shards.add(shard)
            out.append(record(RecordName.DH_LOST, node=pid, iteration=self.lead.t,
                              started=len(dropped) if dropped is not None else NONE))
        self.lead.pending.clear()
        if self.lead.phase in (Phase.PAUSED, Phase.FINISHED):
            return out
        if any(not m for m in self._stage_members()):
            return out + self._pause(now)
        voided = broken and self._void_standing(out)
        if broken:
            self.lead.phase = Phase.COLLECT  # agree again (new round, new reducer)
        if (stage == 0 or voided) and self.lead.phase == Phase.COLLECT and self.node.cfg.hold_batch:
            self.lead.phase = Phase.RUN  # its microbatches are dealt again first (`_deal`)
        if self.lead.phase == Phase.RECOVER:
            return out + self._recover_check(now)
        return out + (self._overlap_check(now) if done else self._check(now))

    def _void_standing(self, out: list[Effect]) -> bool:
        """The round breaks: a data holder lost earlier in it, whose gradient that round still
        counted, has no gradient in the next one (it is gone, and rounds key every tensor). Its
        microbatches are lost as if it had died before the commit (dealt again with the batch
        held; relays' parts of them void). Without this the new round planned a redo chain from
        the dead data holder, for good (faultgen seeds 143 and 342 with the butterfly: a relay
        owning a part died after a data holder left during the same commit). True if any."""
        standing, self.lead.standing = self.lead.standing, {}
        for dh, shard in sorted(standing.items()):
            dropped = self.lead.expected.pop(dh, None)
            self.lead.lost_shards.add(shard)
            out.append(record(RecordName.DH_LOST, node=dh, iteration=self.lead.t,
                              started=len(dropped) if dropped is not None else NONE))
        return bool(standing)

    def leader_tick(self, now: float) -> list[Effect]:
        if self.lead.phase == Phase.COLLECT and any(d <= now for d in self.lead.pending.values()):
            return self._plan(now)
        if self.lead.phase == Phase.ADMIT and now >= self.lead.admit_until_s:
            out: list[Effect] = [record(RecordName.ADMIT_TIMEOUT, iteration=self.lead.t, joiners=tuple(sorted(self.lead.admitting)))]
            self.lead.admitting.clear()
            return out + self._begin(self.lead.t, now)
        if self.lead.phase == Phase.PAUSED and all(self._stage_members()):
            return self._resume(now)  # every stage is served again, but a (bounded) start hold was on
        if self.lead.phase == Phase.PAUSED and now - self.lead.stalled_log_s >= STALLED_LOG_PERIOD_S:
            self.lead.stalled_log_s = now
            empty = [k for k, m in enumerate(self._stage_members()) if not m]
            if empty:
                return [log("warning", "stalled", reason=f"stage {empty[0]} has no node")]
        return []

    @handles(msgs.Ready, sender=Sender.ANYONE)
    def on_ready(self, sender: NodeId, msg: Ready, now: float) -> list[Effect]:
        if not self.node.is_leader or self.lead.reassigned.get(sender, msg.stage) != msg.stage:
            return []
        self.lead.reassigned.pop(sender, None)
        self.node.members.pending_joiners.discard(sender)
        self.node.members.last_hb[sender] = now
        if self.lead.phase == Phase.PAUSED or (self.lead.phase == Phase.RUN and msg.version == self.lead.t
                                               and self.lead.step_round == NONE):
            # (update_delay 1: not beside an overlapped round, whose pending step the joiner lacks;
            # it waits, and the next boundary is synchronous for it: `_overlaps`)
            return self._activate(sender, from_tuple(msg.peer), now, msg.version)
        if self.lead.phase == Phase.ADMIT and msg.version == self.lead.t:
            self.lead.admitting.discard(sender)
            self.lead.refetches.pop(sender, None)
            out = self._activate(sender, from_tuple(msg.peer), now)
            return out + (self._begin(self.lead.t, now) if not self.lead.admitting else [])
        self.node.members.pending_joiners.add(sender)
        self.lead.waiting.add(sender)
        self.lead.ready[sender] = (from_tuple(msg.peer), msg.version)
        return []

    def _activate(self, pid: NodeId, info: PeerInfo, now: float, version: int = NONE) -> list[Effect]:
        # a member is counted by the directory now: a pending assignment left behind would count
        # its capacity again once it dies (and hide a lost stage from the next joiner)
        self.node.members.pending_stage.pop(pid, None)
        if info.stage == 0 and info.shard >= 0 and any(
                p.stage == 0 and p.shard == info.shard for q, p in self.node.directory.items() if q != pid):
            # its shard is served already: the leader that gave it died (its successor never knew
            # of the assignment) or an operator named a shard in use. Another vacant shard, else
            # it joins again (as a relay): two data holders of one shard train its data twice
            vacant = self.node.members.vacant_shards()
            if not vacant:
                stage = bottleneck_stage(self.node.members.utilisation())
                self.lead.waiting.discard(pid)
                self.lead.reassigned[pid] = stage
                return [record(RecordName.JOINER_REASSIGNED, node=pid, stage=stage),
                        self.node.send(pid, Refetch(term=self.node.term, iteration=self.lead.t, stage=stage))]
            info = replace(info, shard=vacant[0])
        if self.lead.phase == Phase.PAUSED and version != NONE and 0 <= info.stage < self.node.S \
                and not self._stage_members()[info.stage]:
            # it restores a lost stage: the swarm can roll back no later than the state it holds
            # (the stage's newest checkpoint may never have been written: its last replica died
            # after the step, before the checkpoint, e.g. while exporting its state to a joiner)
            self.lead.restored[info.stage] = min(self.lead.restored.get(info.stage, version), version)
        self.node.members._dir_set(info)
        out: list[Effect] = [record(RecordName.JOIN, node=pid, stage=info.stage, iteration=self.lead.t)]
        up = MemberUp(term=self.node.term, peer=to_tuple(info))
        out += [self.node.send(p, up) for p in sorted(self.node.directory) if p not in (pid, self.node.me.id)]
        # A data holder activated while the others train (it holds version t) takes part in
        # iteration t at once: the leader waits for its report. It trains its own shard at t only
        # if no one else may hold any of it: not with the batch held (the shard was dealt to the
        # others at t's start), nor when its last holder died during t (relays may hold
        # contributions of that holder's microbatches of it); then it reports with none.
        start = self.lead.t if info.stage == 0 and self.lead.phase == Phase.RUN else NONE
        own = start != NONE and not self.node.cfg.hold_batch and info.shard not in self.lead.lost_shards
        if pid != self.node.me.id:
            out.append(self.node.send(pid, replace(up, start=start, own=own)))
        # Members activated between this joiner's Welcome and now were announced before it was a
        # member, so it never heard of them (e.g. the relay a data holder should route to).
        listed = self.node.members.welcomed_with.pop(pid, frozenset(self.node.directory))
        out += [self.node.send(pid, MemberUp(term=self.node.term, peer=to_tuple(self.node.directory[q])))
                for q in sorted(self.node.directory) if q not in listed and q not in (pid, self.node.me.id)]
        out += self.node.members._peer_up(info, now)
        if self.lead.phase == Phase.PAUSED and all(self._stage_members()):
            out += self._resume(now)
        return out

    def _resume(self, now: float) -> list[Effect]:
        # A fresh or resumed swarm (nothing trained since the start) stays paused until every
        # initial node is a member, so all of them train from its first iteration (equivalence
        # with the reference trainer, and with the uninterrupted run).
        # The hold is bounded: a start member that died while starting delays the first
        # iteration by at most `partition_timeout_s` (then the swarm starts without it).
        node = self.node
        first = node.start_version
        fresh = node.version == first and self.lead.lost_from <= first
        if fresh and len(node.directory) < node.start_members and now - self.lead.started_s < node.cfg.partition_timeout_s:
            return []
        ckpt = self.lead.lost_from - self.lead.lost_from % self.node.cfg.checkpoint_every
        if self.lead.restored:  # the oldest state a restored stage holds bounds the rollback
            held = min(self.lead.restored.values())
            ckpt = min(ckpt, held - held % self.node.cfg.checkpoint_every)
            self.lead.restored.clear()
        out: list[Effect] = [record(RecordName.ROLLBACK, lost_from=self.lead.lost_from, version=ckpt,
                                    lost_iterations=self.lead.lost_from - ckpt)]
        out += self._broadcast(Rollback(term=self.node.term, version=ckpt, lost_from=self.lead.lost_from), include_self=True)
        self.lead.phase = Phase.RUN
        self.lead.step_round = NONE  # the first iteration after a rollback runs on the weights loaded
        return out + self.start_iteration(ckpt, now)
