"""Wire throughput: codec encode+decode of 4 MiB float32 tensors, and one-way transport over loopback.

Usage: `python benchmarks/wire_throughput.py [--frames 100] [--repeat 50]`. The transport part starts
a server in a separate process (this file with --serve; it prints a READY line), sends `--frames`
4 MiB tensors back to back, and stops the clock when the server's DONE message arrives.
It also reports the median round trip of a small message. Target: >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from gwtf.protocol.base import Message
from gwtf.runtime.codec import Decoder, Frame, encode
from gwtf.runtime.transport import Transport

MIB = 1 << 20
SECRET = b"bench-secret"


@dataclass(frozen=True, slots=True)
class Blob(Message):
    TYPE = "B_BLOB"
    seq: int


@dataclass(frozen=True, slots=True)
class Done(Message):
    TYPE = "B_DONE"
    count: int


@dataclass(frozen=True, slots=True)
class Ping(Message):
    TYPE = "B_PING"
    seq: int


REG: dict[str, type[Message]] = {"B_BLOB": Blob, "B_DONE": Done, "B_PING": Ping}


def bench_codec(repeat: int) -> tuple[float, float]:
    """(GB/s of encode + decode through the zero-copy receive path, GB/s via feed(bytes))."""
    x = np.random.default_rng(0).standard_normal(MIB).astype(np.float32)  # 4 MiB
    dec = Decoder(registry=REG)
    frames: list[Frame] = []
    t0 = time.perf_counter()
    for i in range(repeat):
        for buf in encode(Blob(seq=i), [x]):
            view, pos = memoryview(buf).cast("B"), 0
            while pos < len(view):  # what a BufferedProtocol does: copy into decoder-owned memory
                target = dec.get_buffer(-1)
                n = min(len(target), len(view) - pos)
                target[:n] = view[pos : pos + n]
                dec.buffer_updated(n)
                frames += dec.drain()
                pos += n
        (frame,) = frames
        frames.clear()
    zero_copy = repeat * x.nbytes / (time.perf_counter() - t0) / 1e9
    assert np.array_equal(frame.tensors[0], x)
    t0 = time.perf_counter()
    for i in range(repeat):
        (frame,) = dec.feed(b"".join(encode(Blob(seq=i), [x])))
    joined = repeat * x.nbytes / (time.perf_counter() - t0) / 1e9
    return zero_copy, joined


async def serve(reply_to: str, frames: int) -> None:
    """Server side: count Blob frames, answer DONE after `frames` of them, echo pings."""
    done = asyncio.Event()
    pending: set[asyncio.Task[None]] = set()
    count = 0

    def on_frame(peer: str, msg: Message, tensors: list[np.ndarray]) -> None:
        nonlocal count
        if isinstance(msg, Ping):
            pending.add(asyncio.ensure_future(server.send(reply_to, msg, timeout_s=10)))
        elif isinstance(msg, Blob):
            count += 1
            if count == frames:
                pending.add(asyncio.ensure_future(server.send(reply_to, Done(count=count), timeout_s=10)))
                done.set()

    server = Transport("server", SECRET, on_frame, registry=REG)
    addr = await server.start("127.0.0.1", 0)
    print(f"READY addr={addr}", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    await asyncio.gather(*pending)
    await server.close()


async def bench_transport(frames: int, pings: int) -> tuple[float, float]:
    """(one-way GB/s of 4 MiB frames, median small-message round trip in microseconds)."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    client = Transport("client", SECRET, lambda p, m, t: inbox.put_nowait(m), registry=REG)
    me = await client.start("127.0.0.1", 0)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--reply-to", me, "--frames", str(frames)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        addr = line.split("addr=")[1].strip()
        rtts = []
        for i in range(pings):
            t0 = time.perf_counter()
            await client.send(addr, Ping(seq=i), timeout_s=10)
            await asyncio.wait_for(inbox.get(), 10)
            rtts.append((time.perf_counter() - t0) * 1e6)
        x = np.random.default_rng(1).standard_normal(MIB).astype(np.float32)
        t0 = time.perf_counter()
        for i in range(frames):
            await client.send(addr, Blob(seq=i), [x], timeout_s=30)
        done = await asyncio.wait_for(inbox.get(), 60)
        elapsed = time.perf_counter() - t0
        assert isinstance(done, Done) and done.count == frames
        return frames * x.nbytes / elapsed / 1e9, statistics.median(rtts)
    finally:
        await client.close()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100, help="4 MiB frames sent one way")
    parser.add_argument("--repeat", type=int, default=50, help="codec encode+decode rounds")
    parser.add_argument("--pings", type=int, default=200, help="small-message round trips")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reply-to", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.reply_to, args.frames))
        return 0
    zero_copy, joined = bench_codec(args.repeat)
    one_way, rtt_us = asyncio.run(bench_transport(args.frames, args.pings))
    rows = [
        ("codec encode+decode, 4 MiB f32, receive-into-buffer path", f"{zero_copy:.2f} GB/s"),
        ("codec encode+decode, 4 MiB f32, feed(bytes) path", f"{joined:.2f} GB/s"),
        (f"transport one-way, {args.frames} x 4 MiB, loopback, 2 processes", f"{one_way:.2f} GB/s"),
        ("transport small-message round trip (median)", f"{rtt_us:.0f} us"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
