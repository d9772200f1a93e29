"""CUDA (marked `gpu`, skipped without CUDA; run with `pytest -m gpu tests/gpu`, as
benchmarks/gpu_check.sh does): a seed gives the same weights on the GPU as on the CPU, a CUDA
forward/backward matches the CPU's within tolerance, bf16 autocast's loss stays close to fp32's
with float32 master weights, the wire stays float32, and the trainer reports CUDA peak memory."""

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
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.stage import build_stage, stage_forward_backward_reference
from gwtf.model.trainer import StageOptimizer, train_iteration, train_local
from gwtf.runtime.worker import StageWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# CUDA and CPU kernels sum in different orders; TF32 is off by default for matmuls (torch >= 1.12)
LOSS_RTOL = 1e-4
GRAD_ATOL = 1e-5
BF16_LOSS_RTOL = 0.02  # bf16 keeps ~3 significant digits (CPU: within 0.5% over 6 iterations)


def _config(tmp_path: Path, family: str = "gpt", precision: str = "fp32", device: str = "cuda") -> Config:
    return Config(
        model=ModelConfig(family=family, seq_len=64, microbatch_size=4, stages=3),  # type: ignore[arg-type]
        data=DataConfig(source="synthetic", cache_dir=str(tmp_path / "cache"), synthetic_bytes=40_000,
                        vocab_size=512),
        train=TrainConfig(data_holders=2, microbatches=2, iterations=4, lr=3e-3, warmup_iterations=2,
                          eval_every=0, eval_microbatches=2, checkpoint_every=0, device=device,  # type: ignore[arg-type]
                          precision=precision),  # type: ignore[arg-type]
    )


def _setup(tmp_path: Path, family: str) -> tuple[Config, TokenDataset, ModelSpec]:
    cfg = _config(tmp_path, family)
    ds = load_dataset(cfg.data, cfg.model, 0, 2, microbatches=cfg.train.microbatches, say=lambda _: None)
    return cfg, ds, model_spec(cfg.model, ds.vocab_size)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_seed_gives_the_same_weights_on_the_gpu(tmp_path: Path, family: str) -> None:
    _, _, spec = _setup(tmp_path, family)
    for k in range(3):
        cpu, gpu = build_stage(spec, k, 3, seed=5), build_stage(spec, k, 3, seed=5, device="cuda")
        for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values(), strict=True):
            assert b.is_cuda and torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_cuda_forward_backward_matches_the_cpu(tmp_path: Path, family: str) -> None:
    _, ds, spec = _setup(tmp_path, family)
    x, y = ds.microbatch(0, 0, 0)
    out = {}
    for device in ("cpu", "cuda"):
        stages = [build_stage(spec, k, 3, seed=0, device=device) for k in range(3)]
        loss = stage_forward_backward_reference(stages, x.to(device), y.to(device))
        grads = [p.grad.cpu() for s in stages for p in s.parameters() if p.grad is not None]
        out[device] = (float(loss), grads)
    assert out["cuda"][0] == pytest.approx(out["cpu"][0], rel=LOSS_RTOL)
    for g_cpu, g_gpu in zip(out["cpu"][1], out["cuda"][1], strict=True):
        torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-3, atol=GRAD_ATOL)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_bf16_autocast_on_cuda_stays_close_to_fp32(tmp_path: Path, family: str) -> None:
    cfg, ds, spec = _setup(tmp_path, family)
    losses = {}
    for precision in ("fp32", "bf16-autocast"):
        tc = dataclasses.replace(cfg.train, precision=precision)
        stages = [build_stage(spec, k, 3, seed=0, device="cuda") for k in range(3)]
        opts = [StageOptimizer(s, tc) for s in stages]
        losses[precision] = [train_iteration(stages, opts, ds, t, tc).loss for t in range(4)]
        assert all(p.dtype == torch.float32 for s in stages for p in s.parameters())
        for o in opts:
            assert all(v.dtype == torch.float32 for k, v in o.state_tensors().items() if not k.endswith(".step"))
    assert all(math.isfinite(v) for v in losses["bf16-autocast"])
    for a, b in zip(losses["fp32"], losses["bf16-autocast"], strict=True):
        assert b == pytest.approx(a, rel=BF16_LOSS_RTOL), losses


def test_the_wire_is_float32_on_cuda_in_bf16(tmp_path: Path) -> None:
    cfg, ds, spec = _setup(tmp_path, "gpt")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="bf16-autocast"))
    holder = StageWorker(cfg, spec, 0, device="cuda", dataset=ds, shard=0)
    relay = StageWorker(cfg, spec, 1, device="cuda")
    holder.embed("mb", 0, 0, "a0")
    relay.put("a0", holder.to_numpy("a0"))
    relay.forward("mb1", "a0", "a1")
    assert holder.to_numpy("a0").dtype == relay.to_numpy("a1").dtype == np.float32


def test_local_trainer_on_cuda_reports_cuda_peak_memory(tmp_path: Path) -> None:
    cfg = _config(tmp_path, precision="bf16-autocast")
    torch.cuda.reset_peak_memory_stats()
    train_local(cfg, tmp_path / "run", say=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    peaks = [r["peak_memory_bytes"] for r in rows]
    assert 0 < peaks[0] <= peaks[-1] <= torch.cuda.max_memory_allocated()
