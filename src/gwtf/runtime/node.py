"""The node process: the asyncio driver that runs one `NodeCore` over real sockets and torch.

Owns the event loop side of a node: the authenticated `Transport` (Send effects go out through
per-peer `Outbox`es, optionally delayed by the emulated WAN; `SendFailed` becomes
`core.on_send_failed`), protocol timers on `loop.call_at` (`TimerTable`), the single torch thread
(a one-worker executor running `StageWorker` jobs, so heartbeats keep flowing while a stage
computes), the per-node files (`status.json`, `records.jsonl`), the `READY {json}` line (listening),
the `SERVING {json}` line (an active member serving its stage), progress lines on stdout, a line
per member lost or joined (this node's directory, checked every status tick), fault injection
(`runtime.fault`), graceful leave on SIGINT/SIGTERM/SIGHUP (`core.on_leave`, flush, exit 0) and
the exit code of a node that gives up (`STOP_EXIT`).

No torch call runs on the event loop: compute jobs, stage construction and the freeing of torch
tensors go to the torch thread in emission order (see `gwtf.runtime.drive`). A stall of the loop
itself (the status timer firing late by more than a heartbeat period) is recorded (`loop_stall`).

Protocol decisions are the core's; this module only executes effects (see `gwtf.runtime.drive`
for the mapping of compute effects and tensor keys to the worker). The node's id embeds its
key fingerprint, region and address, `<name>~<fingerprint>/<region>@<host>:<port>` (the
fingerprint of its static key, `runtime.keys`, which every handshake checks), so a peer id is all
a node needs to reach a peer: no address book, no coordinator; membership spreads through the
core's own messages.

Must not import sim.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, assert_never

from gwtf.config import Config
from gwtf.errors import UserError
from gwtf.protocol.base import CancelTimer, Log, Message, NodeId, Send, SetTimer
from gwtf.protocol.faults import FaultWatch, Firing
from gwtf.protocol.kinds import RecordName
from gwtf.protocol.messages import Compute, Effect, FreeIteration, Record
from gwtf.runtime import drive, keys, statusrpc
from gwtf.runtime.chaos import fault_from, kill_self
from gwtf.runtime.clock import Outbox, TimerTable, WanModel
from gwtf.runtime.status import RECORDS_FILE, STATUS_FILE, RecordLog, dumps, node_dir, write_status
from gwtf.runtime.transport import SendFailed, Transport, listen_problem, parse_addr
from gwtf.runtime.watch import (
    MemberSnapshot,
    NodeStats,
    member_lines,
    member_snapshot,
    progress_line,
    should_print_progress,
)

log = logging.getLogger("gwtf.node")

# Exit codes of a node whose core stopped it (its `self_stop` record's reason); finished training
# and a graceful leave exit 0, a user error 2, any other reason 1.
STOP_EXIT = {"evicted": 3, "partitioned": 4, "compute_failed": 5}
STOP_TEXT = {
    "evicted": "evicted by the leader (declared dead: missed heartbeats or probes)",
    "partitioned": "no leader heard for protocol.partition_timeout_s (partitioned)",
    "compute_failed": "a compute job failed",
}


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """Process identity from flags: who this node is and where it listens."""

    name: str
    role: str  # "data-holder" | "relay"
    stage: int | None  # None = auto (the core picks the bottleneck stage when joining)
    region: str
    shard: int | None
    listen: str
    join: str | None
    device: str
    out_dir: Path
    resume: bool = False  # --resume: a bootstrap node continues from the newest complete checkpoint
    key_file: Path | None = None  # --key-file: the static key; None = KEY_FILE in the node's folder


def make_node_id(name: str, fingerprint: str, region: str, addr: str) -> NodeId:
    """`NAME~FINGERPRINT/REGION@HOST:PORT` (names never contain '~'; `keys.id_fingerprint` reads it)."""
    return f"{name}{keys.ID_KEY_SEP}{fingerprint}/{region}@{addr}"


def addr_of(node: NodeId) -> str:
    """The "host:port" a node id embeds (ValueError if it embeds none)."""
    _, sep, addr = node.rpartition("@")
    if not sep:
        raise ValueError(f"node id {node!r} has no address")
    return addr


def region_of(node: NodeId) -> str:
    head = node.rpartition("@")[0]
    return head.partition("/")[2] or "local"


class NodeRuntime:
    """Drives one NodeCore; `await run()` returns the process exit code."""

    def __init__(self, cfg: Config, ident: NodeIdentity) -> None:
        self.cfg = cfg
        self.ident = ident
        self.dir = node_dir(ident.out_dir, ident.name)
        self.records = RecordLog(self.dir / RECORDS_FILE)
        fault = fault_from(cfg.runtime.fault)
        self.faults = FaultWatch([fault] if fault else [])  # runtime.fault (docs/faults.md)
        self.wan = WanModel.from_name(cfg.runtime.wan)
        if self.wan is not None:
            self.wan.check_region(ident.region)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.started_s = time.monotonic()
        self.node_id: NodeId = ""
        self.stop = asyncio.Event()
        self.exit_code = 0
        self.state = "starting"
        self.stats = NodeStats()
        self.stop_reason: str | None = None
        self._last_failure = ""
        self._status_due = 0.0
        self.host: drive.Host | None = None
        self._serving_as: tuple[int, int] | None = None  # (stage, shard) of the last SERVING line
        self._members_seen: MemberSnapshot | None = None  # the directory as the member lines last saw it

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # diagnostics: a node that is not serving within the READY deadline dumps every thread's
        # stack into its log (and `kill -USR1 PID` does so at any time)
        faulthandler.dump_traceback_later(self.cfg.runtime.ready_timeout_s, exit=False, file=sys.stdout)
        await loop.run_in_executor(self.executor, drive.init_torch_thread, self.cfg.runtime.torch_threads)
        host, _, port_text = self.ident.listen.rpartition(":")
        host, port = host.strip("[]"), int(port_text)  # port 0: any free port
        secret, key = self._secret_and_key(host)
        transport = Transport("?", secret, self._on_frame, self.cfg.runtime, static_key=key)
        try:
            addr = await transport.start(host, port)
        except OSError as exc:  # e.g. the port was taken since `gwtf node` checked it
            faulthandler.cancel_dump_traceback_later()
            raise UserError(f"--listen {self.ident.listen}: {listen_problem(exc)}") from None
        self.node_id = make_node_id(self.ident.name, transport.fingerprint, self.ident.region, addr)
        transport.node_id = self.node_id  # ids embed the bound port, known only after listen
        self.transport = transport
        transport.on_status = statusrpc.StatusService(
            self._status, self._peer_stages, addr_of, self._ask_status, self.cfg.runtime.connect_timeout_s * 2,
        ).answer
        self.timers = TimerTable(loop, self._on_timer)
        self.outbox = Outbox(self._send_now, self._on_send_error, loop)
        try:
            self.host = await loop.run_in_executor(self.executor, drive.Host.create, self.cfg, self.ident,
                                                   self.node_id)
            if self.ident.resume and not self.ident.join:
                self._say(f"resuming from checkpoint version {self.host.core.start_version}")
            contact = await self._contact_id()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self._on_signal)
            self.state = "joining" if self.ident.join else "active"
            self._status_tick()
            ready = {"node": self.node_id, "name": self.ident.name, "host": addr.rpartition(":")[0],
                     "port": transport.port, "stage": self.host.stage, "role": self.ident.role,
                     "region": self.ident.region, "pid": os.getpid()}
            print("READY " + dumps(ready), flush=True)
            faulthandler.cancel_dump_traceback_later()
            log.info("READY node=%s stage=%s role=%s", self.node_id, self.host.stage, self.ident.role)
            for i, f in enumerate(self.faults.timed):  # t=SECONDS: since the process started (t_s)
                self.timers.set(("runtime", "fault", i), loop.time() + f.time_s - (time.monotonic() - self.started_s))
            self._apply(self.host.start(loop.time(), contact))
            if not self.ident.join:
                self._serving()  # an initial member serves its stage from the start
            await self.stop.wait()
        finally:
            await self._shutdown()
        return self.exit_code

    def _secret_and_key(self, listen_host: str) -> tuple[bytes, bytes]:
        """The swarm secret (the dev secret only if every address is loopback) and the node's
        static key (its --key-file, else KEY_FILE in the node's folder, created on first start).

        Raises:
            UserError: no usable secret, or an unreadable / unsafe key file.
        """
        hosts = [listen_host]
        if self.ident.join:
            try:
                hosts.append(parse_addr(self.ident.join)[0])
            except ValueError:
                raise UserError(f"--join {self.ident.join!r}: expected HOST:PORT") from None
        secret = keys.load_secret(self.cfg.runtime.secret_file or None, hosts=hosts)
        key = keys.load_or_create_key(self.ident.key_file or self.dir / keys.KEY_FILE)
        return secret, key

    async def _contact_id(self) -> NodeId | None:
        """The --join contact's node id (learned from its authenticated handshake)."""
        if not self.ident.join:
            return None
        try:
            return await self.transport.connect(self.ident.join, timeout_s=self.cfg.runtime.connect_timeout_s * 3)
        except SendFailed as exc:
            raise UserError(f"cannot reach join contact {self.ident.join}: {exc.reason}") from None

    def _on_signal(self) -> None:
        """SIGINT/SIGTERM/SIGHUP: graceful leave (announce), then exit once the leave is sent."""
        if self.state == "leaving":
            self.stop.set()
            return
        self.state = "leaving"
        log.info("leaving: node=%s", self.node_id)
        self.record(RecordName.LEAVE)
        if self.host is not None:
            self._apply(self.host.core.on_leave(asyncio.get_running_loop().time()))
        asyncio.get_running_loop().create_task(self._leave_then_stop())

    async def _finish_then_stop(self) -> None:
        """Training is over for this node: let queued compute jobs (e.g. the last step) and
        their messages complete, bounded, then exit."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.cfg.runtime.request_timeout_s):
                await loop.run_in_executor(self.executor, lambda: None)  # FIFO: earlier jobs are done
                await asyncio.sleep(0)  # let their completion callbacks run
        except TimeoutError:
            log.warning("finishing: compute jobs still running after %.0fs", self.cfg.runtime.request_timeout_s)
        await self.outbox.flush(timeout_s=self.cfg.runtime.connect_timeout_s)
        self.stop.set()

    async def _leave_then_stop(self) -> None:
        await self.outbox.flush(timeout_s=self.cfg.runtime.connect_timeout_s)
        self.stop.set()

    async def _shutdown(self) -> None:
        if hasattr(self, "timers"):
            self.timers.cancel_all()
        if hasattr(self, "outbox"):
            await self.outbox.close()
        if hasattr(self, "transport"):
            await self.transport.close()
        self.state = "finished" if self.stop_reason == "finished" else "exited"  # (still serving its stage to the end)
        self._write_status()
        self.records.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    # -- effects ------------------------------------------------------------------------------

    def _apply(self, effects: Iterable[Effect]) -> None:
        """Execute effects in order (none produces more: a core's answers run through here again)."""
        for eff in effects:
            self._apply_one(eff)

    def _apply_one(self, eff: Effect) -> None:
        assert self.host is not None
        if isinstance(eff, Send):
            self._send(eff.to, eff.msg)
        elif isinstance(eff, SetTimer):
            self.timers.set(eff.key, eff.at)
        elif isinstance(eff, CancelTimer):
            self.timers.cancel(eff.key)
        elif isinstance(eff, Log):
            self._log(eff)
        elif isinstance(eff, Record):
            self._on_record(eff)
        elif isinstance(eff, Compute):
            if self.faults.computes:
                self._fire(self.faults.on_compute(eff, self.ident.name))  # a crash loses the job
            self._submit(eff)
        elif isinstance(eff, FreeIteration):
            self.host.free_iteration(eff, submit=self._submit_job)
        else:
            assert_never(eff)  # raises on an effect type this driver does not know

    def _on_record(self, eff: Record) -> None:
        event, fields = drive.record_of(eff)
        if self.faults.records:
            self._fire(self.faults.on_record(event, self.ident.name, fields))  # before the record is written
        self.record(event, **fields)
        self._track(event, fields)
        if event == RecordName.SELF_STOP:
            self._stopped(str(fields.get("reason", "")))
        elif event == RecordName.TRAINING_OVER and self.state != "finishing":
            self.stop_reason = "finished"
            missing = fields.get("copies_missing") or ()
            note = f"; no copy of stage {', '.join(map(str, missing))} arrived in time" if missing else ""
            line = f"training finished ({self.cfg.train.iterations} iterations, weights version {fields.get('version')}){note}; exiting"
            print(f"gwtf node {self.ident.name}: {line}", file=sys.stderr, flush=True)
            log.info("%s", line)
        if event in drive.DONE_EVENTS and self.state != "finishing":
            self.state = "finishing"
            asyncio.get_running_loop().create_task(self._finish_then_stop())

    def _submit_job(self, fn: Any, *args: Any) -> None:
        """Queue a torch-thread job that answers nothing (e.g. freeing tensors), in order."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

        def done(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.error("torch-thread job %s failed: %r", getattr(fn, "__name__", fn), f.exception())

        fut.add_done_callback(done)

    def _stopped(self, reason: str) -> None:
        """The core stopped this node: choose the exit code and say why, in one line."""
        self.stop_reason = reason
        last, total = self.stats.iteration, self.cfg.train.iterations
        finished = reason == "partitioned" and isinstance(last, int) and total > 0 and last >= total - 1
        if finished:  # only the leader hears training_done; the others outlive it, then stop
            self.exit_code = 0
            line = f"training finished ({total} iterations); stopping: no leader any more"
        else:
            self.exit_code = STOP_EXIT.get(reason, 1)
            text = STOP_TEXT.get(reason, reason or "stopped by its protocol core")
            detail = f": {self._last_failure}" if reason == "compute_failed" and self._last_failure else ""
            line = f"stopped: {text}{detail} (exit {self.exit_code})"
        print(f"gwtf node {self.ident.name}: {line}", file=sys.stderr, flush=True)
        (log.info if finished else log.error)("%s", line)
        self._write_status()

    def _submit(self, eff: Compute) -> None:
        assert self.host is not None
        host = self.host
        fut = asyncio.get_running_loop().run_in_executor(self.executor, host.compute, eff)

        def done(f: asyncio.Future[drive.ComputeResult]) -> None:
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                self._compute_failed(eff, exc)
                return
            result = f.result()
            for event, fields in result.records:
                self.record(event, **fields)
                self._track(event, fields)
            if not self.stop.is_set():
                self._apply(host.compute_done(eff, result, asyncio.get_running_loop().time()))

        fut.add_done_callback(done)

    def _compute_failed(self, eff: Any, exc: BaseException) -> None:
        """A job raised on the torch thread: the core decides (refetch, refuse, or leave + stop)."""
        reason = f"{type(exc).__name__}: {exc}"
        self._last_failure = f"{getattr(eff, 'kind', '?')}: {reason}"[:300]
        log.error("compute %s failed: job=%s %s", getattr(eff, "kind", "?"), drive.job_id(eff), reason,
                  exc_info=exc if not isinstance(exc, ValueError) else None)
        if self.host is not None and not self.stop.is_set():
            self._apply(self.host.core.on_compute_failed(drive.job_id(eff), reason, asyncio.get_running_loop().time()))

    def _send(self, to: NodeId, msg: Message) -> None:
        assert self.host is not None
        try:
            addr = addr_of(to)
        except ValueError:
            self._apply(self.host.core.on_send_failed(to, msg, asyncio.get_running_loop().time()))
            return
        tensors = self.host.tensors_for(msg)
        log.debug("send %s to=%s tensors=%d", msg.TYPE, to, len(tensors))
        loop = asyncio.get_running_loop()
        at = 0.0
        if self.wan is not None:
            payload = sum(int(t.nbytes) for t in tensors)
            at = self.wan.deliver_at(loop.time(), self.ident.region, region_of(to), payload)
        self.outbox.put(addr, (to, msg), tensors, at)

    async def _send_now(self, addr: str, item: Any, tensors: list[Any]) -> None:
        _, msg = item
        await self.transport.send(addr, msg, tensors)

    def _on_send_error(self, addr: str, item: Any, exc: BaseException) -> None:
        to, msg = item
        if not isinstance(exc, SendFailed):
            log.error("send of %s to %s failed: %r", msg.TYPE, to, exc)
        if self.host is not None and not self.stop.is_set():
            self._apply(self.host.core.on_send_failed(to, msg, asyncio.get_running_loop().time()))

    def _on_frame(self, sender: NodeId, msg: Message, tensors: list[Any]) -> None:
        if self.host is None or self.stop.is_set():
            return
        now = asyncio.get_running_loop().time()
        log.debug("recv %s from=%s tensors=%d", msg.TYPE, sender, len(tensors))
        try:
            self.host.store_tensors(msg, tensors)
        except ValueError as exc:
            log.warning("refused %s from %s: %s", msg.TYPE, sender, exc)
            self.record(RecordName.MESSAGE_REFUSED, sender=sender, type=msg.TYPE, reason=str(exc))
            return
        self._apply(self.host.core.on_message(sender, msg, now))

    def _on_timer(self, key: Any) -> None:
        if key == ("runtime", "status"):
            self._check_stall()
            self._check_members()
            self._status_tick()
            return
        if isinstance(key, tuple) and key[:2] == ("runtime", "fault"):
            self._fire(self.faults.due(self.faults.timed[key[2]].time_s))  # set for exactly that time
            return
        if self.host is not None and not self.stop.is_set():
            self._apply(self.host.core.on_timer(key, asyncio.get_running_loop().time()))

    # -- observability ------------------------------------------------------------------------

    def record(self, event: RecordName, **fields: Any) -> None:
        self.records.write({"event": event, **fields, "t_s": round(time.monotonic() - self.started_s, 4),
                            "unix_s": round(time.time(), 4), "me": self.node_id})

    def _log(self, eff: Log) -> None:
        level = getattr(logging, eff.level.upper(), logging.INFO)
        log.log(level, "%s %s", eff.event, " ".join(f"{k}={v}" for k, v in eff.fields))

    def _track(self, event: RecordName, fields: dict[str, Any]) -> None:
        before = self.state
        self._track_stats(event, fields)
        if self.state != before:
            # Publish a state change at once, not at the next status tick: a launcher waiting for
            # "active" must see it even if the node is killed (e.g. by a fault) right after.
            self._write_status()

    def _track_stats(self, event: RecordName, fields: dict[str, Any]) -> None:
        stepped = self.stats.absorb(event, fields)
        if event in drive.ACTIVE_EVENTS or (event == RecordName.STEP and self.state == "joining"):
            self.state = "active"
            self._serving(fields.get("version"))
        if stepped:
            self._progress()

    def _progress(self) -> None:
        """A stdout line every `runtime.progress_every` iterations (and the first and last)."""
        it = self.stats.iteration
        if it is None or not should_print_progress(it, self.cfg.train.iterations, self.cfg.runtime.progress_every):
            return
        members = len(getattr(self.host.core, "directory", {})) if self.host is not None else 0
        print(progress_line(self.ident.name, self.host.stage if self.host else None, self.stats,
                            self.cfg.train.iterations, members, self.state), flush=True)

    def _say(self, line: str) -> None:
        """One `gwtf node NAME: ...` line on stderr, also logged."""
        print(f"gwtf node {self.ident.name}: {line}", file=sys.stderr, flush=True)
        log.info("%s", line)

    def _serving(self, version: Any = None) -> None:
        """This node is an active member serving its stage (an initial member at start, a joiner
        once the leader activated it): one `SERVING {json}` line, again only when it serves
        another stage or shard (after a move); the member lines start from its directory now."""
        host = self.host
        if host is None or host.stage is None:
            return
        self._members_seen = member_snapshot(host.core.directory)
        shard = host.core.me.shard
        if (host.stage, shard) == self._serving_as:
            return
        first = self._serving_as is None
        self._serving_as = (host.stage, shard)
        line = {"node": self.node_id, "name": self.ident.name, "role": host.role, "stage": host.stage,
                "shard": shard if shard >= 0 else None}
        print("SERVING " + dumps(line), flush=True)
        log.info("SERVING node=%s stage=%s role=%s shard=%s", self.node_id, host.stage, host.role, line["shard"])
        if first and self.ident.resume and self.ident.join and isinstance(version, int):
            self._say(f"resumed at version {version} (the swarm's, from its leader)")

    def _check_members(self) -> None:
        """Status tick: one line per member that left or entered this node's directory since the
        last tick (with `protocol.view_size` a relay's directory holds only the data holders and its
        neighbour stages), while
        it serves. A comparison of two key sets per tick; a snapshot only when they differ."""
        seen, host = self._members_seen, self.host
        if seen is None or host is None or self.state != "active" or not host.core.active:
            return
        directory = host.core.directory
        if directory.keys() == seen.keys():
            return
        now = member_snapshot(directory)
        for line in member_lines(seen, now, self.node_id):
            print(f"gwtf node {self.ident.name}: {line}", file=sys.stderr, flush=True)
        self._members_seen = now

    def _peer_stages(self) -> dict[NodeId, int]:
        """The members this node knows (the status RPC's fan-out), with their stages."""
        directory = getattr(self.host.core, "directory", {}) if self.host is not None else {}
        return {pid: info.stage for pid, info in directory.items() if pid != self.node_id}

    async def _ask_status(self, addr: str, msg: statusrpc.StatusRequest, timeout_s: float) -> statusrpc.StatusReply | None:
        try:
            return await self.transport.request(addr, msg, timeout_s)
        except SendFailed:
            return None

    def _check_stall(self) -> None:
        """The status timer fired late: the event loop was blocked (heartbeats were late too)."""
        late_s = asyncio.get_running_loop().time() - self._status_due
        if self._status_due and late_s > self.cfg.protocol.heartbeat_period_s:
            log.warning("event loop stalled %.2fs (heartbeat period %.2fs)", late_s,
                        self.cfg.protocol.heartbeat_period_s)
            self.record(RecordName.LOOP_STALL, late_s=round(late_s, 3))

    def _status_tick(self) -> None:
        self._write_status()
        if not self.stop.is_set():
            loop = asyncio.get_running_loop()
            self._status_due = loop.time() + self.cfg.runtime.status_period_s
            self.timers.set(("runtime", "status"), self._status_due)

    def _write_status(self) -> None:
        write_status(self.dir / STATUS_FILE, self._status())

    def _status(self) -> dict[str, Any]:
        host = self.host
        return {
            "node": self.node_id, "name": self.ident.name, "role": host.role if host else self.ident.role,
            "stage": host.stage if host else self.ident.stage, "region": self.ident.region, "state": self.state,
            "in_flight": host.in_flight() if host else 0, "pid": os.getpid(), **self.stats.as_status(),
            "iterations": self.cfg.train.iterations, "stages": self.cfg.model.stages,
            "compute_s": host.core.me.compute_s if host else None,  # advertised (measured once warm)
            "stop_reason": self.stop_reason,
            "time_s": round(time.monotonic() - self.started_s, 3),
        }

    def _fire(self, firings: list[Firing]) -> None:
        """Carry out the faults that fire (`runtime.chaos`): flip the next tensor frame, or SIGKILL."""
        for x in firings:
            self.record(RecordName.FAULT, point=x.point, iteration=x.iteration, index=x.mb, stage=x.stage,
                        action=x.fault.event)
            if x.fault.event == "flip":  # the next tensor frame sent carries a flipped bit
                self.transport.corrupt_next_frame()
                continue
            self.records.close()
            sys.stdout.flush()
            kill_self()


def run_node(cfg: Config, ident: NodeIdentity) -> NoReturn:
    """Run a node until it leaves or training ends, then exit the process with its code."""
    faulthandler.register(signal.SIGUSR1, file=sys.stdout, all_threads=True)
    logging.basicConfig(
        level=os.environ.get("GWTF_LOG_LEVEL", "INFO").upper(), stream=sys.stdout, format=f"%(asctime)s %(levelname)s {ident.name} %(name)s: %(message)s"
    )
    code = asyncio.run(NodeRuntime(cfg, ident).run())
    # Everything is written by now (records and status closed, the torch thread's jobs done). The
    # interpreter's own teardown then spent 3.5-4.5 s in libtorch, no Python frame (a swarm's last
    # node exited 4.5 s after the last step): skip it, so a finished run ends within a second.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
