"""The microbatch data plane of NodeCore: forward, loss, backward, and in-flight recovery.

Owns: what a data holder and a relay do with one microbatch (DESIGN.md 3 and 5):
- forward: DH embeds and sends to a next hop from its router; relays compute and forward; the
  last relay returns to the origin DH; every receiver acks receipt at once (`Got`, adaptive
  deadline from the measured transfer time; none -> suspect the peer, reroute from the cached
  activation: nothing upstream is redone) and tells its own sender `Passed` once its output
  was received downstream; until then a crash of it (MemberDown) also triggers the reroute;
- backward: along the same route in reverse; each node accumulates the microbatch exactly once
  (`contributed`), caches the gradient it sent, and watches the receiver until its final
  `BackAck` (sent once it has back-propagated and passed its own gradient on);
- backward crash at stage k: the gradient holder (stage k+1 or the DH) walks upstream with
  `Redo` to the nearest live node, which sends its cached activation to another stage-k replica
  marked as a redo chain; the chain's last node fetches the holder's cached gradient
  (`GradRequest`), so only the crashed stage's forward+backward is redone;
- duplicates (a reroute whose original was only slow) are ignored at the DH: the first return
  of a microbatch wins, so a microbatch is back-propagated along one route only.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gwtf.protocol import messages as msgs
from gwtf.protocol.base import NodeId, Send, log
from gwtf.protocol.dispatch import Sender, handles
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.ledger import Effect, GradOut, Leg, Origin
from gwtf.protocol.messages import (
    NONE,
    BackAck,
    Backward,
    Compute,
    Forward,
    Got,
    GradRequest,
    MbId,
    Passed,
    Redo,
    RedoAck,
    TensorKey,
    record,
)

if TYPE_CHECKING:
    from gwtf.protocol.core import NodeCore

EMBED, LOSS, EMBED_BWD = 0.05, 0.9, 0.05  # shares of stage 0's fwd+bwd FLOPs
FWD, BWD = 1.0 / 3.0, 2.0 / 3.0  # relay shares


class DataPlane:
    """Data-holder and relay behaviour for one microbatch (see the module docstring), one per
    node: it owns the ledger of the current iteration (legs, origins, contributions, gradient
    caches and the gradients out) and the data holder's progress; the rest of the node it
    reaches through `node`."""

    def __init__(self, node: NodeCore) -> None:
        self.node = node
        # the ledger (cleared every iteration: `clear_iteration`)
        self.legs: dict[int, Leg] = {}
        self._leg_seq = 0
        self.origins: dict[MbId, Origin] = {}
        self.contributed: dict[MbId, int] = {}
        self.grad_cache: dict[MbId, tuple[TensorKey, tuple[NodeId, ...], tuple[int, ...]]] = {}
        self.gouts: dict[MbId, GradOut] = {}
        self.pending_fwd: list[tuple[NodeId, Forward]] = []  # activations ahead of their IterStart
        self.pending_acks: list[Send] = []
        # the data holder's progress in the current iteration
        self.dh_started = 0
        self.dh_data: list[tuple[int, int]] = []  # the batch's (shard, index) of its microbatch n, n = 0, 1, ...
        self.rt_ema_s = 0.0
        # data holders known dead: with the batch held their microbatches are void (served again
        # by others, under other ids), so their in-flight work is dropped here, not recovered
        self.lost_origins: set[NodeId] = set()

    def void(self, mb: MbId) -> bool:
        """`mb` is a dead data holder's (`protocol.hold_batch`): nothing more is done for it."""
        return mb[0] in self.lost_origins

    def lose_origin(self, pid: NodeId) -> None:
        """Data holder `pid` died: drop its microbatches' legs and outgoing gradients, so
        nothing recovers, re-routes or back-propagates them any more. What this node contributed
        of them stays counted in `contributed`: the leader sees it and resets this replica (its
        accumulated gradient holds them), `aggregation.plan_redo`."""
        if not self.node.cfg.hold_batch:
            return
        self.lost_origins.add(pid)
        for n in [n for n, leg in self.legs.items() if leg.mb[0] == pid]:
            del self.legs[n]
        for mb in [mb for mb in self.gouts if mb[0] == pid]:
            del self.gouts[mb]

    def clear_iteration(self) -> None:
        """Drop the ledger of the current iteration (a new iteration, a reset, a stage move)."""
        self.legs.clear()
        self.origins.clear()
        self.contributed.clear()
        self.grad_cache.clear()
        self.gouts.clear()

    def new_leg(self) -> int:
        self._leg_seq += 1
        return self._leg_seq

    def mb_key(self, kind: str, mb: MbId, n: int) -> TensorKey:
        """Tensor key of this node's `kind` tensor for microbatch `mb` on its leg `n`."""
        return (kind, mb[0], mb[1], mb[2], self.node.me.id, n)


    def on_ack_timeout(self, ref: int | MbId, now: float) -> list[Effect]:
        """The receipt ack of a forward (leg `ref`, or a data holder's microbatch) is overdue."""
        rec = self.legs.get(ref) if isinstance(ref, int) else self.origins.get(ref)
        return self.fwd_failed(ref, rec.next, now) if rec is not None else []

    # ---- data holder: start -----------------------------------------------------------

    def dh_start_iteration(self, extra: Sequence[tuple[NodeId, int, int]], now: float,
                           own: bool | None = None) -> list[Effect]:
        """The iteration's microbatches: our shard's M (unless `own` is false, or, with `own`
        None, the leader dealt our shard to the others), then the vacant shards' microbatches
        `extra` deals to us. With none at all we report done at once."""
        self.dh_started = 0
        me = self.node.me
        if own is None:
            own = me.shard < 0 or not any(s == me.shard for _, s, _ in extra)
        self.dh_data = [(me.shard, i) for i in range(self.node.train.microbatches)] if own else []
        self.dh_data += [(s, i) for dh, s, i in extra if dh == me.id]
        return self.dh_progress(now)

    def dh_take(self, items: Sequence[tuple[int, int]]) -> bool:
        """Add the dealt microbatches we do not serve yet (`Deal`); whether any was new."""
        have = set(self.dh_data)
        new = [(int(s), int(i)) for s, i in items if (s, i) not in have]
        self.dh_data += new
        return bool(new)

    def _dh_fill(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        cap = max(1, min(self.node.me.capacity, self.node.train.microbatches))
        inflight = sum(1 for o in self.origins.values() if not self._finished(o))
        while self.dh_started < len(self.dh_data) and inflight < cap:
            mb = (self.node.me.id, self.node.iteration, self.dh_started)
            data = self.dh_data[self.dh_started]
            self.dh_started += 1
            inflight += 1
            o = Origin(mb=mb, out_key=self.mb_key("act", mb, mb[2]), started_at=now)
            self.origins[mb] = o
            out.append(record(RecordName.MB_START, mb=mb, node=self.node.me.id, data=data))
            flops = EMBED * self.node.train.stage_flops[0]
            out.append(Compute(self.node.job(ComputeKind.EMBED, mb), ComputeKind.EMBED, 0, mb, flops, (),
                               (o.out_key,), data=data))
            out.append(self.node.timer(("mb", mb), self._mb_deadline_s(), now))
        return out

    def _finished(self, o: Origin) -> bool:
        """Contributed at stage 0 (a later redo chain through it does not reopen it) or given up."""
        return o.phase == "done" or o.incomplete or o.mb in self.contributed

    def _mb_deadline_s(self) -> float:
        return max(self.node.cfg.mb_deadline_floor_s, self.node.cfg.mb_deadline_multiplier * self.rt_ema_s)

    def dh_progress(self, now: float) -> list[Effect]:
        out = self._dh_fill(now)
        if self.dh_started >= len(self.dh_data) and all(self._finished(o) for o in self.origins.values()):
            out += self.node.agg.dh_done(now)
        return out

    def dh_done(self, now: float) -> list[Effect]:  # overridden by the aggregation part
        return []

    def after_contribution(self, now: float) -> list[Effect]:  # overridden by aggregation
        return []

    # ---- forward sending (DH first hop, relays, redo chains) ----------------------------

    def _pick_next(self, mb: MbId, stage: int, prev: NodeId, flow_id: int, excl: set[NodeId],
                   now: float) -> tuple[NodeId, int] | None:
        if stage == self.node.S - 1:
            return mb[0], flow_id  # the last relay returns to the origin data holder
        banned = excl | self.node.suspects
        if stage == 0 and flow_id == NONE:
            busy = {o.flow_id for o in self.origins.values() if o.phase in ("out", "got", "passed")}
            for slot in self.node.router.flow_slots(now):
                if slot.flow_id not in busy and slot.next not in banned:
                    return slot.next, slot.flow_id
        return self.node.router.next_hop(flow_id, prev, mb[0], banned, now)

    def _send_forward(self, rec: Leg | Origin, path: tuple[NodeId, ...], legs: tuple[int, ...],
                      prev: NodeId, now: float) -> list[Effect]:
        stage = self.node.me.stage
        choice = self._pick_next(rec.mb, stage, prev, rec.flow_id if isinstance(rec, Leg) else NONE,
                                 rec.excl, now)
        ref = rec.n if isinstance(rec, Leg) else rec.mb
        if choice is None and rec.excl:
            rec.excl.clear()  # every replica failed once: let suspicion (which expires) decide
            choice = self._pick_next(rec.mb, stage, prev, rec.flow_id if isinstance(rec, Leg) else NONE,
                                     rec.excl, now)
        if choice is None:
            rec.phase = "parked"
            return [self.node.timer(("retry", ref), self.node.cfg.retry_period_s, now)]
        nxt, flow_id = choice
        rec.next, rec.flow_id, rec.phase, rec.sent_at = nxt, flow_id, "out", now
        size = self.node.train.activation_bytes
        msg = Forward(mb=rec.mb, flow_id=flow_id, path=path, legs=legs, key=rec.out_key, size_bytes=size,
                      until=rec.until, holder=rec.holder, agg=rec.agg)
        rec.sent_expect_s = self.node.reserve_uplink(nxt, size, now)
        deadline = self.node.deadline_for(nxt, rec.sent_expect_s)
        return [self.node.send(nxt, msg), self.node.timer(("ackf", ref), deadline, now)]

    def _resend(self, rec: Leg | Origin, now: float) -> list[Effect]:
        if isinstance(rec, Leg):
            return self._send_forward(rec, rec.path + (self.node.me.id,), rec.legs + (rec.n,), rec.sender, now)
        return self._send_forward(rec, (self.node.me.id,), (rec.mb[2],), self.node.me.id, now)

    def fwd_failed(self, ref: int | MbId, peer: NodeId, now: float) -> list[Effect]:
        """No Got from `peer` in time, or it is down before Passed: suspect it, reroute from the cache."""
        rec: Leg | Origin | None = self.legs.get(ref) if isinstance(ref, int) else self.origins.get(ref)
        if rec is None or rec.phase not in ("out", "got") or rec.next != peer:
            return []
        out: list[Effect] = [self.node.cancel(("ackf", ref)), record(RecordName.REROUTE, node=self.node.me.id, mb=rec.mb,
                                                                  dead=peer)]
        if isinstance(rec, Leg) and self.node.me.stage == self.node.S - 1 and rec.until == NONE:
            if peer not in self.node.directory:
                rec.phase = "done"  # the origin data holder is gone: its microbatch is dropped
                return out
            rec.phase = "parked"  # the origin is alive but unreachable now: try again later
            return out + [self.node.timer(("retry", ref), self.node.cfg.retry_period_s, now)]
        self.node.release(peer)
        rec.excl.add(peer)
        return out + self.node.members.suspect(peer, now) + self._resend(rec, now)

    def on_retry(self, ref: int | MbId, now: float) -> list[Effect]:
        rec: Leg | Origin | None = self.legs.get(ref) if isinstance(ref, int) else self.origins.get(ref)
        if rec is None or rec.phase != "parked":
            return []
        return self._resend(rec, now)

    # ---- receiving ----------------------------------------------------------------------

    @handles(msgs.Forward, sender=Sender.NEIGHBOUR)
    def on_forward(self, sender: NodeId, msg: Forward, now: float) -> list[Effect]:
        if msg.mb[1] > self.node.iteration:
            self.pending_fwd.append((sender, msg))  # IterStart not seen yet: keep it
            return []
        if msg.mb[1] < self.node.iteration or not self.node.active or self.void(msg.mb):
            return [log("debug", "stale_forward", mb=msg.mb, sender=sender)]
        if self.node.me.stage == 0:
            return self._dh_return(sender, msg, now)
        if len(msg.path) != self.node.me.stage:
            return [log("warning", "wrong_stage_forward", mb=msg.mb, sender=sender)]
        n = self.new_leg()
        leg = Leg(n=n, mb=msg.mb, sender=sender, path=msg.path, legs=msg.legs, in_key=msg.key,
                  out_key=self.mb_key("act", msg.mb, n), flow_id=msg.flow_id, until=msg.until,
                  holder=msg.holder, agg=msg.agg)
        self.legs[n] = leg
        flops = FWD * self.node.train.stage_flops[self.node.me.stage]
        return [self.node.send(sender, Got(mb=msg.mb, leg=msg.legs[-1])),
                Compute(self.node.job(ComputeKind.FORWARD, n), ComputeKind.FORWARD, self.node.me.stage, msg.mb, flops,
                        (msg.key,), (leg.out_key,))]

    def _dh_return(self, sender: NodeId, msg: Forward, now: float) -> list[Effect]:
        out: list[Effect] = [self.node.send(sender, Got(mb=msg.mb, leg=msg.legs[-1]))]
        o = self.origins.get(msg.mb)
        if o is None or o.phase not in ("out", "got", "passed", "parked"):
            return out + [record(RecordName.DUP_RETURN, node=self.node.me.id, mb=msg.mb)]
        out.append(self.node.cancel(("ackf", o.mb)))
        self.node.release(o.next)
        o.phase = "loss"
        lgrad = self.mb_key("lgrad", o.mb, o.mb[2])
        flops = LOSS * self.node.train.stage_flops[0]
        job = self.node.job(ComputeKind.LOSS, (o.mb, msg.path, msg.legs, lgrad))
        return out + [Compute(job, ComputeKind.LOSS, 0, o.mb, flops, (msg.key,), (lgrad,))]

    def _rec(self, mb: MbId, leg: int) -> tuple[Leg | Origin | None, int | MbId]:
        if self.node.me.stage == 0:
            return self.origins.get(mb), mb
        return self.legs.get(leg), leg

    @handles(msgs.Got, sender=Sender.MEMBER)
    def on_got(self, sender: NodeId, msg: Got, now: float) -> list[Effect]:
        """The next hop has our activation: time the link; tell our sender it is downstream."""
        rec, ref = self._rec(msg.mb, msg.leg)
        if rec is None or rec.phase != "out" or rec.next != sender or rec.mb != msg.mb:
            return []
        rec.phase = "got"
        rtt = now - rec.sent_at
        self.node.observe_ack(sender, rtt, rec.sent_expect_s)
        out: list[Effect] = [self.node.cancel(("ackf", ref))]
        out += self.node.observe_transfer(sender, self.node.train.activation_bytes, rec.sent_at, now)
        if isinstance(rec, Leg):
            out.append(self.node.send(rec.sender, Passed(mb=rec.mb, leg=rec.legs[-1])))
        return out

    @handles(msgs.Passed, sender=Sender.MEMBER)
    def on_passed(self, sender: NodeId, msg: Passed, now: float) -> list[Effect]:
        rec, _ = self._rec(msg.mb, msg.leg)
        if rec is not None and rec.phase in ("out", "got") and rec.next == sender and rec.mb == msg.mb:
            rec.phase = "passed"
        return []

    @handles(msgs.Backward, sender=Sender.NEIGHBOUR)
    def on_backward(self, sender: NodeId, msg: Backward, now: float) -> list[Effect]:
        if msg.mb[1] != self.node.iteration or self.void(msg.mb):
            return []
        pos = self.node.me.stage
        out: list[Effect] = []
        if msg.mb in self.contributed:
            return self._backward_counted(sender, msg, pos, now)
        if pos == 0:
            o = self.origins.get(msg.mb)
            if o is None:
                return []
            out.append(self.node.send(sender, BackAck(mb=msg.mb)))
            if o.phase == "embed_bwd":
                # a second gradient while the embedding backward runs (an aggregation redo's and
                # the original one): its saved graph is back-propagated once; the job's end
                # sends the final ack and counts the microbatch
                return out
            o.phase = "embed_bwd"
            out.append(self.node.cancel(("gget", o.mb)))
            flops = EMBED_BWD * self.node.train.stage_flops[0]
            job = self.node.job(ComputeKind.EMBED_BACKWARD, (o.mb, sender))
            return out + [Compute(job, ComputeKind.EMBED_BACKWARD, 0, o.mb, flops, (msg.key,), ())]
        leg = self.legs.get(msg.legs[pos]) if len(msg.legs) == self.node.S else None
        if leg is None or leg.mb != msg.mb or leg.phase == "bwd":
            return [log("warning", "unknown_backward", mb=msg.mb, sender=sender)]
        out.append(self.node.send(sender, BackAck(mb=msg.mb)))
        if leg.phase == "gradwait":
            out.append(self.node.cancel(("gget", leg.n)))
        elif leg.next:
            self.node.release(leg.next)
        leg.phase = "bwd"
        gkey = self.mb_key("grad", leg.mb, leg.n)
        flops = BWD * self.node.train.stage_flops[pos]
        job = self.node.job(ComputeKind.BACKWARD, (leg.n, msg.path, msg.legs, gkey, sender))
        return out + [Compute(job, ComputeKind.BACKWARD, pos, leg.mb, flops,
                              (leg.in_key, leg.out_key, msg.key), (gkey,))]

    def _backward_counted(self, sender: NodeId, msg: Backward, pos: int, now: float) -> list[Effect]:
        """A backward for a microbatch this node has counted already. A duplicate, or the end of
        an aggregation redo chain at its holder, ends here. But a chain whose forward passed
        through this node (a data holder's restart of the whole microbatch, say) may still owe
        the stages before this one their contribution: pass the input gradient this node
        cached when it counted the microbatch (same weights, same activation: the same
        gradient) down the chain, counting nothing again (seed 650951: every restart ended at
        a replica that had counted it, and the iteration never finished)."""
        final: list[Effect] = [self.node.send(sender, BackAck(mb=msg.mb, final=True))]
        cached = self.grad_cache.get(msg.mb)
        leg = self.legs.get(msg.legs[pos]) if 0 < pos and len(msg.legs) == self.node.S else None
        if cached is None or leg is None or leg.mb != msg.mb or leg.phase in ("bwd", "done") \
                or msg.path[:pos] != leg.path:
            return final
        if leg.phase == "gradwait":
            final.append(self.node.cancel(("gget", leg.n)))
        elif leg.next:
            self.node.release(leg.next)
        leg.phase = "done"
        return final + [record(RecordName.GRAD_PASSED_ON, node=self.node.me.id, mb=msg.mb)] + \
            self._send_grad(msg.mb, msg.path, msg.legs, pos, cached[0], now)

    # ---- compute completions ------------------------------------------------------------

    def training_compute_done(self, kind: ComputeKind, ref: Any, now: float) -> list[Effect]:
        if kind == ComputeKind.EMBED:
            o = self.origins.get(ref)
            if o is None or o.phase != "embed":
                return []
            return self._resend(o, now)
        if kind == ComputeKind.FORWARD:
            return self._forward_done(ref, now)
        if kind == ComputeKind.LOSS:
            mb, path, legs, lgrad = ref
            o = self.origins.get(mb)
            if o is None:
                return []
            o.phase = "backward"
            self.grad_cache[mb] = (lgrad, path, legs)
            return self._send_grad(mb, path, legs, self.node.S, lgrad, now)
        if kind == ComputeKind.BACKWARD:
            n, path, legs, gkey, ack_to = ref
            leg = self.legs.get(n)
            if leg is None or leg.mb in self.contributed:
                return []
            leg.phase = "done"
            ack = self.node.send(ack_to, BackAck(mb=leg.mb, final=True))
            return self._contribute(leg.mb, n, now) + self._after_backward(leg, path, legs, gkey, now) + [ack]
        if kind == ComputeKind.EMBED_BACKWARD:
            mb, ack_to = ref
            o = self.origins.get(mb)
            if o is None or o.mb in self.contributed:
                return []
            self.pending_acks.append(self.node.send(ack_to, BackAck(mb=mb, final=True)))
            o.phase = "done"
            o.incomplete = False
            dt = now - o.started_at
            a = self.node.cfg.ema_alpha
            self.rt_ema_s = dt if self.rt_ema_s == 0.0 else (1 - a) * self.rt_ema_s + a * dt
            acks, self.pending_acks = self.pending_acks, []
            return [self.node.cancel(("mb", o.mb))] + acks + self._contribute(o.mb, NONE, now) + self.dh_progress(now)
        return []

    def _contribute(self, mb: MbId, n: int, now: float) -> list[Effect]:
        self.contributed[mb] = n
        out: list[Effect] = [record(RecordName.CONTRIBUTE, node=self.node.me.id, stage=self.node.me.stage, mb=mb)]
        return out + self.node.agg.after_contribution(now)

    def _after_backward(self, leg: Leg, path: tuple[NodeId, ...], legs: tuple[int, ...], gkey: TensorKey,
                        now: float) -> list[Effect]:
        self.grad_cache[leg.mb] = (gkey, path, legs)
        return self._send_grad(leg.mb, path, legs, self.node.me.stage, gkey, now)

    def _forward_done(self, n: int, now: float) -> list[Effect]:
        leg = self.legs.get(n)
        if leg is None or leg.phase != "fwd":
            return []
        if leg.until != NONE and self.node.me.stage + 1 == leg.until:
            # end of a redo chain: the holder has the gradient; we are now responsible
            leg.phase = "gradwait"
            req = GradRequest(mb=leg.mb, path=leg.path + (self.node.me.id,), legs=leg.legs + (n,))
            return [self.node.send(leg.sender, Passed(mb=leg.mb, leg=leg.legs[-1])), self.node.send(leg.holder, req),
                    self.node.timer(("gget", n), self.node.ack_deadline_s(leg.holder, self.node.train.activation_grad_bytes), now)]
        return self._resend(leg, now)

    # ---- backward sending and the redo walk -------------------------------------------

    def _send_grad(self, mb: MbId, path: tuple[NodeId, ...], legs: tuple[int, ...], pos: int,
                   key: TensorKey, now: float) -> list[Effect]:
        size = self.node.train.activation_grad_bytes
        to = path[pos - 1]
        expect = self.node.reserve_uplink(to, size, now)
        self.gouts[mb] = GradOut(mb=mb, path=path, legs=legs, pos=pos, key=key, sent_at=now,
                                 sent_expect_s=expect)
        deadline = self.node.deadline_for(to, expect)
        return [self.node.send(to, Backward(mb=mb, path=path, legs=legs, key=key, size_bytes=size)),
                self.node.timer(("ackb", mb), deadline, now)]

    @handles(msgs.BackAck, sender=Sender.MEMBER)
    def on_backack(self, sender: NodeId, msg: BackAck, now: float) -> list[Effect]:
        g = self.gouts.get(msg.mb)
        if g is None or g.path[g.pos - 1] != sender or g.redo_start != NONE:
            return []
        if msg.final:
            del self.gouts[msg.mb]
            return [self.node.cancel(("ackb", msg.mb))]
        if g.got:
            return []
        g.got = True
        rtt = now - g.sent_at
        self.node.observe_ack(sender, rtt, g.sent_expect_s)
        return [self.node.cancel(("ackb", msg.mb))] + self.node.observe_transfer(
            sender, self.node.train.activation_grad_bytes, g.sent_at, now)

    def bwd_failed(self, mb: MbId, now: float) -> list[Effect]:
        """The node we sent a gradient to is gone: ask the nearest live upstream node to redo."""
        g = self.gouts.get(mb)
        if g is None or g.redo_start != NONE:
            return []
        dead = g.path[g.pos - 1]
        out: list[Effect] = [self.node.cancel(("ackb", mb))] + self.node.members.suspect(dead, now)
        start = 1 if self.node.policy.backward_recovery == "restart" else g.pos - 1
        return out + self._redo_walk(g, start, now)

    def _redo_walk(self, g: GradOut, start: int, now: float) -> list[Effect]:
        if start < 1:
            del self.gouts[g.mb]
            return [record(RecordName.ABANDONED, node=self.node.me.id, mb=g.mb, reason="origin_lost")]
        g.redo_start = start
        to = g.path[start - 1]
        msg = Redo(mb=g.mb, path=g.path, legs=g.legs, start=start, until=g.pos, holder=self.node.me.id)
        return [record(RecordName.REDO, node=self.node.me.id, mb=g.mb, start=start, until=g.pos, mode="inflight"),
                self.node.send(to, msg), self.node.timer(("redo", g.mb), self.node.ack_deadline_s(to, 0), now)]

    @handles(msgs.RedoAck, sender=Sender.ANYONE)
    def on_redoack(self, sender: NodeId, msg: RedoAck, now: float) -> list[Effect]:
        g = self.gouts.get(msg.mb)
        if g is None or g.redo_start != msg.start:
            return []
        g.redo_start = NONE
        g.sent_at = now
        return [self.node.cancel(("redo", msg.mb))]

    def redo_failed(self, mb: MbId, now: float) -> list[Effect]:
        g = self.gouts.get(mb)
        if g is None or g.redo_start == NONE:
            return []
        out: list[Effect] = [self.node.cancel(("redo", mb))] + self.node.members.suspect(g.path[g.redo_start - 1], now)
        start = g.redo_start - 1
        g.redo_start = NONE
        return out + self._redo_walk(g, start, now)

    @handles(msgs.Redo, sender=Sender.ANYONE)
    def on_redo(self, sender: NodeId, msg: Redo, now: float) -> list[Effect]:
        """We hold the activation for stage `start`: send it to another replica as a redo chain."""
        if msg.mb[1] != self.node.iteration or self.void(msg.mb):
            return []
        rec: Leg | Origin | None
        if self.node.me.stage == 0:
            rec = self.origins.get(msg.mb)
        elif msg.agg:
            n = self.contributed.get(msg.mb)
            rec = self.legs.get(n) if n is not None else None
        else:
            rec = self.legs.get(msg.legs[msg.start - 1]) if len(msg.legs) >= msg.start else None
        if rec is None:
            return [log("warning", "redo_without_cache", mb=msg.mb, start=msg.start)]
        if isinstance(rec, Origin) and not msg.agg and rec.phase in ("embed", "out", "got", "passed", "parked"):
            # a backward redo comes only after our loss started the backward: this one is from
            # before a rollback that restarted the iteration (a data holder's microbatch ids
            # repeat then); taken, it turned the new forward into a chain to a dead gradient
            # cache, for good (faultgen seed 501926)
            return [log("info", "stale_redo", mb=msg.mb, start=msg.start, phase=rec.phase)]
        out: list[Effect] = [self.node.send(sender, RedoAck(mb=msg.mb, start=msg.start))]
        if rec.phase in ("out", "got"):
            out.append(self.node.cancel(("ackf", rec.n if isinstance(rec, Leg) else rec.mb)))
        rec.until, rec.holder, rec.agg = msg.until, msg.holder, msg.agg
        if msg.start < len(msg.path):
            rec.excl.add(msg.path[msg.start])
        if msg.start == 0 and isinstance(rec, Origin):
            return out + self._dh_stage0_redo(rec, now)
        return out + self._resend(rec, now)

    def _dh_stage0_redo(self, o: Origin, now: float) -> list[Effect]:
        if o.until > 1:
            return self._resend(o, now)
        o.phase = "gradwait"
        req = GradRequest(mb=o.mb, path=(self.node.me.id,), legs=(o.mb[2],))
        return [self.node.send(o.holder, req), self.node.timer(("gget", o.mb), self.node.ack_deadline_s(o.holder, 0), now)]

    @handles(msgs.GradRequest, sender=Sender.ANYONE)
    def on_gradrequest(self, sender: NodeId, msg: GradRequest, now: float) -> list[Effect]:
        cached = self.grad_cache.get(msg.mb)
        if cached is None or msg.mb[1] != self.node.iteration:
            return [log("warning", "grad_request_without_cache", mb=msg.mb)]
        key, path, legs = cached
        hpos = self.node.S if self.node.me.stage == 0 else self.node.me.stage
        full = msg.path + path[hpos:]
        full_legs = msg.legs + legs[hpos:]
        self.gouts.pop(msg.mb, None)
        out: list[Effect] = [self.node.cancel(("ackb", msg.mb)), self.node.cancel(("redo", msg.mb))]
        return out + self._send_grad(msg.mb, full, full_legs, hpos, key, now)

    def chain_failed(self, ref: int | MbId, now: float) -> list[Effect]:
        """The holder of a redo chain did not answer: give up; the leader redoes it at aggregation."""
        rec: Leg | Origin | None = self.legs.get(ref) if isinstance(ref, int) else self.origins.get(ref)
        if rec is None or rec.phase != "gradwait":
            return []
        rec.phase = "done"
        return [record(RecordName.CHAIN_FAILED, node=self.node.me.id, mb=rec.mb)]

    def on_mb_deadline(self, mb: MbId, now: float) -> list[Effect]:
        """DH safety net: restart a lost forward; give up waiting for a lost backward."""
        o = self.origins.get(mb)
        if o is None or o.phase == "done" or o.incomplete or mb[1] != self.node.iteration:
            return []
        out: list[Effect] = [self.node.timer(("mb", mb), self._mb_deadline_s(), now)]
        if o.phase in ("out", "got", "passed", "parked"):
            o.restarts += 1
            if o.next:
                o.excl.add(o.next)
            if len(o.excl) > 8:
                o.excl.clear()
            if o.until != NONE and not o.agg and o.holder not in self.node.directory:
                # an in-flight redo chain whose holder died (its cached gradient with it): ending
                # the restart there again would fail every time (a livelock). End it at our own
                # cached loss gradient if we have one (a second loss would count the head's
                # gradient twice), else run the whole pipeline.
                o.until, o.holder = (self.node.S, self.node.me.id) if mb in self.grad_cache else (NONE, "")
            out.append(self.node.cancel(("ackf", mb)))
            return out + [record(RecordName.MB_RESTART, node=self.node.me.id, mb=mb)] + self._resend(o, now)
        if o.phase in ("loss", "backward", "gradwait", "embed_bwd"):
            o.incomplete = True
            return out + [record(RecordName.MB_INCOMPLETE, node=self.node.me.id, mb=mb)] + self.dh_progress(now)
        return out
