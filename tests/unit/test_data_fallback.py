"""Offline, the Shakespeare -> synthetic fallback is decided once by whoever starts the run, said
on its console, and recorded in the resolved config (and handed to every node of a swarm)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cli_errors import gwtf
from gwtf.commands.swarm import _resolve_data
from gwtf.config import Config, DataConfig
from gwtf.errors import UserError
from gwtf.model.data import resolve_source
from gwtf.runtime.swarm import SwarmOptions

TINY = ("--set", 'data.tokenizer="byte"', "--set", "data.synthetic_bytes=20000", "--set", "model.seq_len=16",
        "--set", "train.data_holders=1", "--set", "train.microbatches=1", "--set", "train.eval_microbatches=0")


def test_train_local_offline_announces_and_records_the_fallback(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "train", "--local", "--out", "run", "--iterations", "1", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert 'this run uses the synthetic corpus instead (data.source = "synthetic")' in proc.stderr
    resolved = tomllib.loads((tmp_path / "run" / "config.resolved.toml").read_text())
    assert resolved["data"]["source"] == "synthetic"


def test_swarm_launcher_resolves_once_and_passes_it_to_the_nodes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GWTF_PIP_INDEX_URL", "none")
    said: list[str] = []
    cfg = Config(data=DataConfig(cache_dir=str(tmp_path / "cache"), synthetic_bytes=20_000))
    opts = SwarmOptions(out_dir=tmp_path / "run", overrides=("train.iterations=3",))
    cfg2, opts2 = _resolve_data(cfg, opts, said.append)
    assert cfg2.data.source == "synthetic" and cfg2.data.cache_dir == cfg.data.cache_dir
    assert opts2.overrides == ("train.iterations=3", 'data.source="synthetic"')
    assert len(said) == 2 and "synthetic corpus" in said[1]  # "preparing ...", then the fallback


def test_other_sources_are_kept_and_checked(tmp_path: Path) -> None:
    synthetic = DataConfig(source="synthetic")
    assert resolve_source(synthetic) is synthetic
    good = tmp_path / "ok.txt"
    good.write_text("some text\n" * 100)
    assert resolve_source(DataConfig(source=str(good))).source == str(good)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x00\x01")
    with pytest.raises(UserError, match="bad.txt is binary"):
        resolve_source(DataConfig(source=str(bad)))
