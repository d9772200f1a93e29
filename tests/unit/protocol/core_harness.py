"""A tiny in-memory driver for NodeCore unit tests: FIFO message queue, manual clock.

Messages are delivered in send order after `latency_s`; computes finish in emission order after
`compute_s` each; timers fire when the clock passes them. `drop` decides per message whether it
is lost (fault injection at the core boundary); `crash(node)` removes a core silently.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any, assert_never

from gwtf.config import FlowConfig, ProtocolConfig
from gwtf.protocol.base import CancelTimer, Log, Message, Send, SetTimer
from gwtf.protocol.core import NodeCore
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.messages import Compute, Effect, FreeIteration, Record
from gwtf.protocol.router import PeerInfo
from gwtf.protocol.systems import build_core, get_system

TRAIN = TrainParams(stages=3, microbatches=2, iterations=2, activation_bytes=1000,
                    stage_flops=(1.0, 1.0, 1.0), stage_state_bytes=(3000, 3000, 3000),
                    stage_grad_bytes=(1000, 1000, 1000), tokens_per_microbatch=16)


class Harness:
    def __init__(self, peers: list[PeerInfo], train: TrainParams = TRAIN, latency_s: float = 0.01,
                 cfg: ProtocolConfig | None = None, system: str | None = None, start_s: float = 0.0) -> None:
        """`system` (a `protocol.systems` name) builds the cores as the drivers do; without it,
        plain NodeCores. `start_s` is the clock's value at the start (a driver's epoch)."""
        self.cfg = cfg or ProtocolConfig()
        self.train = train
        self.now = self.start_s = start_s
        self.latency_s = latency_s
        if system is None:
            self.cores = {p.id: NodeCore(p, self.cfg, train, random.Random(p.id)) for p in peers}
        else:
            sys_ = get_system(system, self.cfg)
            self.cores = {p.id: build_core(sys_, p, self.cfg, FlowConfig(), train, random.Random(p.id))
                          for p in peers}
        self.peers = peers
        self._q: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.timers: dict[tuple[str, Any], float] = {}
        self.busy: dict[str, float] = {}
        self.records: list[tuple[float, str, str, dict[str, Any]]] = []
        self.drop: Callable[[str, str, Message], bool] = lambda src, dst, msg: False
        self.sent: list[tuple[str, str, Message]] = []
        self.computes: list[tuple[str, Compute]] = []

    def _push(self, at: float, kind: str, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._q, (at, self._seq, kind, args))

    def start(self) -> None:
        for p in self.peers:
            self.apply(p.id, self.cores[p.id].on_start(self.start_s, self.peers))

    def apply(self, node: str, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.sent.append((node, e.to, e.msg))
                if not self.drop(node, e.to, e.msg):
                    self._push(self.now + self.latency_s, "msg", node, e.to, e.msg)
            elif isinstance(e, SetTimer):
                self.timers[(node, e.key)] = e.at
                self._push(e.at, "timer", node, e.key, e.at)
            elif isinstance(e, CancelTimer):
                self.timers.pop((node, e.key), None)
            elif isinstance(e, Compute):
                self.computes.append((node, e))
                start = max(self.now, self.busy.get(node, 0.0))
                self.busy[node] = start + 0.1
                self._push(start + 0.1, "compute", node, e.job_id)
            elif isinstance(e, Record):
                self.records.append((self.now, node, e.event, dict(e.fields)))
            elif isinstance(e, (Log, FreeIteration)):
                pass
            else:
                assert_never(e)

    def crash(self, node: str) -> None:
        self.cores.pop(node, None)

    def run(self, until_s: float, stop: Callable[[], bool] | None = None) -> None:
        while self._q and self._q[0][0] <= until_s:
            at, _, kind, args = heapq.heappop(self._q)
            self.now = at
            if kind == "msg":
                src, dst, msg = args
                core = self.cores.get(dst)
                if core is None:
                    if src in self.cores:
                        self._push(self.now + 0.5, "failed", src, dst, msg)
                    continue
                self.apply(dst, core.on_message(src, msg, at))
            elif kind == "failed":
                src, dst, msg = args
                if src in self.cores:
                    self.apply(src, self.cores[src].on_send_failed(dst, msg, at))
            elif kind == "timer":
                node, key, when = args
                if self.timers.get((node, key)) == when and node in self.cores:
                    del self.timers[(node, key)]
                    self.apply(node, self.cores[node].on_timer(key, at))
            elif kind == "compute":
                node, job = args
                if node in self.cores:
                    self.apply(node, self.cores[node].on_compute_done(job, at))
            if stop is not None and stop():
                return

    def events(self, name: str) -> list[dict[str, Any]]:
        return [f for _, _, e, f in self.records if e == name]


def peers(stage_sizes: tuple[int, ...], capacity: int = 4, demand: int = 2) -> list[PeerInfo]:
    """Nodes named d0.. (data holders), a1.. (stage 1), b1.. (stage 2), ..."""
    out: list[PeerInfo] = []
    for stage, n in enumerate(stage_sizes):
        prefix = "d" if stage == 0 else "abcdefgh"[stage - 1]
        for i in range(n):
            out.append(PeerInfo(id=f"{prefix}{i}", stage=stage, region="r", compute_s=0.1 * (i + 1),
                                capacity=capacity, demand=demand if stage == 0 else 0, shard=i if stage == 0 else -1))
    return out
