"""The secure session against an attacker on the path and against misbehaving peers (loopback).

A man-in-the-middle TCP proxy forwards a real handshake, then injects, replays or reorders
records; a recorded handshake is replayed on a new connection; a bit of a tensor frame is
flipped (`Transport.corrupt_next_frame`); ids that do not match their keys are refused; the
caps on unauthenticated connections drop the oldest; refusals are logged at a bounded rate.
Every await is bounded; every test checks that the node keeps serving afterwards.
The floods measured against a node's memory and loop time are in
tests/integration/test_wire_flood.py (an attacker process).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from tests.unit.test_transport import SECRET, Act, Inbox, node, read_until_eof, run

from gwtf.runtime import auth, keys
from gwtf.runtime.codec import MAGIC, PREFIX, Decoder, Limits, WireError
from gwtf.runtime.transport import RefusalLog, SendFailed, Transport, parse_addr

LOGGER = "gwtf.runtime.transport"


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll `cond` (every 10 ms) until true; fail with `what` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def logged(caplog: pytest.LogCaptureFixture, *parts: str) -> bool:
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records)


class Proxy:
    """A TCP relay on loopback that understands the wire's framing (but has no secret).

    Client -> server it forwards the preamble and the two handshake messages, then records one by
    one, keeping a copy of everything; `tamper(index, record, write)` decides what to forward for
    the client's data record `index` (0 = the first after the handshake). Server -> client bytes
    are piped unchanged.
    """

    def __init__(self, target: str, tamper: Callable[[int, bytes, Callable[[bytes], None]], None]) -> None:
        self.target = parse_addr(target)
        self.tamper = tamper
        self.sent: list[bytes] = []  # every client -> server unit, in order (preamble, messages, records)
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.address

    async def _client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(*self.target)
        back = asyncio.ensure_future(self._pipe(s_reader, c_writer))
        self.tasks.add(back)
        try:
            unit = await c_reader.readexactly(len(auth.PREAMBLE))
            self._forward(s_writer, unit)
            for _ in range(2):  # messages 1 and 3
                head = await c_reader.readexactly(auth.HS_LEN.size)
                self._forward(s_writer, head + await c_reader.readexactly(auth.HS_LEN.unpack(head)[0]))
            index = 0
            while True:
                head = await c_reader.readexactly(auth.REC_LEN.size)
                record = head + await c_reader.readexactly(auth.REC_LEN.unpack(head)[0])
                self.sent.append(record)
                self.tamper(index, record, s_writer.write)
                index += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            s_writer.close()
            c_writer.close()

    def _forward(self, writer: asyncio.StreamWriter, unit: bytes) -> None:
        self.sent.append(unit)
        writer.write(unit)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _forged(index: int, record: bytes, write: Callable[[bytes], None]) -> None:
    write(record)
    if index == 0:  # a record the proxy made up: right length layout, no key
        write(auth.REC_LEN.pack(64) + os.urandom(64))


def _replayed(index: int, record: bytes, write: Callable[[bytes], None]) -> None:
    write(record)
    if index == 0:
        write(record)  # the client's own, authentic record, a second time


_held: dict[int, bytes] = {}


def _reordered(index: int, record: bytes, write: Callable[[bytes], None]) -> None:
    if index == 0:
        _held[0] = record  # hold the first record back ...
        return
    write(record)
    if index == 1:
        write(_held.pop(0))  # ... and let it arrive after the second


@pytest.mark.parametrize(("tamper", "delivered"), [(_forged, [1]), (_replayed, [1]), (_reordered, [])],
                         ids=["injected", "replayed", "reordered"])
def test_tampered_record_after_a_real_handshake_closes_that_connection_only(
        caplog: pytest.LogCaptureFixture, tamper: Callable[[int, bytes, Callable[[bytes], None]], None],
        delivered: list[int]) -> None:
    async def main() -> None:
        inbox = Inbox()
        server, client, other = await node("s", inbox), await node("c"), await node("o")
        proxy = Proxy(server.address, tamper)
        await proxy.start()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await client.send(proxy.address, Act(mb=1), timeout_s=5)
            await client.send(proxy.address, Act(mb=2), timeout_s=5)
            await until(lambda: logged(caplog, "dropped peer", f"(node {client.node_id})", "bad record",
                                       "failed authentication"), "the server's warning")
        got = []
        while not inbox.queue.empty():
            peer, msg, _ = inbox.queue.get_nowait()
            assert peer == client.node_id
            got.append(msg.mb)
        assert got == delivered  # the tampered record and everything after it: never delivered
        await other.send(server.address, Act(mb=3), timeout_s=5)  # the server keeps serving
        assert await inbox.get() == (other.node_id, Act(mb=3), [])
        assert sum("failed authentication" in r.getMessage() for r in caplog.records) == 1
        await proxy.close()
        for t in (server, client, other):
            await t.close()

    run(main)


def test_replayed_handshake_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        inbox = Inbox()
        server, client = await node("s", inbox), await node("c")
        proxy = Proxy(server.address, lambda i, rec, write: write(rec))  # records a clean session
        await proxy.start()
        await client.send(proxy.address, Act(mb=1), timeout_s=5)
        assert (await inbox.get())[1] == Act(mb=1)
        await until(lambda: len(proxy.sent) >= 4, "the recorded session")
        reader, writer = await asyncio.open_connection(*parse_addr(server.address))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            writer.write(b"".join(proxy.sent))  # preamble, messages 1 and 3, the data record: verbatim
            await read_until_eof(reader)  # the server answered message 1 with a fresh message 2, then hung up
        writer.close()
        assert logged(caplog, "refused peer 127.0.0.1:", "bad swarm secret")
        assert inbox.queue.empty()  # the replayed data record was never delivered
        await client.send(server.address, Act(mb=2), timeout_s=5)
        assert (await inbox.get())[1] == Act(mb=2)
        await proxy.close()
        await server.close()
        await client.close()

    run(main)


def test_flipped_bit_in_a_tensor_frame_closes_the_connection_and_the_next_send_reconnects(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        inbox = Inbox()
        server, client = await node("s", inbox), await node("c")
        x = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
        await client.send(server.address, Act(mb=0), timeout_s=5)  # a frame without tensors: not corrupted
        assert (await inbox.get())[1] == Act(mb=0)
        client.corrupt_next_frame()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await client.send(server.address, Act(mb=1), [x], timeout_s=5)
            await until(lambda: logged(caplog, "dropped peer", client.node_id, "failed authentication"), "warning")
            await until(lambda: not client._out, "the client to see its connection closed")
        await client.send(server.address, Act(mb=2), [x], timeout_s=5)  # a new connection
        peer, msg, tensors = await inbox.get()
        assert (peer, msg) == (client.node_id, Act(mb=2)) and np.array_equal(tensors[0], x)
        assert inbox.queue.empty()  # mb=1 was never delivered
        await server.close()
        await client.close()

    run(main)


def test_flipped_bit_in_a_chunk_resumes_the_transfer_on_a_new_connection() -> None:
    async def main() -> None:
        from gwtf.config import RuntimeConfig

        cfg = RuntimeConfig(max_frame_bytes=1 << 20, chunk_bytes=256 << 10, connect_timeout_s=2.0,
                            request_timeout_s=3.0)
        inbox = Inbox()
        server = Transport.with_new_key("s", SECRET, inbox, cfg, registry={"T_ACT": Act})
        client = Transport.with_new_key("c", SECRET, Inbox(), cfg, registry={"T_ACT": Act})
        await server.start()
        await client.start()
        state = np.random.default_rng(4).standard_normal(1 << 20).astype(np.float32)  # 4 MiB: 16 chunks
        client.corrupt_next_frame()  # the first chunk frame
        await client.send(server.address, Act(mb=9), [state], timeout_s=5)
        peer, msg, tensors = await inbox.get()
        assert msg == Act(mb=9) and np.array_equal(tensors[0], state)
        assert inbox.queue.empty()  # delivered once
        await server.close()
        await client.close()

    run(main)


def test_node_id_that_does_not_match_its_key_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        inbox = Inbox()
        server, victim = await node("s", inbox), await node("victim")
        impostor = Transport.with_new_key("x", SECRET, Inbox(), registry={"T_ACT": Act})
        impostor.node_id = victim.node_id  # claims the victim's id without the victim's key
        plain = Transport.with_new_key("x", SECRET, Inbox(), registry={"T_ACT": Act})
        plain.node_id = "plain/local@127.0.0.1:1"  # no fingerprint at all
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for liar in (impostor, plain):
                with pytest.raises(SendFailed):
                    await liar.send(server.address, Act(mb=1), timeout_s=5)
        assert logged(caplog, "refused peer 127.0.0.1:", "does not match its key")
        assert logged(caplog, "refused peer 127.0.0.1:", "carries no key fingerprint")
        assert inbox.queue.empty()
        liar_server = Transport.with_new_key("y", SECRET, Inbox(), registry={"T_ACT": Act})
        liar_server.node_id = server.node_id  # a server that claims someone else's id
        await liar_server.start()
        with pytest.raises(SendFailed, match="does not match its key"):
            await victim.send(liar_server.address, Act(mb=2), timeout_s=5)
        await victim.send(server.address, Act(mb=3), timeout_s=5)
        assert await inbox.get() == (victim.node_id, Act(mb=3), [])
        for t in (server, victim, impostor, plain, liar_server):
            await t.close()

    run(main)


def test_flood_of_unauthenticated_connections_drops_the_oldest_not_the_honest_peer(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        inbox = Inbox()
        server, good = await node("s", inbox), await node("good")
        server.MAX_UNAUTHENTICATED_PER_HOST = 8  # type: ignore[misc]  # small caps keep the test fast
        server.MAX_UNAUTHENTICATED = 12  # type: ignore[misc]
        host, port = parse_addr(server.address)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            flood = [await asyncio.open_connection(host, port) for _ in range(40)]  # each sends nothing
            await until(lambda: server.unauthenticated <= 8 and sum(
                r.at_eof() for r, _ in flood) >= 32, "the oldest 32 to be dropped")
            await good.send(server.address, Act(mb=1), timeout_s=5)  # the newest: gets through
        assert await inbox.get() == (good.node_id, Act(mb=1), [])
        assert [r.at_eof() for r, _ in flood[-7:]] == [False] * 7  # the newest of the flood were kept
        cap_lines = [r for r in caplog.records if "too many unauthenticated" in r.getMessage()]
        assert len(cap_lines) == 1  # 33 refusals, one line (rate-limited)
        for _, w in flood:
            w.close()
        await server.close()
        await good.close()

    run(main)


def test_refusal_log_writes_one_line_per_host_and_kind_per_period(caplog: pytest.LogCaptureFixture) -> None:
    rl = RefusalLog()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rl.refused("1.2.3.4:1", "1.2.3.4", "magic", "bad magic", 0.0)
        assert not any(rl.refused("1.2.3.4:2", "1.2.3.4", "magic", "bad magic", t) for t in (1.0, 5.0, 9.9))
        assert rl.refused("1.2.3.4:3", "1.2.3.4", "secret", "bad swarm secret", 1.0)  # another kind
        assert rl.refused("5.6.7.8:1", "5.6.7.8", "magic", "bad magic", 1.0)  # another host
        assert rl.refused("1.2.3.4:4", "1.2.3.4", "magic", "bad magic", 10.5)
    assert len(caplog.records) == 4
    assert "3 more like it from 1.2.3.4" in caplog.records[-1].getMessage()


def test_handshake_messages_have_their_own_small_limit() -> None:
    hs = auth.Handshake("server", keys.new_private_key(), keys.psk_of(SECRET), "s~" + "a" * 16)
    with pytest.raises(auth.HandshakeError, match="message of 65535 bytes"):
        hs.receive(memoryview(auth.PREAMBLE + auth.HS_LEN.pack(65535)))
    hs = auth.Handshake("server", keys.new_private_key(), keys.psk_of(SECRET), "s~" + "a" * 16)
    old = PREFIX.pack(MAGIC, 1, 0, 1 << 20, 256 << 20)  # wire 1: a 1 MiB header, a 256 MiB body
    with pytest.raises(auth.HandshakeError, match="unsupported wire version 1"):
        hs.receive(memoryview(old))


def _session() -> tuple[auth.Sealer, auth.Opener]:
    key = os.urandom(32)
    return auth.Sealer(key), auth.Opener(key, auth.RxBuffer(64))


def _feed(opener: auth.Opener, data: bytes) -> None:
    pos = 0
    while pos < len(data):
        buf = opener.get_buffer()
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        opener.rx.filled(n)
        pos += n


def test_records_decrypt_tensor_bodies_into_the_decoder_buffer() -> None:
    from gwtf.runtime.codec import encode

    sealer, opener = _session()
    x = np.random.default_rng(5).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: 12 body records
    records = sealer.seal(encode(Act(mb=4), [np.arange(3), x]))
    assert len(records) == 13 and all(len(r) <= auth.RECORD_BYTES + auth.RECORD_OVERHEAD for r in records)
    dec = Decoder(registry={"T_ACT": Act})
    pushed = []
    real_push = dec.push
    dec.push = lambda data: (pushed.append(len(data)), real_push(data))  # type: ignore[method-assign]
    frames = []
    for record in records:
        _feed(opener, bytes(record))
        while opener.open_next(dec) is not None:
            frames += dec.drain()
    (frame,) = frames
    assert frame.msg == Act(mb=4) and np.array_equal(frame.tensors[1], x)
    assert sum(pushed) < 4096  # only the header and the small tensor went through a copy
    assert len(opener.rx.buf) <= auth.MAX_RX_BYTES


@pytest.mark.parametrize("change", ["bit", "length", "truncate"])
def test_altered_record_fails(change: str) -> None:
    sealer, opener = _session()
    record = bytearray(sealer.seal_one(b"hello world"))
    if change == "bit":
        record[-1] ^= 0x80  # the tag
    elif change == "length":
        record[0] += 1  # the authenticated length: now the record reads one byte more
        record += b"\x00"
    else:
        record = record[:-1]
        record[0] -= 1
    _feed(opener, bytes(record))
    with pytest.raises(auth.RecordError, match="failed authentication"):
        opener.open_next(None)


def test_record_length_beyond_the_limit_is_refused_before_reading_it() -> None:
    _, opener = _session()
    _feed(opener, auth.REC_LEN.pack(auth.RECORD_BYTES + auth.TAG_BYTES + 1))
    with pytest.raises(auth.RecordError, match="bad record length"):
        opener.open_next(None)
    assert len(opener.rx.buf) < 1 << 17  # nothing was allocated for it


def test_decoder_limits_msgpack_containers_of_authenticated_frames() -> None:
    header = msgpack.packb({"t": "T_ACT", "f": {"mb": 1, "note": [[]] * 70000}})  # ~70k objects
    dec = Decoder(registry={"T_ACT": Act}, limits=Limits())
    with pytest.raises(WireError, match="bad header"):
        dec.feed(PREFIX.pack(MAGIC, 1, 0, len(header), 0) + header)


def test_a_session_key_pair_matches_across_the_handshake() -> None:
    ck, sk = keys.new_private_key(), keys.new_private_key()
    cid, sid = f"c~{keys.fingerprint(keys.public_of(ck))}", f"s~{keys.fingerprint(keys.public_of(sk))}"
    client = auth.Handshake("client", ck, keys.psk_of(SECRET), cid)
    server = auth.Handshake("server", sk, keys.psk_of(SECRET), sid)
    m1 = client.first()
    used, m2 = server.receive(memoryview(m1))
    assert used == len(m1)
    _, m3 = client.receive(memoryview(m2))
    _, nothing = server.receive(memoryview(m3))
    assert nothing == b"" and client.done and server.done
    assert (client.peer_id, server.peer_id) == (sid, cid)
    assert client.send_key == server.recv_key and client.recv_key == server.send_key
    assert client.send_key != client.recv_key and len(client.send_key) == 32
    again = auth.Handshake("server", sk, keys.psk_of(SECRET), sid)  # same static keys, a new session
    _, m2b = again.receive(memoryview(m1))
    assert m2b[:34] != m2[:34]  # a fresh ephemeral key: a recorded message 3 cannot fit this one
    with pytest.raises(auth.HandshakeError, match="bad swarm secret"):
        again.receive(memoryview(m3))


class _Pending:
    """A stand-in for an accepted connection in its handshake (what the cap sweep looks at)."""

    def __init__(self, host: str, generation: int, progress: int) -> None:
        self.host, self.generation, self.progress = host, generation, progress
        self.refused = ""

    def _refuse(self, reason: str, kind: str) -> None:
        self.refused = kind


def test_the_cap_sweep_drops_idle_sockets_only_never_a_handshake_in_progress() -> None:
    """CI run of 43f08ea: a flood reconnecting from the honest peer's own address kept most of
    the per-host pool too young to sweep; the sweep then dropped the oldest mid-handshake
    connection, the honest peer's ("handshake refused by peer"). Now it drops idle ones only."""
    from collections import OrderedDict

    async def main() -> None:
        server = await node("s", Inbox())
        server.MAX_UNAUTHENTICATED_PER_HOST = 4  # type: ignore[misc]
        host = "127.0.0.1"
        honest = _Pending(host, generation=0, progress=1)  # sent message 1, its loop is slow
        idle = [_Pending(host, 0, 0) for _ in range(4)]
        young = [_Pending(host, 1, 0) for _ in range(20)]  # accepted after the last sweep
        for c in (honest, *idle, *young):
            server._unauth[c] = None  # type: ignore[index]
            server._unauth_by_host.setdefault(host, OrderedDict())[c] = None  # type: ignore[index]
        server._generation = 1
        server._sweep_caps()
        assert [c.refused for c in idle] == ["cap"] * 4
        assert honest.refused == "" and honest in server._unauth  # type: ignore[comparison-overlap]
        assert not any(c.refused for c in young)
        server._unauth.clear()
        server._unauth_by_host.clear()
        await server.close()

    run(main)
