"""The config system: layering, strict keys and types, round trip through TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from gwtf.config import Config, dump_toml, load_config, read_toml
from gwtf.errors import UserError


def test_defaults_file_and_overrides_layer(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[train]\nlr = 0.5\niterations = 7\n[model]\nfamily = "llama"\n')
    cfg = load_config(f, ["train.iterations=9", "model.stages=4"])
    assert cfg.train.lr == 0.5 and cfg.train.iterations == 9
    assert cfg.model.family == "llama" and cfg.model.stages == 4
    assert cfg.data == Config().data


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.nope=1", "train.nope"),
        ("nope.x=1", "nope"),
        ("train.iterations=abc", "train.iterations"),
        ("train.iterations=1.5", "train.iterations"),
        ("model.family=rnn", "model.family"),
        ("model.stages=1", "model.stages"),
        ("train=3", "train"),
    ],
)
def test_bad_overrides_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_int_widens_to_float() -> None:
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["train.seed=3", "data.source=synthetic", "model.family=llama"])
    f = tmp_path / "r.toml"
    f.write_text(dump_toml(cfg))
    assert load_config(f) == cfg
    assert read_toml(f)["train"]["seed"] == 3


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
