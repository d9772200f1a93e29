"""The seam between the node driver and NodeCore: compute effects -> torch jobs, keys -> tensors.

Owns `Host`, which holds one node's `NodeCore` and `StageWorker` and implements the driver
contract of docs/protocol.md without any protocol logic:
- a tensor-carrying message names its tensor by `msg.key`: outgoing, the stored tensor under that
  key is attached; incoming, the received array is stored under it;
- a `Compute(kind, inputs, outputs)` runs the matching worker job on the named keys (embed,
  forward, loss, backward, embed_backward, export_grad, reduce, concat, step, reset_grad, export_state,
  import_state, load_checkpoint, export_checkpoint, store_checkpoint, read_checkpoint) and is
  answered with `core.on_compute_done(job_id, now)`;
- `FreeIteration(t)` drops every tensor whose key's iteration (key[2]) is <= t;
- measured compute: the wall time of every microbatch job (embed, forward, loss, backward,
  embed_backward) feeds `runtime.meter.ComputeMeter`; the stage's estimate goes to
  `core.on_compute_measured` after the job's completion (the core advertises it when it moved
  enough), so flow costs price this node's real speed (it starts unmeasured, `UNMEASURED_S`);
  `runtime.compute_slowdown` makes a node that much slower (tests, demos);
- `reduce` sums the named gradients in the given (sorted replica) order and rescales the sum to
  the `count` microbatches behind it; `step` applies the reduced gradient (`StageWorker`). With
  `protocol.reduce = "butterfly"`, `export_grad` names several keys (the gradient's contiguous
  parts, `torch.tensor_split`), `reduce` runs on one part, and `concat` joins the reduced parts
  in order: elementwise, the same sums in the same order as a reduction of the whole.

Threads: no torch call ever runs on the event loop (a loop blocked for a second misses heartbeats
and the node is evicted). The loop side (`tensors_for`, `store_tensors`, `free_wire`) touches
numpy arrays only: `_wire` holds the wire form (numpy) of every tensor the node may send, and
received arrays wait in `_inbox`. Everything torch (building a stage's worker, converting received
arrays into the store, the jobs, freeing the store) runs on the single torch thread: `compute`
and `free_store`. A compute first moves the inbox into the store, so a message's tensors are there
before any compute emitted after its arrival; after the job it publishes the wire form of its
outputs (a view, no copy, on CPU) before its completion reaches the core. One lock guards the two
dicts the threads share. A single-threaded driver (the tensor simulator) may call all of it from
one thread; `free_iteration` then frees both sides at once.

Checkpoints (for a stage whose every replica died, and for `--resume`): after each step whose
version is a multiple of `protocol.checkpoint_every`, every replica writes the same bytes to
`DIR/checkpoints/stage<k>/v<version>.safetensors` with a sha256 manifest, fsynced
(`gwtf.runtime.checkpoints`; on one machine the folder is shared, across machines each host keeps
its own, `runtime.checkpoint_folder`). With `protocol.checkpoint_replicate` the data holders also
keep a copy of every relay stage's (export_checkpoint / store_checkpoint), and serve it to a
joiner of a lost stage (read_checkpoint; the joiner keeps it on its disk too). Version 0 is the
seeded initial model. A bootstrap node started with `--resume` loads
the newest version complete for every stage and starts its core there (`NodeCore.start_version`);
every other node follows the leader's version through the ordinary join path.

Must not import asyncio or socket.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import numpy as np
import torch

from gwtf.config import Config
from gwtf.model import wire
from gwtf.model.data import TokenDataset, load_dataset
from gwtf.model.device import resolve_device
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.pretrained import resolve_init
from gwtf.model.tokenizer import vocab_size_for
from gwtf.model.trainer import lr_at
from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.core import NodeCore, TrainParams
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.ledger import checkpoint_due
from gwtf.protocol.messages import Compute, FreeIteration, GradShare, Record
from gwtf.protocol.router import PeerInfo
from gwtf.protocol.systems import build_core, get_system, iteration_params
from gwtf.runtime import checkpoints, statefile
from gwtf.runtime.meter import ComputeMeter, microbatch_kinds
from gwtf.runtime.stagegrad import StageGradCodec
from gwtf.runtime.worker import StageWorker, tensor_to_numpy

if TYPE_CHECKING:
    from gwtf.runtime.node import NodeIdentity

UNMEASURED_S = 0.0
"""The compute time a node advertises until it measured its own (`runtime.meter`, a few
microbatches after it first serves): optimistic, so a replica that has not served yet looks
fast and gets tried (its first measurement then prices it), instead of a pessimistic guess that
would keep it unmeasured and idle for good next to a measured slow replica."""

# Records the node process reacts to (each one a record the core emits)
# this node's training is over: it led the run to its end, heard the leader's Finish, or stopped
DONE_EVENTS = frozenset({RecordName.TRAINING_OVER, RecordName.SELF_STOP})
CRASH_EVENTS = frozenset({RecordName.EVICT, RecordName.LEADER_LOST})  # status.json's crashes_seen (`runtime.watch`)
JOIN_EVENTS = frozenset({RecordName.JOIN})  # the leader admitted a joiner: joins_seen (`runtime.watch`)
ACTIVE_EVENTS = frozenset({RecordName.ACTIVATED})  # a joiner holds its stage's state: state "active"


def init_torch_thread(threads: int) -> None:
    """Runs first on the torch thread: thread count (several nodes share a machine)."""
    if threads > 0:
        torch.set_num_threads(threads)


def record_of(eff: Record) -> tuple[RecordName, dict[str, Any]]:
    return eff.event, dict(eff.fields)


def job_id(eff: Compute) -> int:
    return eff.job_id


@dataclass(slots=True)
class ComputeResult:
    """What a finished job reports back: records to log (e.g. the loss)."""

    records: list[tuple[RecordName, dict[str, Any]]] = field(default_factory=list)
    compute_s: float | None = None  # a microbatch job: the stage's measured seconds per microbatch so far


class Host:
    """One node's core + worker (see the module docstring)."""

    def __init__(self, cfg: Config, ident: NodeIdentity, node_id: NodeId, core: NodeCore, spec: ModelSpec,
                 dataset: TokenDataset | None, device: str) -> None:
        self.cfg = cfg
        self.ident = ident
        self.node_id = node_id
        self.core = core
        self.spec = spec
        self.dataset = dataset
        self.device = device
        self.worker: StageWorker | None = None
        self.grad_counts: dict[Hashable, int] = {}
        self.ckpt_dir = checkpoint_dir(cfg, ident)
        self._lock = threading.Lock()  # guards _wire and _inbox (loop and torch thread)
        self._wire: dict[Hashable, list[np.ndarray]] = {}  # key -> the arrays a send attaches (numpy)
        self._inbox: dict[Hashable, list[np.ndarray]] = {}  # received, not yet in the worker's store
        self._arrivals = 0  # received tensors so far (a FreeIteration frees only those before it)
        self._arrived: dict[Hashable, int] = {}  # received key -> its arrival number
        self._last_blob: tuple[int, int, np.ndarray] | None = None  # torch thread: the newest checkpoint written
        self.meter = ComputeMeter()  # torch thread: measured compute (`runtime.meter`)
        # torch thread: stage gradients in `wire.stage_gradients`, with error feedback (`runtime.stagegrad`)
        self.grad_codec = StageGradCodec(cfg.wire.stage_gradients, cfg.wire.block_values, cfg.wire.error_feedback)
        self._encoded: set[Hashable] = set()  # torch thread: outputs a job put on the wire itself
        self.pace = StepPace()  # torch thread: tokens and seconds since the last step
        if ident.stage is not None:
            self.worker = self._make_worker(ident.stage)

    @property
    def role(self) -> str:
        """"data-holder" once the node serves stage 0 (planned, or a vacant shard its Welcome gave
        it), else its planned role."""
        return "data-holder" if self.core.me.stage == 0 else self.ident.role

    @property
    def planned_stage(self) -> int | None:
        return self.ident.stage

    @classmethod
    def create(cls, cfg: Config, ident: NodeIdentity, node_id: NodeId) -> Host:
        """Build dataset (data holders), model spec, worker and core (on the torch thread)."""
        cfg = resolve_init(cfg)  # model.init_from: its shape and tokenizer (build_stage loads its weights)
        device = resolve_device(ident.device)
        dataset = None
        if ident.role == "data-holder":
            dataset = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders,
                                   microbatches=cfg.train.microbatches)
            vocab = dataset.vocab_size
        else:
            vocab = vocab_size_of(cfg)
        spec = model_spec(cfg.model, vocab)
        train = train_params(cfg, spec)
        bootstrap = ident.join is None
        stage = ident.stage if ident.stage is not None else -1
        me = PeerInfo(id=node_id, stage=stage if bootstrap else -1, region=ident.region,
                      compute_s=UNMEASURED_S, capacity=max(1, cfg.train.microbatches),
                      demand=cfg.train.microbatches if ident.role == "data-holder" else 0,
                      shard=ident.shard if ident.shard is not None else -1)
        seed = zlib.crc32(node_id.encode()) ^ cfg.train.seed
        system = get_system(cfg.protocol.system, cfg.protocol)
        core = build_core(system, me, cfg.protocol, cfg.flow, train, random.Random(seed))
        core.fixed_stage = None if bootstrap or stage < 0 else stage
        core.start_members = cfg.runtime.start_members
        host = cls(cfg, ident, node_id, core, spec, dataset, device)
        if bootstrap and ident.resume:
            host.resume_from_checkpoint()
        return host

    def resume_from_checkpoint(self) -> int:
        """`--resume` on the bootstrap node (torch thread): load this stage's state of the newest
        version complete for all stages and start the core there; joiners follow through the
        join path (Welcome names the version). UserError if there is nothing to resume."""
        cfg = self.cfg
        version = checkpoints.resume_version(self.ckpt_dir, cfg.model.stages, cfg.train.iterations,
                                             cfg.protocol.checkpoint_every)
        if self.worker is not None:
            self._load_checkpoint(self.worker, ("state", self.worker.stage, version))
        self.core.start_version = version
        return version

    @property
    def stage(self) -> int | None:
        s = self.core.me.stage
        return s if s >= 0 else None

    def start(self, now: float, contact: NodeId | None) -> list[Any]:
        known = [] if contact is None else [PeerInfo(id=contact, stage=-1, region="?", compute_s=1.0, capacity=1)]
        return list(self.core.on_start(now, known))

    def in_flight(self) -> int:
        return len(getattr(self.core, "legs", {})) + sum(
            1 for o in getattr(self.core, "origins", {}).values() if getattr(o, "phase", "done") != "done")

    # -- tensors ------------------------------------------------------------------------------

    def tensors_for(self, msg: Message) -> list[np.ndarray]:
        """Event loop: the arrays a message's key names (received, or a finished job's output):
        one array, or for an int8-format activation/gradient its codes and scales."""
        key = getattr(msg, "key", None)
        if not key:
            return []
        with self._lock:
            arrays = self._wire.get(key)
        return [] if arrays is None else list(arrays)

    def store_tensors(self, msg: Message, tensors: list[np.ndarray]) -> None:
        """Event loop: keep received arrays under the message's key (no torch here: the next
        compute moves them into the worker's store on the torch thread). An activation or
        activation gradient is checked against the wire formats first (`wire_check`: ValueError
        refuses the message)."""
        key = getattr(msg, "key", None)
        if not tensors:
            return
        if not key:
            raise ValueError(f"{len(tensors)} tensors on a message without a key")
        if self.core.me.stage < 0:
            raise ValueError("tensor received before this node has a stage")
        if _boundary_kind(key) is not None or _stage_grad_key(key):
            wire_check(tensors, self.cfg.wire.block_values)
        elif len(tensors) != 1:
            raise ValueError(f"{len(tensors)} tensors on a message with a single-tensor key")
        if isinstance(msg, GradShare):
            self.grad_counts[key] = msg.count
        with self._lock:
            self._wire[key] = list(tensors)  # the same arrays, not copies
            self._inbox[key] = list(tensors)
            self._arrivals += 1
            self._arrived[key] = self._arrivals

    def free_iteration(self, eff: FreeIteration,
                       submit: Callable[[Callable[[int], None], int], None] | None = None) -> None:
        """`FreeIteration`: the wire side now; the store through `submit` (the torch thread's
        queue, in emission order), or at once when no `submit` is given (one-thread drivers)."""
        only = eff.data_only
        self.free_wire(eff.iteration, only)
        # what arrives after this effect was emitted (e.g. a forward of the iteration a
        # rollback starts again) is not the protocol's to drop: the torch thread runs the
        # free later, so it frees only tensors that had arrived by now
        cut = self._arrivals
        if submit is None:
            self.free_store(eff.iteration, cut, only)
        else:
            submit(lambda it: self.free_store(it, cut, only), eff.iteration)

    def free_wire(self, iteration: int, data_only: bool = False) -> None:
        with self._lock:
            for k in [k for k in self._wire if _iteration_of(k) <= iteration and (not data_only or _is_data(k))]:
                del self._wire[k]

    def free_store(self, iteration: int, cut: int | None = None, data_only: bool = False) -> None:
        """Torch thread: drop tensors and autograd graphs of iterations <= `iteration`; of the
        received ones only those with an arrival number <= `cut` (None: all); `data_only`: only
        the microbatches' tensors (`FreeIteration.data_only`)."""
        limit = self._arrivals if cut is None else cut

        def done(k: Hashable) -> bool:
            return _iteration_of(k) <= iteration and self._arrived.get(k, 0) <= limit and (not data_only or _is_data(k))

        with self._lock:
            for k in [k for k in self._inbox if done(k)]:
                del self._inbox[k]
                self._arrived.pop(k, None)
        w = self.worker
        if w is not None:
            self._drain_inbox(w)
            gone = [k for k in list(w.store) if done(k)]
            w.free(gone)
            with self._lock:
                for k in gone:
                    self._arrived.pop(k, None)
            w.drop_graphs_before(iteration)
        if data_only:
            return
        for k in [k for k in list(self.grad_counts) if _iteration_of(k) <= iteration]:
            self.grad_counts.pop(k, None)
        if self._last_blob is not None and self._last_blob[1] <= iteration:
            self._last_blob = None  # no export followed (a replica that sends no copy)

    def take_received(self) -> None:
        """Torch thread: move received arrays into the worker's store now (for a caller that
        drives the worker directly; every `compute` does this first)."""
        if self.worker is not None:
            self._drain_inbox(self.worker)

    def _drain_inbox(self, w: StageWorker) -> None:
        """Torch thread: received arrays -> the worker's store (device tensors)."""
        with self._lock:
            arrived, self._inbox = self._inbox, {}
        for key, arrays in arrived.items():
            if isinstance(key, tuple) and key and key[0] in ("state", "ckpt"):
                w.store[key] = torch.from_numpy(arrays[0])  # serialized state stays on the CPU, uncopied, until imported
            elif _plain_float(arrays):
                w.put(key, arrays[0])
            else:  # a compressed activation/gradient (checked on arrival): float32, then the compute dtype
                w.put(key, wire.decode(arrays, self.cfg.wire.block_values), cast=True)

    def _publish(self, w: StageWorker, keys: Sequence[Hashable]) -> None:
        """Torch thread: the wire form of a job's outputs, for the sends that follow its completion:
        activations and activation gradients in the [wire] formats (fp32: the array as computed)."""
        ready = {k: self._wire_form(k, w.to_numpy(k)) for k in keys if k in w.store and k not in self._encoded}
        self._encoded.clear()
        if ready:
            with self._lock:
                self._wire.update(ready)

    def _wire_form(self, key: Hashable, arr: np.ndarray) -> list[np.ndarray]:
        kind = _boundary_kind(key)
        fmt = "fp32" if kind is None else getattr(self.cfg.wire, kind)
        return [arr] if fmt == "fp32" else wire.encode(arr, fmt, self.cfg.wire.block_values)

    # -- compute (torch thread) ---------------------------------------------------------------

    def compute(self, eff: Compute) -> ComputeResult:
        """Torch thread: one job (the stage's worker is built here when missing or moved)."""
        if self.worker is None or self.worker.stage != eff.stage:
            self.worker = self._make_worker(eff.stage)
        self._drain_inbox(self.worker)
        started = time.perf_counter()
        out = self._run_job(self.worker, eff)
        self._publish(self.worker, eff.outputs)
        if eff.kind in microbatch_kinds(eff.stage):
            out.compute_s = self._measure(eff, started)
        return out

    def _measure(self, eff: Compute, started: float) -> float | None:
        """Torch thread: a microbatch job's wall time (since `started`, its kernels awaited on
        CUDA) into the meter, after the slowdown of a node slowed for tests and demos
        (`runtime.compute_slowdown`: it sleeps (factor - 1) x the job's time, and the sleep
        counts). Returns the stage's estimate (`ComputeMeter.per_microbatch_s`)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        took_s = time.perf_counter() - started
        slowdown = self.cfg.runtime.compute_slowdown
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * took_s)
            took_s *= slowdown
        self.meter.add(eff.stage, eff.kind, took_s)
        return self.meter.per_microbatch_s(eff.stage)

    def _run_job(self, w: StageWorker, eff: Compute) -> ComputeResult:
        out = ComputeResult()
        kind, ins, outs = eff.kind, eff.inputs, eff.outputs
        match kind:
            case ComputeKind.EMBED:
                assert eff.mb is not None
                shard, index = eff.data  # another (vacant) shard's microbatch, or our own: NONE, mb's index
                tokens = w.embed(eff.mb, eff.mb[1], eff.mb[2] if index < 0 else index, outs[0],
                                 shard=None if shard < 0 else shard)
                out.records.append((RecordName.TOKENS, {"iteration": eff.mb[1], "index": eff.mb[2], "tokens": tokens}))
            case ComputeKind.FORWARD:
                w.forward(outs[0], ins[0], outs[0])
                self.pace.served(self.cfg.model.microbatch_size * self.cfg.model.seq_len)
            case ComputeKind.LOSS:
                assert eff.mb is not None
                loss = w.loss(eff.mb, ins[0], outs[0])
                tokens = self.cfg.model.microbatch_size * self.cfg.model.seq_len
                self.pace.served(tokens)
                out.records.append((RecordName.LOSS, {"iteration": eff.mb[1], "index": eff.mb[2], "loss": loss,
                                             "tokens": tokens}))
            case ComputeKind.BACKWARD:
                w.backward(ins[1], ins[2], outs[0])
            case ComputeKind.EMBED_BACKWARD:
                assert eff.mb is not None
                w.backward(eff.mb, ins[0], None)
            case ComputeKind.EXPORT_GRAD:  # several keys: the butterfly's parts (views of one copy)
                flat = w.grads_flat()
                coded: Sequence[tuple[torch.Tensor, list[np.ndarray] | None]]  # (part, its wire arrays or None: fp32)
                if self.grad_codec.lossy:
                    coded = self.grad_codec.export(flat, len(outs), int(outs[0][2]), int(outs[0][4]))
                else:
                    coded = [(part, None) for part in (torch.tensor_split(flat, len(outs)) if len(outs) > 1 else (flat,))]
                for key, (part, arrays) in zip(outs, coded, strict=True):
                    if arrays is None:
                        w.store[key] = part
                    else:
                        self._put_encoded(w, key, part, arrays)
                    self.grad_counts[key] = w.microbatches_accumulated
            case ComputeKind.RESET_GRAD:
                w.zero_grads()
            case ComputeKind.REDUCE:
                mean = w.reduce([w.store[k] for k in ins], eff.count)
                out_key = outs[0]
                if self.grad_codec.lossy:  # gather's reducer: part 0 of 1; a butterfly owner: its part
                    j = int(out_key[5]) if len(out_key) > 5 else 0
                    dec, arrays = self.grad_codec.reduced(mean, j, int(out_key[2]), int(out_key[4]))
                    self._put_encoded(w, out_key, dec, arrays)
                else:
                    w.store[out_key] = mean
                self.grad_counts[out_key] = eff.count
            case ComputeKind.CONCAT:
                w.store[outs[0]] = torch.cat([w.store[k] for k in ins])
                self.grad_counts[outs[0]] = eff.count
            case ComputeKind.STEP:
                out.records.append((RecordName.STEPPED, self._step(w, eff)))
            case ComputeKind.EXPORT_STATE:  # one buffer, on the CPU: the transport streams it in chunks
                blob = statefile.export_state(w)  # only ever sent: its wire form is the buffer itself
                with self._lock:
                    self._wire[outs[0]] = [blob]
                out.records.append((RecordName.STATE_EXPORTED, {"stage": w.stage, "version": outs[0][2],
                                                       "hash": w.weights_hash()}))
            case ComputeKind.IMPORT_STATE:
                self.grad_codec.reset()
                out.records.append(self._import_state(w, ins[0]))
            case ComputeKind.LOAD_CHECKPOINT:
                self.grad_codec.reset()
                self._load_checkpoint(w, outs[0])
                out.records.append((RecordName.STATE_LOADED, {"stage": w.stage, "version": outs[0][2],
                                                     "hash": w.weights_hash()}))
            case ComputeKind.EXPORT_CHECKPOINT | ComputeKind.STORE_CHECKPOINT | ComputeKind.READ_CHECKPOINT:
                out.records.append(self._checkpoint_copy(w, eff))
            case _:
                assert_never(kind)  # raises on a kind this driver does not know
        return out

    def _put_encoded(self, w: StageWorker, key: Hashable, value: torch.Tensor, arrays: list[np.ndarray]) -> None:
        """Torch thread: `value` (decoded) in the store and its wire arrays, for the sends that follow."""
        w.store[key] = value
        self._encoded.add(key)
        with self._lock:
            self._wire[key] = arrays

    def _import_state(self, w: StageWorker, key: Sequence[Any]) -> tuple[RecordName, dict[str, Any]]:
        """Install fetched state: a replica's live state ("state" key), or a data holder's copy
        of a checkpoint ("ckpt" key), which is also kept on this host's disk, so the Rollback
        that follows the restore of a lost stage reloads it here (several hosts)."""
        arr = tensor_to_numpy(w.store.pop(key))
        fields: dict[str, Any] = {}
        if key[0] == "ckpt":
            w.load_state_blob(arr)
            fields["written"] = checkpoints.keep_version(self.ckpt_dir, w.stage, int(key[2]), arr.data)
        else:
            statefile.import_state(w, arr)
        return RecordName.STATE_IMPORTED, {"stage": w.stage, "version": key[2], "hash": w.weights_hash(),
                                           "source": key[3], "checkpoint": key[0] == "ckpt", **fields}

    def _checkpoint_copy(self, w: StageWorker, eff: Compute) -> tuple[RecordName, dict[str, Any]]:
        """The data holders' copies of the relay stages' checkpoints (docs/runtime.md):
        export_checkpoint (a replica: the blob it just wrote, under the "ckpt" key, for the
        sends that follow), store_checkpoint (a data holder: a received one to its disk),
        read_checkpoint (a data holder: its verified copy from disk, for a joiner)."""
        key = (eff.outputs or eff.inputs)[0]
        stage, version = int(key[1]), int(key[2])
        fields: dict[str, Any] = {"stage": stage, "version": version}
        if eff.kind == ComputeKind.STORE_CHECKPOINT:
            arr = tensor_to_numpy(w.store.pop(key))
            with self._lock:
                self._wire.pop(key, None)
            fields.update(source=key[3], written=checkpoints.keep_version(self.ckpt_dir, stage, version,
                                                                         arr.data))
            return RecordName.CHECKPOINT_STORED, fields
        if eff.kind == ComputeKind.EXPORT_CHECKPOINT:
            last = self._last_blob
            blob = last[2] if last is not None and last[:2] == (stage, version) else w.state_blob()
        else:
            blob = np.frombuffer(checkpoints.read_version(self.ckpt_dir, stage, version), dtype=np.uint8)
        self._last_blob = None
        with self._lock:
            self._wire[key] = [blob]  # only ever sent: its wire form is the buffer itself
        exported = eff.kind == ComputeKind.EXPORT_CHECKPOINT
        return (RecordName.CHECKPOINT_EXPORTED if exported else RecordName.CHECKPOINT_SERVED), fields

    def compute_done(self, eff: Compute, result: ComputeResult, now: float) -> list[Any]:
        """Event loop: the job's completion, then its stage's measured compute time (the core
        advertises it when it moved enough: `NodeCore.on_compute_measured`)."""
        out = list(self.core.on_compute_done(eff.job_id, now))
        if result.compute_s is not None and eff.stage == self.core.me.stage:
            out += self.core.on_compute_measured(now, result.compute_s)
        return out

    def _step(self, w: StageWorker, eff: Compute) -> dict[str, Any]:
        """Step with the reduced gradient named by the single input key ("rgrad", stage, it, ...)."""
        key = eff.inputs[0]
        iteration = int(key[2])
        # a copy: the step clips its gradient in place, and the reduced gradient may still be on
        # its way to the other replicas (its wire form shares the tensor's memory)
        h = w.apply_step(iteration, w.store[key].clone())
        self.grad_codec.stepped(iteration, int(key[4]))
        version = iteration + 1
        if checkpoint_due(version, self.cfg.protocol.checkpoint_every, self.cfg.train.iterations):
            self._save_checkpoint(w, version)
        return {"iteration": iteration, "stage": w.stage, "hash": h, "version": version,
                "microbatches": self.grad_counts.get(key, 0), "peak_memory_bytes": w.peak_memory_bytes(),
                **self.pace.stepped(), "lr": lr_at(iteration, self.cfg.train), "grad_norm": w.last_grad_norm}

    def _save_checkpoint(self, w: StageWorker, version: int) -> None:
        """Hashed and fsynced (`runtime.checkpoints`); the previous complete version is kept.
        A relay keeps the blob for the `export_checkpoint` job that follows this step when
        the data holders keep copies (`protocol.checkpoint_replicate`)."""
        blob = w.state_blob()
        checkpoints.write_version(self.ckpt_dir, w.stage, version, blob.data)
        if w.stage > 0 and self.cfg.protocol.checkpoint_replicate:
            self._last_blob = (w.stage, version, blob)

    def _load_checkpoint(self, w: StageWorker, key: Sequence[Any]) -> None:
        """Load version key[2] of this stage, verified (CheckpointError naming a bad file: a
        failed compute; falling back to an older version here would desynchronise the stages)."""
        version = int(key[2])
        if version == 0:
            w.reset_initial()
            return
        blob = checkpoints.read_version(self.ckpt_dir, w.stage, version)
        w.load_state_blob(np.frombuffer(blob, dtype=np.uint8))

    def _make_worker(self, stage: int) -> StageWorker:
        """A worker for `stage`; tensors already received (keyed by the protocol) are kept. A node
        the leader made a data holder (a joiner on a vacant shard) loads the corpus now and serves
        the shard its Welcome named."""
        self.grad_codec.reset()
        shard = self.ident.shard
        if stage == 0:
            if self.dataset is None:
                self.dataset = load_dataset(self.cfg.data, self.cfg.model, self.cfg.train.seed, self.cfg.train.data_holders,
                                            microbatches=self.cfg.train.microbatches)
            if self.core.me.shard >= 0:
                shard = self.core.me.shard
        w = StageWorker(self.cfg, self.spec, stage, device=self.device, dataset=self.dataset, shard=shard)
        old = getattr(self, "worker", None)
        if old is not None:
            w.store = old.store
        return w


class StepPace:
    """Torch thread: the tokens this node computed (a relay's forwards, a data holder's losses)
    and the wall time between its optimizer steps, for the `stepped` record's `tokens_per_s`
    and `iteration_s` (the first step counts from the node's first microbatch job)."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._tokens = 0

    def served(self, tokens: int) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        self._tokens += tokens

    def stepped(self) -> dict[str, float | None]:
        now = time.perf_counter()
        took_s = now - self._since if self._since is not None else None
        rate = self._tokens / took_s if took_s else None
        self._since, self._tokens = now, 0
        return {"iteration_s": None if took_s is None else round(took_s, 4),
                "tokens_per_s": None if rate is None else round(rate, 1)}


def checkpoint_dir(cfg: Config, ident: NodeIdentity) -> Path:
    """This node's checkpoint folder (`runtime.checkpoint_folder`): DIR/checkpoints, or its own
    DIR/nodes/<name>/checkpoints (a host of its own, as on several machines)."""
    out = Path(ident.out_dir)
    if cfg.runtime.checkpoint_folder == "per-node":
        return out / "nodes" / ident.name / checkpoints.CHECKPOINTS_DIR
    return out / checkpoints.CHECKPOINTS_DIR


def _is_data(key: Hashable) -> bool:
    """A microbatch's tensor (an activation or activation gradient), not a stage's."""
    return isinstance(key, tuple) and bool(key) and key[0] in ("act", "grad", "lgrad")


def _iteration_of(key: Hashable) -> float:
    """A tensor key's iteration (key[2]); keys without one are never freed by iteration."""
    if isinstance(key, tuple) and len(key) > 2 and isinstance(key[2], int):
        return key[2]
    return float("inf")


BOUNDARY_KINDS = {"act": "activations", "grad": "gradients", "lgrad": "gradients"}
"""Tensor-key kinds that cross a stage boundary -> the [wire] key of their format."""


def _boundary_kind(key: Hashable) -> str | None:
    return BOUNDARY_KINDS.get(key[0]) if isinstance(key, tuple) and key and isinstance(key[0], str) else None


def _stage_grad_key(key: Hashable) -> bool:
    """A within-stage reduction's tensor ("pgrad" / "rgrad": `wire.stage_gradients`)."""
    return isinstance(key, tuple) and bool(key) and key[0] in ("pgrad", "rgrad")


def _plain_float(arrays: Sequence[np.ndarray]) -> bool:
    """One float32/float64 array: the fp32 wire form (the tensor simulator computes in float64)."""
    return len(arrays) == 1 and arrays[0].dtype in (np.float32, np.float64) and arrays[0].dtype.metadata is None


def wire_check(arrays: Sequence[np.ndarray], block_values: int) -> None:
    """A received activation/gradient: one float array, or a valid encoding in a known wire
    format (dtype tags, scale count, finite scales: `gwtf.model.wire.check`); ValueError if not."""
    if not _plain_float(arrays):
        wire.check(arrays, block_values)


def train_params(cfg: Config, spec: ModelSpec) -> TrainParams:
    """The core's view of an iteration (`gwtf.protocol.systems.iteration_params`: the simulator's formula)."""
    w = cfg.wire
    sizes = wire.boundary_bytes(spec.activation_bytes(cfg.model.microbatch_size, dtype_bytes=1), w.activations,
                                w.gradients, w.block_values)
    return iteration_params(spec, stages=cfg.model.stages, microbatch_size=cfg.model.microbatch_size,
                            seq_len=cfg.model.seq_len, microbatches=cfg.train.microbatches,
                            iterations=cfg.train.iterations, wire_bytes=sizes, data_holders=cfg.train.data_holders,
                            grad_bytes=lambda n: wire.wire_bytes(n, w.stage_gradients, w.block_values),
                            update_delay=cfg.train.update_delay)




def vocab_size_of(cfg: Config) -> int:
    """Relays need only the vocabulary size (no data is read)."""
    return vocab_size_for(cfg.data)
