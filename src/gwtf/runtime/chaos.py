"""Fault injection for deterministic chaos tests: a node kills itself (or corrupts one frame it
sends) at a named protocol point.

Owns: the fault spec grammar (`runtime.fault` in the config, or `$GWTF_FAULT`), its parser and the
matcher the node driver consults before it executes a compute job or writes a record. Killing is
`SIGKILL` on the node's own process (nothing is flushed by Python, exactly like `kill -9` from
outside), after the driver has flushed its record log so the exactly-once ledger stays checkable.

Grammar (one fault per node; fields after the point are optional filters, all must match):

    kill:<point>[:iter=N][:from=N][:mb=K][:stage=S][:after=C]
    flip:<point>[...the same filters]

- `kill` SIGKILLs the node; `flip` (once) flips one ciphertext bit of the next frame with a
  tensor body the node sends (`Transport.corrupt_next_frame`): the receiver must refuse the
  frame and close that connection, and the swarm must recover the lost message.
- `point`: a compute kind (`embed`, `forward`, `loss`, `backward`, `embed_backward`, `step`, ...),
  `aggregate` (the node is about to send or apply its stage's aggregation), or any record event
  name the protocol core emits. `any` matches every point.
- `iter`: the iteration; `from`: any iteration >= N (the first match from then on: routing decides
  which replica of a stage carries an iteration's microbatches, so a relay may see none in a given
  iteration); `mb`: the microbatch index inside its data holder's iteration; `stage`;
  `after`: skip the first C matches (kill on match number C+1).

Must not import torch or asyncio (the driver calls it synchronously).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from gwtf.errors import UserError

FAULT_ENV = "GWTF_FAULT"
KILL_EXIT_CODE = 137  # what a shell reports for a process killed by SIGKILL
ACTIONS = ("kill", "flip")
AGGREGATION_POINTS = frozenset({"aggregate", "aggregation", "grad_share", "step"})


@dataclass(slots=True)
class FaultSpec:
    """A parsed fault: the point to match and optional filters; `seen` counts matches so far."""

    action: str
    point: str
    iteration: int | None = None
    from_iteration: int | None = None
    mb_index: int | None = None
    stage: int | None = None
    after: int = 0
    seen: int = field(default=0, compare=False)

    def matches(self, point: str, iteration: int | None, mb_index: int | None, stage: int | None) -> bool:
        """True when a protocol point satisfies every filter (counts toward `after`)."""
        if self.point not in ("any", point):
            if not (self.point == "aggregate" and point in AGGREGATION_POINTS):
                return False
        if self.iteration is not None and iteration != self.iteration:
            return False
        if self.from_iteration is not None and (iteration is None or iteration < self.from_iteration):
            return False
        if self.mb_index is not None and mb_index != self.mb_index:
            return False
        if self.stage is not None and stage != self.stage:
            return False
        self.seen += 1
        return self.seen > self.after


_INT_KEYS = {"iter": "iteration", "iteration": "iteration", "from": "from_iteration", "mb": "mb_index", "stage": "stage", "after": "after"}


def parse_fault(text: str) -> FaultSpec | None:
    """Parse a fault spec; "" -> None. A malformed spec is a UserError naming the bad part."""
    text = text.strip()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in ACTIONS or not parts[1]:
        raise UserError(f"runtime.fault {text!r}: expected kill|flip:<point>[:iter=N][:from=N][:mb=K][:stage=S]"
                        "[:after=C]")
    values: dict[str, int] = {}
    for part in parts[2:]:
        key, sep, raw = part.partition("=")
        if not sep or key not in _INT_KEYS:
            raise UserError(f"runtime.fault {text!r}: unknown filter {part!r} (iter, from, mb, stage, after)")
        try:
            values[_INT_KEYS[key]] = int(raw)
        except ValueError:
            raise UserError(f"runtime.fault {text!r}: {key} must be an integer, got {raw!r}") from None
    return FaultSpec(action=parts[0], point=parts[1], **values)


def fault_from(config_value: str, environ: dict[str, str] | None = None) -> FaultSpec | None:
    """The node's fault: the config value, else `$GWTF_FAULT`, else None."""
    env = os.environ if environ is None else environ
    return parse_fault(config_value or env.get(FAULT_ENV, ""))


def kill_self() -> None:
    """SIGKILL this process: no atexit handlers, no flushing, sockets reset by the kernel."""
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(KILL_EXIT_CODE)  # pragma: no cover - unreachable unless SIGKILL is blocked
