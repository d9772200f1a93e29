"""The leader's side of the iteration barrier: start, collect, plan, commit, step, pause.

Owns: `LeaderMixin`, what the lowest-id live data holder does in addition to being a data
holder: start iterations, wait for every live data holder's report, collect every replica's
contributions, run `aggregation.plan_redo` (resets and redo chains) until every expected
microbatch is covered exactly once at every stage, then commit (two phases: Have, then Step).
It also pauses training when a whole stage is lost and resumes from the last checkpoint once a
node has taken the stage over, activates joiners at matching versions, and takes over from a
crashed leader by re-collecting every node's state.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from gwtf.protocol.aggregation import Contrib, digest, plan_redo, tree_children
from gwtf.protocol.base import Message, NodeId, log
from gwtf.protocol.ledger import NONE, CoreState, Effect
from gwtf.protocol.membership import from_tuple, to_tuple
from gwtf.protocol.messages import (
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

ROUND_GAP = 1000  # round numbers a crashed leader may have used unseen
STALLED_LOG_PERIOD_S = 5.0  # a paused leader repeats why it is stalled this often
CHAIN_DEADLINE_FACTOR = 6.0  # a redo chain not covered after this x ack deadline is planned again


class LeaderMixin(CoreState):
    """Leader behaviour (see the module docstring); inert unless `is_leader`."""

    is_leader: bool = False

    def leader_init(self, now: float, recovering: bool) -> list[Effect]:
        self.is_leader = True
        self.L_t = self.iteration
        self.L_phase = "recover" if recovering else "run"
        self.L_reports: dict[NodeId, Report] = {}
        self.L_expected: dict[NodeId, tuple[int, ...]] = {}
        # a new leader's rounds must not collide with commits the old one may have sent
        seen = max(getattr(self, "have_round", NONE), getattr(getattr(self, "commit", None), "round", NONE))
        self.L_round = max(getattr(self, "L_round", 0), seen) + (ROUND_GAP if recovering else 0)
        self.L_haves: set[NodeId] = set()
        self.L_commit_set: set[NodeId] = set()
        self.L_pending: dict[Contrib, float] = {}
        self.L_waiting_joiners: set[NodeId] = set()
        self.L_reassigned: set[NodeId] = set()  # joiners told to join again for a lost stage
        self.L_ready: dict[NodeId, PeerInfo] = {}  # waiting joiners as their Ready described them
        self.L_lost_from = NONE
        self.L_commits: dict[int, Commit] = {}  # stage -> the Commit of the current round
        self.L_contributors: set[NodeId] = set()
        self.last_hb = {pid: now for pid in self.directory if pid != self.me.id}  # type: ignore[misc]
        if recovering:
            return self._broadcast(Collect(term=self.term, iteration=self.L_t, leader=self.me.id), include_self=True)
        return self.start_iteration(self.L_t, now)

    def become_leader(self, now: float) -> list[Effect]:
        return [record("leader_takeover", node=self.me.id, iteration=self.iteration)] + \
            self.leader_init(now, recovering=True)

    def _broadcast(self, msg: Message, include_self: bool = False) -> list[Effect]:
        return [self.send(p, msg) for p in sorted(self.directory) if include_self or p != self.me.id]

    def _stage_members(self) -> list[list[NodeId]]:
        members: list[list[NodeId]] = [[] for _ in range(self.S)]
        for pid in sorted(self.directory):
            members[self.directory[pid].stage].append(pid)
        return members

    # ---- iteration lifecycle ----------------------------------------------------------

    def start_iteration(self, t: int, now: float) -> list[Effect]:
        if self.train.iterations and t >= self.train.iterations:
            self.L_phase = "finished"
            return [record("training_done", iterations=t)]
        self.L_t = t
        self.L_reports, self.L_expected, self.L_pending = {}, {}, {}
        self.L_haves, self.L_commit_set = set(), set()
        out: list[Effect] = [record("iter_start", iteration=t, members=len(self.directory))]
        for j in sorted(self.L_waiting_joiners):
            out.append(self.send(j, Refetch(term=self.term, iteration=t, stage=NONE)))
        self.L_waiting_joiners.clear()
        if any(not m for m in self._stage_members()):
            return out + self._pause(now)
        self.L_phase = "run"
        out += self._broadcast(IterStart(term=self.term, iteration=t, leader=self.me.id), include_self=True)
        every = self.policy.rebalance_every
        return out + (self.rebalance(now) if every > 0 and t % every == 0 else [])

    def rebalance(self, now: float) -> list[Effect]:
        """Policy hook (`Policy.rebalance_every`): baselines move replicas between stages here."""
        return []

    def _pause(self, now: float) -> list[Effect]:
        if self.L_phase != "paused":
            self.L_phase = "paused"
            self.L_lost_from = self.L_t
            self.L_stalled_log_s = now
            empty = [k for k, m in enumerate(self._stage_members()) if not m]
            out: list[Effect] = [record("stage_lost", stages=tuple(empty), iteration=self.L_t),
                                 log("warning", "stalled", reason=f"stage {empty[0]} has no node")]
            out += self._reassign_joiners(empty)
            # joiners that were ready but waiting for the next iteration are members now (a
            # paused swarm activates every Ready joiner; the rollback reloads their state)
            horizon = now - self.cfg.evict_after_s
            for j in sorted(self.L_waiting_joiners):
                info = self.L_ready.get(j)
                heard = self.last_hb.get(j)  # type: ignore[attr-defined]
                if info is not None and heard is not None and heard >= horizon and self.L_phase == "paused" \
                        and j not in self.directory:
                    self.L_waiting_joiners.discard(j)
                    self.pending_joiners.discard(j)  # type: ignore[attr-defined]
                    out += self._activate(j, info, now)
            return out
        return []

    def _reassign_joiners(self, empty: list[int]) -> list[Effect]:
        """A stage was lost while joiners were pending at stages that still have replicas: send
        one per lost stage that no pending joiner takes over to join again (it is then assigned
        the lost stage, the bottleneck), instead of leaving the swarm paused with them waiting."""
        pending = {j: st for j, (st, _) in self.pending_stage.items()  # type: ignore[attr-defined]
                   if j not in self.directory}
        spare = sorted(j for j, st in pending.items() if st not in empty)
        out: list[Effect] = []
        for stage in empty:
            if stage == 0 or stage in pending.values() or not spare:
                continue
            j = spare.pop(0)
            self.L_waiting_joiners.discard(j)
            self.L_reassigned.add(j)  # its Ready for the old stage, if in flight, is void
            out += [record("joiner_reassigned", node=j, stage=stage),
                    self.send(j, Refetch(term=self.term, iteration=self.L_t, stage=stage))]
        return out

    def on_report(self, sender: NodeId, msg: Report, now: float) -> list[Effect]:
        if not self.is_leader or sender not in self.directory:
            return []
        if self.L_phase == "recover":
            self.L_reports[sender] = msg
            return self._recover_check(now)
        if msg.iteration != self.L_t or self.L_phase in ("paused", "finished"):
            return []
        self.L_reports[sender] = msg
        if msg.dh_done and self.directory[sender].stage == 0:
            self.L_expected[sender] = msg.dh_completed
        return self._check(now)

    def _recover_check(self, now: float) -> list[Effect]:
        if not set(self.directory) <= set(self.L_reports):
            return []
        reports = self.L_reports
        top = max(r.version for r in reports.values())
        out: list[Effect] = []
        for pid, r in sorted(reports.items()):
            if r.version < top:  # the old leader died while sending Step: finish it
                out.append(self.send(pid, Step(term=self.term, iteration=r.version, round=r.have_round)))
        self.L_t = top
        self.L_phase = "run"
        self.L_reports, self.L_expected, self.L_pending = {}, {}, {}
        out += self._broadcast(IterStart(term=self.term, iteration=top, leader=self.me.id), include_self=True)
        for pid, r in sorted(reports.items()):
            if r.version == top and r.iteration == top:
                out += self.on_report(pid, r, now)
        return out

    def _check(self, now: float) -> list[Effect]:
        if self.L_phase == "run":
            dhs = self.data_holders()  # type: ignore[attr-defined]
            if len(self.L_expected) < len(dhs) or not dhs <= self.L_expected.keys():
                return []
            self.L_phase = "collect"
            out: list[Effect] = [record("collect", iteration=self.L_t)]
            out += [self.send(p, Collect(term=self.term, iteration=self.L_t, leader=self.me.id))
                    for p in sorted(self.directory) if p not in dhs]
            return out + self._check(now)
        if self.L_phase == "collect":
            return self._plan(now)
        if self.L_phase == "commit" and self.L_commit_set <= self.L_haves:
            return self._step(now)
        return []

    def _plan(self, now: float) -> list[Effect]:
        # (the length test first: this runs on every Report, O(1) until the last ones arrive)
        if len(self.L_reports) < len(self.directory) or not self.directory.keys() <= self.L_reports.keys():
            return []
        contrib = {p: (r.stage, frozenset(r.contributed)) for p, r in self.L_reports.items() if p in self.directory}
        plan = plan_redo(self.S, self.L_expected, contrib)
        out: list[Effect] = []
        for victim in plan.resets:
            self.L_reports.pop(victim, None)
            out.append(self.send(victim, Reset(term=self.term, iteration=self.L_t)))
        if plan.resets:
            return out + [record("agg_reset", iteration=self.L_t, nodes=plan.resets)]
        for ch in plan.chains:
            deadline = self.L_pending.get(ch.mb)
            if deadline is not None and deadline > now:
                continue
            self.L_pending[ch.mb] = now + CHAIN_DEADLINE_FACTOR * self.ack_deadline_s(ch.start_node, 0)
            mb = (ch.mb[0], self.L_t, ch.mb[1])
            out.append(record("redo", node=self.me.id, mb=mb, start=ch.start, until=ch.until, mode="aggregation"))
            out.append(self.send(ch.start_node, Redo(mb=mb, path=ch.path, legs=(), start=ch.start, until=ch.until,
                                                     holder=ch.holder, agg=True)))
        if plan.chains:
            return out
        return out + self._commit(contrib, now)

    def _commit(self, contrib: dict[NodeId, tuple[int, frozenset[Contrib]]], now: float) -> list[Effect]:
        self.L_round += 1
        self.L_phase = "commit"
        self.L_haves = set()
        self.L_commit_set = set(self.directory)
        out: list[Effect] = []
        self.L_commits = {}
        self.L_contributors = set()
        for stage, members in enumerate(self._stage_members()):
            contributors = tuple((p, len(contrib[p][1])) for p in members if contrib[p][1])
            self.L_contributors.update(p for p, _ in contributors)
            mbs = {p: tuple(sorted(contrib[p][1])) for p, _ in contributors}
            out.append(record("decision", iteration=self.L_t, round=self.L_round, stage=stage,
                              contributions=mbs, expected=tuple(sorted(self.L_expected.items()))))
            msg = Commit(term=self.term, iteration=self.L_t, round=self.L_round, contributors=contributors, replicas=tuple(members))
            self.L_commits[stage] = msg
            out += [self.send(p, msg) for p in members]
        return out

    def _commit_broken(self, pid: NodeId, stage: int) -> bool:
        """A death during commit forces a new round only if it was the stage's reducer, a
        contributor whose gradient the reducer may not hold yet (its Have not received), or a
        broadcast-tree parent with a child that has not said Have (it may never get the gradient)."""
        c = self.L_commits.get(stage)
        if c is None:
            return False
        d = digest(c)
        if pid == d.reducer:
            return True
        if pid in self.L_contributors and d.reducer not in self.L_haves:
            return True
        return pid in d.pos and not set(tree_children(d, pid, self.cfg.reduce_fanout)) <= self.L_haves

    def on_have(self, sender: NodeId, msg: Have, now: float) -> list[Effect]:
        if not self.is_leader or self.L_phase != "commit" or msg.round != self.L_round:
            return []
        self.L_haves.add(sender)
        return self._check(now)

    def _step(self, now: float) -> list[Effect]:
        t = self.L_t
        out: list[Effect] = [record("iteration_done", iteration=t, round=self.L_round,
                                    expected=sum(len(v) for v in self.L_expected.values()))]
        out += [self.send(p, Step(term=self.term, iteration=t, round=self.L_round)) for p in sorted(self.L_commit_set)]
        if (t + 1) % self.cfg.checkpoint_every == 0:
            out.append(record("checkpoint", version=t + 1))
        return out + self.start_iteration(t + 1, now)

    # ---- churn ------------------------------------------------------------------------

    def on_member_dead(self, pid: NodeId, stage: int, now: float) -> list[Effect]:
        if not self.is_leader:
            return []
        self.L_reports.pop(pid, None)
        self.L_haves.discard(pid)
        self.L_commit_set.discard(pid)
        out: list[Effect] = []
        if stage == 0 and self.L_phase in ("run", "collect", "commit", "recover"):
            dropped = self.L_expected.pop(pid, None)
            out.append(record("dh_lost", node=pid, iteration=self.L_t,
                              started=len(dropped) if dropped is not None else NONE))
        self.L_pending.clear()
        if self.L_phase in ("paused", "finished"):
            return out
        if any(not m for m in self._stage_members()):
            return out + self._pause(now)
        if self.L_phase == "commit" and self._commit_broken(pid, stage):
            self.L_phase = "collect"  # agree again (new round, new reducer)
        if self.L_phase == "recover":
            return out + self._recover_check(now)
        return out + self._check(now)

    def leader_tick(self, now: float) -> list[Effect]:
        if self.L_phase == "collect" and any(d <= now for d in self.L_pending.values()):
            return self._plan(now)
        if self.L_phase == "paused" and now - getattr(self, "L_stalled_log_s", now) >= STALLED_LOG_PERIOD_S:
            self.L_stalled_log_s = now
            empty = [k for k, m in enumerate(self._stage_members()) if not m]
            if empty:
                return [log("warning", "stalled", reason=f"stage {empty[0]} has no node")]
        return []

    def on_ready(self, sender: NodeId, msg: Ready, now: float) -> list[Effect]:
        if not self.is_leader or sender in self.L_reassigned:
            return []
        self.pending_joiners.discard(sender)  # type: ignore[attr-defined]
        self.last_hb[sender] = now  # type: ignore[attr-defined]
        if self.L_phase == "paused" or (self.L_phase == "run" and msg.version == self.L_t):
            return self._activate(sender, from_tuple(msg.peer), now)
        self.pending_joiners.add(sender)  # type: ignore[attr-defined]
        self.L_waiting_joiners.add(sender)
        self.L_ready[sender] = from_tuple(msg.peer)
        return []

    def _activate(self, pid: NodeId, info: PeerInfo, now: float) -> list[Effect]:
        self._dir_set(info)  # type: ignore[attr-defined]
        out: list[Effect] = [record("join", node=pid, stage=info.stage, iteration=self.L_t)]
        out += self._broadcast(MemberUp(term=self.term, peer=to_tuple(info)), include_self=False)
        # Members activated between this joiner's Welcome and now were announced before it was a
        # member, so it never heard of them (e.g. the relay a data holder should route to).
        listed = self.welcomed_with.pop(pid, frozenset(self.directory))  # type: ignore[attr-defined]
        out += [self.send(pid, MemberUp(term=self.term, peer=to_tuple(self.directory[q])))
                for q in sorted(self.directory) if q not in listed and q not in (pid, self.me.id)]
        out += self._peer_up(info, now)  # type: ignore[attr-defined]
        if self.L_phase == "paused" and all(self._stage_members()):
            out += self._resume(now)
        return out

    def _resume(self, now: float) -> list[Effect]:
        ckpt = self.L_lost_from - self.L_lost_from % self.cfg.checkpoint_every
        out: list[Effect] = [record("rollback", lost_from=self.L_lost_from, version=ckpt,
                                    lost_iterations=self.L_lost_from - ckpt)]
        out += self._broadcast(Rollback(term=self.term, version=ckpt, lost_from=self.L_lost_from), include_self=True)
        self.L_phase = "run"
        return out + self.start_iteration(ckpt, now)
