"""Precision (`train.precision`, docs/gpu.md): bf16 autocast on the CPU trains, its loss stays
close to fp32's, the master weights, gradients and AdamW state stay float32, the wire sees
float32 only, and fp32 is exactly the code path without autocast."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import Config, DataConfig, ModelConfig, TrainConfig
from gwtf.model.data import TokenDataset, load_dataset
from gwtf.model.presets import model_spec
from gwtf.model.stage import build_stage, stage_forward_backward_reference
from gwtf.model.trainer import StageOptimizer, train_iteration, train_local
from gwtf.runtime.worker import StageWorker

torch.set_num_threads(1)
ITERATIONS = 6


def _config(tmp_path: Path, precision: str, family: str = "gpt") -> Config:
    return Config(
        model=ModelConfig(family=family, seq_len=32, microbatch_size=4, stages=3),  # type: ignore[arg-type]
        data=DataConfig(source="synthetic", cache_dir=str(tmp_path / "cache"), synthetic_bytes=40_000,
                        vocab_size=512),
        train=TrainConfig(data_holders=2, microbatches=2, iterations=ITERATIONS, lr=3e-3, warmup_iterations=2,
                          eval_every=0, eval_microbatches=2, torch_threads=1, checkpoint_every=0,
                          precision=precision),  # type: ignore[arg-type]
    )


def _train(cfg: Config, ds: TokenDataset) -> tuple[list[float], list[torch.nn.Module], list[StageOptimizer]]:
    spec = model_spec(cfg.model, ds.vocab_size)
    stages = [build_stage(spec, k, cfg.model.stages, cfg.train.seed) for k in range(cfg.model.stages)]
    opts = [StageOptimizer(s, cfg.train) for s in stages]
    losses = [train_iteration(stages, opts, ds, t, cfg.train).loss for t in range(ITERATIONS)]
    return losses, stages, opts


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_bf16_autocast_trains_close_to_fp32_with_fp32_master_weights(tmp_path: Path, family: str) -> None:
    cfg32 = _config(tmp_path, "fp32", family)
    ds = load_dataset(cfg32.data, cfg32.model, 0, 2, microbatches=cfg32.train.microbatches, say=lambda _: None)
    fp32, _, _ = _train(cfg32, ds)
    bf16, stages, opts = _train(_config(tmp_path, "bf16-autocast", family), ds)
    assert all(math.isfinite(x) for x in bf16)
    assert bf16 != fp32  # autocast really ran in bfloat16 (fp32 would repeat fp32's bits)
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a - b) < 0.02 * a, (fp32, bf16)  # measured: at most 0.5% apart over 6 iterations
    assert bf16[-1] < bf16[0]  # it learns
    for s in stages:
        assert all(p.dtype == torch.float32 for p in s.parameters())
    for o in opts:
        state = o.state_tensors()
        assert state and all(v.dtype == torch.float32 for k, v in state.items() if not k.endswith(".step"))


def test_bf16_gradients_point_where_fp32_ones_do(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "fp32")
    ds = load_dataset(cfg.data, cfg.model, 0, 2, microbatches=cfg.train.microbatches, say=lambda _: None)
    spec = model_spec(cfg.model, ds.vocab_size)
    x, y = ds.microbatch(0, 0, 0)
    grads = {}
    for precision in ("fp32", "bf16-autocast"):
        stages = [build_stage(spec, k, 3, seed=0) for k in range(3)]
        stage_forward_backward_reference(stages, x, y, precision=precision)
        flat = [p.grad for s in stages for p in s.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in flat)
        grads[precision] = torch.cat([g.reshape(-1) for g in flat if g is not None])
    cos = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16-autocast"], dim=0)
    assert float(cos) > 0.99


def test_fp32_is_the_plain_code_path(tmp_path: Path) -> None:
    """precision = "fp32" computes exactly what the stages compute without any autocast context."""
    cfg = _config(tmp_path, "fp32")
    ds = load_dataset(cfg.data, cfg.model, 0, 2, microbatches=cfg.train.microbatches, say=lambda _: None)
    spec = model_spec(cfg.model, ds.vocab_size)
    x, y = ds.microbatch(1, 0, 1)
    stages = [build_stage(spec, k, 3, seed=0) for k in range(3)]
    loss = stage_forward_backward_reference(stages, x, y, precision="fp32")
    h = stages[0].embed(x)  # type: ignore[operator]
    for relay in stages[1:]:
        h = relay(h)
    assert torch.equal(loss, stages[0].head_loss(h, y).detach())  # type: ignore[operator]


def test_the_wire_carries_float32_whatever_the_precision(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "bf16-autocast")
    ds = load_dataset(cfg.data, cfg.model, 0, 2, microbatches=cfg.train.microbatches, say=lambda _: None)
    spec = model_spec(cfg.model, ds.vocab_size)
    holder = StageWorker(cfg, spec, 0, dataset=ds, shard=0)
    relay = StageWorker(cfg, spec, 1)
    holder.embed("mb", 0, 0, "act0")
    sent = holder.to_numpy("act0")
    relay.put("act0", sent)
    relay.forward("mb1", "act0", "act1")
    back = relay.to_numpy("act1")
    assert sent.dtype == back.dtype == np.float32
    holder.put("act1", back)
    holder.loss("mb", "act1", "g1")
    assert holder.to_numpy("g1").dtype == np.float32
    assert holder.grads_flat().dtype == torch.float32


def test_local_trainer_records_precision_results_and_peak_memory(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "bf16-autocast")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iterations=2))
    train_local(cfg, tmp_path / "run", say=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0 for r in rows)
    assert "val_loss" in rows[-1] and math.isfinite(rows[-1]["val_loss"])
