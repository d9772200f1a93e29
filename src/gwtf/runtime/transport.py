"""Authenticated TCP transport for codec frames (asyncio).

Owns sockets and nothing else: a listening server, a cache of outbound connections by address
("host:port"), the swarm-secret handshake of `auth` on every connection, and back-pressure.
Inbound frames of authenticated peers go to `on_frame(peer_node_id, msg, tensors)`; a send that
cannot complete within its deadline raises `SendFailed(addr, reason)`, which the node runtime
turns into `NodeCore.on_send_failed`. The transport never decides about routing or retries.

Each connection is an asyncio `BufferedProtocol` feeding the sans-IO `codec.Decoder`, so large
tensor bodies are received straight into their final numpy buffer (DEPENDENCIES.md section 2).
Connections are one-way for requests: a node sends on the connections it opened and receives on
the ones it accepted (simple, and no races between two simultaneous connects).
A bad frame or failed handshake closes that one connection with a warning; others keep going.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gwtf.config import RuntimeConfig
from gwtf.protocol.base import MESSAGE_TYPES, Message, NodeId
from gwtf.runtime import auth
from gwtf.runtime.codec import Decoder, Limits, WireError, encode

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
                self._owner._deliver(self.peer_id, frame.msg, frame.tensors)
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
        self._decoder.registry = self._owner.registry
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
        """Send one frame to `addr`, connecting (and authenticating) first if needed.

        Returns once the frame is handed to the kernel (delivery is the protocol's business).

        Raises:
            SendFailed: refused, timed out (`timeout_s`, default cfg.request_timeout_s), or lost.
            WireError: `msg`/`tensors` cannot be encoded (a bug in the caller, not the peer).
        """
        buffers = encode(msg, tensors, self.limits)
        if self._closed:
            raise SendFailed(addr, "transport closed")
        try:
            async with asyncio.timeout(timeout_s if timeout_s is not None else self.cfg.request_timeout_s):
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

    def _deliver(self, peer_id: NodeId, msg: Message, tensors: list[np.ndarray]) -> None:
        try:
            self._on_frame(peer_id, msg, tensors)
        except Exception:  # a handler bug must not kill the connection loop; it is logged loudly
            log.exception("on_frame failed for %s from node %s", msg.TYPE, peer_id)
