"""No torch work on the event loop: the driver seam (`drive.Host`) splits its work by thread.

A `--stage auto` joiner that built its torch stage on the event-loop thread when its first tensor
(the state blob) arrived stalled its loop for 1.5-1.8 s, missed heartbeats and was evicted. Here a
joiner's Host (stage known, no worker yet) receives a live replica's state the way the node
driver hands it over: `store_tensors`, `tensors_for` and `free_iteration(FreeIteration)` on the
"loop" (this test's main thread, watched by a thread-local `TorchFunctionMode` that records every
torch call made on it), and `compute` on a one-thread executor (the torch thread). The loop side
must make no torch call at all; the state must still reach the joiner's stage intact.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from gwtf.config import Config, load_config
from gwtf.model.presets import model_spec
from gwtf.model.tokenizer import vocab_size_for
from gwtf.protocol.core import NodeCore
from gwtf.protocol.messages import Compute, Forward, FreeIteration, StateTransfer
from gwtf.protocol.router import PeerInfo
from gwtf.runtime.drive import Host, train_params
from gwtf.runtime.node import NodeIdentity
from gwtf.runtime.worker import StageWorker


class TorchCalls(TorchFunctionMode):
    """Records the torch functions called on the thread that entered it (modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    cache = tmp_path_factory.mktemp("cache")
    return load_config(None, [
        'data.source="synthetic"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"', "model.seq_len=16",
        "model.microbatch_size=2", "train.microbatches=2", "train.data_holders=2", "model.stages=3",
    ])


@pytest.fixture
def torch_thread() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch") as ex:
        ex.submit(torch.set_num_threads, 1).result()
        yield ex


def _joiner(cfg: Config, out: Path) -> Host:
    """A joiner after its JoinRequest was answered: stage 1 known, no stage worker built yet."""
    spec = model_spec(cfg.model, vocab_size_for(cfg.data))
    me = PeerInfo(id="j1/local@127.0.0.1:1", stage=1, region="local", compute_s=1.0, capacity=2)
    core = NodeCore(me, cfg.protocol, train_params(cfg, spec), random.Random(0))
    ident = NodeIdentity(name="j1", role="relay", stage=None, region="local", shard=None, listen="", join="x",
                         device="cpu", out_dir=out)
    return Host(cfg, ident, me.id, core, spec, None, "cpu")


def _trained_replica(cfg: Config) -> StageWorker:
    """A live stage-1 replica whose weights differ from the seeded initial ones."""
    w = StageWorker(cfg, model_spec(cfg.model, vocab_size_for(cfg.data)), 1)
    with torch.no_grad():
        for p in w.module.parameters():
            p.add_(0.01)
    return w


def test_torch_calls_are_seen_on_their_own_thread_only() -> None:
    # the detector itself: it must see a torch call on this thread, and none made on another
    with TorchCalls() as mode:
        torch.zeros(2).add_(1.0)
        other = threading.Thread(target=lambda: torch.nn.Linear(2, 2))
        other.start()
        other.join()
    assert mode.calls and all("Linear" not in c for c in mode.calls)
    assert len(mode.calls) <= 3


def test_joiner_takes_state_with_no_torch_call_on_the_loop(cfg: Config, tmp_path: Path,
                                                           torch_thread: ThreadPoolExecutor) -> None:
    replica = torch_thread.submit(_trained_replica, cfg).result()
    blob, expected = replica.state_blob(), replica.weights_hash()
    host = torch_thread.submit(_joiner, cfg, tmp_path).result()
    key = ("state", 1, 7, "r1a/local@127.0.0.1:2")
    msg = StateTransfer(stage=1, version=7, key=key, size_bytes=int(blob.nbytes))
    with TorchCalls() as loop:
        host.store_tensors(msg, [np.array(blob)])  # as the transport delivers it: a writable array
        assert host.tensors_for(msg)[0].tobytes() == blob.tobytes()  # a receiver may pass it on
    assert loop.calls == [], f"torch called on the event loop: {loop.calls[:12]}"
    assert host.worker is None, "the stage was built on the event loop"

    job = Compute(1, "import_state", 1, None, 0.0, (key,), (), int(blob.nbytes))
    result = torch_thread.submit(host.compute, job).result()
    assert ("state_imported", {"stage": 1, "version": 7, "hash": expected, "source": key[3],
                               "checkpoint": False}) in result.records

    out_key = ("state", 1, 7, "j1/local@127.0.0.1:1")
    torch_thread.submit(host.compute, Compute(2, "export_state", 1, None, 0.0, (), (out_key,))).result()
    queued: list[Any] = []
    with TorchCalls() as loop:
        sent = host.tensors_for(StateTransfer(stage=1, version=7, key=out_key))
        host.free_iteration(FreeIteration(7), submit=lambda fn, *a: queued.append(torch_thread.submit(fn, *a)))
        assert host.tensors_for(StateTransfer(stage=1, version=7, key=out_key)) == []
    assert loop.calls == [], f"torch called on the event loop: {loop.calls[:12]}"
    assert len(sent) == 1 and sent[0].tobytes() == replica.state_blob().tobytes()
    for fut in queued:
        fut.result()
    assert host.worker is not None and not any(k[2] <= 7 for k in host.worker.store)


def test_received_tensor_is_in_the_store_for_the_next_compute(cfg: Config, tmp_path: Path,
                                                               torch_thread: ThreadPoolExecutor) -> None:
    """Driver contract: a message's tensors are in the store before the compute that reads them."""
    cfg = replace(cfg, wire=replace(cfg.wire, activations="fp32"))  # fp32: the sent array is the stage's output
    host = torch_thread.submit(_joiner, cfg, tmp_path).result()
    torch_thread.submit(host.compute, Compute(1, "reset_grad", 1, None, 0.0)).result()  # builds the worker
    assert host.worker is not None
    act = np.random.default_rng(0).standard_normal((2, 16, host.spec.d_model)).astype(np.float32)
    mb = (0, 3, 1)
    key, out = ("act", mb, 3, 0), ("act", mb, 3, 1)
    with TorchCalls() as loop:
        host.store_tensors(_forward(mb, key), [act])
    assert loop.calls == [], f"torch called on the event loop: {loop.calls[:12]}"
    torch_thread.submit(host.compute, Compute(2, "forward", 1, mb, 0.0, (key,), (out,))).result()
    sent = host.tensors_for(_forward(mb, out))
    assert len(sent) == 1 and sent[0].shape == act.shape and np.isfinite(sent[0]).all()
    assert not np.allclose(sent[0], act)  # the stage's output, not its input passed through


def _forward(mb: tuple[int, int, int], key: Any) -> Forward:
    return Forward(mb=mb, flow_id=0, path=("dh0",), legs=(0,), key=key, size_bytes=1)


def test_a_tensor_that_arrives_after_a_free_iteration_was_emitted_survives_it(
        cfg: Config, tmp_path: Path, torch_thread: ThreadPoolExecutor) -> None:
    """FreeIteration runs on the torch thread, after the jobs queued before it; a forward of the
    iteration that arrives in between (a rollback starts iteration 0 again and frees it) must not
    be dropped with it: it was, and the relay's next forward failed with KeyError (exit 5)."""
    host = torch_thread.submit(_joiner, cfg, tmp_path).result()
    old = ("act", "d0", 0, 0, "d0", 0)
    new = ("act", "d0", 0, 1, "d0", 0)
    arr = np.zeros(4, dtype=np.float32)
    host.store_tensors(Forward(mb=("d0", 0, 0), flow_id=0, path=("d0",), legs=(0,), key=old, size_bytes=16), [arr])
    queued: list[Any] = []
    gate = threading.Event()
    torch_thread.submit(gate.wait, 10.0)  # the torch thread is busy with an earlier job
    host.free_iteration(FreeIteration(0), submit=lambda fn, *a: queued.append(torch_thread.submit(fn, *a)))
    host.store_tensors(Forward(mb=("d0", 0, 1), flow_id=0, path=("d0",), legs=(0,), key=new, size_bytes=16), [arr])
    gate.set()
    for fut in queued:
        fut.result(timeout=10.0)
    torch_thread.submit(host.compute, Compute(9, "reset_grad", 1, None, 0.0)).result()  # builds the stage
    assert host.worker is not None
    assert new in host.worker.store and old not in host.worker.store
