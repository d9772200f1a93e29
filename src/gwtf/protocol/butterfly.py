"""Butterfly all-reduce of a stage's gradients (`protocol.reduce = "butterfly"`): the replica side.

Owns: `Layout` (who owns which part of a Commit's gradient, and the reduction order), the part
sizes and tensor keys, and `Butterfly` (`Aggregation.bf`), what a replica does between the leader's `Commit`
and its `Have` instead of gather-reduce-broadcast (docs/protocol.md, aggregation):

1. reduce-scatter: the gradient is cut into R contiguous parts, R = the round's replicas; part j
   belongs to the j-th replica in id order. A contributor exports its gradient as R parts
   (`export_grad` with R output keys) and sends part j to owner j; owner j sums part j of every
   contributor, in the Commit's contributor order (the order gather sums whole gradients in),
   and rescales it (`reduce` on the parts);
2. all-gather: owner j sends its reduced part to every other replica; a replica holding all R
   reduced parts joins them (`concat`) into the round's reduced-gradient key, says `Have`, and
   the leader's `Step` applies it as after a gather.

Each node sends (R-1)/R of a gradient in each phase, 2(R-1)/R in all (a contributor; a replica
that contributed nothing only its reduced part), instead of the gather reducer's R-1 gradients.
The reduction is elementwise, so part j of the result is bit for bit part j of gather's: every
replica applies the same bits whichever way it was reduced. Parts go out in a rotated order
(owner i+1 first), so no owner's downlink gets every contributor's part at once (hivemind's
butterfly all-reduce, `hivemind.averaging.partition`, is the anchor; we keep no load balancing
by bandwidth: equal parts).

Crashes: a replica that dies before every other replica of its stage said `Have` may have taken
a part nobody else holds; the leader then agrees again (a new round among the survivors,
`Coordinator._commit_broken`), exactly as when gather's reducer dies. Rounds key every tensor,
so a part of an abandoned round is never mixed into a new one.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gwtf.protocol.base import IdentityMemo, NodeId, log
from gwtf.protocol.kinds import ComputeKind
from gwtf.protocol.ledger import Effect
from gwtf.protocol.messages import NONE, Commit, Compute, GradShare, Have, TensorKey

if TYPE_CHECKING:
    from gwtf.protocol.aggregation import Aggregation


@dataclass(frozen=True, slots=True)
class Layout:
    """What every replica reads from a `Commit` for the butterfly, once per message object."""

    owners: tuple[NodeId, ...]  # sorted replicas: part j is owners[j]'s to reduce
    index: dict[NodeId, int]  # replica -> its part
    positive: tuple[NodeId, ...]  # contributors with a count, in the Commit's order (the summation order)
    counts: dict[NodeId, int]
    total: int


def _layout(c: Commit) -> Layout:
    owners = tuple(sorted(c.replicas))
    return Layout(owners, {r: j for j, r in enumerate(owners)}, tuple(n for n, k in c.contributors if k > 0),
                  dict(c.contributors), sum(k for _, k in c.contributors))


layout: IdentityMemo[Commit, Layout] = IdentityMemo(_layout, limit=1024)


def part_bytes(size_bytes: int, parts: int, j: int) -> int:
    """Bytes of part j of a `size_bytes` gradient cut into `parts` contiguous parts (they differ
    by at most one byte; the runtime cuts the flat tensor with `torch.tensor_split`)."""
    return size_bytes * (j + 1) // parts - size_bytes * j // parts


def part_key(stage: int, iteration: int, contributor: NodeId, rnd: int, j: int) -> TensorKey:
    """Part j of `contributor`'s exported gradient."""
    return ("pgrad", stage, iteration, contributor, rnd, j)


def reduced_key(stage: int, iteration: int, owner: NodeId, rnd: int, j: int) -> TensorKey:
    """Part j of the reduced gradient, reduced by its owner."""
    return ("rgrad", stage, iteration, owner, rnd, j)


def rotated(owners: tuple[NodeId, ...], i: int) -> list[int]:
    """The other parts, starting after part i (every node sends to a different owner first)."""
    n = len(owners)
    return [(i + k) % n for k in range(1, n)]


class Butterfly:
    """The replica side of the butterfly all-reduce (see the module docstring): `Aggregation.bf`.
    It owns the reduced parts received and its progress through the round; the barrier's state
    (the Commit, shares, the round held) it reaches through `agg`, the node through `node`."""

    def __init__(self, agg: Aggregation) -> None:
        self.agg = agg
        self.node = agg.node
        self.rparts: dict[int, set[NodeId]] = {}  # round -> senders of the reduced parts held
        # the round whose part reduction was issued / whose reduced part was sent / whose parts are being joined
        self.bf_reducing = NONE
        self.bf_reduced_round = NONE
        self.bf_joining = NONE

    def bf_commit(self, c: Commit, now: float) -> list[Effect]:
        """`Commit` taken (Aggregation.on_commit): export my parts, or wait for the others'."""
        lay = layout(c)
        if self.node.me.id not in lay.index:
            return [log("error", "commit_without_me", round=c.round)]
        self.bf_reducing = self.bf_reduced_round = self.bf_joining = NONE  # a new round: nothing of the old counts
        self.agg.reducer = lay.owners[0]  # names the joined reduced gradient's key, as gather's does
        self.agg.need = {n for n in lay.positive if n != self.node.me.id}
        self.agg.need_count = len(self.agg.need)
        if lay.counts.get(self.node.me.id, 0) > 0:
            keys = tuple(part_key(self.node.me.stage, c.iteration, self.node.me.id, c.round, j) for j in range(len(lay.owners)))
            job = self.node.job(ComputeKind.EXPORT_GRAD, (c.round, keys))
            return [Compute(job, ComputeKind.EXPORT_GRAD, self.node.me.stage, None, 0.0, (), keys)]
        return self._bf_maybe_reduce(now)

    def bf_exported(self, rnd: int, now: float) -> list[Effect]:
        """My parts are exported: part j to its owner (reduce-scatter)."""
        c = self.agg.commit
        if c is None or c.round != rnd:
            return []
        self.agg.own_exported = rnd
        lay = layout(c)
        size, parts, count = self.node.train.stage_grad_bytes[self.node.me.stage], len(lay.owners), lay.counts[self.node.me.id]
        out: list[Effect] = []
        for j in rotated(lay.owners, lay.index[self.node.me.id]):
            msg = GradShare(iteration=c.iteration, round=rnd, key=part_key(self.node.me.stage, c.iteration, self.node.me.id, rnd, j),
                            count=count, size_bytes=part_bytes(size, parts, j))
            out.append(self.node.send_booked(lay.owners[j], msg, now))
        return out + self._bf_maybe_reduce(now)

    def bf_on_share(self, sender: NodeId, msg: GradShare, now: float) -> list[Effect]:
        """A contributor's part for me to reduce ("pgrad"), or an owner's reduced part ("rgrad")."""
        key = msg.key
        if len(key) != 6 or key[0] not in ("pgrad", "rgrad") or key[1] != self.node.me.stage or key[3] != sender \
                or key[4] != msg.round:
            return [log("warning", "bad_grad_share", sender=sender, key=str(key)[:80])]
        (self.agg.shares if key[0] == "pgrad" else self.rparts).setdefault(msg.round, set()).add(sender)
        c = self.agg.commit
        if c is None or c.round != msg.round:
            return []
        return self._bf_maybe_reduce(now) if key[0] == "pgrad" else self._bf_maybe_join(now)

    def _bf_maybe_reduce(self, now: float) -> list[Effect]:
        """Every contributor's part of mine is here (and my own export done): reduce it."""
        c = self.agg.commit
        if c is None or self.bf_reducing == c.round:
            return []
        lay = layout(c)
        if lay.counts.get(self.node.me.id, 0) > 0 and self.agg.own_exported != c.round:
            return []
        got = self.agg.shares.get(c.round, set())
        if len(got) < self.agg.need_count or not self.agg.need <= got:
            return []
        self.bf_reducing = c.round
        j, st = lay.index[self.node.me.id], self.node.me.stage
        keys = tuple(part_key(st, c.iteration, n, c.round, j) for n in lay.positive)
        out_key = reduced_key(st, c.iteration, self.node.me.id, c.round, j)
        job = self.node.job(ComputeKind.REDUCE, c.round)
        return [Compute(job, ComputeKind.REDUCE, st, None, 0.0, keys, (out_key,), count=lay.total)]

    def bf_reduced(self, rnd: int, now: float) -> list[Effect]:
        """My part is reduced: to every other replica (all-gather)."""
        c = self.agg.commit
        if c is None or c.round != rnd:
            return []
        self.bf_reduced_round = rnd
        lay = layout(c)
        j = lay.index[self.node.me.id]
        msg = GradShare(iteration=c.iteration, round=rnd, key=reduced_key(self.node.me.stage, c.iteration, self.node.me.id, rnd, j),
                        count=lay.total, size_bytes=part_bytes(self.node.train.stage_grad_bytes[self.node.me.stage],
                                                               len(lay.owners), j))
        out = [self.node.send_booked(lay.owners[k], msg, now) for k in rotated(lay.owners, j)]
        return out + self._bf_maybe_join(now)

    def _bf_maybe_join(self, now: float) -> list[Effect]:
        """Every reduced part is here: join them into the round's reduced gradient."""
        c = self.agg.commit
        if c is None or self.bf_reduced_round != c.round or self.bf_joining == c.round:
            return []
        lay = layout(c)
        got = self.rparts.get(c.round, set())
        if len(got) < len(lay.owners) - 1 or not all(o in got for o in lay.owners if o != self.node.me.id):
            return []
        self.bf_joining = c.round
        st = self.node.me.stage
        keys = tuple(reduced_key(st, c.iteration, o, c.round, j) for j, o in enumerate(lay.owners))
        job = self.node.job(ComputeKind.CONCAT, c.round)
        out_key = ("rgrad", st, c.iteration, self.agg.reducer, c.round)
        return [Compute(job, ComputeKind.CONCAT, st, None, 0.0, keys, (out_key,), count=lay.total)]

    def bf_joined(self, rnd: int, now: float) -> list[Effect]:
        """I hold the reduced gradient of the round: tell the leader."""
        c = self.agg.commit
        if c is None or c.round != rnd:
            return []
        self.agg.have_round = rnd
        return [self.node.send(self.node.leader, Have(term=self.node.term, iteration=c.iteration, round=rnd))]

