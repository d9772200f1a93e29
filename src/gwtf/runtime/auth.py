"""The secure session of every connection: a Noise XXpsk3 handshake, then AEAD records.

Owns the sans-IO cryptographic layer under the frame codec (docs/wire.md, "Secure session"):

- `Handshake`: `Noise_XXpsk3_25519_AESGCM_SHA256` (the `noiseprotocol` package over
  `cryptography`), the PSK being `keys.psk_of(swarm secret)`. Both sides prove their static X25519
  key; the encrypted payloads carry each side's node id, which must embed the fingerprint of that
  key (`keys.id_fingerprint(id) == keys.fingerprint(static key)`), so an id cannot be claimed
  without its private key. Fresh ephemeral keys on both sides make a recorded handshake useless
  on any other connection (forward secrecy, no replay).
- `Sealer` / `Opener`: after the handshake every byte travels in records
  `u32 length | AES-GCM(ciphertext + tag)`, keys from the Noise split, one per direction, nonce =
  a 64-bit counter per direction (Noise's nonce layout), the length bytes authenticated as
  associated data. An altered, replayed, reordered, truncated or injected record fails its tag:
  `RecordError`, and the transport closes the connection. The `Opener` decrypts a record that
  lies inside a pending tensor body straight into the decoder's body buffer (`decrypt_into`).
- Bounded cost before authentication: handshake messages are at most `MAX_HANDSHAKE_BYTES`, the
  receive buffer is `HANDSHAKE_BUFFER_BYTES`, no msgpack is parsed (the payload is a UTF-8 node
  id), and the record buffers grow only after authentication.

Must not import asyncio or socket.
"""

from __future__ import annotations

import struct
from typing import Literal, Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from noise.connection import Keypair, NoiseConnection

from gwtf.runtime import keys

PROTOCOL_NAME = b"Noise_XXpsk3_25519_AESGCM_SHA256"
PROLOGUE = b"gwtf-wire-v2"
MAGIC = b"GWTF"
WIRE_VERSION = 2  # version 1 was the plaintext wire with the HMAC handshake
PREAMBLE = MAGIC + bytes([WIRE_VERSION])  # the client's first bytes, before its first message
HS_LEN = struct.Struct("<H")  # handshake message length prefix
MAX_HANDSHAKE_BYTES = 1024  # one Noise handshake message (the largest is ~100 bytes + a node id)
HANDSHAKE_BUFFER_BYTES = 2048  # the receive buffer of a connection until it is authenticated
MAX_NODE_ID_CHARS = 256
RECORD_BYTES = 1 << 20  # plaintext of one record at most (a 4 MiB tensor is 4 records)
TAG_BYTES = 16
REC_LEN = struct.Struct("<I")  # record length prefix: ciphertext bytes including the tag
RECORD_OVERHEAD = REC_LEN.size + TAG_BYTES
SPILL_BYTES = 64 * 1024  # a read whose record length is not known yet takes at most this much
COALESCE_BYTES = 64 * 1024  # buffers of a frame smaller than this share a record
MAX_RX_BYTES = RECORD_BYTES + RECORD_OVERHEAD + 2 * SPILL_BYTES  # receive buffer of an authenticated link
_NONCE_PAD = bytes(4)
_MAX_COUNTER = 2**64 - 1

Role = Literal["client", "server"]


class HandshakeError(Exception):
    """The handshake failed; `kind` is a short fixed word (rate-limited logging keys on it)."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class RecordError(Exception):
    """A record after the handshake is malformed or fails authentication."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_node_id(raw: bytes) -> str:
    """A handshake payload as a node id: UTF-8, 1..MAX_NODE_ID_CHARS printable non-space chars."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HandshakeError("bad handshake: node id is not UTF-8", "payload") from None
    if not 0 < len(text) <= MAX_NODE_ID_CHARS or not text.isprintable() or any(c.isspace() for c in text):
        raise HandshakeError("bad handshake: malformed node id", "payload")
    return text


def bind_id(node_id: str, static_public: bytes) -> None:
    """HandshakeError unless `node_id` embeds the fingerprint of `static_public`."""
    claimed = keys.id_fingerprint(node_id)
    if claimed is None:
        raise HandshakeError(f"node id {node_id[:80]!r} carries no key fingerprint", "no-fingerprint")
    if claimed != keys.fingerprint(static_public):
        raise HandshakeError(f"node id {node_id[:80]!r} does not match its key", "fingerprint")


class Handshake:
    """One side of the Noise XXpsk3 handshake of one connection (sans-IO).

        client -> server   PREAMBLE, len | e                                  (msg 1)
        server -> client   len | e, ee, s, es, payload(server node id)         (msg 2)
        client -> server   len | s, se, psk, payload(client node id)           (msg 3)
        server -> client   an empty record (the first one of the session): confirmation

    The server proves the PSK only with its first record (XXpsk3 mixes the PSK into message 3),
    so a client counts as authenticated once that confirmation decrypts. `first()` gives the
    client's opening bytes; `receive(buf)` consumes at most one message from `buf` and returns
    (bytes consumed, bytes to write); `done` then `peer_id`, `peer_key`, `send_key`, `recv_key`.
    """

    def __init__(self, role: Role, static_key: bytes, psk: bytes, node_id: str) -> None:
        self.role: Role = role
        noise = NoiseConnection.from_name(PROTOCOL_NAME)
        noise.set_psks(psk)
        noise.set_prologue(PROLOGUE)
        noise.set_keypair_from_private_bytes(Keypair.STATIC, static_key)
        if role == "client":
            noise.set_as_initiator()
        else:
            noise.set_as_responder()
        noise.start_handshake()
        self._noise = noise
        self._state = noise.noise_protocol.handshake_state  # kept: the library drops it at the split
        self._payload = node_id.encode("utf-8")
        self._step = 0  # messages processed so far (sent or received)
        self._preamble_seen = role == "client"
        self.done = False
        self.peer_id = ""
        self.peer_key = b""
        self.send_key = b""
        self.recv_key = b""

    def first(self) -> bytes:
        """The client's opening bytes (preamble and message 1); b"" for the server."""
        if self.role != "client":
            return b""
        self._step = 1
        return PREAMBLE + _framed(self._noise.write_message(b""))

    def receive(self, buf: memoryview) -> tuple[int, bytes]:
        """Consume at most one handshake message from `buf`: (bytes consumed, bytes to write).

        (0, b"") means more bytes are needed. Raises HandshakeError.
        """
        used = 0
        if not self._preamble_seen:
            if bytes(buf[: len(MAGIC)]) != MAGIC[: min(len(buf), len(MAGIC))]:
                raise HandshakeError("bad handshake: bad magic", "magic")
            if len(buf) < len(PREAMBLE):
                return 0, b""
            if buf[len(MAGIC)] != WIRE_VERSION:
                raise HandshakeError(f"bad handshake: unsupported wire version {buf[len(MAGIC)]}", "version")
            used = len(PREAMBLE)
        if len(buf) - used < HS_LEN.size:
            return 0, b""
        (size,) = HS_LEN.unpack_from(buf, used)
        if not 0 < size <= MAX_HANDSHAKE_BYTES:
            raise HandshakeError(f"bad handshake: message of {size} bytes", "size")
        if len(buf) - used - HS_LEN.size < size:
            return 0, b""
        self._preamble_seen = True
        message = bytes(buf[used + HS_LEN.size : used + HS_LEN.size + size])
        return used + HS_LEN.size + size, self._on_message(message)

    def _on_message(self, message: bytes) -> bytes:
        if self.done:
            raise HandshakeError("bad handshake: message after the handshake", "protocol")
        try:
            payload = bytes(self._noise.read_message(message))
        except Exception:  # noiseprotocol raises InvalidTag, NoiseInvalidMessage, ValueError, ...
            raise HandshakeError("bad swarm secret (or a tampered handshake)", "secret") from None
        self._step += 1
        if self.role == "server" and self._step == 1:
            if payload:
                raise HandshakeError("bad handshake: payload in message 1", "payload")
            self._step = 2
            return _framed(self._noise.write_message(self._payload))
        self.peer_id = check_node_id(payload)
        self.peer_key = bytes(self._state.rs.public_bytes)
        bind_id(self.peer_id, self.peer_key)
        out = b""
        if self.role == "client":
            self._step = 3
            out = _framed(self._noise.write_message(self._payload))
        self._finish()
        return out

    def _finish(self) -> None:
        proto = self._noise.noise_protocol
        self.send_key = bytes(proto.cipher_state_encrypt.k)
        self.recv_key = bytes(proto.cipher_state_decrypt.k)
        self.done = True
        del self._noise, self._state  # ephemeral secrets go with them


def _framed(message: bytes | bytearray) -> bytes:
    return HS_LEN.pack(len(message)) + bytes(message)


def _nonce(counter: int) -> bytes:
    if counter >= _MAX_COUNTER:
        raise RecordError("record counter exhausted")
    return _NONCE_PAD + counter.to_bytes(8, "big")


class Sealer:
    """The sending half of a session: frames' buffers -> records (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = 0

    def seal(self, buffers: list[bytes | memoryview] | tuple[bytes | memoryview, ...],
             corrupt: bool = False) -> list[memoryview]:
        """Records carrying `buffers` in order; small buffers share a record, large ones are cut
        into records of RECORD_BYTES. `corrupt`: flip one ciphertext bit of the last record (a
        fault-injection hook for tests, `Transport.corrupt_next_frame`)."""
        out: list[memoryview] = []
        small: list[memoryview] = []
        small_len = 0
        for buf in buffers:
            view = memoryview(buf)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            if len(view) <= COALESCE_BYTES and small_len + len(view) <= RECORD_BYTES:
                small.append(view)
                small_len += len(view)
                continue
            if small:
                out.append(self.seal_one(b"".join(small)))
                small, small_len = [], 0
            for offset in range(0, len(view), RECORD_BYTES):
                out.append(self.seal_one(view[offset : offset + RECORD_BYTES]))
        if small:
            out.append(self.seal_one(b"".join(small)))
        if corrupt and out:
            last = out[-1]
            last[REC_LEN.size] ^= 0x01
        return out

    def seal_one(self, data: bytes | memoryview) -> memoryview:
        """One record holding `data` (at most RECORD_BYTES)."""
        n = len(data)
        assert n <= RECORD_BYTES
        record = np.empty(RECORD_OVERHEAD + n, np.uint8).data  # no zero fill: all of it is written
        REC_LEN.pack_into(record, 0, n + TAG_BYTES)
        self._aead.encrypt_into(_nonce(self._counter), data, record[: REC_LEN.size], record[REC_LEN.size :])
        self._counter += 1
        return record


class RecordSink(Protocol):
    """Where decrypted bytes go (`codec.Decoder` implements it)."""

    def body_window(self, nbytes: int) -> memoryview | None: ...

    def body_written(self, nbytes: int) -> None: ...

    def push(self, data: bytes | bytearray | memoryview) -> None: ...


class RxBuffer:
    """A connection's receive buffer: bytes [start, end) are received but not yet consumed."""

    def __init__(self, capacity: int) -> None:
        self.buf = bytearray(capacity)
        self.start = 0
        self.end = 0

    @property
    def pending(self) -> int:
        return self.end - self.start

    def view(self) -> memoryview:
        return memoryview(self.buf)[self.start : self.end]

    def consume(self, n: int) -> None:
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0

    def reserve(self, total: int, limit: int) -> None:
        """Make room for `total` bytes from `start` (compact, or grow up to `limit`)."""
        if self.start + total <= len(self.buf):
            return
        if total <= len(self.buf):
            self.buf[: self.pending] = self.buf[self.start : self.end]
        else:
            grown = bytearray(min(max(total, 2 * len(self.buf)), max(total, limit)))
            grown[: self.pending] = self.buf[self.start : self.end]
            self.buf = grown
        self.start, self.end = 0, self.end - self.start

    def writable(self, limit: int) -> memoryview:
        """Space for the next read, ending at byte `limit` of the buffer."""
        return memoryview(self.buf)[self.end : limit]

    def filled(self, n: int) -> None:
        self.end += n


class Opener:
    """The receiving half of a session: records in `rx` -> plaintext into a `RecordSink`.

    `get_buffer()` hands asyncio the space for the next read (never past the end of a large
    record, so a record's ciphertext is contiguous without copying it); `open_next(sink)`
    decrypts one complete record, into the sink's pending tensor body when it lies inside one.
    `max_rx` caps the buffer (small until the peer is authenticated).
    """

    def __init__(self, key: bytes, rx: RxBuffer, max_rx: int = MAX_RX_BYTES) -> None:
        self._aead = AESGCM(key)
        self._counter = 0
        self.rx = rx
        self.max_rx = max_rx
        self._scratch = bytearray(0)
        self.records = 0

    def get_buffer(self) -> memoryview:
        rx = self.rx
        pending = rx.pending
        total = self._record_total()
        if total is not None and total > SPILL_BYTES and total <= self.max_rx:
            rx.reserve(total, self.max_rx)
            return rx.writable(rx.start + total)
        rx.reserve(min(pending + SPILL_BYTES, max(self.max_rx, pending + 1)), self.max_rx)
        return rx.writable(min(len(rx.buf), rx.end + SPILL_BYTES))

    def _record_total(self) -> int | None:
        rx = self.rx
        if rx.pending < REC_LEN.size:
            return None
        return REC_LEN.size + REC_LEN.unpack_from(rx.buf, rx.start)[0]

    def open_next(self, sink: RecordSink | None) -> int | None:
        """Decrypt the next complete record into `sink`: its plaintext length, or None if incomplete.

        Raises RecordError (bad length, or the tag fails: altered, replayed, reordered, injected).
        """
        total = self._record_total()
        if total is None:
            return None
        size = total - REC_LEN.size
        if not TAG_BYTES <= size <= RECORD_BYTES + TAG_BYTES or total > self.max_rx:
            raise RecordError(f"bad record length {size}")
        rx = self.rx
        if rx.pending < total:
            return None
        view = memoryview(rx.buf)
        aad, ciphertext = view[rx.start : rx.start + REC_LEN.size], view[rx.start + REC_LEN.size : rx.start + total]
        n = size - TAG_BYTES
        target = sink.body_window(n) if sink is not None and n else None
        out = target if target is not None else self._scratch_of(n)
        try:
            self._aead.decrypt_into(_nonce(self._counter), ciphertext, aad, out)
        except Exception:  # cryptography.exceptions.InvalidTag
            raise RecordError(f"record {self._counter} failed authentication "
                              "(altered, replayed, reordered or injected)") from None
        self._counter += 1
        self.records += 1
        rx.consume(total)
        if n and sink is not None:
            if target is not None:
                sink.body_written(n)
            else:
                sink.push(out)
        return n

    def _scratch_of(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = bytearray(max(n, 2 * len(self._scratch), 4096))
        return memoryview(self._scratch)[:n]
