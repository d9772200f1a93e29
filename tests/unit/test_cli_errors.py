"""User errors through the real CLI: exit code 2, exactly one stderr line naming the problem, no
traceback. Each case runs `python -m gwtf` in a subprocess with a private cache and no network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gwtf.config import Config, DataConfig, ModelConfig, TrainConfig


def _gwtf(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GWTF_CACHE": str(tmp_path / "cache"), "GWTF_PIP_INDEX_URL": "none"}
    return subprocess.run(
        [sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=120, env=env,
        cwd=tmp_path, check=False,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("train.no_such_key=1", ("unknown key", "train.no_such_key")),
        ("train.lr=fast", ("train.lr", "must be a float")),
        ("model.seq_len=1.5", ("model.seq_len", "must be an int")),
    ],
)
def test_bad_config_values(tmp_path: Path, override: str, needles: tuple[str, ...]) -> None:
    proc = _gwtf(tmp_path, "train", "--local", "--out", "run", "--set", override)
    _assert_one_line_error(proc, *needles)


def test_missing_data_path(tmp_path: Path) -> None:
    proc = _gwtf(tmp_path, "train", "--local", "--out", "run", "--set", "data.source=/no/such/corpus.txt")
    _assert_one_line_error(proc, "data path not found", "/no/such/corpus.txt")


def test_train_without_local_points_to_swarm(tmp_path: Path) -> None:
    _assert_one_line_error(_gwtf(tmp_path, "train", "--out", "run"), "--local", "gwtf swarm")


def test_corrupt_checkpoint(tmp_path: Path) -> None:
    from gwtf.config import write_resolved
    from gwtf.model.trainer import train_local

    cfg = Config(
        model=ModelConfig(seq_len=16, microbatch_size=2),
        data=DataConfig(source="synthetic", tokenizer="byte", synthetic_bytes=20_000, cache_dir=str(tmp_path / "c")),
        train=TrainConfig(iterations=1, data_holders=1, microbatches=1, torch_threads=1),
    )
    train_local(cfg, tmp_path / "run", say=lambda _: None)
    index = tmp_path / "run" / "checkpoint" / "checkpoint.json"
    index.write_text(index.read_text()[:50])  # truncated mid-write
    config_file = write_resolved(cfg, tmp_path, "cfg.toml")
    proc = _gwtf(tmp_path, "train", "--local", "--out", "run", "--resume", "--config", str(config_file),
                 "--iterations", "2")
    _assert_one_line_error(proc, "corrupt checkpoint:", "checkpoint.json")
