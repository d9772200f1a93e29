"""Messages and effects of the training protocol (data plane, membership, aggregation).

Owns: every message NodeCore sends that is not routing ("flow." / "swarm." belong to the
router), the training effects (`Compute`, `Record`, `FreeIteration`), `Effect` (the closed union
of every effect a core returns, base ones included) and the microbatch id type.
TYPE prefixes: "train." (microbatch data plane), "mem." (membership, join, leave, state
transfer), "agg." (iteration barrier and aggregation).

Tensor naming (the driver contract, see docs/protocol.md): a tensor-carrying message names its
tensor by `key` (a flat tuple of str/int) and declares `size_bytes`; the receiving driver stores
the tensor under that same key. Keys always carry the iteration at position 2, so
`FreeIteration(t)` lets a driver drop every tensor of iterations <= t without protocol logic.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias, get_args

from gwtf.protocol.base import CancelTimer, Log, Message, NodeId, Send, SetTimer, fast_init, message
from gwtf.protocol.kinds import ComputeKind, RecordName

MbId = tuple[str, int, int]
"""A microbatch: (origin data holder, iteration, index within that holder's iteration)."""

TensorKey = tuple[Any, ...]
"""("act"|"grad"|"ret"|"lgrad"|"pgrad"|"state", ...) with the iteration at position 2."""

NONE = -1  # "no value" for int fields (messages carry no Optional nested types)


# --------------------------------------------------------------------------------------------
# Effects (beside base Send / SetTimer / CancelTimer / Log)
# --------------------------------------------------------------------------------------------


@fast_init
@dataclass(frozen=True, slots=True)
class Compute:
    """Run one stage computation; the driver answers with `on_compute_done(job_id, now)`.

    kind: what to run (`kinds.ComputeKind` says what each kind means)."""

    job_id: int
    kind: ComputeKind
    stage: int
    mb: MbId | None
    flops: float
    inputs: tuple[TensorKey, ...] = ()
    outputs: tuple[TensorKey, ...] = ()
    size_bytes: int = 0  # state/checkpoint transfers: bytes read or written
    count: int = 0  # "reduce": the total microbatch count the summed gradient is divided by
    data: tuple[int, int] = (NONE, NONE)  # "embed": the (shard, index) of the batch it trains (NONE: own, mb's)


@fast_init
@dataclass(frozen=True, slots=True)
class Record:
    """A fact for metrics and invariant checks (the sim collects it; the runtime logs JSONL)."""

    event: RecordName
    fields: tuple[tuple[str, Any], ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class FreeIteration:
    """The driver may drop every stored tensor whose key's iteration (key[2]) is <= `iteration`
    (`data_only`: only the microbatches' tensors, keys "act", "grad" and "lgrad")."""

    iteration: int
    data_only: bool = False


def record(event: RecordName, **fields: Any) -> Record:
    return Record(event, tuple(fields.items()))


Effect: TypeAlias = Send | SetTimer | CancelTimer | Log | Compute | Record | FreeIteration
"""Everything a NodeCore handler returns: a closed union. A driver dispatches on it exhaustively
(`match` / isinstance chain ending in `typing.assert_never`, so mypy names a missing case) and
raises on anything else; tests/unit/test_effect_dispatch.py checks every driver handles each."""

EFFECT_TYPES: tuple[type, ...] = get_args(Effect)


# --------------------------------------------------------------------------------------------
# Data plane: "train."
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tensor(Message):
    size_bytes: int = 0

    @property
    def tensor_bytes(self) -> int:
        return self.size_bytes


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Forward(_Tensor):
    """An activation going to the next stage. `path`/`legs`: the nodes so far and their leg ids.

    `until` >= 0 marks a redo chain: the node at stage `until - 1` asks `holder` for the
    gradient instead of forwarding. `agg`: the chain was started by the aggregation leader.
    """

    TYPE = "train.fwd"
    mb: MbId
    flow_id: int
    path: tuple[NodeId, ...]
    legs: tuple[int, ...]
    key: TensorKey
    until: int = NONE
    holder: NodeId = ""
    agg: bool = False


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Got(Message):
    """Immediate receipt ack of a Forward on the sender's leg `leg` (times the link)."""

    TYPE = "train.got"
    mb: MbId
    leg: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Passed(Message):
    """Ack to the sender of leg `leg`: the activation is now the next stage's (or the DH's) job."""

    TYPE = "train.passed"
    mb: MbId
    leg: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Backward(_Tensor):
    """A gradient going back along the route; `path`/`legs` are the full cycle (length S)."""

    TYPE = "train.bwd"
    mb: MbId
    path: tuple[NodeId, ...]
    legs: tuple[int, ...]
    key: TensorKey


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class BackAck(Message):
    """Ack of a Backward: `final=False` on receipt (times the link), `final=True` once the
    receiver has back-propagated it and passed its own gradient on (a crash before that is the
    sender's to recover)."""

    TYPE = "train.back"
    mb: MbId
    final: bool = False


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Redo(Message):
    """Ask the node at stage `start - 1` of `path` to redo stages start..until-1 from its cache."""

    TYPE = "train.redo"
    mb: MbId
    path: tuple[NodeId, ...]
    legs: tuple[int, ...]
    start: int
    until: int
    holder: NodeId
    agg: bool = False


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class RedoAck(Message):
    TYPE = "train.redoack"
    mb: MbId
    start: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class GradRequest(Message):
    """A redo chain's last node asks the holder for its cached gradient (answer: Backward)."""

    TYPE = "train.gget"
    mb: MbId
    path: tuple[NodeId, ...]
    legs: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# Membership: "mem."
# --------------------------------------------------------------------------------------------

PeerTuple = tuple[str, int, str, float, int, int, int]  # PeerInfo's fields in order
"""A PeerInfo flattened for the wire: (id, stage, region, compute_s, capacity, demand)."""


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    TYPE = "mem.hb"
    term: int  # the sender's current term (a leader that sees a higher one steps down)
    version: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatAck(Message):
    TYPE = "mem.hback"
    term: int
    leader: NodeId
    iteration: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class SuspectNotice(Message):
    """A node to the leader: `node` missed an ack deadline or a send to it failed."""

    TYPE = "mem.suspect"
    node: NodeId


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeUpdate(Message):
    """A member to the members that price it (its previous, same and next stage, and the data
    holders): its measured compute seconds per microbatch of its stage changed
    (`NodeCore.on_compute_measured`; only the runtime measures, the simulator never sends it)."""

    TYPE = "mem.compute"
    compute_s: float


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class LeaderVote(Message):
    """A member that lost the leader `old` votes for the receiver to lead `term` (one vote per
    voter per term; a strict majority of the members other than `old` elects)."""

    TYPE = "mem.vote"
    term: int
    old: NodeId


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class TermNotice(Message):
    """Answer to a message of an older term, or to a heartbeat sent to a node that does not
    lead: the term and leader the receiver knows, so a stale node catches up."""

    TYPE = "mem.term"
    term: int
    leader: NodeId


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Probe(Message):
    """Leader to a suspected node: answer with a Heartbeat now."""

    TYPE = "mem.probe"
    term: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberUp(Message):
    TYPE = "mem.up"
    term: int
    peer: PeerTuple
    start: int = NONE  # to the data holder activated: the iteration it trains now (NONE: the next IterStart)
    # with start: it trains its own shard in that iteration too (false: the leader dealt the shard to the
    # others at the iteration's start, or its last holder died during it, so relays may hold some of it)
    own: bool = False


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberDown(Message):
    TYPE = "mem.down"
    term: int
    node: NodeId
    graceful: bool = False


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Evicted(Message):
    """Leader to a node it has already declared dead: stop (rejoin under a new id)."""

    TYPE = "mem.evicted"
    term: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveNotice(Message):
    TYPE = "mem.leave"


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class JoinRequest(Message):
    """A new node (or a contact forwarding it) asks the leader to join; `peer` has stage -1."""

    TYPE = "mem.join"
    peer: PeerTuple
    want: int = NONE  # the stage the joiner must serve (its `--stage`, 0 for a data holder); NONE: any


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome(Message):
    """Leader to a joiner: the directory, per-stage utilisation, and where to fetch state."""

    TYPE = "mem.welcome"
    term: int
    stage: int  # the stage the leader assigns (counting joiners still pending); -1: choose
    members: tuple[PeerTuple, ...]
    utilisation: tuple[float, ...]
    iteration: int
    checkpoint_iteration: int
    shard: int = NONE  # with stage 0: the vacant data shard the joiner serves


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class StateRequest(Message):
    """A joiner asks a live replica of `stage` for its state; with `checkpoint` >= 1 it asks a
    data holder for its copy of that checkpoint version of `stage` instead."""

    TYPE = "mem.sget"
    stage: int
    checkpoint: int = NONE


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class StateTransfer(_Tensor):
    """Weights + optimizer state of `stage` at `version` (steps applied). Key ("state", stage,
    version, source): a replica's live state; ("ckpt", stage, version, source): a checkpoint
    (a replica sending it to a data holder to keep, or a data holder answering a joiner)."""

    TYPE = "mem.state"
    stage: int
    version: int
    key: TensorKey
    ok: bool = True


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """A joiner holds state `version` of `stage` and asks to be activated."""

    TYPE = "mem.ready"
    stage: int
    version: int
    peer: PeerTuple


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Refetch(Message):
    """Leader to a joiner whose state is stale (the swarm stepped meanwhile)."""

    TYPE = "mem.refetch"
    term: int
    stage: int = -1  # >= 1: the stage was lost, join again to take it over (-1: fetch again, same stage)
    iteration: int


# --------------------------------------------------------------------------------------------
# Iteration barrier and aggregation: "agg."
# --------------------------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class IterStart(Message):
    """Leader: iteration `iteration` begins (replicas hold weight version == iteration)."""

    TYPE = "agg.start"
    term: int
    iteration: int
    leader: NodeId
    # the vacant shards' microbatches of this iteration: (data holder, shard, index), each served
    # by that live data holder besides its own shard (protocol.hold_batch)
    extra: tuple[tuple[NodeId, int, int], ...] = ()
    # train.update_delay 1: the round of iteration-1's Commit, which a replica takes (exporting
    # that gradient) before this iteration's passes; NONE: iteration-1 was stepped (Step) first
    after: int = NONE


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Deal(Message):
    """Leader: serve these microbatches (shard, index) of `iteration` too: no live data holder
    serves them (theirs died with them, `protocol.hold_batch`). Cumulative: every item dealt to
    this data holder in the iteration so far, so a lost or reordered Deal is repaired by the next."""

    TYPE = "agg.deal"
    term: int
    iteration: int
    items: tuple[tuple[int, int], ...]


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Finish(Message):
    """Leader: training is over at weight version `version` (the run's last step was sent
    before this): every member checkpoints what it is configured to, and stops (exit 0)."""

    TYPE = "agg.finish"
    term: int
    version: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Collect(Message):
    """Leader: report your state for `iteration` (also sent by a new leader after failover)."""

    TYPE = "agg.collect"
    term: int
    iteration: int
    leader: NodeId


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Report(Message):
    """A node's state for `iteration`: contributed microbatches (as (origin, index)), and for a
    data holder whether it is done and which of its microbatches completed."""

    TYPE = "agg.report"
    term: int
    iteration: int
    version: int
    stage: int
    contributed: tuple[tuple[str, int], ...]
    dh_done: bool = False
    dh_completed: tuple[int, ...] = ()
    have_round: int = NONE
    # a data holder done: the batch's (shard, index) of each of its microbatches, in order (the
    # leader re-deals what no live data holder serves, `Deal`)
    dh_data: tuple[tuple[int, int], ...] = ()


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Reset(Message):
    """Leader: discard your accumulated gradient of `iteration` (it duplicated another's)."""

    TYPE = "agg.reset"
    term: int
    iteration: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Commit(Message):
    """Leader: the contributors of your stage for `iteration` (round `round`), with counts.

    Contributors send their gradient to every other replica listed in `replicas`."""

    TYPE = "agg.commit"
    term: int
    iteration: int
    round: int
    contributors: tuple[tuple[NodeId, int], ...]
    replicas: tuple[NodeId, ...]
    # train.update_delay 1: after exporting this round's gradient, apply the step of iteration-1
    # with its round `step_round` (the replica holds that reduced gradient); NONE: no step pending
    step_round: int = NONE


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class GradShare(_Tensor):
    TYPE = "agg.grad"
    iteration: int
    round: int
    key: TensorKey
    count: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Have(Message):
    """A replica holds the reduced gradient of round `round` (the reducer: it holds every
    contributor's gradient, so contributors that die from now on no longer matter)."""

    TYPE = "agg.have"
    term: int
    iteration: int
    round: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Step(Message):
    """Leader: apply the step of `iteration` with the gradients of round `round`."""

    TYPE = "agg.step"
    term: int
    iteration: int
    round: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Rollback(Message):
    """Leader: a whole stage was lost; reload checkpoint `version` and resume from there."""

    TYPE = "agg.rollback"
    term: int
    version: int
    lost_from: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class StageMove(Message):
    """Leader to a relay: leave your stage and serve `stage` (gwtf's rebalancing,
    `protocol.rebalance`)."""

    TYPE = "mem.move"
    term: int
    stage: int


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmMove(StageMove):
    """Leader to a relay: leave your stage and serve `stage` (SWARM's adaptive rebalancing,
    `protocol.swarm`)."""

    TYPE = "swarm.move"
