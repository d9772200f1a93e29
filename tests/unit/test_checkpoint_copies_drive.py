"""The driver side of the data holders' checkpoint copies, with one folder per "host".

A stage-1 replica (host A) writes checkpoint 5 and exports it under a "ckpt" key; a data holder
(host B) stores the received blob in its own folder; a joiner (host C, empty folder) asks B,
which reads its verified copy, and imports it: the joiner holds the replica's weights and keeps
the checkpoint on its own disk (the Rollback after a restore reloads it there). A corrupt copy
fails B's read job (the core answers the joiner with a refusal).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.protocol.messages import Compute, StateTransfer
from gwtf.runtime import checkpoints
from gwtf.runtime.drive import Host
from gwtf.runtime.node import NodeIdentity

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


def _cfg() -> Config:
    return load_config(CONFIG, ["model.stages=3", "protocol.checkpoint_every=5", "train.iterations=30"])


def _host(out: Path, name: str, role: str, stage: int) -> Host:
    ident = NodeIdentity(name=name, role=role, stage=stage, region="local", shard=0 if stage == 0 else None,
                         listen="127.0.0.1:0", join=None, device="cpu", out_dir=out)
    return Host.create(_cfg(), ident, f"{name}/local@127.0.0.1:1")


def _deliver(sender: Host, receiver: Host, key: tuple[object, ...]) -> tuple[object, ...]:
    """What the transport does: the sender's wire array, stored under the message's key."""
    msg = StateTransfer(stage=int(key[1]), version=int(key[2]), key=key)
    (arr,) = sender.tensors_for(msg)
    receiver.store_tensors(msg, [np.array(arr)])  # the transport delivers a writable copy
    return key


def test_a_checkpoint_travels_replica_to_data_holder_to_joiner(tmp_path: Path) -> None:
    replica = _host(tmp_path / "A", "r1a", "relay", 1)
    holder = _host(tmp_path / "B", "dh1", "data-holder", 0)
    joiner = _host(tmp_path / "C", "j1", "relay", 1)
    assert replica.worker is not None and joiner.worker is not None
    with torch.no_grad():
        for p in replica.worker.module.parameters():
            p.add_(0.01)
    replica._save_checkpoint(replica.worker, 5)
    expected = replica.worker.weights_hash()
    on_disk = checkpoints.read_version(tmp_path / "A" / "checkpoints", 1, 5)

    out_key = ("ckpt", 1, 5, replica.node_id)
    res = replica.compute(Compute(1, "export_checkpoint", 1, None, 0.0, (), (out_key,)))
    assert res.records == [("checkpoint_exported", {"stage": 1, "version": 5})]
    assert replica._last_blob is None  # the step's blob was used, then let go

    _deliver(replica, holder, out_key)
    res = holder.compute(Compute(2, "store_checkpoint", 0, None, 0.0, (out_key,), ()))
    assert res.records == [("checkpoint_stored", {"stage": 1, "version": 5, "source": replica.node_id,
                                                  "written": True})]
    assert holder.worker is not None and holder.worker.stage == 0  # no stage-1 worker built on B
    assert out_key not in holder.worker.store and not holder.tensors_for(
        StateTransfer(stage=1, version=5, key=out_key))  # the blob is not kept in memory
    assert checkpoints.read_version(tmp_path / "B" / "checkpoints", 1, 5) == on_disk

    assert checkpoints.versions(tmp_path / "C" / "checkpoints", 1) == []  # host C never served stage 1
    serve_key = ("ckpt", 1, 5, holder.node_id)
    res = holder.compute(Compute(3, "read_checkpoint", 0, None, 0.0, (), (serve_key,)))
    assert res.records == [("checkpoint_served", {"stage": 1, "version": 5})]
    _deliver(holder, joiner, serve_key)
    res = joiner.compute(Compute(4, "import_state", 1, None, 0.0, (serve_key,), ()))
    assert res.records == [("state_imported", {"stage": 1, "version": 5, "hash": expected,
                                               "source": holder.node_id, "checkpoint": True,
                                               "written": True})]
    assert checkpoints.read_version(tmp_path / "C" / "checkpoints", 1, 5) == on_disk


def test_a_corrupt_copy_fails_the_read(tmp_path: Path) -> None:
    holder = _host(tmp_path / "B", "dh1", "data-holder", 0)
    blob = b"\x00" * 64
    path = checkpoints.write_version(tmp_path / "B" / "checkpoints", 2, 5, blob)
    path.write_bytes(b"\x01" * 64)
    with pytest.raises(checkpoints.CheckpointError, match="sha256"):
        holder.compute(Compute(1, "read_checkpoint", 0, None, 0.0, (), (("ckpt", 2, 5, holder.node_id),)))


def test_a_copy_already_on_a_shared_folder_is_not_rewritten(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    blob = bytes(range(256)) * 4
    assert checkpoints.keep_version(folder, 1, 5, blob)
    mtime = checkpoints.stage_dir(folder, 1).joinpath("v5.safetensors").stat().st_mtime_ns
    assert not checkpoints.keep_version(folder, 1, 5, memoryview(blob))
    assert checkpoints.stage_dir(folder, 1).joinpath("v5.safetensors").stat().st_mtime_ns == mtime
    assert checkpoints.keep_version(folder, 1, 5, blob[::-1])  # different bytes: written
    assert checkpoints.read_version(folder, 1, 5) == blob[::-1]


def test_stage_0_travels_data_holder_to_relay_to_a_joining_data_holder(tmp_path: Path) -> None:
    """Issue 42 (no class holds the only copies): a data holder (host B) exports its stage-0
    checkpoint 5 (re-serialised: a data holder keeps no blob after its step), a relay (host A)
    stores it in its own folder beside its own stage's, and a joiner made a data holder on an
    empty host C, with every data holder gone, imports it from A: the same weights."""
    holder = _host(tmp_path / "B", "dh1", "data-holder", 0)
    relay = _host(tmp_path / "A", "r1a", "relay", 1)
    joiner = _host(tmp_path / "C", "j1", "data-holder", 0)
    assert holder.worker is not None and joiner.worker is not None
    with torch.no_grad():
        for p in holder.worker.module.parameters():
            p.add_(0.01)
    holder._save_checkpoint(holder.worker, 5)
    assert holder._last_blob is None  # stage 0 keeps no extra copy in memory between checkpoints
    expected = holder.worker.weights_hash()
    on_disk = checkpoints.read_version(tmp_path / "B" / "checkpoints", 0, 5)

    out_key = ("ckpt", 0, 5, holder.node_id)
    res = holder.compute(Compute(1, "export_checkpoint", 0, None, 0.0, (), (out_key,)))
    assert res.records == [("checkpoint_exported", {"stage": 0, "version": 5})]
    _deliver(holder, relay, out_key)
    res = relay.compute(Compute(2, "store_checkpoint", 1, None, 0.0, (out_key,), ()))
    assert res.records == [("checkpoint_stored", {"stage": 0, "version": 5, "source": holder.node_id,
                                                  "written": True})]
    assert relay.worker is not None and relay.worker.stage == 1  # no stage-0 worker built on A
    assert checkpoints.read_version(tmp_path / "A" / "checkpoints", 0, 5) == on_disk

    assert checkpoints.versions(tmp_path / "C" / "checkpoints", 0) == []
    serve_key = ("ckpt", 0, 5, relay.node_id)
    res = relay.compute(Compute(3, "read_checkpoint", 1, None, 0.0, (), (serve_key,)))
    assert res.records == [("checkpoint_served", {"stage": 0, "version": 5})]
    _deliver(relay, joiner, serve_key)
    res = joiner.compute(Compute(4, "import_state", 0, None, 0.0, (serve_key,), ()))
    assert res.records[0][0] == "state_imported" and res.records[0][1]["hash"] == expected
    assert checkpoints.read_version(tmp_path / "C" / "checkpoints", 0, 5) == on_disk
