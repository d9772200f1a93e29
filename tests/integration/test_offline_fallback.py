"""`gwtf swarm` offline with data.source = "shakespeare": the launcher says on its console that
the run uses the synthetic corpus, records that in DIR/config.resolved.toml, and its data holders
train on it (no node falls back on its own: their logs hold no fallback warning)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cli_errors import gwtf

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "swarm-test.toml")


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_swarm_offline_announces_and_records_the_synthetic_fallback(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "swarm", "--config", CONFIG, "--set", 'data.source="shakespeare"', "--iterations", "2",
                "--replicas", "1", "--out", "run", "--timeout-s", "300", timeout_s=380)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'gwtf swarm: warning: cannot get Shakespeare' in proc.stderr
    assert 'this run uses the synthetic corpus instead (data.source = "synthetic")' in proc.stderr
    resolved = tomllib.loads((tmp_path / "run" / "config.resolved.toml").read_text())
    assert resolved["data"]["source"] == "synthetic"
    logs = {p.parent.name: p.read_text(errors="replace") for p in (tmp_path / "run" / "nodes").glob("*/stdout.log")}
    assert {"dh0", "dh1"} <= logs.keys()
    assert not [name for name, text in logs.items() if "cannot get Shakespeare" in text]
