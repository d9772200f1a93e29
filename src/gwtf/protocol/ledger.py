"""Per-node microbatch ledger and the shared state every NodeCore part works on.

Owns: `TrainParams` (iteration parameters), `Policy` (the seam the SWARM baseline implements),
the ledger records (`Leg`: one forward a relay received; `Origin`: one microbatch a data holder
started; `GradOut`: a gradient sent back and not yet acknowledged; `DataPlane` keeps them), and
`CoreState`, the node's shared facts (identity, directory, term and leader, suspects, link
moving averages, iteration and version) and small helpers (send, timers, deadlines) that the
parts of `NodeCore` (membership, data plane, aggregation, coordinator) read, with the parts
themselves as typed attributes.

What the ledger keeps (DESIGN.md 5, exactly once): every activation a node sent forward and every
gradient it sent back stays cached until the iteration's step, because aggregation-time redo
(a replica died after its backward passes) needs them. `contributed[mb]` records the microbatches
whose backward this node accumulated, the only thing that counts toward a stage's update.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gwtf.config import ProtocolConfig
from gwtf.protocol.base import CancelTimer, Message, NodeId, Send, SetTimer
from gwtf.protocol.kinds import ComputeKind
from gwtf.protocol.messages import NONE, MbId, TensorKey
from gwtf.protocol.messages import Effect as Effect  # re-exported: the parts import it from here
from gwtf.protocol.router import LinkEstimate, PeerInfo, Router

if TYPE_CHECKING:  # annotation only: the leader part imports this module
    from gwtf.protocol.aggregation import Aggregation
    from gwtf.protocol.leader import Coordinator
    from gwtf.protocol.membership import Membership
    from gwtf.protocol.training import DataPlane

DEFAULT_LINK = LinkEstimate(latency_s=0.05, bandwidth_bytes_per_s=50e6)



def checkpoint_due(version: int, every: int, iterations: int) -> bool:
    """Weight version `version` is checkpointed (and copied to the data holders): every
    `protocol.checkpoint_every` steps, and the run's last (`iterations`; 0: no last)."""
    return version > 0 and (version % every == 0 or version == iterations)

@dataclass(frozen=True, kw_only=True, slots=True)
class TrainParams:
    """What one iteration is: sizes and FLOPs the core puts on its effects (no tensors)."""

    stages: int
    microbatches: int  # M: per data holder per iteration
    iterations: int  # stop after this many steps (0 = never stop)
    activation_bytes: int
    stage_flops: tuple[float, ...]  # fwd+bwd FLOPs of one microbatch at each stage
    stage_state_bytes: tuple[int, ...]  # weights + optimizer state per stage (join transfer)
    stage_grad_bytes: tuple[int, ...]  # gradient bytes per stage (aggregation exchange)
    tokens_per_microbatch: int = 0
    activation_grad_bytes: int = -1  # one activation gradient on the wire (Backward); -1 = activation_bytes
    data_holders: int = 0  # D: data shards (train.data_holders); a joiner takes a vacant one (0: none)
    update_delay: int = 0  # train.update_delay: 1 = the reduction overlaps the next iteration's passes

    def __post_init__(self) -> None:
        if self.activation_grad_bytes < 0:
            object.__setattr__(self, "activation_grad_bytes", self.activation_bytes)

    @property
    def route_bytes(self) -> int:
        """The `size` of the flow cost model (2 * size / bw prices a microbatch's activation in
        and gradient out over one edge): the mean of the two, = activation_bytes when equal."""
        return (self.activation_bytes + self.activation_grad_bytes) // 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """How a system reacts to churn. gwtf: redo only the crashed stage. SWARM: restart the
    microbatch through the whole pipeline. `rebalance_every` > 0 calls `NodeCore.rebalance`
    (a hook the baselines may override) every that many iterations."""

    name: str = "gwtf"
    backward_recovery: Literal["stage", "restart"] = "stage"
    rebalance_every: int = 0


Phase = Literal["fwd", "out", "got", "passed", "parked", "gradwait", "bwd", "done"]


@dataclass(slots=True)
class Leg:
    """A relay's handling of one forward it received (key: its local leg number `n`)."""

    n: int
    mb: MbId
    sender: NodeId
    path: tuple[NodeId, ...]  # up to and including the sender
    legs: tuple[int, ...]
    in_key: TensorKey
    out_key: TensorKey
    flow_id: int
    until: int = NONE
    holder: NodeId = ""
    agg: bool = False
    phase: Phase = "fwd"
    next: NodeId = ""
    excl: set[NodeId] = field(default_factory=set)
    sent_at: float = 0.0
    sent_expect_s: float = 0.0


@dataclass(slots=True)
class Origin:
    """A data holder's microbatch (its leg number is the microbatch index)."""

    mb: MbId
    out_key: TensorKey
    phase: str = "embed"  # embed|out|got|passed|parked|loss|backward|gradwait|embed_bwd|done
    next: NodeId = ""
    flow_id: int = NONE
    excl: set[NodeId] = field(default_factory=set)
    started_at: float = 0.0
    sent_at: float = 0.0
    sent_expect_s: float = 0.0
    until: int = NONE
    holder: NodeId = ""
    agg: bool = False
    incomplete: bool = False
    restarts: int = 0


@dataclass(slots=True)
class GradOut:
    """A gradient sent back to `path[pos - 1]`, waiting for its BackAck (or a redo walk)."""

    mb: MbId
    path: tuple[NodeId, ...]
    legs: tuple[int, ...]
    pos: int  # position of this node on the cycle (S for the data holder's return)
    key: TensorKey
    sent_at: float
    sent_expect_s: float = 0.0
    redo_start: int = NONE  # >= 1 while a Redo(start) is out
    got: bool = False  # the receiver acknowledged receipt


LinkPrior = Callable[[PeerInfo, PeerInfo], LinkEstimate]
"""What a node believes of a link before measuring it (the simulator: the region table's value)."""


class CoreState:
    """Fields and helpers shared by the NodeCore parts (see the module docstring)."""

    is_leader: bool = False  # set by the leader part (leader_init), cleared by membership on a new term
    link_prior: LinkPrior | None = None  # set by NodeCore's constructor (a driver's link priors)
    router_factory: Callable[[PeerInfo], Router] | None = None  # ... and the router a joiner builds
    coord: Coordinator  # the leader part (NodeCore's constructor)
    agg: Aggregation  # the replica side of the iteration barrier (NodeCore's constructor)
    plane: DataPlane  # the microbatch data plane and its ledger (NodeCore's constructor)
    members: Membership  # directory upkeep, failure detection, election, join (NodeCore's constructor)

    def __init__(self, me: PeerInfo, cfg: ProtocolConfig, train: TrainParams, rng: random.Random,
                 router: Router, policy: Policy) -> None:
        self.me = me
        self.cfg = cfg
        self.train = train
        self.rng = rng
        self.router = router
        self.policy = policy
        self.S = train.stages
        self.alive = True
        self.started_s = 0.0  # `now` at on_start (the runtime's clock does not start at 0)
        self.active = me.stage >= 0  # a joiner is inactive until the leader activates it
        self.iteration = 0  # current iteration (from the leader)
        self.version = 0  # optimizer steps applied to this node's stage
        self.directory: dict[NodeId, PeerInfo] = {}  # every change sets dhs_cache = None
        self.dhs_cache: frozenset[NodeId] | None = None  # data_holders()
        self.links: dict[NodeId, LinkEstimate] = {}
        self.suspects: set[NodeId] = set()
        self.leader: NodeId = ""  # the leader of `term`, "" while unknown
        self.term = 0  # leadership term (epoch): the initial leader leads term 0 unelected
        self._job_seq = 0
        self.jobs: dict[int, tuple[ComputeKind, Any]] = {}
        self.uplink_free_est_s = 0.0  # when our uplink will have sent what we queued on it
        self.uplink_done_s = -1.0  # when the last acked tensor left our uplink, as its ack measured
        self.uplink_done_sent_s = -1.0  # and when that tensor was sent
        self.unmeasured_until_s = -1.0  # a tensor nothing acks (a gradient share) may hold the uplink until then
        self.ack_excess_ema_s: dict[NodeId, float] = {}

    # -- the parts' interface to each other -------------------------------------------------
    # Declared here, implemented by one part each (named in the docstring); NodeCore's MRO puts
    # CoreState last, so these bodies run only on a class that lacks the part (a bug).

    # -- helpers -----------------------------------------------------------------------------

    def data_holders(self) -> frozenset[NodeId]:
        """The data holders in the directory (cached: every change of the directory clears it)."""
        dhs = self.dhs_cache
        if dhs is None:
            dhs = self.dhs_cache = frozenset(pid for pid, p in self.directory.items() if p.stage == 0)
        return dhs

    def job(self, kind: ComputeKind, ref: Any) -> int:
        self._job_seq += 1
        self.jobs[self._job_seq] = (kind, ref)
        return self._job_seq

    def send(self, to: NodeId, msg: Message) -> Send:
        return Send(to, msg)

    def send_booked(self, to: NodeId, msg: Message, now: float) -> Send:
        """Send a tensor message whose ack nothing waits on (a gradient share, a state transfer),
        booking its bytes on our model of our uplink: the activations and gradients sent after it
        queue behind it, and their ack deadlines and bandwidth samples must know."""
        self.reserve_uplink(to, msg.tensor_bytes, now)
        self.unmeasured_until_s = max(self.unmeasured_until_s, self.uplink_free_est_s)
        return self.send(to, msg)

    def timer(self, key: tuple[Any, ...], delay_s: float, now: float) -> SetTimer:
        return SetTimer(key, now + delay_s)

    def cancel(self, key: tuple[Any, ...]) -> CancelTimer:
        return CancelTimer(key)

    def link(self, peer: NodeId) -> LinkEstimate:
        """Our estimate of the link to `peer`: measured EMA, else the driver's prior, else a default."""
        est = self.links.get(peer)
        if est is None:
            info = self.directory.get(peer)
            prior = self.link_prior
            est = prior(self.me, info) if prior is not None and info is not None else DEFAULT_LINK
            self.links[peer] = est
        return est

    def reserve_uplink(self, peer: NodeId, size_bytes: int, now: float) -> float:
        """Our own model of our uplink (tensor sends go out one after another): the expected
        receipt-ack delay of a tensor queued now, in seconds (what its ack deadline starts from)."""
        link = self.link(peer)
        start = max(now, self.uplink_free_est_s)
        tx = size_bytes / link.bandwidth_bytes_per_s
        self.uplink_free_est_s = start + tx
        return start - now + tx + 2 * link.latency_s

    def deadline_for(self, peer: NodeId, expected_s: float) -> float:
        """Receipt-ack deadline: multiplier x (expected delay from the link EMAs and our uplink
        backlog + EMA of how much acks from this peer were late before), at least the floor.
        Work a peer does after receipt is watched through membership, not deadlines."""
        excess = self.ack_excess_ema_s.get(peer, 0.0)
        return max(self.cfg.deadline_floor_s, self.cfg.deadline_multiplier * (expected_s + excess))

    def ack_deadline_s(self, peer: NodeId, size_bytes: int) -> float:
        """Deadline of a request whose answer carries `size_bytes` (no uplink reservation)."""
        link = self.link(peer)
        return self.deadline_for(peer, 2 * link.latency_s + size_bytes / link.bandwidth_bytes_per_s)

    def observe_ack(self, peer: NodeId, rtt_s: float, expected_s: float) -> None:
        a = self.cfg.ema_alpha
        excess = max(0.0, rtt_s - expected_s)
        old = self.ack_excess_ema_s.get(peer)
        self.ack_excess_ema_s[peer] = excess if old is None else (1 - a) * old + a * excess

    def observe_transfer(self, peer: NodeId, size_bytes: int, sent_at: float, now: float) -> list[Effect]:
        """A tensor's receipt ack: a delivery-rate sample of the link's bandwidth (EMA); tell the
        router when the estimate moved by more than 20%.

        The sample is measured, not modelled: the last byte left our uplink one round of latency
        before its ack came back (`done`), and it began when it was sent or when the tensor ahead
        of it on our FIFO uplink was done, whichever is later, that tensor's own ack having told
        us when. (Subtracting our modelled queue instead, which is itself built from these
        estimates, fed their errors back into them: samples of one link spread 50-fold.) No
        sample from a tensor that may have queued behind one nothing acks (a gradient share), nor
        from an ack that comes after the ack of a tensor sent later (overtaken or delayed: the
        FIFO order says it was done first, the times say otherwise)."""
        old = self.link(peer)
        done = now - 2 * old.latency_s
        prev = self.uplink_done_s
        if done <= prev or sent_at < self.uplink_done_sent_s:
            return []
        self.uplink_done_s, self.uplink_done_sent_s = done, sent_at
        if sent_at < self.unmeasured_until_s:
            return []
        transfer_s = done - max(sent_at, prev)
        if transfer_s <= 1e-9:
            return []
        sample = size_bytes / transfer_s
        a = self.cfg.ema_alpha
        bw = (1 - a) * old.bandwidth_bytes_per_s + a * sample
        new = LinkEstimate(old.latency_s, bw)
        self.links[peer] = new
        if abs(bw - old.bandwidth_bytes_per_s) > 0.2 * old.bandwidth_bytes_per_s:
            return list(self.router.on_link_update(peer, new, now))
        return []


    def release(self, peer: NodeId) -> None:
        self.router.on_release(peer)
