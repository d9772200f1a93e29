"""`train.update_delay = 1` (docs/protocol.md, "Overlapped aggregation") on real tensors under
simulated churn, and in the protocol's records.

The setup of `test_real_tensors` (tiny preset, float64, 2 data holders, 3 stages, 3 replicas of
each relay stage, M = 2, K iterations, lossless wire, gather and butterfly): with delay 1
iteration t's passes run on the weights of step t-2 and each stage applies step t-1 after
exporting t's gradient. Checks:
- no churn: every replica's weights equal the local trainer's with delay 1 (`reference_stages`,
  the `gwtf train --local` loop), within float64 summation order; replicas bit-identical after
  every step; and they differ from the delay-0 run's (the delay is real);
- relays crashing at random protocol points (the seeded schedules of `test_real_tensors`): every
  survivor equals the local trainer with delay 1 given the versions the leader restarted at
  (a round broken after its replicas stepped past it: `Coordinator._restart`), 0 violations;
- the leader's records: with delay 1 the iteration t+1 starts before iteration t is done.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.flow.instance import Instance
from gwtf.model.data import TokenDataset, load_dataset
from gwtf.protocol.kinds import RecordName
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.messages import Record
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import ScenarioConfig, build, load_scenario
from gwtf.sim.simulator import Simulator
from gwtf.tensor_sim import (
    TensorRun,
    compare_stages,
    config_for,
    reference_stages,
    relay_crash_schedule,
    replica_problems,
    run_with_tensors,
)

ATOL = 1e-12
RTOL = 1e-9
K = 4
INSTANCE_SEED = 7
SCENARIO = [
    'model.preset="tiny"', "model.seq_len=16", "model.microbatch_size=2", "model.stages=3",
    "nodes.count=8", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]", f"train.iterations={K}",
    "train.microbatches=2", "sim.max_time_s=1500.0", "sim.progress_bound_s=600.0", "train.update_delay=1",
    'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
]


@dataclass(frozen=True, slots=True)
class Setup:
    cfg: Config
    dataset: TokenDataset


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    base = load_config(None, ['data.source="synthetic"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"'])
    cfg = config_for(load_scenario(None, SCENARIO), base)
    ds = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    yield Setup(cfg, ds)
    torch.set_num_threads(threads)


def _scenario(reduce: str) -> ScenarioConfig:
    return load_scenario(None, [*SCENARIO, f'protocol.reduce="{reduce}"'])


def _problems(run: TensorRun, cfg: Config, ds: TokenDataset) -> list[str]:
    """Everything wrong with a finished delay-1 run, against the local trainer with delay 1 and
    the run's own restarts."""
    out: list[str] = []
    s = run.summary
    if not s.get("finished") or s.get("invariant_violations"):
        out.append(f"finished={s.get('finished')} violations={s.get('violations')}")
    out += run.contract_violations[:3]
    want, _ = reference_stages(cfg, ds, K, restarts=run.restarts)
    return out + [f"{line} (restarts {run.restarts})" for line in replica_problems(run, want, K, ATOL, RTOL)]


@pytest.mark.parametrize("reduce", ["gather", "butterfly"])
def test_no_churn_equals_the_local_trainer_with_delay_1(setup: Setup, reduce: str) -> None:
    sc = _scenario(reduce)
    run = run_with_tensors(sc, 0, setup.cfg, setup.dataset, built=build(sc, INSTANCE_SEED))
    assert not run.crashed and run.restarts == []
    assert _problems(run, setup.cfg, setup.dataset) == []
    synchronous, _ = reference_stages(replace(setup.cfg, train=replace(setup.cfg.train, update_delay=0)),
                                      setup.dataset, K)
    stage = run.stage_of[min(run.weights)]
    assert compare_stages(run.weights[min(run.weights)], synchronous[stage])[0] > 1e-6  # the delay is real


@pytest.mark.timeout(900)
@pytest.mark.parametrize("reduce", ["gather", "butterfly"])
def test_relay_crashes_with_delay_1_equal_the_local_trainer_given_its_restarts(setup: Setup, reduce: str) -> None:
    sc = _scenario(reduce)
    built: tuple[Instance, TrainParams] = build(sc, INSTANCE_SEED)
    duration_s = float(run_with_tensors(sc, 0, setup.cfg, setup.dataset, built=built).summary["training_time_s"])
    failures: list[str] = []
    restarted = 0
    for seed in range(8):
        rng = random.Random(f"update-delay:{seed}")
        faults, chosen = relay_crash_schedule(rng, built[0].by_stage, duration_s, 3, 2)
        try:
            run = run_with_tensors(replace(sc, faults=tuple(faults)), seed, setup.cfg, setup.dataset, built=built)
        except RuntimeError as exc:  # a compute found a tensor or graph missing: a protocol bug
            failures.append(f"seed {seed} {chosen}: {exc}")
            continue
        restarted += bool(run.restarts)
        problems = _problems(run, setup.cfg, setup.dataset)
        if problems:
            failures.append(f"seed {seed} victims={chosen} crashed={run.crashed}: " + "; ".join(problems))
    assert failures == []
    assert restarted >= 1  # the schedules reach the restart of a broken overlapped round


class _Recording(Simulator):
    """A simulator that keeps the order of the leader's iteration records."""

    seen: list[tuple[str, int]]

    def _record(self, node: str, rec: Record, now: float) -> None:
        f = dict(rec.fields)
        if rec.event in (RecordName.ITER_START, RecordName.ITERATION_DONE):
            self.seen.append((str(rec.event), int(f["iteration"])))
        super()._record(node, rec, now)


@pytest.mark.parametrize("delay", [0, 1])
def test_the_next_iteration_starts_before_the_previous_one_is_done(delay: int) -> None:
    """The leader's records: delay 1 sends iteration t+1's start with iteration t's commit, so
    `iter_start` of t+1 comes before `iteration_done` of t (every iteration but the last, which
    ends synchronously); delay 0 after it. And delay 1 is faster on the same nodes."""
    times = {}
    for d in (0, 1):
        sc = load_scenario("configs/scenarios/paper-gpt-nochurn.toml", [f"train.update_delay={d}", "train.iterations=6"])
        sim = _Recording(sc, 0, get_system("gwtf", sc.protocol))
        sim.seen = []
        summary = sim.run()
        assert summary["finished"] and summary["invariant_violations"] == 0
        times[d] = summary["training_time_s"]
        if d != delay:
            continue
        at = {rec: i for i, rec in enumerate(sim.seen)}
        for t in range(5):
            before = at[(str(RecordName.ITER_START), t + 1)] < at[(str(RecordName.ITERATION_DONE), t)]
            assert before == bool(delay), (t, sim.seen)
    assert times[1] < times[0]


def test_a_node_moved_to_another_stage_across_a_restart_takes_the_iteration_again() -> None:
    """SWARM seed 3 of paper-gpt-high with delay 1: a rebalancing move (the moved relay leaves,
    breaking the overlapped round) made the leader restart iteration t while the mover had
    already taken IterStart(t+1) at its old stage; after its Welcome at the new stage it ignored
    IterStart(t+1) as taken (`Aggregation.started_iter`), never reported, and the iteration
    waited 6,000 s for its report. Welcome now forgets the old stage's rounds."""
    sc = load_scenario("configs/scenarios/paper-gpt-high.toml", ["train.update_delay=1"])
    sim = Simulator(sc, 3, get_system("swarm", sc.protocol))
    summary = sim.run()
    assert summary["finished"] and summary["invariant_violations"] == 0
    assert summary["training_time_s"] < 600.0  # 346 s with the fix, 12,934 s without
