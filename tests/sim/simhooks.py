"""Hooks the simulator tests put into a `Simulator` run (test code, not a driver feature)."""

from __future__ import annotations

from collections.abc import Callable

from gwtf.protocol.core import NodeCore
from gwtf.sim.simulator import Simulator


def crash_on_delivery(sim: Simulator, when: Callable[[str, object, NodeCore], bool]) -> list[str]:
    """Crash the first receiver for which `when(dst, msg, its core)` holds, right after the
    message reaches it (whatever it then queued on its uplink is lost with it). Returns the list
    the crashed node's name is appended to, for the test to assert that the crash happened."""
    deliver, crashed = sim._deliver, []

    def deliver_then_crash(src: str, dst: str, msg: object, left_s: float) -> None:
        deliver(src, dst, msg, left_s)  # type: ignore[arg-type]
        core = sim.cores.get(dst)
        if crashed or core is None or not when(dst, msg, core):
            return
        crashed.append(dst)
        sim.crash(dst)

    sim._deliver = deliver_then_crash  # type: ignore[method-assign]
    return crashed
