"""User errors through the real CLI: exit code 2, exactly one stderr line naming the problem, no
traceback. Each case runs `python -m gwtf` in a subprocess with a private cache and no network
(`tests/cli_errors.py`). Every case here fails before any node process starts."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_errors import assert_one_line_error, assert_one_line_error_in_process, gwtf, gwtf_in_process
from gwtf.config import Config, DataConfig, ModelConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "scenarios" / "smoke.toml")
SMALL = ("--set", 'data.source="synthetic"', "--set", "data.tokenizer=\"byte\"", "--set", "model.seq_len=16")


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("train.no_such_key=1", ("unknown key", "train.no_such_key")),
        ("train.lr=fast", ("train.lr", "must be a float")),
        ("model.seq_len=1.5", ("model.seq_len", "must be an int")),
        ("train.seed=-1", ("train.seed", ">= 0")),
        ("train.min_lr=-1e-4", ("train.min_lr",)),
        ("train.time_limit_s=-5", ("train.time_limit_s", ">= 0")),
        ("runtime.connect_timeout_s=-1", ("runtime.connect_timeout_s", "> 0")),
        ("protocol.heartbeat_period_s=0", ("protocol.heartbeat_period_s", "> 0")),
        ("flow.stable_s=-2", ("flow.stable_s", ">= 0")),
    ],
)
def test_bad_config_values(tmp_path: Path, override: str, needles: tuple[str, ...]) -> None:
    result = gwtf_in_process(tmp_path, "train", "--local", "--out", "run", "--set", override)
    assert_one_line_error_in_process(result, *needles)


def test_bad_config_value_subprocess(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "train", "--local", "--out", "run", "--set", "train.lr=nan")
    assert_one_line_error(proc, "train.lr", "got nan")


def test_negative_time_limit_flag(tmp_path: Path) -> None:
    assert_one_line_error(gwtf(tmp_path, "train", "--local", "--out", "run", "--time-limit-s", "-1"),
                          "train.time_limit_s")


def test_missing_data_path(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "train", "--local", "--out", "run", "--set", "data.source=/no/such/corpus.txt")
    assert_one_line_error(proc, "data path not found", "/no/such/corpus.txt")


def test_train_without_local_points_to_swarm(tmp_path: Path) -> None:
    assert_one_line_error(gwtf(tmp_path, "train", "--out", "run"), "--local", "gwtf swarm")


# ---- text data: binary or non-UTF-8 files are refused, naming the file and the byte offset -------------


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (b"some text first\n" + b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), ("is binary", "byte 0x02 at offset 20")),
        ("caf\u00e9 au lait\n".encode("latin-1") * 100, ("is not UTF-8", "byte 0xe9 at offset 3")),
    ],
    ids=["binary", "latin-1"],
)
def test_non_text_data_is_refused(tmp_path: Path, data: bytes, needles: tuple[str, ...]) -> None:
    bad = _write(tmp_path / "corpus.txt", data)
    proc = gwtf(tmp_path, "train", "--local", "--out", "run", "--set", f'data.source="{bad}"', *SMALL[2:])
    assert_one_line_error(proc, str(bad), *needles)


def test_binary_file_in_a_data_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    _write(folder / "a.txt", b"plain text\n" * 200)
    bad = _write(folder / "b.txt", b"\x00\x01\x02 not text")
    proc = gwtf(tmp_path, "data", "prepare", str(folder), "--set", 'data.tokenizer="byte"')
    assert_one_line_error(proc, str(bad), "offset 0")


def test_valid_utf8_text_is_read(tmp_path: Path) -> None:
    from gwtf.model.data import read_text_file

    text = "héllo wörld, tabs\tand\r\nlines\f\x1b[0m\n" * 40
    assert read_text_file(_write(tmp_path / "ok.txt", text.encode())) == text


# ---- --out pointing at an existing file -----------------------------------------------------------------


OUT_TAKEN = [
    ("train", "--local", "--out", "taken", *SMALL),
    ("simulate", SMOKE, "--no-progress", "--out", "taken"),
    ("node", "--name", "r1", "--out", "taken"),
    ("swarm", "--out", "taken"),
    ("demo", "--out", "taken"),
]


@pytest.mark.parametrize("args", OUT_TAKEN[1:], ids=lambda a: a[0])
def test_out_is_an_existing_file(tmp_path: Path, args: tuple[str, ...]) -> None:
    (tmp_path / "taken").write_text("not a folder\n")
    assert_one_line_error_in_process(gwtf_in_process(tmp_path, *args), "--out taken", "not a folder")


def test_out_is_an_existing_file_subprocess(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a folder\n")
    assert_one_line_error(gwtf(tmp_path, *OUT_TAKEN[0]), "--out taken", "not a folder")


# ---- listen addresses -----------------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_listen_port_in_use(tmp_path: Path, busy_port: int) -> None:
    proc = gwtf(tmp_path, "node", "--listen", f"127.0.0.1:{busy_port}", "--name", "dh0", "--role", "data-holder",
                "--out", "run")
    assert_one_line_error(proc, f"--listen 127.0.0.1:{busy_port}", "already in use")


@pytest.mark.parametrize(
    ("listen", "needles"),
    [
        ("192.0.2.1:7000", ("no such address",)),  # TEST-NET-1: never an address of this machine
        ("nosuchhost.invalid:7000", ("unknown host",)),
        ("127.0.0.1:99999", ("bad address",)),
        ("127.0.0.1", ("bad address",)),
    ],
)
def test_bad_listen_address(tmp_path: Path, listen: str, needles: tuple[str, ...]) -> None:
    result = gwtf_in_process(tmp_path, "node", "--listen", listen, "--name", "r1", "--out", "run")
    assert_one_line_error_in_process(result, "--listen", *needles)


def test_bad_listen_address_subprocess(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "node", "--listen", "192.0.2.1:7000", "--name", "r1", "--out", "run")
    assert_one_line_error(proc, "--listen 192.0.2.1:7000", "no such address")


# ---- nonsensical numbers of the node-starting commands ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("swarm", "--out", "run", "--timeout-s", "-5"), ("--timeout-s", ">= 0")),
        (("swarm", "--out", "run", "--iterations", "0"), ("train.iterations", ">= 1")),
        (("swarm", "--out", "run", "--replicas", "0"), ("--replicas",)),
        (("demo", "--out", "run", "--timeout-s", "-1"), ("--timeout-s", "> 0")),
        (("demo", "--out", "run", "--iterations", "0"), ("train.iterations", ">= 1")),
        (("node", "--name", "r1", "--out", "run", "--iterations", "0"), ("unrecognized arguments",)),
        (("node", "--name", "r1", "--out", "run", "--set", "train.iterations=0"), ("train.iterations", ">= 1")),
    ],
)
def test_bad_numbers(tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    assert_one_line_error_in_process(gwtf_in_process(tmp_path, *args), *needles)


def test_negative_timeout_subprocess(tmp_path: Path) -> None:
    assert_one_line_error(gwtf(tmp_path, "swarm", "--out", "run", "--timeout-s", "-5"), "--timeout-s")


def test_scenario_bad_value(tmp_path: Path) -> None:
    result = gwtf_in_process(tmp_path, "simulate", SMOKE, "--no-progress", "--out", "sim", "--set",
                             "sim.control_bytes=-1")
    assert_one_line_error_in_process(result, "sim.control_bytes")


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
    proc = gwtf(tmp_path, "train", "--local", "--out", "run", "--resume", "--config", str(config_file),
                "--iterations", "2")
    assert_one_line_error(proc, "corrupt checkpoint:", "checkpoint.json")
