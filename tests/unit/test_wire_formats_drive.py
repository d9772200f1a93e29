"""The runtime really sends the [wire] formats: a relay's Host decodes what it receives, computes
in float32, publishes its output in the configured format, and refuses bad payloads while it
keeps serving (drive.Host: the seam the node process and the tensor simulator use)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.model import wire
from gwtf.model.presets import model_spec
from gwtf.model.tokenizer import vocab_size_for
from gwtf.protocol.core import NodeCore
from gwtf.protocol.messages import Backward, Compute, Forward
from gwtf.protocol.router import PeerInfo
from gwtf.runtime.drive import Host, train_params
from gwtf.runtime.node import NodeIdentity

BASE = ['data.source="synthetic"', 'data.tokenizer="byte"', "model.seq_len=16", "model.microbatch_size=2",
        "train.microbatches=2", "train.data_holders=2", "model.stages=3", "wire.block_values=64"]


def _relay(overrides: list[str], out: Path) -> Host:
    cfg = load_config(None, [*BASE, f'data.cache_dir="{out}"', *overrides])
    spec = model_spec(cfg.model, vocab_size_for(cfg.data))
    me = PeerInfo(id="r1/local@127.0.0.1:1", stage=1, region="local", compute_s=1.0, capacity=2)
    core = NodeCore(me, cfg.protocol, train_params(cfg, spec), random.Random(0))
    ident = NodeIdentity(name="r1", role="relay", stage=1, region="local", shard=None, listen="", join=None,
                         device="cpu", out_dir=out)
    return Host(cfg, ident, me.id, core, spec, None, "cpu")


def _fwd(key: tuple[object, ...]) -> Forward:
    return Forward(mb=("d0", 0, 0), flow_id=0, path=("d0",), legs=(0,), key=key, size_bytes=1)


def _act(host: Host) -> np.ndarray:
    cfg: Config = host.cfg
    shape = (cfg.model.microbatch_size, cfg.model.seq_len, host.spec.d_model)
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8"])
def test_relay_computes_on_the_decoded_activation_and_sends_its_format(fmt: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    host = _relay([f'wire.activations="{fmt}"', 'wire.gradients="bf16"'], tmp_path)
    act = _act(host)
    key, out, gkey = ("act", "d0", 0, 0, "d0", 0), ("act", "d0", 0, 0, "r1", 1), ("grad", "d0", 0, 0, "r1", 1)
    host.store_tensors(_fwd(key), wire.encode(act, fmt, 64))
    host.compute(Compute(1, "forward", 1, ("d0", 0, 0), 0.0, (key,), (out,)))
    sent = host.tensors_for(_fwd(out))
    assert wire.format_of(sent) == fmt
    assert host.worker is not None
    with torch.no_grad():
        want = host.worker.module(torch.from_numpy(wire.roundtrip(act, fmt, 64))).numpy()
    assert np.array_equal(wire.decode(sent, 64), wire.roundtrip(want, fmt, 64))
    # the gradient back: received bf16, the input gradient goes out in bf16
    grad_in = ("grad", "d0", 0, 0, "d1", 2)
    g = np.ones_like(act) * 1e-3
    host.store_tensors(Backward(mb=("d0", 0, 0), path=("d0", "r1", "r2"), legs=(0, 1, 2), key=grad_in),
                       wire.encode(g, "bf16"))
    host.compute(Compute(2, "backward", 1, ("d0", 0, 0), 0.0, (key, out, grad_in), (gkey,)))
    back = host.tensors_for(Backward(mb=("d0", 0, 0), path=("d0", "r1", "r2"), legs=(0, 1, 2), key=gkey))
    assert wire.format_of(back) == "bf16" and np.isfinite(wire.decode(back)).all()


def test_fp32_sends_the_array_as_computed(tmp_path: Path) -> None:
    host = _relay(['wire.activations="fp32"'], tmp_path)  # explicit: the default is int8
    act = _act(host)
    key, out = ("act", "d0", 0, 0, "d0", 0), ("act", "d0", 0, 0, "r1", 1)
    host.store_tensors(_fwd(key), [act])
    host.compute(Compute(1, "forward", 1, ("d0", 0, 0), 0.0, (key,), (out,)))
    sent = host.tensors_for(_fwd(out))
    assert len(sent) == 1 and sent[0].dtype == np.float32 and sent[0].shape == act.shape


def test_the_default_sends_int8_activations(tmp_path: Path) -> None:
    host = _relay([], tmp_path)
    act = _act(host)
    key, out = ("act", "d0", 0, 0, "d0", 0), ("act", "d0", 0, 0, "r1", 1)
    host.store_tensors(_fwd(key), wire.encode(act, "int8", 64))
    host.compute(Compute(1, "forward", 1, ("d0", 0, 0), 0.0, (key,), (out,)))
    sent = host.tensors_for(_fwd(out))
    assert wire.format_of(sent) == "int8" and wire.decode(sent, 64).shape == act.shape


def test_bad_payloads_are_refused_and_the_relay_keeps_serving(tmp_path: Path) -> None:
    host = _relay(['wire.activations="int8"'], tmp_path)
    act = _act(host)
    codes, scales = wire.encode(act, "int8", 64)
    bad = {
        "wrong scale count": [codes, scales[:-1]],
        "block size not ours": wire.encode(act, "int8", 128),
        "nan scale": [codes, np.where(np.arange(scales.size) == 0, np.nan, scales).astype(np.float32)],
        "three arrays": [codes, scales, scales],
        "unknown dtype": [act.astype(np.int32)],
    }
    for i, arrays in enumerate(bad.values()):
        key = ("act", "d0", 0, i, "d0", 0)
        with pytest.raises(ValueError):
            host.store_tensors(_fwd(key), arrays)
        assert host.tensors_for(_fwd(key)) == []  # nothing of it was kept
    key, out = ("act", "d0", 0, 9, "d0", 0), ("act", "d0", 0, 9, "r1", 1)
    host.store_tensors(_fwd(key), [codes, scales])
    host.compute(Compute(1, "forward", 1, ("d0", 0, 9), 0.0, (key,), (out,)))
    assert wire.format_of(host.tensors_for(_fwd(out))) == "int8"
