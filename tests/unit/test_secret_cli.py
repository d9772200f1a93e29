"""Secrets and keys as a user meets them, through the real CLI (`python -m gwtf` in a subprocess,
no inherited $GWTF_SWARM_SECRET): `gwtf secret new`, and the one-line refusals (exit code 2, before
any node process or torch starts) of a missing, empty or weak secret, of no secret on a
non-loopback address, and of a node key file that others can read. Also that `gwtf swarm`
passes `--secret-file` on to every node it starts."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gwtf.runtime import keys

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")
STRONG = "0123456789abcdef" * 2  # 128 bits


def _gwtf(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != keys.SECRET_ENV}
    base.update({"GWTF_CACHE": str(tmp_path / "cache"), "GWTF_PIP_INDEX_URL": "none", **(env or {})})
    return subprocess.run([sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=60,
                          env=base, cwd=tmp_path, check=False)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("gwtf: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_secret_new_writes_a_private_256_bit_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    proc = _gwtf(tmp_path, "secret", "new", "swarm.secret")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "swarm.secret"
    text = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", text.strip()), text
    assert "swarm.secret" in proc.stdout and "--secret-file swarm.secret" in proc.stdout
    assert keys.SECRET_ENV in proc.stdout and text.strip() not in proc.stdout + proc.stderr  # never printed
    again = _gwtf(tmp_path, "secret", "new", "swarm.secret")
    _one_line_error(again, "swarm.secret already exists", "not overwriting")
    assert path.read_text() == text


def test_secret_without_action_or_path_is_a_usage_error(tmp_path: Path) -> None:
    _one_line_error(_gwtf(tmp_path, "secret"), "required")
    _one_line_error(_gwtf(tmp_path, "secret", "new"), "required: PATH")


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["--secret-file", "missing.secret"], {}, ("cannot read swarm secret file", "missing.secret")),
        (["--secret-file", "weak.secret"], {}, ("weak.secret is too weak", "need 128")),
        (["--secret-file", "empty.secret"], {}, ("empty.secret is empty",)),
        ([], {keys.SECRET_ENV: "hunter2"}, ("$GWTF_SWARM_SECRET is too weak",)),
        (["--listen", "0.0.0.0:0"], {}, ("no swarm secret for non-loopback address 0.0.0.0", "gwtf secret new")),
        (["--join", "10.1.2.3:7000"], {}, ("no swarm secret for non-loopback address 10.1.2.3",)),
        (["--key-file", "shared.key"], {keys.SECRET_ENV: STRONG}, ("shared.key is readable by other users",)),
    ],
    ids=["missing", "weak", "empty", "weak-env", "public-listen", "public-join", "key-perms"],
)
def test_node_refuses_bad_secrets_and_keys_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], needles: tuple[str, ...]
) -> None:
    (tmp_path / "weak.secret").write_text("abcdef0123456789\n")  # 64 bits
    (tmp_path / "empty.secret").write_text("\n")
    (tmp_path / "shared.key").write_text(keys.new_private_key().hex())
    (tmp_path / "shared.key").chmod(0o644)
    proc = _gwtf(tmp_path, "node", "--out", "run", "--config", CONFIG, *args, env=env)
    _one_line_error(proc, *needles)
    assert not (tmp_path / "run" / "nodes").exists() or not any((tmp_path / "run" / "nodes").rglob("records.jsonl"))


def test_node_refuses_an_existing_default_key_that_others_can_read(tmp_path: Path) -> None:
    key = tmp_path / "run" / "nodes" / "dh0" / keys.KEY_FILE
    keys.load_or_create_key(key)
    key.chmod(0o604)
    proc = _gwtf(tmp_path, "node", "--out", "run", "--name", "dh0", "--config", CONFIG)
    _one_line_error(proc, f"{key.relative_to(tmp_path)} is readable by other users")


@pytest.mark.parametrize("command", ["swarm", "demo"])
def test_swarm_and_demo_check_the_secret_before_starting_nodes(tmp_path: Path, command: str) -> None:
    (tmp_path / "weak.secret").write_text("abc\n")
    config = ["--config", CONFIG] if command == "swarm" else []
    proc = _gwtf(tmp_path, command, "--out", "run", *config, "--secret-file", "weak.secret")
    _one_line_error(proc, "weak.secret is too weak")
    assert not (tmp_path / "run").exists()  # no node was started, no folder made
    proc = _gwtf(tmp_path, command, "--out", "run", *config, env={keys.SECRET_ENV: "short"})
    _one_line_error(proc, "$GWTF_SWARM_SECRET is too weak")


def test_swarm_passes_the_secret_file_to_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gwtf.cli import apply_secret_file
    from gwtf.config import load_config
    from gwtf.runtime.launcher import NodePlan
    from gwtf.runtime.swarm import Swarm, SwarmOptions, _ResumeGroup

    secret = tmp_path / "swarm.secret"
    keys.write_new_secret(secret)
    monkeypatch.chdir(tmp_path)  # a relative --secret-file names the same file in every node
    cfg = apply_secret_file(load_config(CONFIG), "swarm.secret", ["127.0.0.1"])
    assert cfg.runtime.secret_file == str(secret)
    with Swarm(cfg, SwarmOptions(out_dir=tmp_path / "run", config_path=CONFIG), say=lambda _: None) as swarm:
        cmd = swarm.group.command(NodePlan(name="r1a"), join="127.0.0.1:9")
    assert cmd[cmd.index("--secret-file") + 1] == str(secret)
    with _ResumeGroup(tmp_path / "run", CONFIG, secret_file=str(secret)) as group:
        cmd = group.command(NodePlan(name="r1a"), join=None)
    assert cmd[cmd.index("--secret-file") + 1] == str(secret) and "--resume" in cmd
    with Swarm(load_config(CONFIG), SwarmOptions(out_dir=tmp_path / "plain"), say=lambda _: None) as swarm:
        assert "--secret-file" not in swarm.group.command(NodePlan(name="r1a"), join=None)
