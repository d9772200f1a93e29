"""Wire throughput: 4 MiB float32 tensors through the codec, the record layer, and over loopback
encrypted (the real transport) side by side with plaintext (the same frames on a bare socket).

Usage: `python benchmarks/wire_throughput.py [--frames 100] [--repeat 50]`. Each loopback part
starts a server in a separate process (this file with --serve / --serve-plain; it prints a READY
line), sends `--frames` 4 MiB tensors back to back, and stops the clock when the server says it
has all of them. The plaintext server exists only in this benchmark: the transport has no
plaintext mode. Also reported: the median round trip of a small encrypted message.
Target: >= 1 GB/s one way encrypted.
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
from gwtf.runtime import auth
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
    """Server side (encrypted): count Blob frames, answer DONE after `frames` of them, echo pings."""
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

    server = Transport.with_new_key("server", SECRET, on_frame, registry=REG)
    addr = await server.start("127.0.0.1", 0)
    print(f"READY addr={addr}", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    await asyncio.gather(*pending)
    await server.close()


class _PlainServer(asyncio.BufferedProtocol):
    """Plaintext baseline (benchmark only): the same codec frames on a bare socket, decoded with
    the zero-copy receive path the transport used before the secure session; one byte back per
    frame count reached."""

    def __init__(self, frames: int, done: asyncio.Event) -> None:
        self.dec = Decoder(registry=REG)
        self.frames, self.count, self.done = frames, 0, done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.dec.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.dec.buffer_updated(nbytes)
        while (frame := self.dec.next_frame()) is not None:
            if isinstance(frame.msg, Blob):
                self.count += 1
            if self.count == self.frames and self.transport is not None:
                self.transport.write(b"D")
                self.done.set()


async def serve_plain(frames: int) -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _PlainServer(frames, done), "127.0.0.1", 0)
    print(f"READY addr=127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    server.close()


def _start_server(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split("addr=")[1].strip()


async def bench_transport(frames: int, pings: int) -> tuple[float, float]:
    """Encrypted: (one-way GB/s of 4 MiB frames, median small-message round trip in microseconds)."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    client = Transport.with_new_key("client", SECRET, lambda p, m, t: inbox.put_nowait(m), registry=REG)
    me = await client.start("127.0.0.1", 0)
    proc, addr = await asyncio.to_thread(_start_server, ["--serve", "--reply-to", me, "--frames", str(frames)])
    try:
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


async def bench_plain(frames: int) -> float:
    """Plaintext baseline: one-way GB/s of the same 4 MiB frames over a bare asyncio socket."""
    proc, addr = await asyncio.to_thread(_start_server, ["--serve-plain", "--frames", str(frames)])
    try:
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        x = np.random.default_rng(1).standard_normal(MIB).astype(np.float32)
        t0 = time.perf_counter()
        for i in range(frames):
            for buf in encode(Blob(seq=i), [x]):
                writer.write(buf)
            await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(1), 60) == b"D"
        elapsed = time.perf_counter() - t0
        writer.close()
        return frames * x.nbytes / elapsed / 1e9
    finally:
        proc.wait(timeout=30)


def bench_records(repeat: int) -> tuple[float, float]:
    """The record layer alone, in one process: (seal GB/s, open-into-the-body GB/s) of 4 MiB frames."""
    key = bytes(range(32))
    sealer, opener = auth.Sealer(key), auth.Opener(key, auth.RxBuffer(auth.MAX_RX_BYTES))
    x = np.random.default_rng(0).standard_normal(MIB).astype(np.float32)
    buffers = encode(Blob(seq=0), [x])
    t0 = time.perf_counter()
    for _ in range(repeat):
        sealer.seal(buffers)  # dropped at once, as the transport does once a record is written
    seal_s = time.perf_counter() - t0
    sealed = [sealer.seal(buffers) for _ in range(repeat)]
    opener._counter = sealer._counter - repeat * len(sealed[0])  # open the ones kept (benchmark only)
    dec = Decoder(registry=REG)
    t0 = time.perf_counter()
    for records in sealed:
        for record in records:
            pos = 0
            while pos < len(record):
                target = opener.get_buffer()
                n = min(len(target), len(record) - pos)
                target[:n] = record[pos : pos + n]  # what the kernel's recv_into does
                opener.rx.filled(n)
                pos += n
                while opener.open_next(dec) is not None:
                    dec.drain()
    open_s = time.perf_counter() - t0
    return repeat * x.nbytes / seal_s / 1e9, repeat * x.nbytes / open_s / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100, help="4 MiB frames sent one way")
    parser.add_argument("--repeat", type=int, default=50, help="codec encode+decode rounds")
    parser.add_argument("--pings", type=int, default=200, help="small-message round trips")
    parser.add_argument("--rounds", type=int, default=3, help="plaintext/encrypted runs, interleaved")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reply-to", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.reply_to, args.frames))
        return 0
    if args.serve_plain:
        asyncio.run(serve_plain(args.frames))
        return 0
    zero_copy, joined = bench_codec(args.repeat)
    seal, open_ = bench_records(args.repeat)
    plains, encs, rtts = [], [], []
    for _ in range(args.rounds):  # interleaved: a shared machine's load changes between runs
        plains.append(asyncio.run(bench_plain(args.frames)))
        one_way, rtt_us = asyncio.run(bench_transport(args.frames, args.pings))
        encs.append(one_way)
        rtts.append(rtt_us)
    plain, one_way, rtt_us = statistics.median(plains), statistics.median(encs), statistics.median(rtts)
    ratios = ", ".join(f"{e / p:.2f}" for p, e in zip(plains, encs, strict=True))
    rows = [
        ("codec encode+decode, 4 MiB f32, receive-into-buffer path", f"{zero_copy:.2f} GB/s"),
        ("codec encode+decode, 4 MiB f32, feed(bytes) path", f"{joined:.2f} GB/s"),
        ("records: seal (AES-GCM encrypt_into), 4 MiB f32", f"{seal:.2f} GB/s"),
        ("records: open (decrypt_into the body), 4 MiB f32", f"{open_:.2f} GB/s"),
        (f"plaintext one-way, {args.frames} x 4 MiB, loopback, 2 processes (median)", f"{plain:.2f} GB/s"),
        (f"encrypted one-way, {args.frames} x 4 MiB, loopback, 2 processes (median)", f"{one_way:.2f} GB/s"),
        ("encrypted / plaintext (median of medians)", f"{one_way / plain:.2f}"),
        (f"encrypted / plaintext per round ({args.rounds})", ratios),
        ("encrypted small-message round trip (median)", f"{rtt_us:.0f} us"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
