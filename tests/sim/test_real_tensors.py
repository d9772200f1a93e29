"""Real tensors under simulated churn: the end-to-end check of exactly-once (DESIGN.md 3 and 5).

The simulator drives NodeCores; `gwtf.tensor_sim` carries out their compute effects on
real torch stage modules (tiny preset, float64, one process). Tiny shape: 2 data holders, 3
stages, 3 replicas of each relay stage, M = 2 microbatches per data holder, K = 3 iterations.

Checks:
- no churn: every stage's weights after K steps equal `gwtf train --local`'s (`train_iteration`
  on the same microbatches, same optimizer), the losses too, and the replicas of a stage are
  bit-identical (same weights hash) after every step;
- relays crashing at random protocol points (mid-forward / mid-backward / mid-aggregation /
  mid-step compute, right after a protocol record, or at a random time; one replica of every
  stage never crashes; data holders never crash), for 20 seeds: every survivor's weights equal the
  no-churn run's, replicas stay bit-identical after every step.

Tolerance: float64; only the order of floating-point sums may differ between runs (which
replica accumulated which microbatch, the sorted-replica aggregation), so max |diff| <= 1e-12
and per-tensor relative difference (|diff| / max|param|) <= 1e-9. A microbatch counted twice or
dropped moves parameters by ~1e-4 (one AdamW step of a 1/(D*M)-weighted gradient), 8 orders
above the tolerance; `test_detects_a_double_count` shows the check catches one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.flow.instance import Instance
from gwtf.model.data import TokenDataset, load_dataset
from gwtf.protocol.butterfly import layout
from gwtf.protocol.ledger import TrainParams
from gwtf.protocol.messages import Compute
from gwtf.sim.scenario import Fault, ScenarioConfig, build, load_scenario
from gwtf.tensor_sim import (
    StageWeights,
    TensorRun,
    TensorSimulator,
    config_for,
    reference_stages,
    relay_crash_schedule,
    replica_problems,
    run_with_tensors,
)

ATOL = 1e-12
RTOL = 1e-9
K = 3
INSTANCE_SEED = 7  # by_stage sizes (2, 3, 3): 2 data holders, 3 replicas per relay stage
SCENARIO = [
    'model.preset="tiny"', "model.seq_len=16", "model.microbatch_size=2", "model.stages=3",
    "nodes.count=8", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]", f"train.iterations={K}",
    "train.microbatches=2", "sim.max_time_s=1500.0", "sim.progress_bound_s=600.0",
    # exact: compares with the reference trainer (1e-12), so lossless messages; gather is the reference
    # reduction (reduce_fanout trees need it; the butterfly test overrides it and compares with gather's bits)
    'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"', 'protocol.reduce="gather"',
]


@dataclass(frozen=True, slots=True)
class Setup:
    sc: ScenarioConfig
    cfg: Config
    dataset: TokenDataset
    built: tuple[Instance, TrainParams]
    reference: list[StageWeights]
    reference_losses: list[float]
    no_churn: TensorRun


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    sc = load_scenario(None, SCENARIO)
    base: Config = load_config(None, ['data.source="synthetic"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"'])
    cfg = config_for(sc, base)
    ds = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    built = build(sc, INSTANCE_SEED)
    ref, losses = reference_stages(cfg, ds, K)
    no_churn = run_with_tensors(sc, 0, cfg, ds, built=built)
    yield Setup(sc, cfg, ds, built, ref, losses, no_churn)
    torch.set_num_threads(threads)


def _problems(run: TensorRun, want: list[StageWeights] | dict[int, StageWeights],
              initial: frozenset[str]) -> list[str]:
    """Everything wrong with a finished run, as readable lines (empty = exactly once held).

    `initial`: the nodes present from the start (they must have stepped every iteration)."""
    out: list[str] = []
    s = run.summary
    if not s.get("finished") or s.get("microbatches_dropped") or s.get("invariant_violations"):
        out.append(f"finished={s.get('finished')} dropped={s.get('microbatches_dropped')} "
                   f"violations={s.get('violations')}")
    out += run.contract_violations[:3]
    alive_per_stage = {k: [n for n, st in run.stage_of.items() if st == k] for k in range(len(want))}
    if any(not nodes for nodes in alive_per_stage.values()):
        out.append(f"a stage has no live replica: {alive_per_stage}")
    out += replica_problems(run, want, K, ATOL, RTOL)
    for node, stage in sorted(run.stage_of.items()):
        stepped = [it for it in range(K) if node in run.step_hashes.get((stage, it), {})]
        first = 0 if node in initial else (stepped[0] if stepped else K)  # a joiner steps once active
        if stepped != list(range(first, K)):
            out.append(f"{node} (stage {stage}) recorded steps of iterations {stepped}")
    return out


def test_no_churn_equals_the_reference_trainer(setup: Setup) -> None:
    run = setup.no_churn
    assert not run.crashed
    assert _problems(run, setup.reference, _initial(setup)) == []
    assert sorted(run.stage_of.values()) == sorted(n.stage for n in setup.built[0].nodes)
    for it, want in enumerate(setup.reference_losses):
        got = run.losses[it]
        assert len(got) == setup.cfg.train.data_holders * setup.cfg.train.microbatches
        assert abs(sum(got) / len(got) - want) <= 1e-12 * abs(want)
    # every step of every stage was taken by all of its replicas, with identical weights
    by_stage = [len(ns) for ns in setup.built[0].by_stage]
    for (stage, _), hashes in run.step_hashes.items():
        assert len(hashes) == by_stage[stage]


def _churn_run(setup: Setup, seed: int, victims: int) -> tuple[TensorRun | None, str, str]:
    """(run or None, schedule text, error text) of one seeded crash schedule."""
    rng = random.Random(f"real-tensors:{seed}")
    duration_s = float(setup.no_churn.summary["training_time_s"])
    faults, chosen = relay_crash_schedule(rng, setup.built[0].by_stage, duration_s, 3, victims)
    sc = replace(setup.sc, faults=tuple(faults))
    schedule = f"seed={seed} victims={chosen} faults={[f.spec() for f in faults]}"
    try:
        run = run_with_tensors(sc, seed, setup.cfg, setup.dataset, built=setup.built)
    except RuntimeError as exc:  # a compute found a tensor or graph missing: a protocol bug
        return None, schedule, str(exc)
    return run, schedule, ""


def _churn_seeds(setup: Setup, seeds: range, victims: int) -> tuple[list[str], list[TensorRun]]:
    reference = _stage_weights(setup.no_churn)
    failures: list[str] = []
    runs: list[TensorRun] = []
    for seed in seeds:
        run, schedule, error = _churn_run(setup, seed, victims)
        problems = [error] if run is None else _problems(run, reference, _initial(setup))
        if run is not None:
            runs.append(run)
        if problems:
            failures.append(f"{schedule} crashed={run.crashed if run else '?'}: " + "; ".join(problems))
    return failures, runs


def _initial(setup: Setup) -> frozenset[str]:
    return frozenset(setup.built[0].by_id)


def _stage_weights(run: TensorRun) -> dict[int, StageWeights]:
    """One replica's weights per stage (the lowest id; replicas are checked identical)."""
    out: dict[int, StageWeights] = {}
    for node in sorted(run.weights):
        out.setdefault(run.stage_of[node], run.weights[node])
    return out


@pytest.mark.timeout(600)
def test_relay_crashes_at_random_points_keep_exactly_once(setup: Setup) -> None:
    failures, runs = _churn_seeds(setup, range(20), victims=2)
    assert failures == [], "\n".join(failures)
    crashed = [r for r in runs if r.crashed]
    assert len(crashed) >= 15, f"only {len(crashed)} of 20 seeds crashed a relay"
    points = {p.split(":")[1].split("#")[0] for r in runs for p in r.crash_points}
    assert {"forward", "backward", "export_grad"} <= points, points
    paths = {k for r in runs for k, v in r.summary["counters"].items() if v}
    assert {"reroute", "redo_inflight", "redo_aggregation"} <= paths, paths  # every recovery path ran


def test_a_restart_after_its_redo_holder_died_keeps_exactly_once(setup: Setup) -> None:
    """Seed 137 of the long test: an in-flight redo chain of (n0, 0, 0) ends at a relay that then
    crashes. The data holder's deadline restarted the microbatch as that same chain, ending at
    the dead holder, every 60 s: a livelock until the run's time limit. Rerunning the whole
    pipeline instead ran the loss twice (the head's gradient counted twice: stage 0 off by 63%).
    The restart now ends at the data holder's own cached loss gradient."""
    failures, runs = _churn_seeds(setup, range(137, 138), victims=4)
    assert failures == [], "\n".join(failures)
    assert runs[0].summary["counters"].get("mb_restart", 0) >= 1


@pytest.mark.slow  # about 90 s on 2 cores (.ci/run's slow stage)
@pytest.mark.timeout(600)
def test_relay_crashes_many_seeds(setup: Setup) -> None:
    failures, runs = _churn_seeds(setup, range(20, 220), victims=4)
    assert failures == [], "\n".join(failures)
    assert sum(1 for r in runs if r.crashed) >= 150


class _DoubleCounting(TensorSimulator):
    """A broken executor: runs the first relay backward of stage 1 twice (a double count)."""

    doubled = False

    def _compute_done(self, node: str, job: Compute, dur_s: float) -> None:
        if not self.doubled and job.kind == "backward" and job.stage == 1 and node in self.hosts:
            self.doubled = True
            self.hosts[node].take_received()
            self.hosts[node].worker.backward(job.inputs[1], job.inputs[2], ("scratch",))  # type: ignore[union-attr]
            self.hosts[node].worker.forward(job.inputs[1], job.inputs[0], job.inputs[1])  # type: ignore[union-attr]
        super()._compute_done(node, job, dur_s)


def test_detects_a_double_count(setup: Setup, tmp_path: Path) -> None:
    sim = _DoubleCounting(setup.sc, 0, setup.cfg, setup.dataset, out_dir=tmp_path, built=setup.built)
    sim.run()
    problems = _problems(sim.result, setup.reference, _initial(setup))
    assert sim.doubled
    assert any("stage 1" in p and "differs" in p for p in problems), problems


def test_a_joiner_takes_real_state_and_stays_identical(setup: Setup) -> None:
    """A new node joins, then a relay crashes: the joiner fetches weights + AdamW state over the (simulated)
    wire and ends with the no-churn weights like every survivor."""
    faults = (Fault(event="join", time_s=0.2), Fault(event="crash", node=setup.built[0].by_stage[1][0], time_s=3.0))
    run = run_with_tensors(replace(setup.sc, faults=faults), 1, setup.cfg, setup.dataset, built=setup.built)
    assert run.crashed == [setup.built[0].by_stage[1][0]]
    assert "j1" in run.weights
    assert _problems(run, _stage_weights(setup.no_churn), _initial(setup)) == []


def test_a_broadcast_tree_passes_the_real_reduced_gradient_on(setup: Setup) -> None:
    """`protocol.reduce_fanout = 2` on 12 nodes (5 replicas a relay stage, so inner replicas
    forward the reduced gradient they stored): without churn, and with relays crashing at random
    protocol points for 4 seeds, every survivor ends with the reference weights."""
    sc = load_scenario(None, [*SCENARIO, "nodes.count=12", "protocol.reduce_fanout=2"])
    built = build(sc, INSTANCE_SEED)
    assert min(len(nodes) for nodes in built[0].by_stage[1:]) >= 4
    initial = frozenset(built[0].by_id)
    failures = []
    for seed in range(5):
        faults: list[Fault] = []
        if seed:
            faults, _ = relay_crash_schedule(random.Random(f"tree:{seed}"), built[0].by_stage,
                                                      float(setup.no_churn.summary["training_time_s"]), 6, 3)
        run = run_with_tensors(replace(sc, faults=tuple(faults)), seed, setup.cfg, setup.dataset, built=built)
        failures += [f"seed {seed}: {p}" for p in _problems(run, setup.reference, initial)]
    assert failures == [], "\n".join(failures)


class _GatherCheck(TensorSimulator):
    """Butterfly, checked against gather at every join: when a replica has joined the reduced
    parts (`concat`), the result must equal, bit for bit, what gather's reducer computes from the
    same exported gradients (`StageWorker.reduce` of the whole flat gradients, in the Commit's
    contributor order)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.exported: dict[tuple[object, ...], torch.Tensor] = {}  # (stage, it, node, round) -> flat
        self.joins = 0
        self.mismatches: list[str] = []

    def _compute_done(self, node: str, job: Compute, dur_s: float) -> None:
        super()._compute_done(node, job, dur_s)
        host, core = self.hosts.get(node), self.cores.get(node)
        if host is None or core is None or host.worker is None:
            return
        store = host.worker.store
        if job.kind == "export_grad":
            self.exported[job.outputs[0][1:5]] = torch.cat([store[k] for k in job.outputs])
        elif job.kind == "concat" and core.agg.commit is not None and core.agg.commit.round == job.outputs[0][4]:
            lay = layout(core.agg.commit)
            st, it, rnd = job.stage, job.outputs[0][2], job.outputs[0][4]
            want = host.worker.reduce([self.exported[(st, it, n, rnd)] for n in lay.positive], lay.total)
            self.joins += 1
            if not torch.equal(store[job.outputs[0]], want):
                self.mismatches.append(f"{node} stage {st} iteration {it} round {rnd}")


def test_butterfly_reduces_to_gathers_bits_and_the_reference(setup: Setup, tmp_path: Path) -> None:
    """`protocol.reduce = "butterfly"`, float32 (the runtime's dtype) and float64: every join
    equals gather's reduction of the same gradients bit for bit (the reduction is elementwise:
    part j of the sum is the sum of the parts j, in the same order), and, float64, without churn
    and with relays crashing at random protocol points (4 seeds), every survivor ends with the
    reference trainer's weights (the module's tolerance)."""
    sc = load_scenario(None, [*SCENARIO, 'protocol.reduce="butterfly"'])
    cfg = replace(setup.cfg, protocol=sc.protocol)
    for dtype in (torch.float32, torch.float64):
        sim = _GatherCheck(sc, 0, cfg, setup.dataset, out_dir=tmp_path / str(dtype), built=setup.built, dtype=dtype)
        sim.run()
        assert sim.joins >= K * len(setup.built[0].by_id) and sim.mismatches == [], sim.mismatches
    failures = []
    for seed in range(4):
        faults: list[Fault] = []
        if seed:
            faults, _ = relay_crash_schedule(random.Random(f"butterfly:{seed}"), setup.built[0].by_stage,
                                                      float(setup.no_churn.summary["training_time_s"]), 3, 2)
        run = run_with_tensors(replace(sc, faults=tuple(faults)), seed, cfg, setup.dataset, built=setup.built)
        failures += [f"seed {seed}: {p}" for p in _problems(run, setup.reference, _initial(setup))]
    assert failures == [], "\n".join(failures)
