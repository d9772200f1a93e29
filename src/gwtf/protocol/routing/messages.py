"""Messages of gwtf's decentralized flow protocol (TYPE names "flow.*"; docs/flow-protocol.md).

Owns: the wire vocabulary of `protocol.routing.FlowAgent`: cost advertisements (distance vector),
hop-by-hop reservation (request / response / cancel / push back), cost and switch notices along a
flow, consistency checks, and the annealing exchange between same-stage peers (query / table /
propose / respond). A flow is named by (origin data holder, flow id) everywhere.

Field types are limited to int, float, str, bool and flat tuples of those (the codec's rule).

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from dataclasses import dataclass

from gwtf.protocol.base import Message, message

INF_COST_S = float("inf")
MOVE_KINDS = frozenset({"redirect", "yield", "exchange", "swap_next"})  # FlowPropose.kind (routing.moves)


@message
@dataclass(frozen=True, slots=True)
class FlowAdvert(Message):
    """Distance vector: my least cost to each target data holder for a NEW flow, and whether I can take one."""

    TYPE = "flow.advert"
    targets: tuple[str, ...]
    costs_s: tuple[float, ...]  # aligned with targets; inf when no downstream capacity
    has_capacity: bool

    def validate(self) -> None:
        """Called by the wire codec on every decoded advert: aligned columns, distinct targets,
        costs >= 0 (inf allowed, NaN not), so one bad peer cannot poison the distance vector."""
        if len(self.targets) != len(self.costs_s):
            raise ValueError(f"{len(self.targets)} targets but {len(self.costs_s)} costs")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError("duplicate targets")
        if not all(c >= 0.0 for c in self.costs_s):  # False for NaN too
            raise ValueError("a cost is negative or NaN")


@message
@dataclass(frozen=True, slots=True)
class FlowLoad(Message):
    """`flow.load_aware`: the flows I carry now (reserved or established), to my previous, same and
    next-stage peers, which price my compute with it (`flow.cost.queue_factor`); at most one per
    `advert_interval_s`."""

    TYPE = "flow.load"
    load: int

    def validate(self) -> None:
        if not 0 <= self.load <= 1_000_000:
            raise ValueError(f"load {self.load} not in [0, 1000000]")


@message
@dataclass(frozen=True, slots=True)
class FlowRequest(Message):
    """Reserve one slot of flow (origin, flow_id) at the receiver; `up_s` is the sender's cost so far.

    `claim` (routing.moves.Claim): the origin has unmet demand and no next hop with capacity. A
    full receiver may then release its costliest flow for it, if that route costs more than this
    one would through the receiver; a receiver with spare capacity passes the claim on.
    `displace_origin` / `displace_flow_id`: a full sender took a claim's slot from that flow,
    whose next hop the receiver is; the receiver may give the claim its slot of that flow too
    (the sender's release of it commits).
    """

    TYPE = "flow.request"
    origin: str
    flow_id: int
    up_s: float
    claim: bool = False
    displace_origin: str = ""
    displace_flow_id: int = -1


@message
@dataclass(frozen=True, slots=True)
class FlowResponse(Message):
    """Answer to a FlowRequest. Accept: `down_s` is the receiver's cost back to the origin.

    Reject: `cost_s` / `has_capacity` refresh the requester's view of the receiver.
    """

    TYPE = "flow.response"
    origin: str
    flow_id: int
    accepted: bool
    down_s: float = 0.0
    last: str = ""  # the flow's last relay (the data holder records it as its prev)
    cost_s: float = INF_COST_S
    has_capacity: bool = False


@message
@dataclass(frozen=True, slots=True)
class FlowCancel(Message):
    """Upstream -> downstream: release this flow (and pass the cancel on)."""

    TYPE = "flow.cancel"
    origin: str
    flow_id: int
    force: bool = False  # release even if the sender is not the flow's prev (an aborted hand-over)


@message
@dataclass(frozen=True, slots=True)
class FlowPushBack(Message):
    """Downstream -> upstream: the flow is broken below you; repair it or pass it back.

    `release`: a relay gave its slot to a claim (routing.moves.Claim): release the flow here and
    pass the notice up; the data holder drops it (and rebuilds it whole if capacity is left).
    """

    TYPE = "flow.push_back"
    origin: str
    flow_id: int
    release: bool = False


@message
@dataclass(frozen=True, slots=True)
class FlowCost(Message):
    """A cost change along a flow. side="prev": the sender is the receiver's prev and `cost_s` its
    up cost; side="next": the sender is the receiver's next and `cost_s` its down cost."""

    TYPE = "flow.cost"
    origin: str
    flow_id: int
    side: str
    cost_s: float
    last: str = ""  # side="next" after a repair: the flow's (new) last relay, for the data holder


@message
@dataclass(frozen=True, slots=True)
class FlowSwitch(Message):
    """Your `side` ("prev" or "next") neighbour on this flow changed from `old` to `new` (the sender).

    `cost_s` is the new neighbour's up cost (side="prev") or down cost (side="next"). A node that
    handed the flow over forwards the notice to the new holder (`ttl` hops at most).
    """

    TYPE = "flow.switch"
    origin: str
    flow_id: int
    side: str
    old: str
    new: str
    cost_s: float
    ttl: int = 3


@message
@dataclass(frozen=True, slots=True)
class FlowRekey(Message):
    """Downstream along a flow that data holder `origin` yielded: it now belongs to `new_origin`.

    Each relay renames its entry (keeping an alias for late notices) and passes the rename on
    with its new up cost; the last relay closes the route at `new_origin` and sends the new
    down cost back up.
    """

    TYPE = "flow.rekey"
    origin: str
    flow_id: int
    new_origin: str
    new_flow_id: int
    up_s: float
    ttl: int = 3


@message
@dataclass(frozen=True, slots=True)
class FlowCheck(Message):
    """Consistency check: "I hold this flow and I am your `side` neighbour on it"; carries my cost.

    side="prev": the sender is the receiver's prev (cost_s = its up cost); side="next": the
    sender is the receiver's next (cost_s = its down cost). Also refreshes stale costs.
    """

    TYPE = "flow.check"
    origin: str
    flow_id: int
    side: str
    cost_s: float


@message
@dataclass(frozen=True, slots=True)
class FlowCheckFail(Message):
    """Reply to a FlowCheck that does not match: I do not hold it that way (`holder`: who took it)."""

    TYPE = "flow.check_fail"
    origin: str
    flow_id: int
    side: str  # echo of the check's side
    holder: str = ""


@message
@dataclass(frozen=True, slots=True)
class FlowQuery(Message):
    """Annealing: same-stage peer, send me your flow table and your link costs to these nodes."""

    TYPE = "flow.query"
    nodes: tuple[str, ...]


@message
@dataclass(frozen=True, slots=True)
class FlowTable(Message):
    """A node's stable flows (parallel tuples), its spare capacity, its link costs to queried nodes."""

    TYPE = "flow.table"
    origins: tuple[str, ...]
    flow_ids: tuple[int, ...]
    prevs: tuple[str, ...]
    nexts: tuple[str, ...]
    up_prev_s: tuple[float, ...]  # up cost at the prev (route cost before entering me)
    down_next_s: tuple[float, ...]  # down cost at the next (route cost after leaving me)
    link_prev_s: tuple[float, ...]  # d(prev, me)
    link_next_s: tuple[float, ...]  # d(me, next)
    spare: int
    link_nodes: tuple[str, ...]
    link_costs_s: tuple[float, ...]


@message
@dataclass(frozen=True, slots=True)
class FlowPropose(Message):
    """Annealing move. kind="redirect": I take your flow (origin, flow_id).

    kind="exchange": I take yours and you take mine (my_origin, my_flow_id), whose neighbours and
    outer costs follow so you can install it. kind="swap_next": we swap next hops (and so whole
    tails) of two flows of the same origin; my_up_prev_s is then my up cost, my_down_next_s the
    down cost at my next.
    """

    TYPE = "flow.propose"
    kind: str
    origin: str
    flow_id: int
    expect_prev: str
    expect_next: str
    my_origin: str = ""
    my_flow_id: int = -1
    my_prev: str = ""
    my_next: str = ""
    my_up_prev_s: float = 0.0
    my_down_next_s: float = 0.0
    nonce: int = 0  # kind="swap_next": names the tail swap (FlowSwapTail) the move sets off

    def validate(self) -> None:
        """Called by the wire codec: a kind no move of `routing.moves` knows is refused."""
        if self.kind not in MOVE_KINDS:
            raise ValueError(f"unknown move kind {self.kind!r}")


@message
@dataclass(frozen=True, slots=True)
class FlowRespond(Message):
    """Answer to a FlowPropose; on accept, the handed-over flow's neighbours and outer costs."""

    TYPE = "flow.respond"
    accepted: bool
    origin: str
    flow_id: int
    prev: str = ""
    next: str = ""
    up_prev_s: float = 0.0
    down_next_s: float = 0.0


@message
@dataclass(frozen=True, slots=True)
class FlowSwapTail(Message):
    """Down two flows' tails after a swap_next move: names `a` and `b` of `origin` swap here and below.

    The receiver swaps the two names once per `nonce` and passes the notice down both tails;
    `flow_id` is the (new) name of the flow `prev` passes to it, `up_s` the up cost at `prev`;
    `old_prev` (first hop only) is the receiver's prev on it before the move.
    """

    TYPE = "flow.swap_tail"
    origin: str
    a: int
    b: int
    nonce: int
    flow_id: int
    prev: str  # the receiver's prev on that flow (the sender, unless forwarded after a hand-over)
    old_prev: str
    up_s: float
    ttl: int = 3
