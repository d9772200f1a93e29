"""Chunked transfers: one message whose body is larger than a chunk, sent as several frames.

Owns the three runtime-level messages of a chunked transfer (`ChunkBegin`, `Chunk`, `ChunkAck`;
their own registry `CHUNK_TYPES`, decoded only on authenticated connections and never seen by the
protocol core), the sender's slicing of a body into chunks (`chunk_at`), and the receiver's
`Reassembler`, which validates every chunk against the declared header, writes it into the one
preallocated body buffer, and hands back the whole message once the last chunk is in. The
transport (`runtime.transport`) drives both ends (docs/wire.md, "Chunked transfers"):

    sender -> receiver  ChunkBegin(xfer, header, body_len, chunk_bytes)
    receiver -> sender  ChunkAck(xfer, have)          have: bytes already held (0, or > 0 to resume)
    sender -> receiver  Chunk(xfer, offset, crc) + one uint8 tensor, ... (a bounded window unacked)
    receiver -> sender  ChunkAck(xfer, have) per chunk; done=True once the message was delivered
    refused:            ChunkAck(xfer, have, error="reason"); the partial transfer is dropped

A connection lost mid-transfer: the sender reconnects and sends the same ChunkBegin; the receiver
answers with the bytes it holds and the sender continues from there. Memory on the receiver is
the declared body (allocated once, at ChunkBegin) plus the chunk being decoded. Never unpickles.
Must not import asyncio or socket.
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gwtf.protocol.base import Message, NodeId
from gwtf.runtime.codec import Frame, Layout, Limits, WireError, body_tensors, decode_header

log = logging.getLogger(__name__)

MIN_CHUNK_BYTES = 4096
CHUNK_OVERHEAD_BYTES = 4096  # a chunk frame's prefix + header stay below this
WINDOW_CHUNKS = 2  # chunks a sender has written but the receiver not yet acknowledged
DONE_MEMORY = 64  # finished transfers remembered: a resumed Begin of a delivered one is answered
# "done", and the chunks still in flight behind a refused one are dropped silently


@dataclass(frozen=True, slots=True)
class ChunkBegin(Message):
    """Starts (or resumes) transfer `xfer`: the message's header as `codec.encode_parts` made it."""

    TYPE = "CHUNK_BEGIN"
    xfer: int
    header: bytes
    body_len: int
    chunk_bytes: int

    def validate(self) -> None:
        if self.xfer < 0 or self.body_len <= 0 or self.chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError("bad transfer id, body length or chunk size")


@dataclass(frozen=True, slots=True)
class Chunk(Message):
    """Bytes [offset, offset + len) of transfer `xfer`'s body (one uint8 tensor); crc32 of them."""

    TYPE = "CHUNK"
    xfer: int
    offset: int
    crc: int

    def validate(self) -> None:
        if self.xfer < 0 or self.offset < 0 or not 0 <= self.crc < 2**32:
            raise ValueError("bad transfer id, offset or crc")


@dataclass(frozen=True, slots=True)
class ChunkAck(Message):
    """Receiver -> sender on the same connection: `have` bytes held; `done`; or `error`."""

    TYPE = "CHUNK_ACK"
    xfer: int
    have: int
    done: bool = False
    error: str = ""


CHUNK_TYPES: dict[str, type[Message]] = {c.TYPE: c for c in (ChunkBegin, Chunk, ChunkAck)}


def chunk_at(views: Sequence[bytes | memoryview], offset: int, size: int) -> np.ndarray:
    """Bytes [offset, offset + size) of the body made of `views` (as `encode_parts` returns it).

    A view of the body when the range lies inside one buffer (the usual case: one big tensor),
    else a copy of at most `size` bytes.
    """
    pieces: list[memoryview] = []
    start = 0
    for buf in views:
        end = start + len(buf)
        if end > offset and start < offset + size:
            lo, hi = max(offset, start) - start, min(offset + size, end) - start
            pieces.append(memoryview(buf)[lo:hi])
        start = end
        if start >= offset + size:
            break
    if len(pieces) == 1:
        return np.frombuffer(pieces[0], np.uint8)
    out = np.empty(size, np.uint8)
    pos = 0
    for piece in pieces:
        out[pos:pos + len(piece)] = np.frombuffer(piece, np.uint8)
        pos += len(piece)
    return out


def crc_of(data: np.ndarray) -> int:
    return zlib.crc32(data.data) & 0xFFFFFFFF


@dataclass(slots=True)
class _Partial:
    """A transfer in progress on the receiver."""

    begin: ChunkBegin
    msg: Message
    layout: Layout
    body: np.ndarray
    conn: Hashable  # the connection that (re)began it: chunks from any other are stale
    touched_s: float
    have: int = 0


@dataclass
class Reassembler:
    """The receiving end of chunked transfers, per authenticated peer (see the module docstring).

    `begin` and `chunk` return the ack to write back on the same connection (None: nothing to
    answer) and, after the last chunk, the complete frame to deliver. A refusal is an ack with
    `error` (logged here); the partial transfer is dropped and the connection stays open.
    """

    registry: Mapping[str, type[Message]]
    max_frame_bytes: int
    max_transfer_bytes: int
    max_pending: int = 4
    keep_s: float = 60.0
    _partials: dict[tuple[NodeId, int], _Partial] = field(default_factory=dict)
    _done: OrderedDict[tuple[NodeId, int], int] = field(default_factory=OrderedDict)  # -> bytes, -1 refused

    @property
    def pending_bytes(self) -> int:
        """Bytes allocated for transfers in progress."""
        return sum(p.begin.body_len for p in self._partials.values())

    def __len__(self) -> int:
        return len(self._partials)

    def begin(self, peer: NodeId, conn: Hashable, msg: ChunkBegin, now: float) -> ChunkAck:
        key = (peer, msg.xfer)
        if key in self._done:
            have = self._done[key]
            return ChunkAck(xfer=msg.xfer, have=have, done=True) if have >= 0 else \
                ChunkAck(xfer=msg.xfer, have=0, error="transfer refused earlier")
        part = self._partials.get(key)
        if part is not None:
            if part.begin != msg:
                return self._refuse(peer, msg.xfer, "resumed with a different header")
            part.conn, part.touched_s = conn, now
            log.info("resuming transfer %x from node %s at byte %d/%d", msg.xfer, peer, part.have, msg.body_len)
            return ChunkAck(xfer=msg.xfer, have=part.have)
        try:
            inner, layout = self._check_begin(msg)
        except WireError as exc:
            return self._refuse(peer, msg.xfer, exc.reason)
        if len(self._partials) >= self.max_pending:
            return self._refuse(peer, msg.xfer, f"busy: {len(self._partials)} transfers in progress")
        body = np.empty(msg.body_len, np.uint8)  # the one buffer the chunks are written into
        self._partials[key] = _Partial(msg, inner, layout, body, conn, now)
        return ChunkAck(xfer=msg.xfer, have=0)

    def chunk(self, peer: NodeId, conn: Hashable, msg: Chunk, tensors: list[np.ndarray],
              now: float) -> tuple[ChunkAck | None, Frame | None]:
        key = (peer, msg.xfer)
        part = self._partials.get(key)
        if part is None:
            if key in self._done:
                return None, None  # in flight behind a refusal, or from a connection that was replaced
            return self._refuse(peer, msg.xfer, "chunk of an unknown transfer"), None
        if part.conn != conn:
            return None, None  # stale: the transfer was resumed on another connection
        reason = self._check_chunk(part, msg, tensors)
        if reason is not None:
            return self._refuse(peer, msg.xfer, reason), None
        data = tensors[0]
        part.body[msg.offset:msg.offset + len(data)] = data
        part.have += len(data)
        part.touched_s = now
        if part.have < part.begin.body_len:
            return ChunkAck(xfer=msg.xfer, have=part.have), None
        del self._partials[key]
        self._finish(key, part.have)
        return ChunkAck(xfer=msg.xfer, have=part.have, done=True), Frame(part.msg, body_tensors(part.body, part.layout))

    def expire(self, now: float) -> list[tuple[NodeId, int]]:
        """Drop transfers idle for more than `keep_s` (their sender gave up); return their keys."""
        old = [k for k, p in self._partials.items() if now - p.touched_s > self.keep_s]
        for peer, xfer in old:
            part = self._partials.pop((peer, xfer))
            log.warning("dropped transfer %x from node %s: idle %.0fs at byte %d/%d", xfer, peer,
                        now - part.touched_s, part.have, part.begin.body_len)
        return old

    def _check_begin(self, msg: ChunkBegin) -> tuple[Message, Layout]:
        if msg.chunk_bytes + CHUNK_OVERHEAD_BYTES > self.max_frame_bytes:
            raise WireError(f"chunk of {msg.chunk_bytes} bytes exceeds the frame limit")
        if msg.body_len > self.max_transfer_bytes:
            raise WireError(f"transfer of {msg.body_len} bytes exceeds runtime.max_transfer_bytes")
        limits = Limits(max_frame_bytes=self.max_transfer_bytes)
        return decode_header(msg.header, msg.body_len, self.registry, limits)

    @staticmethod
    def _check_chunk(part: _Partial, msg: Chunk, tensors: list[np.ndarray]) -> str | None:
        if msg.offset != part.have:
            return f"chunk at offset {msg.offset}, expected {part.have}"
        want = min(part.begin.chunk_bytes, part.begin.body_len - part.have)
        if len(tensors) != 1 or tensors[0].dtype != np.uint8 or tensors[0].ndim != 1:
            return "chunk must carry one 1-d uint8 tensor"
        if tensors[0].size != want:
            return f"chunk of {tensors[0].size} bytes at offset {msg.offset}, expected {want}"
        if crc_of(tensors[0]) != msg.crc:
            return f"chunk crc mismatch at offset {msg.offset}"
        return None

    def _refuse(self, peer: NodeId, xfer: int, reason: str) -> ChunkAck:
        log.warning("refused transfer %x from node %s: %s", xfer, peer, reason)
        part = self._partials.pop((peer, xfer), None)
        self._finish((peer, xfer), -1)
        return ChunkAck(xfer=xfer, have=part.have if part else 0, error=reason[:200])

    def _finish(self, key: tuple[NodeId, int], have: int) -> None:
        self._done[key] = have
        while len(self._done) > DONE_MEMORY:
            self._done.popitem(last=False)


def iter_chunks(body_len: int, chunk_bytes: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """(offset, size) of every chunk from `start` to the end of the body."""
    for offset in range(start, body_len, chunk_bytes):
        yield offset, min(chunk_bytes, body_len - offset)


__all__ = [
    "CHUNK_TYPES",
    "Chunk",
    "ChunkAck",
    "ChunkBegin",
    "Reassembler",
    "chunk_at",
    "crc_of",
    "iter_chunks",
]
