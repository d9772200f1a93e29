"""Fault injection for deterministic chaos tests: a node kills itself (or corrupts one frame it
sends) at a named protocol point or time.

Owns: where a node's fault comes from (`runtime.fault` in the config, or `$GWTF_FAULT`), which
faults a node process carries out (`RUNTIME_ACTIONS`, `RUNTIME_TRIGGERS`) and `kill_self`.
The grammar, its parser and the matcher (`FaultWatch`) are `gwtf.protocol.faults`, the same the
simulator uses (docs/faults.md). A node carries one fault, in the compact form, e.g.

    crash:compute=forward:iter=2:mb=1     crash:after=step:count=2     flip:compute=forward:from=2

- `crash` SIGKILLs the node's own process (nothing is flushed by Python, exactly like `kill -9`
  from outside), after the driver has flushed its record log so the exactly-once ledger stays
  checkable; `flip` flips one ciphertext bit of the next frame with a tensor body the node sends
  (`Transport.corrupt_next_frame`): the receiver must refuse the frame and close that
  connection, and the swarm must recover the lost message.
- triggers: `compute=KIND` (the node is about to run that job; "aggregate" = export_grad,
  reduce or step), `after=RECORD` (the core emitted that record; the node dies before writing
  it), `t=SECONDS` (seconds since the node process started, the records' `t_s`).

Before the one grammar, this module had its own: `kill:<point>[:iter=N][:from=N][:mb=K]
[:stage=S][:after=C]`. Today `kill:` is `crash:`, a point is written `compute=KIND` or
`after=RECORD` (the old point matched either), and `after=C` (skip C matches) is `count=C+1`.

Must not import torch or asyncio (the driver calls it synchronously).
"""

from __future__ import annotations

import os
import signal

from gwtf.protocol.faults import Fault, parse_fault, require

FAULT_ENV = "GWTF_FAULT"
KILL_EXIT_CODE = 137  # what a shell reports for a process killed by SIGKILL
RUNTIME_ACTIONS = ("crash", "flip")
RUNTIME_TRIGGERS = ("time", "record", "compute")


def runtime_fault(text: str) -> Fault | None:
    """A node's fault from its compact spec; "" -> None. A malformed spec, or one a node cannot
    carry out, is a FaultError (a UserError: one line, exit 2) naming the bad part."""
    if not text.strip():
        return None
    fault = parse_fault(text, "runtime.fault")
    require(fault, RUNTIME_ACTIONS, RUNTIME_TRIGGERS, f"runtime.fault {text.strip()!r}")
    return fault


def fault_from(config_value: str, environ: dict[str, str] | None = None) -> Fault | None:
    """The node's fault: the config value, else `$GWTF_FAULT`, else None."""
    env = os.environ if environ is None else environ
    return runtime_fault(config_value or env.get(FAULT_ENV, ""))


def kill_self() -> None:
    """SIGKILL this process: no atexit handlers, no flushing, sockets reset by the kernel."""
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(KILL_EXIT_CODE)  # pragma: no cover - unreachable unless SIGKILL is blocked
