"""A churn-free swarm of real node processes trains exactly like `gwtf train --local`.

Tolerance: per-iteration loss within rtol 1e-5 (6 iterations) / 1e-4 (20 iterations) of the
reference trainer on the same config, seed and data. The only difference allowed is float32
summation order (replica gradients are summed per replica, then across replicas); iterations 0
and 1 come out bit-identical in practice. Replicas of a stage must hold bit-identical weights
(equal hashes) after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.model.trainer import train_local
from gwtf.runtime.swarm import Swarm

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


def _cfg(overrides: tuple[str, ...]) -> Config:
    return load_config(CONFIG, list(overrides))


def _reference_losses(overrides: tuple[str, ...], out: Path) -> list[float]:
    torch.set_num_threads(1)
    result = train_local(_cfg(overrides), out)
    return [float(m["loss"]) for m in result.metrics]


def _compare(make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], overrides: tuple[str, ...],
             tmp_path: Path, rtol: float, timeout_s: float) -> None:
    iterations = _cfg(overrides).train.iterations
    swarm = make_swarm(overrides)
    swarm.start()
    totals = finish(swarm, iterations, timeout_s)
    swarm.close()
    got = [r["loss"] for r in swarm.metrics.rows[:iterations]]
    assert all(r["microbatches"] == 4 for r in swarm.metrics.rows[:iterations])
    assert totals["expected"] == 4 * iterations * swarm.cfg.model.stages
    want = _reference_losses(overrides, tmp_path / "local")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce", ["gather", "butterfly"])
def test_two_data_holders_two_relays_match_local_trainer(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], tmp_path: Path, reduce: str
) -> None:
    """4 processes: data holders dh0, dh1 (stage 0) and relays r1a, r1b (stage 1 of 2); the
    replicas reduce by gather or by the butterfly all-reduce (`protocol.reduce`)."""
    _compare(make_swarm, finish, ("model.stages=2", "train.iterations=6", f'protocol.reduce="{reduce}"'),
             tmp_path, rtol=1e-5, timeout_s=90)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_swarm_matches_local_trainer_for_20_iterations(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], tmp_path: Path
) -> None:
    """The issue's setting: 2 data holders, 3 stages, 2 replicas of each relay stage (6 processes)."""
    _compare(make_swarm, finish, ("model.stages=3", "train.iterations=20"), tmp_path, rtol=1e-4, timeout_s=200)
