"""Devices: `train.device` / `--device` resolution, the one-line refusal of cuda without CUDA
(through the real CLI, in subprocesses, for train and node), the flag overriding the config, the
autocast context of `train.precision`, and peak memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gwtf.cli import build_parser
from gwtf.commands.train import _resolve
from gwtf.config import TrainConfig, load_config
from gwtf.errors import UserError
from gwtf.model.device import compute_autocast, cuda_unavailable_reason, peak_memory_bytes, resolve_device

NO_CUDA = not torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(not NO_CUDA, reason="refusals need a machine without CUDA")


def test_auto_is_cuda_when_available_else_cpu() -> None:
    assert resolve_device("auto") == ("cpu" if NO_CUDA else "cuda")
    assert resolve_device("cpu") == "cpu"
    assert TrainConfig().device == "auto"


def test_an_unknown_device_is_a_user_error() -> None:
    with pytest.raises(UserError, match="--device gpu: expected one of auto, cpu, cuda"):
        resolve_device("gpu")


@needs_no_cuda
def test_cuda_without_cuda_names_the_torch_build() -> None:
    reason = cuda_unavailable_reason()
    assert reason is not None and torch.__version__ in reason
    with pytest.raises(UserError) as info:
        resolve_device("cuda")
    assert str(info.value) == f"--device cuda: CUDA is not available ({reason})"


def test_the_flag_overrides_the_config(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\ndevice = "cuda"\n', encoding="utf-8")
    assert load_config(toml, []).train.device == "cuda"
    args = build_parser().parse_args(["train", "--local", "--config", str(toml), "--device", "cpu"])
    assert _resolve(args).train.device == "cpu"
    args = build_parser().parse_args(["train", "--local", "--config", str(toml)])
    assert _resolve(args).train.device == "cuda"


@pytest.mark.parametrize("command", ["train", "node", "swarm", "demo"])
def test_every_training_command_has_the_flag(command: str) -> None:
    args = build_parser().parse_args([command, "--device", "cpu"])
    assert args.device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--device", "tpu"])


def _gwtf(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GWTF_CACHE": str(tmp_path / "cache"), "GWTF_PIP_INDEX_URL": "none"}
    return subprocess.run([sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path, check=False)


@needs_no_cuda
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("train", "--local", "--device", "cuda", "--out", "run"), "--device cuda: CUDA is not available"),
        (("train", "--local", "--set", 'train.device="cuda"', "--out", "run"),
         "train.device = cuda: CUDA is not available"),
        (("node", "--role", "data-holder", "--device", "cuda", "--out", "run"), "--device cuda: CUDA is not available"),
    ],
)
def test_cuda_without_cuda_is_one_line_and_exit_2(tmp_path: Path, argv: tuple[str, ...], needle: str) -> None:
    proc = _gwtf(tmp_path, *argv)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0] and "built without CUDA" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_autocast_context_follows_the_precision() -> None:
    with compute_autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with compute_autocast("cpu", "bf16-autocast"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        a = torch.ones(4, 4)
        assert (a @ a).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision"):
        compute_autocast("cpu", "fp8")


def test_peak_memory_is_the_resident_peak_on_the_cpu() -> None:
    first = peak_memory_bytes("cpu")
    block = torch.ones(8 * 2**20, dtype=torch.uint8)  # touched: counts in the resident set
    second = peak_memory_bytes("cpu")
    assert block.sum() > 0
    assert 10 * 2**20 < first <= second  # an interpreter with torch holds far more than 10 MiB


@needs_no_cuda
def test_the_gpu_check_without_cuda_points_to_the_dry_run(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--skip-tests", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, check=False)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "CUDA is not available" in lines[0] and "--dry-run" in lines[0]
    assert not (tmp_path / "out").exists()
