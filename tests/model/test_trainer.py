"""Reference trainer: schedule, aggregation, clipping, equivalence to a monolithic step, learning,
resume == uninterrupted, outputs, corrupt checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from gwtf.config import Config, DataConfig, ModelConfig, TrainConfig, load_config
from gwtf.errors import UserError
from gwtf.model.data import load_dataset
from gwtf.model.presets import model_spec
from gwtf.model.stage import build_stage
from gwtf.model.trainer import (
    StageOptimizer,
    aggregate_stage_grads,
    clip_grads_by_norm,
    lr_at,
    train_iteration,
    train_local,
)
from gwtf.model.transformer import build_model

torch.set_num_threads(1)


def tiny_config(tmp_path: Path, **train: object) -> Config:
    return Config(
        model=ModelConfig(seq_len=32, microbatch_size=4, stages=3),
        data=DataConfig(source="synthetic", cache_dir=str(tmp_path / "cache"), synthetic_bytes=40_000, vocab_size=512),
        train=TrainConfig(**{"data_holders": 2, "microbatches": 2, "iterations": 4, "lr": 3e-3,
                             "warmup_iterations": 2, "eval_every": 2, "eval_microbatches": 2,
                             "torch_threads": 1, **train}),  # type: ignore[arg-type]
    )


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_iterations=4, iterations=20)
    lrs = [lr_at(t, cfg) for t in range(25)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[19] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[11] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 15)))


def test_aggregate_sums_count_weighted_grads_and_rescales_drops() -> None:
    g = [[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 5.0])], [torch.tensor([100.0, 100.0])]]
    assert torch.equal(aggregate_stage_grads(g, [2, 2, 0], planned_count=4)[0], torch.tensor([4.0, 7.0]))
    dropped = aggregate_stage_grads(g[:1], [2], planned_count=4)[0]  # half the microbatches died
    assert torch.equal(dropped, torch.tensor([2.0, 4.0]))
    single = torch.randn(5)
    out = aggregate_stage_grads([[single]], [3], planned_count=3)[0]
    assert torch.equal(out, single) and out is not single
    with pytest.raises(ValueError):
        aggregate_stage_grads(g, [0, 0, 0])


def test_clip_bounds_the_stage_norm() -> None:
    grads = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
    norm = clip_grads_by_norm(grads, 1.0)
    assert norm == pytest.approx(math.sqrt(27 + 64))
    assert float(torch.linalg.vector_norm(torch.cat(grads))) == pytest.approx(1.0, rel=1e-5)
    small = [torch.full((2,), 0.1)]
    clip_grads_by_norm(small, 1.0)
    assert torch.equal(small[0], torch.full((2,), 0.1))


def test_one_iteration_equals_monolithic_gradient_accumulation(tmp_path: Path) -> None:
    """DESIGN.md section 3: staged D*M microbatches == one process, one model, mean loss, same AdamW."""
    cfg = tiny_config(tmp_path, grad_clip=0.0, warmup_iterations=0)
    ds = load_dataset(cfg.data, cfg.model, 0, 2, microbatches=cfg.train.microbatches, say=lambda _: None)
    spec = model_spec(cfg.model, ds.vocab_size)
    stages = [build_stage(spec, k, 3, seed=0) for k in range(3)]
    stage_opts = [StageOptimizer(s, cfg.train) for s in stages]
    train_iteration(stages, stage_opts, ds, 0, cfg.train)

    model = build_model(spec, seed=0)
    opt = StageOptimizer(model, cfg.train)
    for d in range(2):
        for m in range(2):
            x, y = ds.microbatch(d, 0, m)
            (model(x, y)[1] / 4).backward()  # type: ignore[index]
    opt.step(0)
    # The aggregated gradient itself, tightly: after one step AdamW's first moment is (1 - beta1) * g,
    # so a wrong weighting of any microbatch shows here (the step alone would hide it: Adam's first
    # step is g / (|g| + eps), nearly blind to the gradient's scale).
    want_m = {k: v for k, v in opt.state_tensors().items() if k.endswith(".exp_avg")}
    got_m = {
        f"opt.{s.global_param_name(k.removeprefix('opt.').removesuffix('.exp_avg'))}.exp_avg": v  # type: ignore[operator]
        for s, o in zip(stages, stage_opts) for k, v in o.state_tensors().items() if k.endswith(".exp_avg")
    }
    assert set(got_m) == set(want_m)
    for name, value in want_m.items():
        torch.testing.assert_close(got_m[name], value, rtol=1e-5, atol=1e-9, msg=name)
    # The weights, to a hundredth of a step: for a gradient within rounding of zero, g / (|g| + eps)
    # turns the last-bit differences of two summation orders into a visible part of lr.
    want = model.state_dict()
    got = {s.global_param_name(k): v for s in stages for k, v in s.state_dict().items()}  # type: ignore[operator]
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-2 * cfg.train.lr, msg=name)


def test_loss_decreases_on_synthetic_corpus(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, iterations=20, warmup_iterations=3, eval_every=0, checkpoint_every=0)
    result = train_local(cfg, tmp_path / "run", say=lambda _: None)
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5, losses
    assert result.metrics[-1]["val_loss"] < losses[0] - 1.5


def test_outputs_and_metrics_fields(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_local(tiny_config(tmp_path), out, say=lambda _: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    for key in ("loss", "tokens", "time_s", "lr", "tokens_per_s", "grad_norms", "peak_memory_bytes"):
        assert all(key in r for r in rows), key
    assert all(r["tokens"] == 2 * 2 * 4 * 32 for r in rows)
    assert [("val_loss" in r) for r in rows] == [False, True, False, True]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_config(out / "config.resolved.toml") == tiny_config(tmp_path)
    assert (out / "checkpoint" / "checkpoint.json").is_file()


def _comparable(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s", "peak_memory_bytes")} for r in rows]


@pytest.mark.parametrize("delay", [0, 1])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, delay: int) -> None:
    """With `train.update_delay` 1 the checkpoint carries the step still pending."""
    cfg = tiny_config(tmp_path, checkpoint_every=0)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, update_delay=delay))
    whole = train_local(cfg, tmp_path / "whole", say=lambda _: None)
    part = train_local(cfg, tmp_path / "split", stop_after=2, say=lambda _: None)
    assert part.stopped_early and part.completed == 2
    rest = train_local(cfg, tmp_path / "split", resume=True, say=lambda _: None)
    assert rest.completed == 4 and not rest.stopped_early
    assert _comparable(rest.metrics) == _comparable(whole.metrics)
    on_disk = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert _comparable(on_disk) == _comparable(whole.metrics)
    assert {"val_loss", "val_loss_at_stop"} & set(part.metrics[-1])  # a stopped run reports val loss


def test_corrupt_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, iterations=1)
    train_local(cfg, tmp_path / "run", say=lambda _: None)
    stage1 = next((tmp_path / "run" / "checkpoint").glob("stage1-*.safetensors"))
    stage1.write_bytes(stage1.read_bytes()[:100])
    with pytest.raises(UserError, match=r"corrupt checkpoint: .*stage1-.*sha256"):
        train_local(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iterations=2)),
                    tmp_path / "run", resume=True, say=lambda _: None)


def test_resume_with_a_different_model_is_refused(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, iterations=1)
    train_local(cfg, tmp_path / "run", say=lambda _: None)
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e-2))
    with pytest.raises(UserError, match="cannot resume: .*train.lr"):
        train_local(other, tmp_path / "run", resume=True, say=lambda _: None)


def test_tiny_local_config_documents_the_defaults() -> None:
    """configs/tiny-local.toml must stay equal to the embedded defaults it documents."""
    path = Path(__file__).resolve().parents[2] / "configs" / "tiny-local.toml"
    cfg, defaults = load_config(path), Config()
    assert (cfg.model, cfg.data, cfg.train) == (defaults.model, defaults.data, defaults.train)


def test_resume_without_a_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        train_local(tiny_config(tmp_path), tmp_path / "empty", resume=True, say=lambda _: None)
