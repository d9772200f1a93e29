"""Starting, watching and always killing node processes on this machine.

Owns `ProcessGroup`: it starts `python -m gwtf node ...` processes, each in its own session (so
`killpg` reaches anything the node started), with stdout+stderr going to
`DIR/nodes/<name>/stdout.log` (every node gets the group's config, overrides and `--secret-file`,
and inherits the environment, $GWTF_SWARM_SECRET included); it waits for each node's single
`READY {json}` line with a deadline (ports come from that line, never fixed ports); it kills (SIGKILL, the churn the paper
means by "crash") or stops (SIGTERM, a graceful leave) nodes; and it kills every process it ever
started when closed, on exceptions, on Ctrl+C, and at interpreter exit (atexit). A node process
found dead (killed, crashed, or exited) gets its status.json rewritten by the launcher with
`dead: true`, its exit code and a dead state ("crashed" for a signal, else "exited" unless the
node wrote its own final status): a kill -9 leaves no node to say so itself.

Waiting is polling of files and `Popen.poll()` under a deadline; nothing sleeps to synchronise.

Must not import torch or asyncio.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from gwtf.runtime.status import STATUS_FILE, STDOUT_FILE, node_dir, read_status, write_status

READY_PREFIX = "READY "
POLL_S = 0.02  # file polling period while waiting for a READY line

_LIVE_GROUPS: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node process to start: identity flags of `gwtf node`."""

    name: str
    role: str = "relay"  # "data-holder" | "relay"
    stage: str = "auto"  # "auto" or a stage number
    region: str = "local"
    shard: int | None = None  # data holders: which data shard (0..D-1)
    fault: str = ""  # runtime.fault for this node only (chaos tests)
    slowdown: float = 1.0  # runtime.compute_slowdown for this node only (a slow GPU: tests, demos)


@dataclass(slots=True)
class NodeProcess:
    """A started node: its plan, process, files and what its READY line said."""

    plan: NodePlan
    popen: subprocess.Popen[bytes]
    dir: Path
    started_s: float
    ready: dict[str, Any] | None = None
    state: str = "starting"  # starting | ready | killed | stopped | exited
    _offset: int = field(default=0, repr=False)
    _marked: bool = field(default=False, repr=False)  # its status.json says it is dead

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def addr(self) -> str:
        assert self.ready is not None, f"node {self.name} is not ready"
        return f"{self.ready['host']}:{self.ready['port']}"

    @property
    def node_id(self) -> str:
        assert self.ready is not None, f"node {self.name} is not ready"
        return str(self.ready["node"])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            data = (self.dir / STDOUT_FILE).read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")


class NodeStartError(RuntimeError):
    """A node exited or stayed silent before printing READY."""


def parse_ready(line: str) -> dict[str, Any] | None:
    """The JSON object of a `READY {json}` line, or None if the line is not one."""
    if not line.startswith(READY_PREFIX):
        return None
    try:
        data = json.loads(line[len(READY_PREFIX):])
    except ValueError:
        return None
    return data if isinstance(data, dict) and {"node", "host", "port"} <= data.keys() else None


class ProcessGroup:
    """Owns node processes; `close()` (also via `with`, atexit) SIGKILLs every one still running."""

    def __init__(
        self,
        out_dir: str | Path,
        config_path: str | None = None,
        overrides: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        python: str = sys.executable,
        secret_file: str | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.config_path = config_path
        self.overrides = list(overrides)
        self.secret_file = secret_file  # every node's --secret-file (None: config, else the inherited env)
        self.env = {**os.environ, **(extra_env or {})}
        self.python = python
        self.procs: list[NodeProcess] = []
        _LIVE_GROUPS.add(self)

    def command(self, plan: NodePlan, join: str | None, listen: str = "127.0.0.1:0") -> list[str]:
        """The argv of `gwtf node` for `plan`."""
        cmd = [self.python, "-m", "gwtf", "node", "--listen", listen, "--out", str(self.out_dir),
               "--name", plan.name, "--role", plan.role, "--stage", plan.stage, "--region", plan.region]
        if plan.shard is not None:
            cmd += ["--shard", str(plan.shard)]
        if join:
            cmd += ["--join", join]
        if self.config_path:
            cmd += ["--config", self.config_path]
        if self.secret_file:
            cmd += ["--secret-file", self.secret_file]
        for text in self.overrides:
            cmd += ["--set", text]
        if plan.fault:
            cmd += ["--set", f'runtime.fault="{plan.fault}"']
        if plan.slowdown != 1.0:
            cmd += ["--set", f"runtime.compute_slowdown={plan.slowdown!r}"]
        return cmd

    def spawn(self, plan: NodePlan, join: str | None = None) -> NodeProcess:
        """Start one node process (returns at once; see `wait_ready`)."""
        if any(p.name == plan.name for p in self.procs):
            raise ValueError(f"node name {plan.name!r} already used in this swarm")
        ndir = node_dir(self.out_dir, plan.name)
        with (ndir / STDOUT_FILE).open("wb") as out:
            popen = subprocess.Popen(
                self.command(plan, join), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        proc = NodeProcess(plan=plan, popen=popen, dir=ndir, started_s=time.monotonic())
        self.procs.append(proc)
        return proc

    def check_ready(self, proc: NodeProcess) -> bool:
        """Non-blocking: scan new stdout for the READY line; raise if the process died first."""
        if proc.ready is not None:
            return True
        try:
            with (proc.dir / STDOUT_FILE).open("rb") as f:
                f.seek(proc._offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        complete = chunk[: chunk.rfind(b"\n") + 1]
        proc._offset += len(complete)
        for raw in complete.decode("utf-8", "replace").splitlines():
            info = parse_ready(raw.strip())
            if info is not None:
                proc.ready, proc.state = info, "ready"
                return True
        if proc.popen.poll() is not None:
            proc.state = "exited"
            raise NodeStartError(
                f"node {proc.name} exited with code {proc.popen.returncode} before READY:\n{proc.log_tail()}"
            )
        return False

    def wait_ready(self, procs: Sequence[NodeProcess], timeout_s: float) -> None:
        """Block until every process printed READY; NodeStartError on exit or deadline."""
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            pending = [p for p in pending if not self.check_ready(p)]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise NodeStartError(f"no READY from {names} within {timeout_s:.0f}s:\n{pending[0].log_tail()}")
            time.sleep(POLL_S)  # polling period of a bounded wait, not synchronisation

    def kill(self, proc: NodeProcess) -> None:
        """kill -9 the node's whole process group (a crash)."""
        _signal_group(proc.popen, signal.SIGKILL)
        proc.popen.wait()
        proc.state = "killed"
        mark_dead(proc)

    def stop(self, proc: NodeProcess, timeout_s: float = 10.0) -> int:
        """SIGTERM (graceful leave), then SIGKILL after `timeout_s`; returns the exit code."""
        _signal_group(proc.popen, signal.SIGTERM)
        try:
            code = proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.popen, signal.SIGKILL)
            code = proc.popen.wait()
        proc.state = "stopped"
        mark_dead(proc)
        return code

    def live(self) -> list[NodeProcess]:
        """Processes still running; ones that exited by themselves are marked `exited`."""
        out = []
        for p in self.procs:
            if p.popen.poll() is None:
                out.append(p)
            else:
                if p.state in ("starting", "ready"):
                    p.state = "exited"
                mark_dead(p)
        return out

    def close(self) -> None:
        """SIGKILL every process this group started that is still running, and reap them."""
        for p in self.procs:
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGKILL)
        for p in self.procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
                continue
            mark_dead(p)
        _LIVE_GROUPS.discard(self)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def mark_dead(proc: NodeProcess) -> None:
    """Rewrite a dead node's status.json (once): `dead`, `exit_code`, and its state ("crashed"
    when a signal ended it; "exited" when it ended without writing a final state itself)."""
    code = proc.popen.poll()
    if code is None or proc._marked:
        return
    proc._marked = True
    path = proc.dir / STATUS_FILE
    status = read_status(path) or {"name": proc.name, "role": proc.plan.role}
    if code < 0:
        status["state"] = "crashed"
        status["signal"] = signal.Signals(-code).name
    elif status.get("state") != "exited" or code != 0:
        status["state"] = str(status.get("stop_reason") or "exited")
    status.update(dead=True, exit_code=code, in_flight=0)
    try:
        write_status(path, status)
    except OSError:  # the folder is gone (a test's tmp dir): nothing to mark
        pass


def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the child's process group (its own session), falling back to the child alone."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


@atexit.register
def _close_all_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.close()
