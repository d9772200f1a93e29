"""A minimal deterministic discrete-event engine: a heap of (time, sequence, callback, args).

Owns: the virtual clock and event ordering. Ties at equal time are broken by insertion
sequence, so a run is a pure function of its inputs and seed (simpy's rule). Actors (NodeCores)
are not generator processes: drivers schedule plain callbacks, which keeps the loop small and
fast enough for 10,000 nodes.

Cancellation is lazy: `schedule` returns a handle; `cancel(handle)` marks it dead and the loop
skips it when popped.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class Engine:
    """Virtual-time event loop."""

    __slots__ = ("now", "_heap", "_seq", "_cancelled", "events_run")

    def __init__(self, start_s: float = 0.0) -> None:
        self.now: float = start_s
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._cancelled: set[int] = set()
        self.events_run = 0

    def schedule(self, at: float, fn: Callable[..., Any], *args: Any) -> int:
        """Run `fn(*args)` at virtual time `at` (clamped to now); returns a cancellable handle."""
        if at < self.now:
            at = self.now
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, fn, args))
        return self._seq

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> int:
        """Run `fn(*args)` `delay_s` seconds from now."""
        return self.schedule(self.now + delay_s, fn, *args)

    def cancel(self, handle: int) -> None:
        """Skip the event with this handle if it has not run yet."""
        self._cancelled.add(handle)

    def __len__(self) -> int:
        return len(self._heap)

    def peek(self) -> float | None:
        """Time of the next event, or None when idle."""
        return self._heap[0][0] if self._heap else None

    def step(self) -> bool:
        """Run one event; False when the heap is empty."""
        heap = self._heap
        while heap:
            at, seq, fn, args = heapq.heappop(heap)
            if seq in self._cancelled:
                self._cancelled.discard(seq)
                continue
            self.now = at
            self.events_run += 1
            fn(*args)
            return True
        return False

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Run events until the heap is empty, virtual time passes `until_s`, or `stop()` is true."""
        heap = self._heap
        cancelled = self._cancelled
        pop = heapq.heappop
        limit_s = until_s if until_s is not None else math.inf
        ran = 0  # written back in `finally` (events_run is read only between runs)
        try:
            while heap:
                if heap[0][0] > limit_s:
                    self.now = limit_s
                    return
                at, seq, fn, args = pop(heap)
                if cancelled and seq in cancelled:
                    cancelled.discard(seq)
                    continue
                self.now = at
                ran += 1
                fn(*args)
                if stop is not None and stop():
                    return
        finally:
            self.events_run += ran
        if until_s is not None and self.now < until_s:
            self.now = until_s
