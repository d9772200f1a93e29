"""State transfer of a real relay stage between two processes over loopback: time and peak RSS.

    python benchmarks/state_transfer.py [--preset 124m] [--stages 3] [--stage 1] [--chunk-mib 32]

The sender process builds stage `--stage` of the preset (weights + AdamW state after one step),
exports it the way a node does (`statefile.export_state`, one buffer) and sends it as one
`StateTransfer` through the real `Transport` (a chunked transfer: the state is larger than one
chunk). The receiver process builds the same stage, receives the message (chunks written into one
preallocated buffer) and imports it (`statefile.import_state`). Each side reports its RSS before
the transfer and its peak RSS (VmHWM) after it, so the table shows what the transfer itself
costs on top of the model the node holds anyway. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from gwtf.config import RuntimeConfig, load_config
from gwtf.model.presets import model_spec
from gwtf.protocol.messages import StateTransfer
from gwtf.runtime import statefile
from gwtf.runtime.transport import Transport
from gwtf.runtime.worker import StageWorker

SECRET = b"bench-secret"


def rss_mib(field: str = "VmRSS") -> float:
    """The process's current (VmRSS) or peak (VmHWM) resident set, MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def worker_for(args: argparse.Namespace) -> StageWorker:
    torch.set_num_threads(1)
    cfg = load_config(None, [f'model.preset="{args.preset}"', f"model.stages={args.stages}", "model.seq_len=16"])
    w = StageWorker(cfg, model_spec(cfg.model, 256), args.stage)
    return w


def sender(args: argparse.Namespace, pipe: Connection) -> None:
    w = worker_for(args)
    w.optimizer.step(0, [torch.full_like(p, 1e-3) for p in w.optimizer.params])  # AdamW state exists
    addr = pipe.recv()
    before = rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    blob = statefile.export_state(w)
    t_export = time.perf_counter() - t0
    msg = StateTransfer(stage=args.stage, version=1, key=("state", args.stage, 1, "bench"), size_bytes=blob.nbytes)

    async def send() -> float:
        cfg = RuntimeConfig(chunk_bytes=args.chunk_mib << 20, request_timeout_s=60.0)
        t = Transport.with_new_key("sender", SECRET, lambda *a: None, cfg)
        await t.start("127.0.0.1", 0)
        await t.connect(addr)
        t1 = time.perf_counter()
        await t.send(addr, msg, [blob])
        dt = time.perf_counter() - t1
        await t.close()
        return dt

    t_send = asyncio.run(send())
    pipe.send({"bytes": blob.nbytes, "export_s": t_export, "send_s": t_send, "rss_before": before,
               "rss_peak": rss_mib("VmHWM"), "hash": w.weights_hash()})


def receiver(args: argparse.Namespace, pipe: Connection) -> None:
    w = worker_for(args)
    got: asyncio.Queue[tuple[Any, list[np.ndarray]]] | None = None

    async def serve() -> dict[str, float]:
        nonlocal got
        got = asyncio.Queue()
        t = Transport.with_new_key("receiver", SECRET, lambda peer, msg, ts: got.put_nowait((msg, ts)),
                                   RuntimeConfig(request_timeout_s=60.0))
        addr = await t.start("127.0.0.1", 0)
        before = rss_mib()
        reset_peak()
        pipe.send(addr)
        t0 = time.perf_counter()
        msg, tensors = await asyncio.wait_for(got.get(), 600)
        t_recv = time.perf_counter() - t0
        peak_recv = rss_mib("VmHWM")
        t1 = time.perf_counter()
        statefile.import_state(w, tensors[0])
        t_import = time.perf_counter() - t1
        del tensors
        await t.close()
        return {"recv_s": t_recv, "import_s": t_import, "rss_before": before, "rss_peak_recv": peak_recv,
                "rss_peak": rss_mib("VmHWM")}

    out = asyncio.run(serve())
    out["hash"] = w.weights_hash()  # type: ignore[assignment]
    pipe.send(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="124m")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--chunk-mib", type=int, default=32)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    s_pipe, s_child = ctx.Pipe()
    r_pipe, r_child = ctx.Pipe()
    procs = [ctx.Process(target=receiver, args=(args, r_child)), ctx.Process(target=sender, args=(args, s_child))]
    for p in procs:
        p.start()
    try:
        s_pipe.send(r_pipe.recv())  # the receiver's address
        s, r = s_pipe.recv(), r_pipe.recv()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    mib = s["bytes"] / 2**20
    print(f"state of {args.preset} stage {args.stage}/{args.stages}: {mib:.1f} MiB, chunks of {args.chunk_mib} MiB, "
          f"imported hash {'matches' if s['hash'] == r['hash'] else 'DIFFERS'}")
    print("| side | step | seconds | MiB/s | RSS before MiB | peak RSS MiB | peak - before MiB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| sender | export (one buffer) | {s['export_s']:.2f} | {mib / s['export_s']:.0f} | | | |")
    print(f"| sender | send (chunked) | {s['send_s']:.2f} | {mib / s['send_s']:.0f} | {s['rss_before']:.0f} | "
          f"{s['rss_peak']:.0f} | {s['rss_peak'] - s['rss_before']:.0f} |")
    print(f"| receiver | receive (incl. the sender's export) | {r['recv_s']:.2f} | {mib / r['recv_s']:.0f} | {r['rss_before']:.0f} | "
          f"{r['rss_peak_recv']:.0f} | {r['rss_peak_recv'] - r['rss_before']:.0f} |")
    print(f"| receiver | import (views) | {r['import_s']:.2f} | {mib / r['import_s']:.0f} | {r['rss_before']:.0f} | "
          f"{r['rss_peak']:.0f} | {r['rss_peak'] - r['rss_before']:.0f} |")


if __name__ == "__main__":
    main()
