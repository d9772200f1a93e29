"""Encrypted, authenticated TCP transport for codec frames (asyncio).

Owns sockets and nothing else: a listening server, a cache of outbound connections by address
("host:port"), the secure session of `auth` on every connection (a Noise XXpsk3 handshake bound to
the swarm secret and to each node's static key, then AES-GCM records with a counter), the limits
before authentication (a small handshake buffer, a handshake deadline, a global and a per-host cap
on unauthenticated connections that drop the oldest one, rate-limited refusal warnings), and
back-pressure. Inbound frames of authenticated peers go to `on_frame(peer_node_id, msg, tensors)`;
the peer id is the one its handshake proved. A send that cannot complete within its deadline
raises `SendFailed(addr, reason)`, which the node runtime turns into `NodeCore.on_send_failed`.
The transport never decides about routing or retries.

Each connection is an asyncio `BufferedProtocol`: ciphertext is received into the session's
buffer and a record inside a tensor body is decrypted straight into the decoder's final numpy
buffer (docs/wire.md). Connections are one-way for requests: a node sends on the connections it
opened and receives on the ones it accepted (simple, and no races between two simultaneous
connects); the only frames going back are the acks of chunked transfers and the replies of
the status RPC (`runtime.statusrpc`: `on_status` answers requests, `request` awaits a reply).

A message whose body is larger than `runtime.chunk_bytes` travels as a chunked transfer
(`runtime.chunks`): the receiver writes the chunks into one preallocated buffer and hands the
whole message to `on_frame` once every chunk is in; the sender's `send` returns then, resuming
on a new connection after a loss (`runtime.transfer_retries`) and raising `SendFailed` when out
of tries, so a transfer never hangs.
A refused handshake, a bad record or a bad frame closes that one connection with a warning;
others keep going.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
import socket
from collections import ChainMap, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from gwtf.config import RuntimeConfig
from gwtf.protocol.base import MESSAGE_TYPES, Message, NodeId
from gwtf.runtime import auth, keys
from gwtf.runtime.chunks import (
    CHUNK_TYPES,
    WINDOW_CHUNKS,
    Chunk,
    ChunkAck,
    ChunkBegin,
    Reassembler,
    chunk_at,
    crc_of,
)
from gwtf.runtime.codec import Decoder, Limits, WireError, encode, encode_parts, frame_buffers
from gwtf.runtime.statusrpc import STATUS_TYPES, StatusReply, StatusRequest

log = logging.getLogger(__name__)

OnFrame = Callable[[NodeId, Message, list[np.ndarray]], None]
OnStatus = Callable[[StatusRequest], Awaitable[StatusReply]]


class SendFailed(Exception):
    """A send to `addr` did not complete: refused, lost, timed out, or handshake refused."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__(f"send to {addr} failed: {reason}")
        self.addr = addr
        self.reason = reason


def parse_addr(addr: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:port"); ValueError if malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {addr!r}: expected host:port")
    return host.strip("[]"), int(port)


def listen_problem(exc: OSError) -> str:
    """Why a listen failed, in words a user can act on."""
    if exc.errno == errno.EADDRINUSE:
        return "the port is already in use (pick another port, or 0 for any free one)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "this machine has no such address (listen on one of its own addresses)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    return f"cannot listen: {exc.strerror or exc}"


class _Refused(Exception):
    """The receiver refused a chunked transfer (its ack carried an error)."""


@dataclass(slots=True)
class _Outgoing:
    """A chunked transfer being sent: how far the receiver acknowledged it, on which connection."""

    begin: ChunkBegin
    conn: _Connection | None = None
    acked: int = -1  # bytes the receiver holds; -1 until it answered the current ChunkBegin
    done: bool = False
    error: str = ""
    waiter: asyncio.Future[None] | None = None

    def wake(self, exc: BaseException | None = None) -> None:
        if self.waiter is not None and not self.waiter.done():
            if exc is None:
                self.waiter.set_result(None)
            else:
                _settle(self.waiter, exc)


def _settle(fut: asyncio.Future[None], exc: BaseException) -> None:
    """Fail `fut` if pending, marking the exception retrieved (nobody may be waiting any more)."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


class RefusalLog:
    """Rate-limited warnings about refused peers: at most one line per (host, kind) per period,
    the next line saying how many were not logged (a flood cannot fill the log)."""

    PERIOD_S = 10.0
    MAX_KEYS = 4096

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], list[float]] = {}  # (host, kind) -> [last logged at, suppressed]

    def refused(self, addr: str, host: str, kind: str, reason: str, now: float) -> bool:
        """Log (or count) one refusal; True if a line was written."""
        key = (host, kind)
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.PERIOD_S:
            entry[1] += 1
            return False
        suppressed = int(entry[1]) if entry is not None else 0
        if entry is None and len(self._seen) >= self.MAX_KEYS:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.PERIOD_S}
            if len(self._seen) >= self.MAX_KEYS:
                self._seen.clear()
        self._seen[key] = [now, 0]
        more = f" ({suppressed} more like it from {host} not logged since the last line)" if suppressed else ""
        log.warning("refused peer %s: %s%s", addr, reason, more)
        return True


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection: the secure session (`auth`), the frame decoder, write back-pressure.

    Stages: handshake (a small receive buffer, no decoder) -> [client: waiting for the server's
    confirmation record] -> authenticated (records in both directions, frames to the decoder).
    """

    def __init__(self, owner: Transport, role: auth.Role) -> None:
        self._owner = owner
        self._role: auth.Role = role
        self._rx = auth.RxBuffer(auth.HANDSHAKE_BUFFER_BYTES)
        self._hs: auth.Handshake | None = None  # the server makes it on the first bytes received
        self._opener: auth.Opener | None = None
        self._sealer: auth.Sealer | None = None
        self._decoder: Decoder | None = None  # made at authentication
        self._confirming = False
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()  # authenticated (or failed)
        self.closed: asyncio.Future[None] = loop.create_future()
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.addr = "?"
        self.host = "?"
        self.peer_id: NodeId = ""
        self.authenticated = False
        self.progress = 0  # handshake messages received
        self.generation = 0  # the transport's sweep count when it was accepted

    # -- asyncio protocol callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.addr = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.host = str(peer[0]) if peer else "?"
        self._owner._conns_all.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            self._owner.cfg.connect_timeout_s, self._refuse, "handshake timeout", "timeout"
        )
        if self._role == "server":
            self._owner._admit(self)
        else:
            self._hs = self._owner._handshake("client")
            self._write_raw(self._hs.first())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._opener is not None:
            return self._opener.get_buffer()
        self._rx.reserve(len(self._rx.buf), len(self._rx.buf))  # compact: handshake bytes are few
        return self._rx.writable(len(self._rx.buf))

    def buffer_updated(self, nbytes: int) -> None:
        self._rx.filled(nbytes)
        try:
            if self._opener is None:
                self._handshake_bytes()
            if self._opener is not None:
                self._records()
        except auth.HandshakeError as exc:
            self._refuse(exc.reason, exc.kind)
        except auth.RecordError as exc:
            self._fail(f"bad record: {exc.reason}")
        except WireError as exc:
            self._fail(f"bad frame: {exc.reason}")

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._owner._release(self)
        reason = f"connection lost ({exc})" if exc else "connection closed by peer"
        why = "handshake refused by peer (wrong swarm secret?)" if self._confirming else f"{reason} during handshake"
        _settle(self.ready, ConnectionError(why))
        if self._drain_waiter is not None:
            _settle(self._drain_waiter, ConnectionError(reason))
        if not self.closed.done():
            self.closed.set_result(None)
        self._owner._forget(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- handshake and records (auth module docstring) -----------------------------------------

    def _closing(self) -> bool:
        return self.closed.done() or self._transport is None or self._transport.is_closing()

    def _handshake_bytes(self) -> None:
        while self._opener is None and not self._closing():
            if self._hs is None:
                self._hs = self._owner._handshake("server")
            used, out = self._hs.receive(self._rx.view())
            if not used:
                return
            self._rx.consume(used)
            self.progress += 1
            if out:
                self._write_raw(out)
            if self._hs.done:
                self._start_session(self._hs)

    def _start_session(self, hs: auth.Handshake) -> None:
        self._sealer = auth.Sealer(hs.send_key)
        self.peer_id = hs.peer_id
        if self._role == "server":
            self._opener = auth.Opener(hs.recv_key, self._rx)
            self._write_raw(self._sealer.seal_one(b""))  # confirmation: the server knows the PSK too
            self._authenticated()
        else:
            self._opener = auth.Opener(hs.recv_key, self._rx, max_rx=auth.HANDSHAKE_BUFFER_BYTES)
            self._confirming = True
        self._hs = None

    def _records(self) -> None:
        opener = self._opener
        assert opener is not None
        while not self._closing():
            if self._confirming:
                try:
                    n = opener.open_next(None)
                except auth.RecordError:
                    raise auth.HandshakeError("bad swarm secret (confirmation failed)", "secret") from None
                if n is None:
                    return
                if n:
                    raise auth.HandshakeError("bad handshake: no confirmation record", "protocol")
                self._confirming = False
                opener.max_rx = auth.MAX_RX_BYTES
                self._authenticated()
                continue
            assert self._decoder is not None
            if opener.open_next(self._decoder) is None:
                return
            while not self._closing() and (frame := self._decoder.next_frame()) is not None:
                self._owner._receive(self, frame.msg, frame.tensors)

    def _authenticated(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._decoder = Decoder(registry=self._owner.wire_registry, limits=self._owner.limits)
        self.authenticated = True
        self._owner._release(self)
        self.ready.set_result(None)
        log.debug("peer %s authenticated as node %s", self.addr, self.peer_id)

    # -- writing and closing ------------------------------------------------------------------

    def _write_raw(self, data: bytes | memoryview) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionError("connection closed")
        self._transport.write(data)

    def send_frame(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Queue one encoded frame as records (only on an authenticated connection)."""
        if not self.authenticated or self._sealer is None:
            raise ConnectionError("not authenticated")
        if self._transport is None or self._transport.is_closing():
            raise ConnectionError("connection closed")
        corrupt = self._owner._take_corrupt(len(buffers) > 1)
        for record in self._sealer.seal(list(buffers), corrupt=corrupt):  # records never interleave
            self._transport.write(record)

    def reply(self, msg: Message) -> None:
        """Write a small runtime message back on this connection (a chunk ack); dropped if closed."""
        try:
            self.send_frame(encode(msg, (), self._owner.limits))
        except ConnectionError:
            pass

    async def drain(self) -> None:
        """Wait until the write buffer is below its low-water mark (raises if the link died)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionError("connection closed")
        if self._paused:
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain_waiter)

    def _refuse(self, reason: str, kind: str) -> None:
        """Before authentication: one rate-limited warning, then close."""
        if self._closing():
            return
        self._owner._refusals.refused(self.addr, self.host, kind, reason, asyncio.get_running_loop().time())
        _settle(self.ready, ConnectionError(reason))
        self.abort()

    def _fail(self, reason: str) -> None:
        """After authentication: a warning naming the peer, then close."""
        if not self.authenticated:
            self._refuse(reason, "record")
            return
        if self._closing():
            return
        log.warning("dropped peer %s (node %s): %s", self.addr, self.peer_id, reason)
        _settle(self.ready, ConnectionError(reason))
        self.abort()

    def abort(self) -> None:
        self._owner._release(self)
        if self._transport is not None:
            self._transport.abort()

    def finish(self) -> None:
        """Close gracefully: what is buffered still goes out, then our end of the stream; the
        peer closes its side once it has read all of it (`eof_received`), and `closed` resolves.
        (`abort` drops the write buffer: a frame `send` had already handed over, a relay's last
        checkpoint copy, was lost.) A connection not authenticated yet has nothing to deliver."""
        t = self._transport
        if t is None or t.is_closing():
            return
        if not self.authenticated or not t.can_write_eof():
            self.abort()
            return
        t.write_eof()


class Transport:
    """Listens for peers, sends frames to peers, hands inbound frames to `on_frame`.

    Usage: `t = Transport(node_id, secret, on_frame, cfg, static_key=key)`; `addr = await
    t.start(host, port)`; `await t.send(addr, msg, tensors)`; `await t.close()`. `static_key` is
    the node's 32-byte X25519 private key (`keys.load_or_create_key`); `node_id` must embed its
    fingerprint (`t.fingerprint`, `NAME~FINGERPRINT/...`) or peers refuse it. `node_id` may be
    reassigned after `start` as long as no connection exists yet (it goes into each handshake).
    """

    MAX_UNAUTHENTICATED = 256  # accepted connections still in their handshake, all hosts together
    MAX_UNAUTHENTICATED_PER_HOST = 64  # ... from one host; past either cap the OLDEST one is dropped
    HARD_CAP_FACTOR = 8  # past 8 x the global cap, connections are dropped without waiting for a sweep
    CAP_GRACE_S = 0.02  # period of the sweep that enforces the caps while they are exceeded
    LISTEN_BACKLOG = 1024

    def __init__(
        self,
        node_id: NodeId,
        secret: bytes,
        on_frame: OnFrame,
        cfg: RuntimeConfig | None = None,
        registry: Mapping[str, type[Message]] | None = None,
        *,
        static_key: bytes,
    ) -> None:
        self.node_id = node_id
        self._psk = keys.psk_of(secret)  # the secret itself is not kept
        if len(static_key) != keys.KEY_BYTES:
            raise ValueError(f"static_key must be {keys.KEY_BYTES} bytes")
        self._static_key = static_key
        self.fingerprint = keys.fingerprint(keys.public_of(static_key))
        self.cfg = cfg or RuntimeConfig()
        self.limits = Limits(max_frame_bytes=self.cfg.max_frame_bytes)
        self.registry: Mapping[str, type[Message]] = MESSAGE_TYPES if registry is None else registry
        self.wire_registry: Mapping[str, type[Message]] = ChainMap(
            CHUNK_TYPES, STATUS_TYPES, cast(MutableMapping[str, type[Message]], self.registry))  # live: not a snapshot
        self.on_status: OnStatus | None = None  # answers `statusrpc` requests (None: refused)
        self._replies: dict[int, asyncio.Future[StatusReply]] = {}  # request id -> its pending reply
        self.chunk_bytes = min(self.cfg.chunk_bytes, self.cfg.max_frame_bytes // 2)
        keep_s = 2 * self.cfg.request_timeout_s + self.cfg.connect_timeout_s
        self.reassembler = Reassembler(self.registry, self.cfg.max_frame_bytes, self.cfg.max_transfer_bytes,
                                       keep_s=keep_s)
        self._sending: dict[int, _Outgoing] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._on_frame = on_frame
        self._server: asyncio.Server | None = None
        self._out: dict[str, _Connection] = {}  # authenticated outbound connections by address
        self._connecting: dict[str, asyncio.Task[_Connection]] = {}
        self._conns_all: set[_Connection] = set()
        self._unauth: OrderedDict[_Connection, None] = OrderedDict()  # accepted, not yet authenticated
        self._unauth_by_host: dict[str, OrderedDict[_Connection, None]] = {}
        self._refusals = RefusalLog()
        self._sweep: asyncio.TimerHandle | None = None
        self._generation = 0  # sweeps so far
        self._corrupt_next = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.address = ""

    @classmethod
    def with_new_key(cls, name: str, secret: bytes, on_frame: OnFrame, cfg: RuntimeConfig | None = None,
                     registry: Mapping[str, type[Message]] | None = None) -> Transport:
        """A transport with a fresh static key and the id `NAME~FINGERPRINT` (probes, benchmarks,
        tests; a node keeps its key in a file, `runtime.node`)."""
        t = cls("?", secret, on_frame, cfg, registry, static_key=keys.new_private_key())
        t.node_id = f"{name}{keys.ID_KEY_SEP}{t.fingerprint}"
        return t

    def corrupt_next_frame(self) -> None:
        """Fault injection for tests (`runtime.chaos`): the next outgoing frame that carries a
        tensor body gets one ciphertext bit flipped after encryption, so its receiver must refuse
        it and close that connection. Never set by the transport itself."""
        self._corrupt_next = True

    @property
    def unauthenticated(self) -> int:
        """Accepted connections still in their handshake."""
        return len(self._unauth)

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        return parse_addr(self.address)[1] if self.address else 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = any free port); return the bound "host:port"."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self, "server"), host, port,
                                                backlog=self.LISTEN_BACKLOG)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{sock_host}:{sock_port}"
        log.info("listening on %s as node %s", self.address, self.node_id)
        return self.address

    async def send(
        self, addr: str, msg: Message, tensors: Sequence[np.ndarray] = (), timeout_s: float | None = None
    ) -> None:
        """Send one message to `addr`, connecting (and authenticating) first if needed.

        A message whose body fits in one chunk (`chunk_bytes`) is one frame, and `send` returns
        once it is handed to the kernel (delivery is the protocol's business). A larger one is a
        chunked transfer (docs/wire.md), and `send` returns once the receiver holds all of it;
        `timeout_s` then bounds each step without progress, and a lost connection is resumed
        `cfg.transfer_retries` times.

        Raises:
            SendFailed: refused, timed out (`timeout_s`, default cfg.request_timeout_s), or lost.
            WireError: `msg`/`tensors` cannot be encoded (a bug in the caller, not the peer).
        """
        header, views, body_len = encode_parts(msg, tensors, self.limits)
        if self._closed:
            raise SendFailed(addr, "transport closed")
        timeout_s = timeout_s if timeout_s is not None else self.cfg.request_timeout_s
        if body_len > self.chunk_bytes:
            begin = ChunkBegin(xfer=secrets.randbits(62), header=header, body_len=body_len,
                               chunk_bytes=self.chunk_bytes)
            await self._send_chunked(addr, begin, views, timeout_s)
            return
        buffers = frame_buffers(header, views, body_len, self.limits)
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._connection(addr)
                conn.send_frame(buffers)
                await conn.drain()
        except TimeoutError:
            raise SendFailed(addr, "timeout") from None
        except (OSError, ValueError) as exc:  # ConnectionError is an OSError; ValueError: bad addr
            raise SendFailed(addr, str(exc) or type(exc).__name__) from None

    async def request(self, addr: str, msg: StatusRequest, timeout_s: float | None = None) -> StatusReply:
        """Send a status request to `addr` and await its reply on the same connection.

        Raises:
            SendFailed: unreachable, handshake refused, or no reply within `timeout_s`.
        """
        fut: asyncio.Future[StatusReply] = asyncio.get_running_loop().create_future()
        self._replies[msg.req] = fut
        timeout_s = timeout_s if timeout_s is not None else self.cfg.request_timeout_s
        try:
            await self.send(addr, msg, timeout_s=timeout_s)
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise SendFailed(addr, "no status reply") from None
        finally:
            self._replies.pop(msg.req, None)

    def _answer_status(self, conn: _Connection, msg: StatusRequest) -> None:
        handler = self.on_status
        if handler is None:
            conn.reply(StatusReply(req=msg.req, rows=(), error="this peer answers no status requests"))
            return

        async def answer() -> None:
            try:
                reply = await handler(msg)
            except Exception:  # a handler bug must not go unseen; the asker gets an error, not silence
                log.exception("status request from node %s failed", conn.peer_id)
                reply = StatusReply(req=msg.req, rows=(), error="internal error")
            conn.reply(reply)

        task = asyncio.get_running_loop().create_task(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def connect(self, addr: str, timeout_s: float | None = None) -> NodeId:
        """Open (or reuse) the authenticated connection to `addr`; return the peer's node id.

        Raises:
            SendFailed: refused, timed out, or handshake refused.
        """
        if self._closed:
            raise SendFailed(addr, "transport closed")
        try:
            async with asyncio.timeout(timeout_s if timeout_s is not None else self.cfg.connect_timeout_s):
                conn = await self._connection(addr)
        except TimeoutError:
            raise SendFailed(addr, "timeout") from None
        except (OSError, ValueError) as exc:
            raise SendFailed(addr, str(exc) or type(exc).__name__) from None
        return conn.peer_id

    async def close(self) -> None:
        """Stop listening, cancel connects, close every connection, wait until they are gone."""
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        conns = list(self._conns_all)
        for conn in conns:
            conn.finish()  # buffered frames go out first; the peers close their sides
        if conns:
            await asyncio.wait([c.closed for c in conns], timeout=self.cfg.connect_timeout_s)
        for conn in conns:
            if not conn.closed.done():
                conn.abort()  # a peer that never closed its side (gone, or not reading)
        if conns:
            await asyncio.wait([c.closed for c in conns], timeout=self.cfg.connect_timeout_s)
        if self._server is not None:
            await self._server.wait_closed()

    # -- internals -----------------------------------------------------------------------------

    async def _connection(self, addr: str) -> _Connection:
        conn = self._out.get(addr)
        if conn is not None and not conn.closed.done():
            return conn
        task = self._connecting.get(addr)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._open(addr))
            self._connecting[addr] = task
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._connect_done(addr, t))
        return await asyncio.shield(task)  # one caller's deadline must not cancel a shared connect

    def _connect_done(self, addr: str, task: asyncio.Task[_Connection]) -> None:
        self._tasks.discard(task)
        if self._connecting.get(addr) is task:
            del self._connecting[addr]
        if not task.cancelled() and task.exception() is None:
            self._out[addr] = task.result()

    async def _open(self, addr: str) -> _Connection:
        host, port = parse_addr(addr)
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, "client"), host, port)
                await conn.ready
        except TimeoutError:
            if conn is not None:
                conn.abort()
            raise ConnectionError("connect/handshake timeout") from None
        except BaseException:
            if conn is not None:
                conn.abort()
            raise
        return conn

    def _handshake(self, role: auth.Role) -> auth.Handshake:
        return auth.Handshake(role, self._static_key, self._psk, self.node_id)

    def _take_corrupt(self, has_body: bool) -> bool:
        if has_body and self._corrupt_next:
            self._corrupt_next = False
            return True
        return False

    def _admit(self, conn: _Connection) -> None:
        """Count an accepted connection against the caps (docs/wire.md, "Limits before authentication").

        The caps are enforced by a sweep every CAP_GRACE_S while they are exceeded, and only on
        connections admitted before the previous sweep: every connection then had at least one
        turn of the loop to deliver its first handshake message. The sweep drops the oldest that
        did not, then the oldest; an honest peer sends its first message at once, so a flood of
        idle sockets from its own address cannot push it out. Past HARD_CAP_FACTOR x the global
        cap, the oldest idle ones go at once, whatever their age.
        """
        conn.generation = self._generation
        self._unauth[conn] = None
        self._unauth_by_host.setdefault(conn.host, OrderedDict())[conn] = None
        excess = len(self._unauth) - self.HARD_CAP_FACTOR * self.MAX_UNAUTHENTICATED
        if excess > 0:
            self._drop_oldest(self._unauth, excess, self._generation + 1)
        if self._sweep is None and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.CAP_GRACE_S, self._sweep_caps)

    def _sweep_caps(self) -> None:
        self._sweep = None
        self._generation += 1
        ripe = self._generation - 1  # admitted before the previous sweep
        for host in list(self._unauth_by_host):
            pool = self._unauth_by_host.get(host)
            if pool is not None:
                # a connection mid-handshake (an honest peer's, on a loaded loop) is left to its
                # deadline: the sweeps drop idle sockets only; the hard cap bounds the rest
                self._drop_oldest(pool, len(pool) - self.MAX_UNAUTHENTICATED_PER_HOST, ripe, idle_only=True)
        self._drop_oldest(self._unauth, len(self._unauth) - self.MAX_UNAUTHENTICATED, ripe, idle_only=True)
        if len(self._unauth) > min(self.MAX_UNAUTHENTICATED, self.MAX_UNAUTHENTICATED_PER_HOST):
            self._sweep = asyncio.get_running_loop().call_later(self.CAP_GRACE_S, self._sweep_caps)

    def _drop_oldest(self, pool: OrderedDict[_Connection, None], excess: int, ripe: int,
                     idle_only: bool = False) -> None:
        """Drop up to `excess` connections of `pool` admitted before generation `ripe`: the
        oldest that have not sent a whole handshake message first, then (unless `idle_only`)
        the oldest."""
        if excess <= 0:
            return
        old = [c for c in pool if c.generation < ripe]
        idle = [c for c in old if not c.progress][:excess]
        victims = idle if idle_only else idle + [c for c in old if c.progress][: excess - len(idle)]
        for victim in victims:
            self._release(victim)
            victim._refuse("too many unauthenticated connections: dropped the oldest", "cap")

    def _release(self, conn: _Connection) -> None:
        """`conn` is authenticated or gone: it no longer counts against the caps."""
        if conn in self._unauth:
            del self._unauth[conn]
            mine = self._unauth_by_host.get(conn.host)
            if mine is not None:
                mine.pop(conn, None)
                if not mine:
                    del self._unauth_by_host[conn.host]

    def _forget(self, conn: _Connection) -> None:
        self._conns_all.discard(conn)
        for addr, c in list(self._out.items()):
            if c is conn:
                del self._out[addr]
        for out in self._sending.values():
            if out.conn is conn:
                out.wake(ConnectionError("connection lost"))

    # -- chunked transfers (runtime.chunks) ----------------------------------------------------

    async def _send_chunked(self, addr: str, begin: ChunkBegin, views: list[bytes | memoryview],
                            timeout_s: float) -> None:
        """Send one chunked transfer, resuming on a new connection after a loss (bounded)."""
        out = _Outgoing(begin)
        self._sending[begin.xfer] = out
        tries = self.cfg.transfer_retries + 1
        try:
            for attempt in range(1, tries + 1):
                try:
                    await self._transfer(addr, out, views, timeout_s)
                    return
                except _Refused as exc:
                    raise SendFailed(addr, f"transfer refused by peer: {exc}") from None
                except (TimeoutError, OSError, ValueError) as exc:
                    reason = "timeout" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
                    await self._drop(out.conn)  # a stalled connection is useless: a try starts afresh
                    if isinstance(exc, ValueError) or self._closed or attempt == tries:
                        where = f"at byte {max(out.acked, 0)}/{begin.body_len} after {attempt} tries"
                        raise SendFailed(addr, f"{reason} ({where})") from None
                    log.info("transfer %x to %s lost at byte %d/%d (%s): resuming, try %d/%d", begin.xfer,
                             addr, max(out.acked, 0), begin.body_len, reason, attempt + 1, tries)
                    await asyncio.sleep(min(1.0, 0.1 * 2**attempt))  # back off before reconnecting
        finally:
            del self._sending[begin.xfer]

    async def _transfer(self, addr: str, out: _Outgoing, views: list[bytes | memoryview], timeout_s: float) -> None:
        """One try: (re)begin on a connection, then chunks from where the receiver stands."""
        begin = out.begin
        async with asyncio.timeout(timeout_s):
            conn = await self._connection(addr)
        out.conn, out.acked, out.done = conn, -1, False
        conn.send_frame(encode(begin, (), self.limits))
        await self._progress(out, timeout_s)
        offset, window = out.acked, WINDOW_CHUNKS * begin.chunk_bytes
        while not out.done:
            if offset < begin.body_len and offset - out.acked < window:
                size = min(begin.chunk_bytes, begin.body_len - offset)
                data = chunk_at(views, offset, size)
                conn.send_frame(encode(Chunk(xfer=begin.xfer, offset=offset, crc=crc_of(data)), [data], self.limits))
                offset += size
                async with asyncio.timeout(timeout_s):
                    await conn.drain()
            else:
                await self._progress(out, timeout_s)

    async def _progress(self, out: _Outgoing, timeout_s: float) -> None:
        """Wait (bounded) for the receiver's next ack on the transfer's connection."""
        if not out.done and not out.error:
            out.waiter = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(timeout_s):
                await out.waiter
        if out.error:
            raise _Refused(out.error)

    def _on_ack(self, conn: _Connection, msg: ChunkAck) -> None:
        out = self._sending.get(msg.xfer)
        if out is None or out.conn is not conn:
            return  # a late ack of a finished transfer, or from a replaced connection
        if out.error:
            return  # the first refusal is the reason
        if msg.error:
            out.error = msg.error
        elif not max(out.acked, 0) <= msg.have <= out.begin.body_len or (msg.done and msg.have != out.begin.body_len):
            out.error = f"bad ack: have {msg.have} after {out.acked}"
        else:
            out.acked, out.done = msg.have, msg.done
        out.wake()

    async def _drop(self, conn: _Connection | None) -> None:
        """Abort `conn` (a stalled transfer's) and wait, bounded, until it is forgotten."""
        if conn is not None and not conn.closed.done():
            conn.abort()
            await asyncio.wait([conn.closed], timeout=self.cfg.connect_timeout_s)

    def _receive(self, conn: _Connection, msg: Message, tensors: list[np.ndarray]) -> None:
        """An authenticated frame: chunk traffic is handled here, anything else goes to on_frame."""
        now = asyncio.get_running_loop().time()
        if isinstance(msg, ChunkBegin):
            conn.reply(self.reassembler.begin(conn.peer_id, conn, msg, now))
            self._arm_expiry()
        elif isinstance(msg, Chunk):
            ack, frame = self.reassembler.chunk(conn.peer_id, conn, msg, tensors, now)
            if frame is not None:
                self._deliver(conn.peer_id, frame.msg, frame.tensors)
            if ack is not None:
                conn.reply(ack)
        elif isinstance(msg, ChunkAck):
            self._on_ack(conn, msg)
        elif isinstance(msg, StatusRequest):
            self._answer_status(conn, msg)
        elif isinstance(msg, StatusReply):
            fut = self._replies.get(msg.req)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            self._deliver(conn.peer_id, msg, tensors)

    def _arm_expiry(self) -> None:
        if self._expiry is None and len(self.reassembler) and not self._closed:
            self._expiry = asyncio.get_running_loop().call_later(self.reassembler.keep_s / 2, self._expire_tick)

    def _expire_tick(self) -> None:
        self._expiry = None
        self.reassembler.expire(asyncio.get_running_loop().time())
        self._arm_expiry()

    def _deliver(self, peer_id: NodeId, msg: Message, tensors: list[np.ndarray]) -> None:
        try:
            self._on_frame(peer_id, msg, tensors)
        except Exception:  # a handler bug must not kill the connection loop; it is logged loudly
            log.exception("on_frame failed for %s from node %s", msg.TYPE, peer_id)
