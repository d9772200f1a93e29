"""`data.order`: "epoch" visits every window of a shard exactly once per epoch, in an order that
is a pure function of (seed, shard, iteration, index), so a resumed run continues mid-epoch
exactly; "random" is bit-identical to the implementation before epoch order existed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from gwtf.config import DataConfig, ModelConfig
from gwtf.model.data import TokenDataset, keyed_permutation, load_dataset

SMALL = ModelConfig(seq_len=16, microbatch_size=4)
M = 3  # microbatches per data holder per iteration
# sha256 over (microbatch_starts, tokens) of d in 0..2, t in 0..3, m in 0..2 (synthetic corpus of
# 30,000 bytes, byte tokenizer, seed 7, 3 data holders), computed with the implementation before
# data.order existed (git 46172e0)
RANDOM_ORDER_SHA = "c3bf1c1029b8acbcb980ccb1dcc4e9425d0f12b55bdfd79ac6c3c571b337e793"


def _ds(tmp_path: Path, order: str = "epoch", seed: int = 7, holders: int = 3) -> TokenDataset:
    cfg = DataConfig(source="synthetic", cache_dir=str(tmp_path), synthetic_bytes=30_000, tokenizer="byte",
                     order=order)  # type: ignore[arg-type]
    return load_dataset(cfg, SMALL, seed, holders, microbatches=M, say=lambda _: None)


def _rows(ds: TokenDataset, d: int, iterations: range) -> list[int]:
    """The window starts shard d trains, in training order, over `iterations`."""
    return [s for t in iterations for m in range(M) for s in ds.microbatch_starts(d, t, m).tolist()]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_keyed_permutation_is_a_permutation(n: int) -> None:
    x = np.arange(n, dtype=np.int64)
    p = keyed_permutation(x, n, [1, 2, 3])
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(keyed_permutation(x[::-1].copy(), n, [1, 2, 3]), p[::-1])  # elementwise
    if n >= 64:
        assert not np.array_equal(p, x) and not np.array_equal(p, keyed_permutation(x, n, [1, 2, 4]))


def test_one_epoch_trains_every_window_of_a_shard_once(tmp_path: Path) -> None:
    ds = _ds(tmp_path)
    w = ds.seq_len + 1
    for d in range(ds.data_holders):
        n = ds.shard_windows(d)
        every = sorted(a + k * w for a, b in ds.shard_token_ranges(d) for k in range((b - a) // w))
        assert len(every) == n > 2 * M * ds.microbatch_size
        iterations = range(n // (M * ds.microbatch_size) + 2)
        rows = _rows(ds, d, iterations)
        first_epoch, second_epoch = rows[:n], rows[n:2 * n]
        assert sorted(first_epoch) == every  # each window exactly once
        assert sorted(second_epoch[: n // 4]) != sorted(first_epoch[: n // 4])  # reshuffled per epoch
        assert len(set(second_epoch)) == len(second_epoch)


def test_a_resumed_run_trains_the_windows_of_an_unbroken_one(tmp_path: Path) -> None:
    """Stop at iteration k mid-epoch, load the data afresh, go on from k: same windows, same tokens."""
    unbroken = _ds(tmp_path)
    n = unbroken.shard_windows(0)
    per_iteration = M * unbroken.microbatch_size
    k, end = n // per_iteration // 2, n // per_iteration + 3  # stops mid-epoch, ends in the next one
    resumed = _ds(tmp_path)  # a new process would build exactly this
    assert _rows(unbroken, 0, range(k, end)) == _rows(resumed, 0, range(k, end))
    for t in (k, end - 1):
        x1, y1 = unbroken.microbatch(0, t, M - 1)
        x2, y2 = resumed.microbatch(0, t, M - 1)
        assert np.array_equal(x1.numpy(), x2.numpy()) and np.array_equal(y1.numpy(), y2.numpy())
    assert _rows(_ds(tmp_path, seed=8), 0, range(k, end)) != _rows(unbroken, 0, range(k, end))


def test_epoch_order_needs_the_microbatch_count(tmp_path: Path) -> None:
    cfg = DataConfig(source="synthetic", cache_dir=str(tmp_path), synthetic_bytes=30_000, tokenizer="byte",
                     order="epoch")
    ds = load_dataset(cfg, SMALL, 7, 3, microbatches=0, say=lambda _: None)
    with pytest.raises(ValueError, match="microbatches"):
        ds.microbatch(0, 0, 0)
    with pytest.raises(ValueError, match="not in 0..2"):
        _ds(tmp_path).microbatch(0, 0, M)
    assert len(ds.val_microbatches(2)) == 2  # validation does not need it


def test_random_order_is_unchanged(tmp_path: Path) -> None:
    ds = _ds(tmp_path, order="random")
    h = hashlib.sha256()
    for d in range(3):
        for t in range(4):
            for m in range(3):
                h.update(ds.microbatch_starts(d, t, m).astype("<i8").tobytes())
                h.update(ds.microbatch(d, t, m)[0].numpy().astype("<i8").tobytes())
    assert h.hexdigest() == RANDOM_ORDER_SHA


def test_local_training_runs_in_epoch_order(tmp_path: Path) -> None:
    """`gwtf train --local` hands its dataset the microbatch count (epoch order numbers rows by it)."""
    from gwtf.config import Config, TrainConfig
    from gwtf.model.trainer import train_local

    cfg = Config(model=ModelConfig(seq_len=16, microbatch_size=4, stages=2),
                 data=DataConfig(source="synthetic", cache_dir=str(tmp_path / "cache"), synthetic_bytes=30_000,
                                 tokenizer="byte", order="epoch"),
                 train=TrainConfig(data_holders=2, microbatches=2, iterations=2, eval_every=0, checkpoint_every=0,
                                   torch_threads=1))
    result = train_local(cfg, tmp_path / "run", say=lambda _: None)
    assert len(result.metrics) == 2 and all(r["loss"] == r["loss"] for r in result.metrics)  # not NaN
