"""`gwtf train --local` checkpoints: the previous checkpoint is kept until a newer one is complete,
and loading falls back to it (with a warning naming the bad file) when the newest is damaged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gwtf.errors import UserError
from gwtf.model.checkpoint import INDEX_NAME, PREV_INDEX_NAME, load_checkpoint, save_checkpoint


def _save(root: Path, iteration: int) -> None:
    stages = [{"w": torch.full((64,), float(iteration + k))} for k in range(2)]
    save_checkpoint(root, iteration, stages, {"rng": torch.arange(4)}, {"it": iteration})


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize("damage", [_flip_bit, _truncate, Path.unlink], ids=["flipped-bit", "truncated", "missing"])
def test_damaged_newest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]
) -> None:
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    assert load_checkpoint(tmp_path).iteration == 4
    bad = tmp_path / "stage1-it00000004.safetensors"
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="gwtf.checkpoint"):
        ckpt = load_checkpoint(tmp_path)
    assert ckpt.iteration == 2 and ckpt.meta == {"it": 2}
    assert torch.equal(ckpt.stages[1]["w"], torch.full((64,), 3.0))
    assert str(bad) in caplog.text


def test_only_the_newest_two_are_kept(tmp_path: Path) -> None:
    for it in (2, 4, 6):
        _save(tmp_path, it)
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == [f"{kind}-it0000000{it}.safetensors" for kind in ("extra", "stage0", "stage1") for it in (4, 6)]
    assert (tmp_path / PREV_INDEX_NAME).is_file()


def test_a_damaged_index_falls_back_and_without_a_previous_is_an_error(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    (tmp_path / INDEX_NAME).write_text("{")
    with pytest.raises(UserError, match=r"corrupt checkpoint: .*checkpoint\.json"):
        load_checkpoint(tmp_path)
    _save(tmp_path, 4)  # the next saves replace the damaged index; then it falls back again
    _save(tmp_path, 6)
    (tmp_path / INDEX_NAME).unlink()
    assert load_checkpoint(tmp_path, warn=lambda _: None).iteration == 4
