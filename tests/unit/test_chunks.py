"""Chunked transfers: split/reassemble, refused chunks, lost connections, memory bounds.

The frame limit is lowered (1 MiB frames, 256 KiB chunks) so a "state larger than the frame
limit" is a few MiB and the tests stay fast. Every await is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from tests.unit.test_transport import REG, Act, Inbox, make_transport

from gwtf.config import RuntimeConfig
from gwtf.runtime import chunks, statefile, transport
from gwtf.runtime.chunks import Chunk, ChunkBegin, Reassembler, chunk_at, crc_of, iter_chunks
from gwtf.runtime.codec import encode_parts
from gwtf.runtime.transport import SendFailed, Transport

FRAME = 1 << 20
CHUNK = 256 << 10
CFG = RuntimeConfig(max_frame_bytes=FRAME, chunk_bytes=CHUNK, connect_timeout_s=2.0, request_timeout_s=3.0)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30.0))


async def node(name: str, inbox: Inbox | None = None, cfg: RuntimeConfig = CFG) -> Transport:
    t = make_transport(name, inbox, cfg=cfg)
    await t.start("127.0.0.1", 0)
    return t


def state(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)


def begin_of(msg: Act, tensors: list[np.ndarray], xfer: int = 7) -> tuple[ChunkBegin, list[Any]]:
    header, views, body_len = encode_parts(msg, tensors)
    return ChunkBegin(xfer=xfer, header=header, body_len=body_len, chunk_bytes=CHUNK), views


def chunk_msg(begin: ChunkBegin, views: list[Any], offset: int, size: int) -> tuple[Chunk, list[np.ndarray]]:
    data = chunk_at(views, offset, size)
    return Chunk(xfer=begin.xfer, offset=offset, crc=crc_of(data)), [data]


def reassembler() -> Reassembler:
    return Reassembler(REG, FRAME, max_transfer_bytes=64 << 20)


# -- the receiver's reassembly (pure) ----------------------------------------------------------


def test_split_and_reassemble_several_tensors_across_chunk_borders() -> None:
    tensors = [np.arange(3, dtype=np.int64), state(5 * CHUNK + 1004), np.arange(10, dtype=np.uint8).reshape(2, 5)]
    begin, views = begin_of(Act(mb=5, note="x"), tensors)
    assert begin.body_len > FRAME  # the message could not travel as one frame
    r = reassembler()
    assert r.begin("b", "conn", begin, 0.0).have == 0
    frame = None
    for offset, size in iter_chunks(begin.body_len, CHUNK):
        ack, frame = r.chunk("b", "conn", *chunk_msg(begin, views, offset, size), 0.0)
        assert ack is not None and not ack.error and ack.have == offset + size
    assert frame is not None and ack is not None and ack.done
    assert frame.msg == Act(mb=5, note="x")
    assert all(np.array_equal(a, b) for a, b in zip(frame.tensors, tensors, strict=True))
    assert len(r) == 0 and r.pending_bytes == 0
    # a resumed Begin of a delivered transfer is answered "done": the message is not delivered twice
    assert r.begin("b", "conn2", begin, 0.0).done


@pytest.mark.parametrize("bad", ["offset", "size", "crc", "dtype"])
def test_bad_chunk_is_refused_and_logged_and_others_keep_going(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    begin, views = begin_of(Act(mb=1), [state(4 * CHUNK)])
    other, other_views = begin_of(Act(mb=2), [state(2 * CHUNK, seed=1)], xfer=8)
    r = reassembler()
    r.begin("b", "c", begin, 0.0)
    r.begin("b", "c", other, 0.0)
    r.chunk("b", "c", *chunk_msg(begin, views, 0, CHUNK), 0.0)
    msg, data = chunk_msg(begin, views, CHUNK, CHUNK)
    if bad == "offset":
        msg = Chunk(xfer=msg.xfer, offset=2 * CHUNK, crc=msg.crc)
    elif bad == "size":
        data = [data[0][: CHUNK // 2]]
        msg = Chunk(xfer=msg.xfer, offset=CHUNK, crc=crc_of(data[0]))
    elif bad == "crc":
        msg = Chunk(xfer=msg.xfer, offset=CHUNK, crc=(msg.crc + 1) % 2**32)
    else:
        data = [data[0].view(np.float32)]
    with caplog.at_level(logging.WARNING):
        ack, frame = r.chunk("b", "c", msg, data, 0.0)
    assert ack is not None and ack.error and frame is None
    assert "refused transfer 7" in caplog.text
    assert r.pending_bytes == other.body_len  # the bad transfer's buffer is gone
    assert r.chunk("b", "c", *chunk_msg(begin, views, 2 * CHUNK, CHUNK), 0.0) == (None, None)  # in flight: dropped
    assert "refused earlier" in r.begin("b", "c2", begin, 0.0).error  # the refused transfer stays refused
    stranger = Chunk(xfer=99, offset=0, crc=0)
    ack, _ = r.chunk("b", "c", stranger, [np.zeros(CHUNK, np.uint8)], 0.0)
    assert ack is not None and "unknown transfer" in ack.error
    for offset, size in iter_chunks(other.body_len, CHUNK):
        ack, frame = r.chunk("b", "c", *chunk_msg(other, other_views, offset, size), 0.0)
    assert frame is not None and frame.msg == Act(mb=2)


def test_bad_begin_is_refused_before_allocating() -> None:
    begin, _ = begin_of(Act(mb=1), [state(4 * CHUNK)])
    r = Reassembler(REG, FRAME, max_transfer_bytes=2 * CHUNK)
    assert "max_transfer_bytes" in r.begin("b", "c", begin, 0.0).error
    r = reassembler()
    lying = ChunkBegin(xfer=1, header=begin.header, body_len=begin.body_len + 8, chunk_bytes=CHUNK)
    assert "mismatch" in r.begin("b", "c", lying, 0.0).error  # the header's tensors say otherwise
    huge_chunks = ChunkBegin(xfer=2, header=begin.header, body_len=begin.body_len, chunk_bytes=FRAME)
    assert "frame limit" in r.begin("b", "c", huge_chunks, 0.0).error
    assert len(r) == 0


def test_stale_connection_chunks_are_ignored_and_idle_transfers_expire() -> None:
    begin, views = begin_of(Act(mb=1), [state(4 * CHUNK)])
    r = reassembler()
    r.begin("b", "old", begin, 0.0)
    r.chunk("b", "old", *chunk_msg(begin, views, 0, CHUNK), 1.0)
    assert r.begin("b", "new", begin, 2.0).have == CHUNK  # resumed where it stood
    assert r.chunk("b", "old", *chunk_msg(begin, views, CHUNK, CHUNK), 2.0) == (None, None)
    assert r.expire(2.0 + r.keep_s / 2) == []
    assert r.expire(3.0 + r.keep_s) == [("b", 7)] and r.pending_bytes == 0


def test_receiver_memory_is_the_body_plus_one_chunk() -> None:
    body = state(32 << 20)  # 32 MiB in 128 chunks
    begin, views = begin_of(Act(mb=1), [body])
    r = reassembler()
    tracemalloc.start()
    try:
        r.begin("b", "c", begin, 0.0)
        for offset, size in iter_chunks(begin.body_len, CHUNK):
            data = chunk_at(views, offset, size).copy()  # a decoded chunk frame's own buffer
            ack, frame = r.chunk("b", "c", Chunk(xfer=7, offset=offset, crc=crc_of(data)), [data], 0.0)
            del data
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert frame is not None and np.array_equal(frame.tensors[0], body)
    assert peak < begin.body_len + 3 * CHUNK, f"peak {peak / 2**20:.1f} MiB for a {begin.body_len / 2**20:.0f} MiB body"


# -- over the transport -----------------------------------------------------------------------


def test_state_larger_than_the_frame_limit_round_trips_over_the_transport() -> None:
    async def main() -> None:
        inbox = Inbox()
        a, b = await node("a", inbox), await node("b")
        x = state(5 * FRAME + 12)
        await b.send(a.address, Act(mb=3), [np.arange(3), x], timeout_s=5)
        await b.send(a.address, Act(mb=4), timeout_s=5)  # small messages still go as one frame
        peer, msg, tensors = await inbox.get()
        assert (peer, msg) == (b.node_id, Act(mb=3))
        assert np.array_equal(tensors[0], np.arange(3)) and np.array_equal(tensors[1], x)
        assert (await inbox.get())[1] == Act(mb=4)
        assert len(a.reassembler) == 0
        await a.close()
        await b.close()

    run(main)


def _drop_connection_after(t: Transport, chunks_in: int) -> list[int]:
    """Test-only fault: abort the receiving connection once, after `chunks_in` chunks arrived."""
    seen: list[int] = []
    original = t.reassembler.chunk

    def chunk(peer: str, conn: Any, msg: Chunk, tensors: list[np.ndarray], now: float) -> Any:
        out = original(peer, conn, msg, tensors, now)
        seen.append(msg.offset)
        if len(seen) == chunks_in:
            conn.abort()
        return out

    t.reassembler.chunk = chunk  # type: ignore[method-assign]
    return seen


def test_connection_lost_mid_transfer_resumes_from_the_last_chunk(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        inbox = Inbox()
        a, b = await node("a", inbox), await node("b")
        x = state(8 * CHUNK)
        seen = _drop_connection_after(a, 3)
        with caplog.at_level(logging.INFO):
            await b.send(a.address, Act(mb=9), [x], timeout_s=3)
        _, msg, tensors = await inbox.get()
        assert msg == Act(mb=9) and np.array_equal(tensors[0], x)
        assert inbox.queue.empty()  # delivered exactly once
        assert seen[:3] == [0, CHUNK, 2 * CHUNK] and seen[3] == 3 * CHUNK  # resumed, not restarted
        assert f"at byte {3 * CHUNK}/" in caplog.text
        await a.close()
        await b.close()

    run(main)


def test_receiver_dying_mid_transfer_fails_the_send_in_bounded_time() -> None:
    async def main() -> None:
        a, b = await node("a"), await node("b")
        arrived = _drop_connection_after(a, 2)
        started = time.monotonic()
        send = asyncio.ensure_future(b.send(a.address, Act(mb=1), [state(64 * CHUNK)], timeout_s=3))
        while len(arrived) < 2:
            await asyncio.sleep(0.005)  # polling period of a bounded wait (the outer deadline)
        await a.close()  # the peer is gone: every reconnect is refused
        with pytest.raises(SendFailed, match="after 4 tries"):
            await asyncio.wait_for(send, 10.0)
        assert time.monotonic() - started < 5.0
        await b.close()

    run(main)


def test_stalled_receiver_fails_the_send_with_timeout() -> None:
    async def main() -> None:
        cfg = RuntimeConfig(max_frame_bytes=FRAME, chunk_bytes=CHUNK, connect_timeout_s=2.0,
                            request_timeout_s=3.0, transfer_retries=0)
        a, b = await node("a"), await node("b", cfg=cfg)
        await b.send(a.address, Act(mb=0), timeout_s=5)
        for conn in list(a._conns_all):  # test-only: the receiver stops reading
            assert conn._transport is not None
            conn._transport.pause_reading()
        with pytest.raises(SendFailed, match="timeout"):
            await b.send(a.address, Act(mb=1), [state(64 * CHUNK)], timeout_s=0.3)
        await a.close()
        await b.close()

    run(main)


def test_refused_chunk_fails_the_send_and_the_receiver_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        inbox = Inbox()
        a, b = await node("a", inbox), await node("b")
        with monkeypatch.context() as m:
            m.setattr(transport, "crc_of", lambda data: (chunks.crc_of(data) + 1) % 2**32)  # a corrupting sender
            with pytest.raises(SendFailed, match="refused by peer: chunk crc mismatch"):
                await b.send(a.address, Act(mb=1), [state(4 * CHUNK)], timeout_s=3)
        assert "refused transfer" in caplog.text
        x = state(4 * CHUNK, seed=2)
        await b.send(a.address, Act(mb=2), [x], timeout_s=3)  # same connection, next transfer
        _, msg, tensors = await inbox.get()
        assert msg == Act(mb=2) and np.array_equal(tensors[0], x)
        await a.close()
        await b.close()

    run(main)


def test_transfer_memory_on_both_ends_is_bounded_by_chunks() -> None:
    async def main() -> None:
        inbox = Inbox()
        a, b = await node("a", inbox), await node("b")
        x = state(32 << 20)
        await b.send(a.address, Act(mb=0), timeout_s=5)  # connect first
        await inbox.get()
        tracemalloc.start()
        try:
            await b.send(a.address, Act(mb=1), [x], timeout_s=5)
            _, msg, tensors = await inbox.get()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(tensors[0], x)
        # sender and receiver in this one process: the received body plus a few chunks in flight
        assert peak < x.nbytes + 8 * CHUNK, f"peak {peak / 2**20:.1f} MiB for {x.nbytes / 2**20:.0f} MiB"
        await a.close()
        await b.close()

    run(main)


# -- the state buffer -------------------------------------------------------------------------


def test_packed_state_is_safetensors_and_loads_as_views() -> None:
    tensors = {"w.a": torch.randn(3, 5), "opt.a.step": torch.tensor(4.0), "w.b": torch.arange(7, dtype=torch.int64),
               "w.h": torch.randn(4).to(torch.bfloat16)}
    blob = statefile.pack(tensors)
    assert {k: v.tolist() for k, v in st_load(blob.tobytes()).items()} == {k: v.tolist() for k, v in tensors.items()}
    back = statefile.views(blob)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    back["w.a"][0, 0] = 42.0  # a view: no second copy of the serialized bytes
    assert statefile.views(blob)["w.a"][0, 0] == 42.0
    bad = blob.copy()
    bad[:8] = np.frombuffer((blob.size).to_bytes(8, "little"), np.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        statefile.views(bad)
