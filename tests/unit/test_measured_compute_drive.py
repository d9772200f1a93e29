"""Measured compute on the driver side (issue 15, deliverable 2): `runtime.meter.ComputeMeter`
averages a stage's microbatch job times after a warm-up, `drive.Host` feeds it from real torch
jobs (slowed by `runtime.compute_slowdown`) and hands the estimate to its core, and
`gwtf swarm --slow NODE=FACTOR` slows one node's process."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gwtf.commands.swarm import _options
from gwtf.config import load_config
from gwtf.errors import UserError
from gwtf.protocol.messages import Compute, Record
from gwtf.runtime.drive import ComputeResult, Host
from gwtf.runtime.launcher import ProcessGroup
from gwtf.runtime.meter import SAMPLES, WARMUP_JOBS, ComputeMeter
from gwtf.runtime.node import NodeIdentity
from gwtf.runtime.swarm import initial_plans

PLACEHOLDER_S = 1e3
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


def test_the_meter_skips_the_warm_up_and_averages_a_stage_s_microbatch_kinds() -> None:
    m = ComputeMeter(alpha=0.5, warmup=2, samples=1)
    for _ in range(2):
        m.add(1, "forward", 9.0)  # warm-up: not counted
        m.add(1, "backward", 9.0)
    m.add(1, "forward", 1.0)
    assert m.per_microbatch_s(1) is None  # no backward counted yet
    m.add(1, "backward", 2.0)
    m.add(1, "step", 50.0)  # not a microbatch job
    assert m.per_microbatch_s(1) == 3.0
    m.add(1, "forward", 3.0)  # EMA: 1 + 0.5 * (3 - 1)
    assert m.per_microbatch_s(1) == 4.0
    assert m.per_microbatch_s(2) is None
    m.add(2, "forward", 1.0)  # another stage (a move): starts afresh, warm-up included
    assert m.per_microbatch_s(1) is None and m.stage == 2
    dh = ComputeMeter(alpha=1.0, warmup=0, samples=1)
    for kind, s in (("embed", 0.1), ("loss", 0.2), ("forward", 5.0)):
        dh.add(0, kind, s)
    assert dh.per_microbatch_s(0) is None  # the embedding's backward is part of a data holder's microbatch
    dh.add(0, "embed_backward", 0.3)
    assert dh.per_microbatch_s(0) == pytest.approx(0.6)
    mean = ComputeMeter(alpha=0.1, warmup=1, samples=3)
    for s in (100.0, 1.0, 2.0):
        mean.add(1, "forward", s)
        mean.add(1, "backward", 0.0)
    assert mean.per_microbatch_s(1) is None  # 2 counted jobs of each kind, 3 needed
    mean.add(1, "forward", 6.0)
    mean.add(1, "backward", 0.0)
    assert mean.per_microbatch_s(1) == pytest.approx(3.0)  # the mean of 1, 2, 6 (not an EMA from 1)


def _relay(out: Path, slowdown: float) -> Host:
    cfg = load_config(CONFIG, ["model.stages=2", f"runtime.compute_slowdown={slowdown}"])
    ident = NodeIdentity(name="r1a", role="relay", stage=1, region="local", shard=None, listen="127.0.0.1:0",
                         join=None, device="cpu", out_dir=out)
    host = Host.create(cfg, ident, "r1a/local@127.0.0.1:1")
    host.start(0.0, None)
    return host


def _microbatch(host: Host, i: int) -> tuple[ComputeResult, Compute]:
    """One forward + backward of microbatch i on the relay (as the node's torch thread runs them)."""
    assert host.worker is not None
    shape = (host.cfg.model.microbatch_size, host.cfg.model.seq_len, host.spec.d_model)
    act, out, grad, back = (("act", "d0", 0, i), ("fout", "d0", 0, i), ("grad", "d0", 0, i), ("bout", "d0", 0, i))
    host.worker.put(act, np.random.default_rng(i).standard_normal(shape, dtype=np.float32))
    host.compute(Compute(2 * i, "forward", 1, ("d0", 0, i), 0.0, (act,), (out,)))
    host.worker.put(grad, np.ones(shape, dtype=np.float32))
    job = Compute(2 * i + 1, "backward", 1, ("d0", 0, i), 0.0, (act, out, grad), (back,))
    return host.compute(job), job


def _estimates(host: Host, n: int) -> list[float | None]:
    return [_microbatch(host, i)[0].compute_s for i in range(n)]


def test_a_host_measures_its_jobs_after_the_warm_up_and_its_core_advertises_them(tmp_path: Path) -> None:
    host = _relay(tmp_path, 1.0)
    first = WARMUP_JOBS + SAMPLES - 1
    assert _estimates(host, first) == [None] * first
    result, job = _microbatch(host, first)
    assert result.compute_s is not None and result.compute_s > 0.0
    # a placeholder no measurement of the tiny model comes near (a loaded machine may take ~1 s)
    host.core.me = replace(host.core.me, compute_s=PLACEHOLDER_S)
    out = host.compute_done(job, result, 1.0)
    advertised = [dict(e.fields) for e in out if isinstance(e, Record) and e.event == "compute_advertised"]
    assert advertised == [{"node": host.node_id, "stage": 1, "compute_s": result.compute_s,
                           "previous_s": PLACEHOLDER_S}]
    assert host.core.me.compute_s == result.compute_s


def test_a_slowed_host_sleeps_the_slowdown_and_measures_it(tmp_path: Path) -> None:
    host = _relay(tmp_path, 4.0)
    host.meter = ComputeMeter(alpha=1.0, warmup=0, samples=1)
    fwd = Compute(1, "forward", 1, ("d0", 0, 0), 0.0, (), ())
    bwd = Compute(2, "backward", 1, ("d0", 0, 0), 0.0, (), ())
    t0 = time.perf_counter()
    assert host._measure(fwd, time.perf_counter() - 0.01) is None  # a job that took 10 ms
    estimate = host._measure(bwd, time.perf_counter() - 0.01)
    slept_s = time.perf_counter() - t0
    assert slept_s >= 2 * 3 * 0.01  # (4 - 1) x each job's time
    assert estimate is not None and estimate >= 2 * 4 * 0.01  # the sleep counts


def _args(*slow: str) -> argparse.Namespace:
    return argparse.Namespace(overrides=["model.stages=2"], iterations=None, data_holders=None, stages=None,
                              wan=None, config=CONFIG, secret_file=None, replicas=2, timeout_s=0.0, out="x",
                              churn="none", churn_spare="none", resume=False, slow=list(slow), faults=[])


def test_swarm_slow_flag_slows_that_node_s_process_only() -> None:
    cfg, opts = _options(_args("r1a=4"))
    plans = {p.name: p for p in initial_plans(cfg, opts)}  # type: ignore[arg-type]
    assert plans["r1a"].slowdown == 4.0 and plans["r1b"].slowdown == 1.0
    group = ProcessGroup("out")
    assert "runtime.compute_slowdown=4.0" in group.command(plans["r1a"], None)
    assert not any("compute_slowdown" in a for a in group.command(plans["r1b"], None))


@pytest.mark.parametrize("spec, says", [("r9z=4", "no initial node 'r9z'"), ("r1a=0.5", r"FACTOR in \[1, 1000\]"),
                                        ("r1a", "NODE=FACTOR"), ("r1a=fast", "NODE=FACTOR")])
def test_a_bad_slow_flag_is_a_user_error(spec: str, says: str) -> None:
    with pytest.raises(UserError, match=says):
        _options(_args(spec))


def test_two_slow_flags_for_one_node_are_refused_as_faults_are() -> None:
    with pytest.raises(UserError, match="node 'r1a' has a slowdown already"):
        _options(_args("r1a=4", "r1a=2"))
