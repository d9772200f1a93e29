"""Authenticated TCP transport for codec frames (asyncio).

Owns sockets and nothing else: a listening server, a cache of outbound connections by address
("host:port"), the swarm-secret handshake of `auth` on every connection, and back-pressure.
Inbound frames of authenticated peers go to `on_frame(peer_node_id, msg, tensors)`; a send that
cannot complete within its deadline raises `SendFailed(addr, reason)`, which the node runtime
turns into `NodeCore.on_send_failed`. The transport never decides about routing or retries.

Each connection is an asyncio `BufferedProtocol` feeding the sans-IO `codec.Decoder`, so large
tensor bodies are received straight into their final numpy buffer (DEPENDENCIES.md section 2).
Connections are one-way for requests: a node sends on the connections it opened and receives on
the ones it accepted (simple, and no races between two simultaneous connects); the only frames
going back are the acks of chunked transfers.

A message whose body is larger than `runtime.chunk_bytes` travels as a chunked transfer
(`runtime.chunks`): the receiver writes the chunks into one preallocated buffer and hands the
whole message to `on_frame` once every chunk is in; the sender's `send` returns then, resuming
on a new connection after a loss (`runtime.transfer_retries`) and raising `SendFailed` when out
of tries, so a transfer never hangs.
A bad frame or failed handshake closes that one connection with a warning; others keep going.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gwtf.config import RuntimeConfig
from gwtf.protocol.base import MESSAGE_TYPES, Message, NodeId
from gwtf.runtime import auth
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

log = logging.getLogger(__name__)

OnFrame = Callable[[NodeId, Message, list[np.ndarray]], None]


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


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection: handshake state, decoder, write back-pressure."""

    def __init__(self, owner: Transport, role: auth.Role) -> None:
        self._owner = owner
        self._role: auth.Role = role
        self._decoder = Decoder(registry=auth.HANDSHAKE_TYPES, limits=owner.limits)
        self._mine = auth.Hello(node_id=owner.node_id, nonce=auth.new_nonce())
        self._peer: auth.Hello | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()  # authenticated (or failed)
        self.closed: asyncio.Future[None] = loop.create_future()
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.addr = "?"
        self.peer_id: NodeId = ""
        self.authenticated = False

    # -- asyncio protocol callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.addr = f"{peer[0]}:{peer[1]}" if peer else "?"
        self._owner._conns_all.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            self._owner.cfg.connect_timeout_s, self._fail, "handshake timeout"
        )
        self._write(encode(self._mine, (), self._owner.limits))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.buffer_updated(nbytes)
        while not self.closed.done() and self._transport is not None and not self._transport.is_closing():
            try:
                frame = self._decoder.next_frame()
            except WireError as exc:
                self._fail(f"bad frame: {exc.reason}")
                return
            if frame is None:
                return
            if self.authenticated:
                self._owner._receive(self, frame.msg, frame.tensors)
            else:
                self._handshake(frame.msg)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        reason = f"connection lost ({exc})" if exc else "connection closed by peer"
        refused = self._peer is not None and self._role == "client"  # we sent our proof, peer hung up
        why = "handshake refused by peer (wrong swarm secret?)" if refused else f"{reason} during handshake"
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

    # -- handshake (auth module docstring) ----------------------------------------------------

    def _handshake(self, msg: Message) -> None:
        if isinstance(msg, auth.Hello) and self._peer is None:
            self._peer = msg
            if self._role == "client":
                self._write(encode(auth.Proof(mac=self._mac("client")), (), self._owner.limits))
        elif isinstance(msg, auth.Proof) and self._peer is not None:
            peer_role: auth.Role = "server" if self._role == "client" else "client"
            if not auth.verify_mac(self._owner.secret, peer_role, *self._hellos(), msg.mac):
                log.warning("refused peer %s: bad swarm secret", self.addr)
                self._fail("bad swarm secret", quiet=True)
                return
            if self._role == "server":
                self._write(encode(auth.Proof(mac=self._mac("server")), (), self._owner.limits))
            self._authenticated()
        else:
            self._fail(f"bad frame: unexpected {msg.TYPE} in handshake")

    def _hellos(self) -> tuple[auth.Hello, auth.Hello]:
        """(client hello, server hello) of this connection."""
        assert self._peer is not None
        return (self._mine, self._peer) if self._role == "client" else (self._peer, self._mine)

    def _mac(self, role: auth.Role) -> bytes:
        return auth.handshake_mac(self._owner.secret, role, *self._hellos())

    def _authenticated(self) -> None:
        assert self._peer is not None
        if self._timer is not None:
            self._timer.cancel()
        self.peer_id = self._peer.node_id
        self._decoder.registry = self._owner.wire_registry
        self.authenticated = True
        self.ready.set_result(None)
        log.debug("peer %s authenticated as node %s", self.addr, self.peer_id)

    # -- writing and closing ------------------------------------------------------------------

    def _write(self, buffers: Sequence[bytes | memoryview]) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionError("connection closed")
        for buf in buffers:  # one frame's buffers back to back: frames never interleave
            self._transport.write(buf)

    def send_frame(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Queue one encoded frame (only on an authenticated connection)."""
        if not self.authenticated:
            raise ConnectionError("not authenticated")
        self._write(buffers)

    def reply(self, msg: Message) -> None:
        """Write a small runtime message back on this connection (a chunk ack); dropped if closed."""
        try:
            self._write(encode(msg, (), self._owner.limits))
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

    def _fail(self, reason: str, quiet: bool = False) -> None:
        if not quiet:
            who = f" (node {self.peer_id})" if self.peer_id else ""
            log.warning("dropped peer %s%s: %s", self.addr, who, reason)
        _settle(self.ready, ConnectionError(reason))
        self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class Transport:
    """Listens for peers, sends frames to peers, hands inbound frames to `on_frame`.

    Usage: `t = Transport(node_id, secret, on_frame, cfg)`; `addr = await t.start(host, port)`;
    `await t.send(addr, msg, tensors)`; `await t.close()`. `node_id` may be reassigned after
    `start` as long as no connection exists yet (it goes into each connection's HELLO).
    """

    def __init__(
        self,
        node_id: NodeId,
        secret: bytes,
        on_frame: OnFrame,
        cfg: RuntimeConfig | None = None,
        registry: Mapping[str, type[Message]] | None = None,
    ) -> None:
        self.node_id = node_id
        self.secret = secret
        self.cfg = cfg or RuntimeConfig()
        self.limits = Limits(max_frame_bytes=self.cfg.max_frame_bytes)
        self.registry: Mapping[str, type[Message]] = MESSAGE_TYPES if registry is None else registry
        self.wire_registry: Mapping[str, type[Message]] = {**self.registry, **CHUNK_TYPES}
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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.address = ""

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        return parse_addr(self.address)[1] if self.address else 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = any free port); return the bound "host:port"."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self, "server"), host, port)
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
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        conns = list(self._conns_all)
        for conn in conns:
            conn.abort()
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
