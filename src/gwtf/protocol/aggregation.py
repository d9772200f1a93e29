"""Iteration barrier and aggregation agreement: the leader's planner and both sides' messages.

Owns: `plan_redo` (pure: from the data holders' started microbatches and every replica's
reported contributions, decide which replicas to reset and which redo chains to start; the
leader side, `leader.Coordinator`, runs it: IterStart -> wait for every live DH -> Collect ->
plan -> Reset/Redo until every expected microbatch is covered exactly once at every stage ->
Commit -> Have from every replica -> Step -> next IterStart), and `Aggregation` (`node.agg`),
the replica side (Report, GradShare, Have, step).

Decision (ours, docs/protocol.md): the control plane has a coordinator, the lowest-id live data
holder ("leader"); routing and the data plane stay decentralized. Agreement is two-phase so
replicas never diverge: nobody steps before every replica holds every contributor's gradient of
the same round; a leader crash at any point is recovered by the next leader re-collecting state.

Exactly once: a replica's accumulated gradient is all-or-nothing. A microbatch covered twice at
a stage (a false suspicion let two replicas back-propagate it) makes the leader reset one
replica's gradient and redo its other microbatches; a microbatch covered nowhere (its replica
crashed) is redone by a chain from the neighbours' caches. Microbatches of a crashed data holder
are served again by the live ones (`protocol.hold_batch`: the leader's `Deal`), and a replica
holding a part of one is reset (`plan_redo(void=True)`); with the batch not held they are
counted as dropped, and any relay contributions they made stay at most once.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gwtf.protocol import messages as msgs
from gwtf.protocol.base import IdentityMemo, NodeId, log
from gwtf.protocol.butterfly import Butterfly
from gwtf.protocol.dispatch import Fence, Sender, handles
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.ledger import Effect, checkpoint_due
from gwtf.protocol.membership import STATE_DEADLINE_FACTOR
from gwtf.protocol.messages import (
    NONE,
    Collect,
    Commit,
    Compute,
    Deal,
    FreeIteration,
    GradShare,
    Have,
    IterStart,
    MbId,
    Report,
    Reset,
    Rollback,
    Step,
    record,
)

if TYPE_CHECKING:
    from gwtf.protocol.core import NodeCore

Contrib = tuple[str, int]  # (origin, index) within one iteration


@dataclass(frozen=True, slots=True)
class CommitDigest:
    """What every replica reads from a `Commit`, computed once per message object."""

    counts: dict[NodeId, int]  # contributor -> microbatches (as `dict(contributors)`)
    positive: tuple[NodeId, ...]  # contributors with a count, in order
    positive_set: frozenset[NodeId]
    total: int
    reducer: NodeId  # the lowest-id replica
    order: tuple[NodeId, ...]  # the other replicas, sorted: the broadcast tree's nodes in order
    pos: dict[NodeId, int]  # replica -> its index in `order`


def _digest(c: Commit) -> CommitDigest:
    positive = tuple(n for n, k in c.contributors if k > 0)
    reducer = min(c.replicas)
    order = tuple(sorted(r for r in c.replicas if r != reducer))
    return CommitDigest(dict(c.contributors), positive, frozenset(positive),
                        sum(k for _, k in c.contributors), reducer, order, {r: i for i, r in enumerate(order)})


digest: IdentityMemo[Commit, CommitDigest] = IdentityMemo(_digest, limit=1024)
"""`CommitDigest` of a Commit, once per message object. In a simulation every replica of a stage
holds the same Commit: one O(replicas) pass per stage instead of several per replica, and per
share at the reducer (that was O(replicas^2) per iteration)."""


def tree_children(d: CommitDigest, node: NodeId, fanout: int) -> tuple[NodeId, ...]:
    """Who `node` passes the reduced gradient on to. `fanout` 0: the reducer sends it to every
    replica itself. `fanout` k >= 2: a k-ary tree over `d.order` rooted at the reducer (the
    reducer feeds order[0:k]; order[j] feeds order[(j+1)k:(j+2)k]), so no uplink carries more
    than k copies and the last replica has it after ~log_k(replicas) hops."""
    if fanout <= 0:
        return d.order if node == d.reducer else ()
    i = 0 if node == d.reducer else d.pos[node] + 1
    return d.order[i * fanout:(i + 1) * fanout]


def tree_parent(d: CommitDigest, node: NodeId, fanout: int) -> NodeId:
    """Whom a replica (not the reducer) receives the reduced gradient from (see `tree_children`)."""
    j = d.pos[node]
    return d.reducer if fanout <= 0 or j < fanout else d.order[j // fanout - 1]


@dataclass(frozen=True, slots=True)
class Chain:
    mb: Contrib
    start_node: NodeId
    start: int  # first stage to redo (0: the DH redoes its embedding backward)
    until: int  # holder's stage (S: the data holder's cached loss gradient)
    holder: NodeId
    path: tuple[NodeId, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    resets: tuple[NodeId, ...]
    chains: tuple[Chain, ...]
    missing: int  # microbatch-stage pairs not covered yet


def plan_redo(stages: int, expected: Mapping[NodeId, tuple[int, ...]],
              contributions: Mapping[NodeId, tuple[int, frozenset[Contrib]]], void: bool = False) -> Plan:
    """Pure planner. `contributions`: live replica -> (stage, contributed microbatches).
    `void`: a microbatch of a data holder not in `expected` (it died) counts nowhere: its data
    is served again by another data holder (`protocol.hold_batch`), so a replica whose gradient
    holds one is reset (and its other microbatches redone).

    Invariant it establishes once its resets and chains are done: every expected microbatch is
    covered by exactly one live replica at every stage (and, with `void`, no other).
    """
    contrib = {n: set(c) for n, (_, c) in contributions.items()}
    stage_of = {n: s for n, (s, _) in contributions.items()}
    resets: list[NodeId] = []
    if void:
        for n in sorted(contrib):
            if any(mb[0] not in expected for mb in contrib[n]):
                resets.append(n)
                contrib[n] = set()
    while True:
        cover: list[dict[Contrib, list[NodeId]]] = [{} for _ in range(stages)]
        for n in sorted(contrib):
            for mb in contrib[n]:
                cover[stage_of[n]].setdefault(mb, []).append(n)
        dups: dict[NodeId, int] = {}
        for per_stage in cover:
            for nodes in per_stage.values():
                if len(nodes) > 1:
                    for n in nodes:
                        dups[n] = dups.get(n, 0) + 1
        if not dups:
            break
        victim = min(dups, key=lambda n: (-dups[n], len(contrib[n]), [-ord(c) for c in n]))
        resets.append(victim)
        contrib[victim] = set()
    chains: list[Chain] = []
    missing = 0
    for dh in sorted(expected):
        for idx in expected[dh]:
            mb = (dh, idx)
            cpath = [cover[k].get(mb, [""])[0] for k in range(stages)]
            k = 0
            while k < stages:
                if cpath[k]:
                    k += 1
                    continue
                j = k
                while k < stages and not cpath[k]:
                    k += 1
                missing += k - j
                start_node = dh if j <= 1 else cpath[j - 1]
                holder = dh if k == stages else cpath[k]
                chains.append(Chain(mb, start_node, j, k, holder, tuple(cpath)))
    return Plan(tuple(resets), tuple(chains), missing)


class Aggregation:
    """The replica side of the iteration barrier (see the module docstring), one per node: it
    owns the barrier's per-iteration state (the Commit taken, gradient shares, the round held);
    the butterfly all-reduce is its `bf` (`protocol.reduce = "butterfly"`); the rest of the node
    it reaches through `node`."""

    def __init__(self, node: NodeCore) -> None:
        self.node = node
        self.started_iter = NONE  # the iteration whose IterStart was taken
        self.dh_reported_done = False  # a data holder reported its microbatches done
        self.reported = False  # this iteration's Report is sent
        self.collect_due = NONE  # a Collect for this iteration came before its IterStart
        self.commit: Commit | None = None  # the leader's last Commit for this iteration
        self.shares: dict[int, set[NodeId]] = {}  # round -> senders of the gradient shares held
        self.have_round = NONE  # the round whose reduced gradient this replica holds
        self.need: set[NodeId] = set()  # contributors whose gradient we still wait for
        self.need_count = 0
        self.reducer: NodeId = ""  # the stage replica that sums the gradients of the committed round
        self.own_exported = NONE  # round whose own gradient export finished
        self.copies: dict[int, int] = {}  # a data holder: relay stage -> newest checkpoint copy stored
        self.ending: tuple[int, set[int]] | None = None  # the run ended at version v; stages whose copy of v is owed
        # train.update_delay 1: an IterStart that came before the Commit it follows (`IterStart.after`)
        self.held_start: tuple[NodeId, IterStart] | None = None
        self.bf = Butterfly(self)

    def forget_rounds(self) -> None:
        """No iteration started and no round held (a rollback; a node that joins, or joins
        again at another stage: what it held of its old rounds is void, and an IterStart it took
        there must not make it skip the same iteration number here)."""
        self.started_iter = NONE
        self.held_start = None
        self._drop_round()

    def _drop_round(self) -> None:
        """Hold no Commit, gradient share or reduced gradient of any round."""
        self.commit = None
        self.shares = {}
        self.bf.rparts = {}
        self.have_round = NONE

    # ---- replica side ------------------------------------------------------------------

    @handles(msgs.IterStart, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_iter_start(self, sender: NodeId, msg: IterStart, now: float, own: bool | None = None) -> list[Effect]:
        """`own`: whether a data holder trains its own shard (None: unless `msg.extra` deals it to
        the others; a data holder activated mid-iteration is told, `MemberUp.own`)."""
        self.node.leader = msg.leader
        self.node.members.last_leader_s = now
        if not self.node.active or self.started_iter == msg.iteration:
            return []
        overlapped = msg.after != NONE
        if overlapped and (self.commit is None or self.commit.round != msg.after) \
                and msg.iteration == self.node.iteration + 1:
            # update_delay 1: this iteration's passes start only after this replica took the
            # previous iteration's Commit (exported that gradient, applied the step before it)
            self.held_start = (sender, msg)
            return []
        self.held_start = None
        self.started_iter = msg.iteration
        self.dh_reported_done = False
        if msg.iteration != self.node.iteration:
            self.node.plane.clear_iteration()
            if not overlapped:
                # (a joiner activated during this iteration sees its first IterStart for it only
                # from a new leader's recovery; a gradient share of the new round that came first
                # must survive it: faultgen seed 501556 waited for that share for good)
                self._drop_round()
            # overlapped: the previous iteration's round goes on reducing beside these passes
        self.node.iteration = msg.iteration
        self.reported = False
        out: list[Effect] = [record(RecordName.ITER_SEEN, node=self.node.me.id, iteration=msg.iteration)]
        if self.node.me.stage == 0:
            out += self.node.plane.dh_start_iteration(msg.extra, now, own)
        pending, self.node.plane.pending_fwd = self.node.plane.pending_fwd, []
        for s, m in pending:
            out += self.node.plane.on_forward(s, m, now)
        if self.collect_due == msg.iteration:
            self.collect_due = NONE
            self.reported = True
            out.append(self.node.send(self.node.leader, self._report()))
        return out

    def _report(self, dh_done: bool = False) -> Report:
        mine = tuple(sorted((mb[0], mb[2]) for mb in self.node.plane.contributed if mb[1] == self.node.iteration))
        started = tuple(range(self.node.plane.dh_started)) if self.node.me.stage == 0 else ()
        done = self.node.me.stage == 0 and (self.dh_reported_done or dh_done)
        return Report(term=self.node.term, iteration=self.node.iteration, version=self.node.version, stage=self.node.me.stage, contributed=mine,
                      dh_done=done, dh_completed=started if done else (), have_round=self.have_round,
                      dh_data=tuple(self.node.plane.dh_data) if done else ())

    @handles(msgs.Deal, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_deal(self, sender: NodeId, msg: Deal, now: float) -> list[Effect]:
        """Serve `msg.items` too (a crashed data holder's microbatches, dealt again): we are not
        done until they are; the leader waits for the report that names them."""
        if not self.node.active or self.node.me.stage != 0 or msg.iteration != self.node.iteration \
                or self.started_iter != msg.iteration:
            return []
        if not self.node.plane.dh_take(msg.items):
            # all taken already (a resend): say where we are, the leader may have missed it
            return [self.node.send(sender, self._report())] if self.dh_reported_done else []
        self.dh_reported_done = False
        return [record(RecordName.DEAL_TAKEN, node=self.node.me.id, iteration=msg.iteration, items=len(msg.items))] + \
            self.node.plane.dh_progress(now)

    @handles(msgs.Collect, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_collect(self, sender: NodeId, msg: Collect, now: float) -> list[Effect]:
        self.node.leader = msg.leader
        self.node.members.last_leader_s = now
        if not self.node.active:
            return []
        if msg.iteration > self.node.iteration:
            # IterStart not seen yet (resent after a cut link, it can arrive after this Collect):
            # this report is for our old iteration; report again once the new one starts
            self.collect_due = msg.iteration
        self.reported = True
        return [self.node.send(sender, self._report())]

    def dh_done(self, now: float) -> list[Effect]:
        self.dh_reported_done = True
        self.reported = True
        return [self.node.send(self.node.leader, self._report(dh_done=True))] if self.node.leader else []

    def after_contribution(self, now: float) -> list[Effect]:
        if self.reported and self.node.leader:
            return [self.node.send(self.node.leader, self._report())]
        return []

    @handles(msgs.Reset, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_reset(self, sender: NodeId, msg: Reset, now: float) -> list[Effect]:
        if msg.iteration != self.node.iteration:
            return []
        self.node.plane.contributed.clear()
        reset = self._reset_grad()
        return [record(RecordName.RESET, node=self.node.me.id, stage=self.node.me.stage, iteration=msg.iteration),
                reset, self.node.send(sender, self._report())]

    def _reset_grad(self) -> Compute:
        """Zero this replica's accumulated gradient (after the computes already queued)."""
        return Compute(self.node.job(ComputeKind.RESET_GRAD, None), ComputeKind.RESET_GRAD, self.node.me.stage, None, 0.0)

    @handles(msgs.Commit, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_commit(self, sender: NodeId, msg: Commit, now: float) -> list[Effect]:
        """Gather-reduce-broadcast: contributors send their gradient to the stage's reducer (the
        lowest-id replica), which sums them in sorted replica order and sends the mean back
        (itself, or down a tree with `protocol.reduce_fanout`), so every replica applies the
        bit-identical gradient with O(replicas) messages."""
        if msg.iteration != self.node.iteration or not self.node.active:
            return []
        if self.commit is not None and msg.round < self.commit.round:
            # a resend of an older round (after a cut link) overtaken by the newer one: taking it
            # would leave us holding a round the leader no longer waits for (faultgen seed 20100)
            return [log("info", "old_commit_ignored", round=msg.round, holding=self.commit.round)]
        if self.node.train.update_delay:
            return self._delayed_commit(msg, now)
        return self._take_commit(msg, now)

    def _delayed_commit(self, msg: Commit, now: float) -> list[Effect]:
        """`train.update_delay` 1: take this round as `_take_commit` does (its gradient is
        exported first: computes are FIFO), then apply the step the previous iteration's round
        left pending (`msg.step_round`), or with none pending zero the accumulated gradient,
        so the next iteration's passes, which may start at once, accumulate a gradient of their
        own while this round reduces; then an IterStart held for this Commit starts."""
        prev = self.commit
        if prev is not None and prev.round == msg.round:
            return []  # a resend of the round we are reducing: its step is applied already
        node = self.node
        pending = msg.step_round != NONE
        rkey = self._rkey(prev) if prev is not None else ()
        ok = pending and prev is not None and prev.round == msg.step_round and self.have_round == prev.round \
            and node.version == prev.iteration
        out = self._take_commit(msg, now)
        self.shares = {r: got for r, got in self.shares.items() if r >= msg.round}
        self.bf.rparts = {r: got for r, got in self.bf.rparts.items() if r >= msg.round}
        if ok:
            assert prev is not None
            out += self._step_effects(prev, rkey)
        elif pending:
            out.append(log("error", "step_without_gradients", iteration=msg.iteration - 1, round=msg.step_round))
        else:
            out.append(self._reset_grad())
        # nothing of this iteration is redone after its Commit (a broken round restarts it): its
        # ledger and activations go now, not with its step, so two iterations' are never held
        node.plane.clear_iteration()
        out.append(FreeIteration(msg.iteration, data_only=True))
        held = self.held_start
        if held is not None and held[1].after == msg.round:
            out += self.on_iter_start(held[0], held[1], now)
        return out

    def _take_commit(self, msg: Commit, now: float) -> list[Effect]:
        if self.node.cfg.reduce == "butterfly":
            if self.commit is not None and self.commit.round == msg.round:
                return []  # a resend of the round we are reducing
            self.commit, self.have_round = msg, NONE
            return self.bf.bf_commit(msg, now)
        self.commit = msg
        self.have_round = NONE
        d = digest(msg)
        self.reducer = d.reducer
        if self.reducer == self.node.me.id:
            self.need = {n for n in d.positive if n != self.node.me.id}
        else:
            self.need = {tree_parent(d, self.node.me.id, self.node.cfg.reduce_fanout)}  # the reduced gradient
        self.need_count = len(self.need)
        out: list[Effect] = []
        if self.node.me.id in d.positive_set:
            key = ("pgrad", self.node.me.stage, msg.iteration, self.node.me.id, msg.round)
            out.append(Compute(self.node.job(ComputeKind.EXPORT_GRAD, (msg.round, key)), ComputeKind.EXPORT_GRAD,
                               self.node.me.stage, None, 0.0, (), (key,)))
        else:
            out += self._maybe_reduce(now) + self._maybe_have(now)
        return out

    def _rkey(self, c: Commit) -> tuple[object, ...]:
        return ("rgrad", self.node.me.stage, c.iteration, self.reducer, c.round)

    def _share_grads(self, rnd: int, key: tuple[object, ...], now: float) -> list[Effect]:
        c = self.commit
        if c is None or c.round != rnd:
            return []
        self.own_exported = rnd
        if self.reducer == self.node.me.id:
            return self._maybe_reduce(now)
        count = digest(c).counts.get(self.node.me.id, 0)
        size = self.node.train.stage_grad_bytes[self.node.me.stage]
        return [self.node.send_booked(self.reducer, GradShare(iteration=c.iteration, round=rnd, key=key, count=count,
                                                         size_bytes=size), now)]

    @handles(msgs.GradShare, sender=Sender.REPLICA)
    def on_grad_share(self, sender: NodeId, msg: GradShare, now: float) -> list[Effect]:
        if msg.iteration != self.node.iteration and (self.commit is None or msg.iteration != self.commit.iteration):
            return []  # (update_delay 1: the round of the iteration before goes on beside this one's passes)
        if self.node.cfg.reduce == "butterfly":
            return self.bf.bf_on_share(sender, msg, now)
        self.shares.setdefault(msg.round, set()).add(sender)
        c = self.commit
        if c is None or c.round != msg.round:
            return []
        return self._maybe_reduce(now) if self.reducer == self.node.me.id else self._maybe_have(now)

    def _maybe_reduce(self, now: float) -> list[Effect]:
        c = self.commit
        if c is None or self.reducer != self.node.me.id or self.have_round == c.round:
            return []
        d = digest(c)
        mine = d.counts.get(self.node.me.id, 0)
        if mine and self.own_exported != c.round:
            return []
        got = self.shares.get(c.round, set())
        if len(got) < self.need_count or not self.need <= got:
            return []
        keys = tuple(("pgrad", self.node.me.stage, c.iteration, n, c.round) for n in d.positive)
        total = d.total
        job = self.node.job(ComputeKind.REDUCE, c.round)
        self.have_round = NONE
        return [Compute(job, ComputeKind.REDUCE, self.node.me.stage, None, 0.0, keys, (self._rkey(c),),
                        count=total)]

    def _reduced(self, rnd: int, now: float) -> list[Effect]:
        c = self.commit
        if c is None or c.round != rnd:
            return []
        return self._have(c, now)

    def _maybe_have(self, now: float) -> list[Effect]:
        """A replica got the reduced gradient from its parent (`need`)."""
        c = self.commit
        if c is None or self.have_round == c.round or self.reducer == self.node.me.id:
            return []
        if not self.need <= self.shares.get(c.round, set()):
            return []
        return self._have(c, now)

    def _have(self, c: Commit, now: float) -> list[Effect]:
        """I hold the reduced gradient of `c`'s round: tell the leader, and pass it on to my
        children in the broadcast tree (every other replica when I am the reducer of a star)."""
        self.have_round = c.round
        d = digest(c)
        out: list[Effect] = [self.node.send(self.node.leader, Have(term=self.node.term, iteration=c.iteration, round=c.round))]
        children = tree_children(d, self.node.me.id, self.node.cfg.reduce_fanout)
        if children:
            msg = GradShare(iteration=c.iteration, round=c.round, key=self._rkey(c), count=d.total,
                            size_bytes=self.node.train.stage_grad_bytes[self.node.me.stage])
            out += [self.node.send_booked(r, msg, now) for r in children]
        return out

    @handles(msgs.Finish, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_finish(self, sender: NodeId, msg: msgs.Finish, now: float) -> list[Effect]:
        """The leader ended the run: this node's training is over too."""
        if self.node.is_leader:
            return []
        return self.end(msg.version, now)

    def end(self, version: int, now: float) -> list[Effect]:
        """The run ended at weight version `version`: `training_over` (the driver lets the
        queued computes, the last step and checkpoint among them, finish, then stops the node).
        A data holder first waits, bounded, for its copy of every relay stage's checkpoint of
        that version (`_replicate_checkpoint`: each data holder gets one of each), so the final
        weights of every stage are on the data holders' disks when the run is over."""
        if self.ending is not None:
            return []
        node = self.node
        owed: set[int] = set()
        if node.me.stage == 0 and node.cfg.checkpoint_replicate and checkpoint_due(version, node.cfg.checkpoint_every, node.train.iterations):
            owed = {k for k in range(1, node.S) if self.copies.get(k, NONE) < version}
        self.ending = (version, owed)
        if not owed:
            return self._over(now)
        size = max(node.train.stage_state_bytes)
        wait_s = max(node.members.join_deadline_s(), STATE_DEADLINE_FACTOR * max(
            (node.ack_deadline_s(p, size) for p in self._copy_senders(owed)), default=0.0))
        return [record(RecordName.FINAL_COPIES_WAIT, node=node.me.id, version=version, stages=tuple(sorted(owed)),
                       wait_s=round(wait_s, 3)), node.timer(("ending", 0), wait_s, now)]

    def _copy_senders(self, stages: set[int]) -> list[NodeId]:
        """The replicas this data holder's copies of relay `stages` come from, as far as its
        directory knows them: `_replicate_checkpoint` deals the sorted data holders round-robin
        over each stage's sorted replicas. (One pass over the directory: the deadline of every
        relay, at 1,000 data holders x 9,000 relays, was a sixth of a 10,000-node simulation.)"""
        node = self.node
        by_stage: dict[int, list[NodeId]] = {k: [] for k in stages}
        for pid, info in node.directory.items():
            replicas = by_stage.get(info.stage)
            if replicas is not None:
                replicas.append(pid)
        holders = sorted(node.data_holders())
        j = holders.index(node.me.id) if node.me.id in holders else 0
        return [sorted(ps)[j % len(ps)] for ps in by_stage.values() if ps]

    def _over(self, now: float, missing: tuple[int, ...] = ()) -> list[Effect]:
        assert self.ending is not None
        out: list[Effect] = [log("warning", "final_copies_missing", version=self.ending[0], stages=missing)] \
            if missing else []
        return out + [record(RecordName.TRAINING_OVER, node=self.node.me.id, version=self.ending[0],
                             holding=self.node.version, copies_missing=missing)]

    def copy_stored(self, stage: int, version: int, now: float) -> list[Effect]:
        """A data holder stored a relay stage's checkpoint copy (`STORE_CHECKPOINT` done)."""
        self.copies[stage] = max(self.copies.get(stage, NONE), version)
        if self.ending is None or not self.ending[1]:
            return []
        v, owed = self.ending
        if version >= v:
            owed.discard(stage)
        return [self.node.cancel(("ending", 0))] + self._over(now) if not owed else []

    def on_ending_timer(self, _: object, now: float) -> list[Effect]:
        if self.ending is None or not self.ending[1]:
            return []
        missing = tuple(sorted(self.ending[1]))
        self.ending[1].clear()
        return self._over(now, missing)

    @handles(msgs.Step, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_step(self, sender: NodeId, msg: Step, now: float) -> list[Effect]:
        if msg.iteration != self.node.iteration or self.node.version != msg.iteration:
            return []
        if self.have_round != msg.round or self.commit is None:
            return [log("error", "step_without_gradients", iteration=msg.iteration, round=msg.round)]
        self.node.plane.clear_iteration()
        return self._step_effects(self.commit, self._rkey(self.commit))

    def _step_effects(self, c: Commit, rkey: tuple[object, ...]) -> list[Effect]:
        """Apply the step of `c`'s iteration with its reduced gradient `rkey`: this node's
        weights become version iteration + 1 (later computes run after the step: FIFO per node)."""
        self.node.version = c.iteration + 1
        contributors = digest(c).positive
        job = self.node.job(ComputeKind.STEP, (c.iteration, c.round, contributors))
        return [Compute(job, ComputeKind.STEP, self.node.me.stage, None, 0.0, (rkey,), ()),
                *self._replicate_checkpoint(c, self.node.version), FreeIteration(c.iteration - 1)]

    def _replicate_checkpoint(self, c: Commit, version: int) -> list[Effect]:
        """At a checkpoint version, relay replicas send it to the data holders, which keep the
        newest checkpoint of every stage (`protocol.checkpoint_replicate`): the sorted data
        holders are dealt round-robin over the round's sorted replicas (the Commit's list, the
        same at every replica), so each data holder gets one copy and the uplinks share the
        load. Stage 0's goes the same way to `stage0_copy_holders` (a few relays) while at most
        `protocol.stage0_copies_max_dhs` data holders are live: no class of node holds the only
        copies of a stage. The export runs after the step (computes are FIFO): it holds state `version`."""
        if not self.node.cfg.checkpoint_replicate or \
                not checkpoint_due(version, self.node.cfg.checkpoint_every, self.node.train.iterations):
            return []
        replicas = sorted(c.replicas)
        if self.node.me.id not in replicas:
            return []
        mine, n = replicas.index(self.node.me.id), len(replicas)
        if self.node.me.stage == 0:
            # stage 0 is on every data holder; while few are live it also goes to relays
            # (`protocol.stage0_copies`), the data holders sharing the uplink work as above
            if n > self.node.cfg.stage0_copies_max_dhs:
                return []
            holders = self.node.members.stage0_copy_holders()[:self.node.cfg.stage0_copies]
        else:
            holders = sorted(self.node.data_holders())
        targets = tuple(d for j, d in enumerate(holders) if j % n == mine)
        if not targets:
            return []
        key = ("ckpt", self.node.me.stage, version, self.node.me.id)
        size = self.node.train.stage_state_bytes[self.node.me.stage]
        job = self.node.job(ComputeKind.EXPORT_CHECKPOINT, (targets, key, version))
        return [Compute(job, ComputeKind.EXPORT_CHECKPOINT, self.node.me.stage, None, 0.0, (), (key,), size)]

    def aggregation_compute_done(self, kind: ComputeKind, ref: Any, now: float) -> list[Effect]:
        butterfly = self.node.cfg.reduce == "butterfly"
        if kind == ComputeKind.EXPORT_GRAD:
            rnd, key = ref
            return self.bf.bf_exported(rnd, now) if butterfly else self._share_grads(rnd, key, now)
        if kind == ComputeKind.REDUCE:
            return self.bf.bf_reduced(ref, now) if butterfly else self._reduced(ref, now)
        if kind == ComputeKind.CONCAT:
            return self.bf.bf_joined(ref, now)
        if kind == ComputeKind.STEP:
            it, rnd, contributors = ref
            return [record(RecordName.STEP, node=self.node.me.id, stage=self.node.me.stage, iteration=it, round=rnd,
                           version=it + 1, contributors=contributors), FreeIteration(it)]
        return []

    @handles(msgs.Rollback, sender=Sender.LEADER, fence=Fence.FROM_LEADER)
    def on_rollback(self, sender: NodeId, msg: Rollback, now: float) -> list[Effect]:
        held = self.node.version == msg.version  # our weights are that version already (e.g. a joiner
        # that just imported it): nothing to load, and our own disk may not even hold it
        c = self.commit
        # update_delay 1: a restart at the version the last Commit steps to (its round broke
        # while the next passes ran); a replica that did not take that Commit yet holds the
        # pending step's reduced gradient (the leader sent the Commit only once all did)
        pending = self.node.train.update_delay and not held and c is not None and c.iteration == self.node.version \
            and msg.version == c.iteration + 1 and self.have_round == c.round and self.node.active
        step = self._step_effects(c, self._rkey(c)) if pending and c is not None else []
        self.node.plane.clear_iteration()
        self.node.plane.pending_fwd.clear()
        self.node.version = msg.version
        self.node.iteration = msg.version
        self.forget_rounds()  # the rolled-back iterations' rounds are void (IterStart keeps them
        # when the iteration number does not change)
        if not self.node.active:
            return []
        if step:  # (the step's reduced gradient stays until the step has run: no FreeIteration here)
            return [record(RecordName.ROLLBACK_NODE, node=self.node.me.id, version=msg.version, held=True), *step]
        if held:
            # the gradient accumulated in the iteration given up is void (a restart with the
            # weights held: nothing else resets it)
            return [record(RecordName.ROLLBACK_NODE, node=self.node.me.id, version=msg.version, held=True),
                    FreeIteration(10**9), self._reset_grad()]
        job = self.node.job(ComputeKind.LOAD_CHECKPOINT, msg.version)
        size = self.node.train.stage_state_bytes[self.node.me.stage]
        key = ("state", self.node.me.stage, msg.version, "checkpoint")
        return [record(RecordName.ROLLBACK_NODE, node=self.node.me.id, version=msg.version),
                FreeIteration(10**9),
                Compute(job, ComputeKind.LOAD_CHECKPOINT, self.node.me.stage, None, 0.0, (), (key,), size)]

    def mb_of(self, c: Contrib) -> MbId:
        return (c[0], self.node.iteration, c[1])
