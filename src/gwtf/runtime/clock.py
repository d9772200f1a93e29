"""Wall-clock plumbing of the node driver: protocol timers, ordered per-peer outboxes, WAN delays.

Owns:
- `TimerTable`: the core's `SetTimer`/`CancelTimer` effects on `loop.call_at` (re-setting a key
  replaces it; the loop clock `loop.time()` is the `now` the core sees);
- `Outbox`: one FIFO queue and one sending task per peer address, so messages to a peer leave in
  the order the core emitted them and a slow peer never blocks the others; failures are
  reported to a callback (the driver turns them into `NodeCore.on_send_failed`);
- `WanModel`: optional WAN emulation on loopback with the simulator's delay model
  (`gwtf.flow.network.uplink_send`): a message from region a to region b is held back by
  latency(a, b) + (payload + header) / bandwidth(a, b) from the region table, after the bulk
  messages queued on this node's uplink (a big tensor delays the tensors sent after it, to any
  peer, as on a real uplink); a control message waits for none.

Every task is owned (tracked and cancelled by `close`). The holding-back of a message is the
emulated network itself, not synchronisation. Must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from gwtf.flow.network import Network, load_network, uplink_send

log = logging.getLogger(__name__)


class TimerTable:
    """Protocol timers on the event loop: `set(key, at)` replaces, `cancel(key)` forgets."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[Any], None]) -> None:
        self._loop = loop
        self._fire = fire
        self._handles: dict[Hashable, asyncio.TimerHandle] = {}

    def set(self, key: Hashable, at: float) -> None:
        self.cancel(key)
        self._handles[key] = self._loop.call_at(at, self._run, key)

    def cancel(self, key: Hashable) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)

    def _run(self, key: Hashable) -> None:
        self._handles.pop(key, None)
        self._fire(key)


class WanModel:
    """Delays of an emulated WAN between the regions of one network table, for this node's
    messages: the simulator's delay model (`gwtf.flow.network.uplink_send`) on its uplink."""

    def __init__(self, network: Network) -> None:
        self.network = network
        self._uplink_free_s = 0.0

    @classmethod
    def from_name(cls, name: str) -> WanModel | None:
        """"" -> None (no emulation); else the named table (UserError if unknown)."""
        return cls(load_network(name)) if name else None

    def check_region(self, region: str) -> None:
        """ValueError naming the region if the table does not know it."""
        if region not in self.network.regions:
            known = ", ".join(self.network.regions)
            raise ValueError(f"region {region!r} is not in network {self.network.name} ({known})")

    def deliver_at(self, now: float, src: str, dst: str, payload_bytes: int) -> float:
        """When a message with `payload_bytes` of tensors (plus its header), sent now from region
        `src` to `dst`, arrives: after the bulk messages queued on this node's uplink."""
        if src not in self.network.regions or dst not in self.network.regions:
            return now  # unknown region: no emulated delay (logged once by the driver)
        self._uplink_free_s, _, arrival = uplink_send(
            self._uplink_free_s, now, self.network.latency_s(src, dst), self.network.bandwidth_bytes_per_s(src, dst),
            payload_bytes)
        return arrival


SendFn = Callable[[str, Any, list[Any]], Awaitable[None]]
FailFn = Callable[[str, Any, BaseException], None]


@dataclass(slots=True)
class _Queue:
    items: deque[tuple[float, Any, list[Any]]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class Outbox:
    """Per-address FIFO send queues; `put(addr, msg, tensors, deliver_at)` never blocks."""

    def __init__(self, send: SendFn, on_fail: FailFn, loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self._on_fail = on_fail
        self._loop = loop
        self._queues: dict[str, _Queue] = {}
        self._closed = False

    def put(self, addr: str, msg: Any, tensors: list[Any], deliver_at: float = 0.0) -> None:
        if self._closed:
            return
        q = self._queues.get(addr)
        if q is None:
            q = self._queues[addr] = _Queue()
        q.items.append((deliver_at, msg, tensors))
        if q.task is None or q.task.done():
            q.task = self._loop.create_task(self._drain(addr, q), name=f"outbox {addr}")

    def pending(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    async def _drain(self, addr: str, q: _Queue) -> None:
        while q.items:
            deliver_at, msg, tensors = q.items[0]
            delay_s = deliver_at - self._loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)  # the emulated WAN holds the message back
            q.items.popleft()
            try:
                await self._send(addr, msg, tensors)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # SendFailed, or an encoding bug: the core decides what next
                self._on_fail(addr, msg, exc)

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until every queued message was handed to the transport."""
        tasks = [q.task for q in self._queues.values() if q.task is not None and not q.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        self._closed = True
        tasks = [q.task for q in self._queues.values() if q.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
