"""The iteration's physical lower bound (`sim.bound`, issue 40 item 3): each term on instances small
enough to work out by hand, which term binds, achieved >= bound on real runs, and the
summary.json / table contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gwtf.cli import main
from gwtf.flow.instance import Instance, NodeSpec
from gwtf.flow.network import Network
from gwtf.protocol.ledger import TrainParams
from gwtf.sim.bound import IterationBound, iteration_bound, min_makespan_s
from gwtf.sim.metrics import iteration_fields
from gwtf.sim.scenario import build, load_scenario
from gwtf.sim.simulator import run_scenario

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "smoke.toml"
FIELDS = ("iteration_s", "bound_s", "bound_compute_s", "bound_traffic_s", "bound_reduction_s", "bound_route_s",
          "bound_term", "achieved_over_bound")
CALM = ["churn.crash_rate_per_hour=0.0", "churn.join_rate_per_hour=0.0", "faults=[]", "sim.compute_jitter=0.0"]

Node = tuple[str, int, str, float]  # id, stage, region, compute_s


def _instance(nodes: list[Node], latency_s: dict[tuple[str, str], float], bw: dict[tuple[str, str], float],
              act: int, grad: int, microbatches: int, grad_bytes: tuple[int, ...]) -> tuple[Instance, TrainParams]:
    regions = tuple(sorted({r for pair in latency_s for r in pair}))
    stages = 1 + max(n[1] for n in nodes)
    net = Network("hand", regions, tuple(tuple(latency_s[(a, b)] for b in regions) for a in regions),
                  tuple(tuple(bw[(a, b)] for b in regions) for a in regions))
    specs = tuple(NodeSpec(id=i, stage=k, region=r, profile="hand", compute_s=c, capacity=4,
                           demand=microbatches if k == 0 else 0) for i, k, r, c in nodes)
    train = TrainParams(stages=stages, microbatches=microbatches, iterations=1, activation_bytes=act,
                        stage_flops=(1.0,) * stages, stage_state_bytes=(0,) * stages, stage_grad_bytes=grad_bytes,
                        activation_grad_bytes=grad)
    return Instance(specs, stages, net, (act + grad) // 2), train


def _pair(latency_s: float, bw: float, downlink: float = 0.0) -> IterationBound:
    """1 data holder (c 0.1) + 1 relay (c 0.5), one region, M = 3, activation 1e5 B, gradient 2e5 B."""
    inst, train = _instance([("d", 0, "a", 0.1), ("r", 1, "a", 0.5)], {("a", "a"): latency_s}, {("a", "a"): bw},
                            act=100_000, grad=200_000, microbatches=3, grad_bytes=(10**9, 10**9))
    return iteration_bound(inst, train, downlink)


def test_unit_jobs_on_machines_of_different_speeds() -> None:
    assert min_makespan_s([1.0, 2.0], 3) == 2.0  # finishes 1, 2 | 2
    assert min_makespan_s([1.0, 2.0], 4) == 3.0  # 1, 2, 3 | 2
    assert min_makespan_s([0.5], 5) == 2.5
    assert min_makespan_s([1.0], 0) == 0.0
    assert math.isinf(min_makespan_s([], 1))


def test_one_holder_one_relay_compute_binds() -> None:
    b = _pair(latency_s=0.01, bw=1e6)
    assert b.compute_s == pytest.approx(1.5)  # the relay runs all 3 microbatches at 0.5 s
    assert b.traffic_s == pytest.approx(0.9)  # 3 x (activation 0.1 s + gradient 0.2 s) on one uplink
    assert b.reduction_s == 0.0  # one replica per stage: nothing to reduce
    assert b.route_s == pytest.approx(0.1 + 0.5 + 2 * (0.02 + 0.1 + 0.2))  # compute + two hops, both ways
    assert (b.term, b.bound_s) == ("compute", pytest.approx(1.5))


def test_a_data_holder_computes_all_its_microbatches_itself() -> None:
    # two holders of M = 3: the slow one (c 1.0) cannot hand its data to the fast one; relays are quick
    lat, bw = {("a", "a"): 0.001}, {("a", "a"): 1e9}
    nodes = [("d1", 0, "a", 1.0), ("d2", 0, "a", 0.1), ("r1", 1, "a", 0.1), ("r2", 1, "a", 0.1)]
    inst, train = _instance(nodes, lat, bw, act=1000, grad=1000, microbatches=3, grad_bytes=(1, 1))
    b = iteration_bound(inst, train)
    assert (b.term, b.compute_s) == ("compute", pytest.approx(3 * 1.0))  # relays: 6 jobs on 2 at 0.1 s = 0.3


def test_a_slow_link_makes_traffic_bind() -> None:
    b = _pair(latency_s=0.01, bw=1e5)
    assert b.traffic_s == pytest.approx(3 * (1.0 + 2.0))
    assert b.route_s == pytest.approx(0.6 + 2 * (0.02 + 1.0 + 2.0))
    assert (b.term, b.bound_s) == ("traffic", pytest.approx(9.0))


def test_a_downlink_counts_as_traffic() -> None:
    b = _pair(latency_s=0.01, bw=1e6, downlink=1e5)  # 3e5 bytes in per microbatch at 1e5 B/s
    assert (b.term, b.traffic_s) == ("traffic", pytest.approx(9.0))


def test_long_latency_makes_the_route_bind() -> None:
    b = _pair(latency_s=1.0, bw=1e6)
    assert (b.term, b.route_s) == ("route", pytest.approx(0.6 + 2 * (2.0 + 0.3)))


def test_reduction_uses_each_replicas_fastest_peer() -> None:
    # regions a, b; a->a 4e6, a->b 1e6, b->a 2e6 B/s; tensors tiny, compute tiny: the reduction binds
    lat = {(x, y): 0.001 for x in "ab" for y in "ab"}
    bw = {("a", "a"): 4e6, ("a", "b"): 1e6, ("b", "a"): 2e6, ("b", "b"): 1e6}
    nodes = [("d1", 0, "a", 0.01), ("d2", 0, "b", 0.01), ("r1", 1, "a", 0.01), ("r2", 1, "a", 0.01), ("r3", 1, "b", 0.01)]
    inst, train = _instance(nodes, lat, bw, act=1000, grad=1000, microbatches=1, grad_bytes=(3_000_000, 15_000_000))
    b = iteration_bound(inst, train)
    # stage 0: both holders contribute, 2 (R-1) G0 = 6e6 B over uplinks of 1e6 (d1 -> b) + 2e6 (d2 -> a)
    # stage 1: the mean must reach 2 of 3 replicas, (R-1) G1 = 3e7 B over 4e6 + 4e6 (a -> a) + 2e6 (b -> a)
    assert b.reduction_s == pytest.approx(max(6e6 / 3e6, 3e7 / 1e7))
    assert (b.term, b.bound_s) == ("reduction", pytest.approx(3.0))


def test_route_is_the_slowest_holders_cheapest_cycle() -> None:
    # stage 1: f fast but in far region b, s slow next door (a); stage 2: t in a. Links free of transfer time.
    lat = {("a", "a"): 0.01, ("b", "b"): 0.01, ("a", "b"): 0.5, ("b", "a"): 0.5}
    bw = dict.fromkeys(lat, 1e15)
    nodes = [("d1", 0, "a", 0.05), ("d2", 0, "b", 0.07), ("f", 1, "b", 0.1), ("s", 1, "a", 1.0), ("t", 2, "a", 0.2)]
    inst, train = _instance(nodes, lat, bw, act=1, grad=1, microbatches=1, grad_bytes=(1, 1, 1))
    d1 = 0.05 + min(1.0 + 0.2 + 3 * 0.02, 0.1 + 0.2 + 1.0 + 1.0 + 0.02)  # via s: 1.26; via f: 2.32
    d2 = 0.07 + min(0.1 + 0.2 + 0.02 + 1.0 + 1.0, 1.0 + 0.2 + 1.0 + 0.02 + 1.0)  # via f: 2.32; via s: 3.22
    assert iteration_bound(inst, train).route_s == pytest.approx(max(d1, d2))


def test_fields_from_known_seconds() -> None:
    b = IterationBound(compute_s=1.0, traffic_s=4.0, reduction_s=2.0, route_s=3.0)
    f = iteration_fields(100.0, 10, b)
    assert f == {"iteration_s": 10.0, "bound_s": 4.0, "bound_compute_s": 1.0, "bound_traffic_s": 4.0,
                 "bound_reduction_s": 2.0, "bound_route_s": 3.0, "bound_term": "traffic", "achieved_over_bound": 2.5}
    none = iteration_fields(100.0, 0, b)
    assert none["iteration_s"] is None and none["achieved_over_bound"] is None and none["bound_s"] == 4.0


@pytest.mark.parametrize("extra", [[], ["nodes.gpu_flops_scale=0.0001", "train.microbatches=20", "train.iterations=3"]],
                         ids=["smoke", "compute-bound"])
@pytest.mark.parametrize("system", ["gwtf", "swarm"])
def test_no_run_beats_its_bound(system: str, extra: list[str]) -> None:
    """No churn, no jitter: the bound must hold exactly. GPUs 10^4 x slower make compute bind;
    there its makespan lies between the fluid bound D M / sum(1/c) and that + the slowest c."""
    sc = load_scenario(SMOKE, CALM + extra)
    s, _ = run_scenario(sc, 1, system)
    assert s["invariant_violations"] == 0 and s["iterations"] == sc.train.iterations
    assert s["iteration_s"] == pytest.approx(s["training_time_s"] / s["iterations"])
    assert s["iteration_s"] >= s["bound_s"] > 0
    terms = {t: s[f"bound_{t}_s"] for t in ("compute", "traffic", "reduction", "route")}
    assert s["bound_s"] == max(terms.values()) and terms[s["bound_term"]] == s["bound_s"]
    assert s["achieved_over_bound"] == round(s["iteration_s"] / s["bound_s"], 4) >= 1
    if extra:
        inst, train = build(sc, 1)
        jobs = len(inst.by_stage[0]) * train.microbatches
        fluid = [jobs / sum(1 / inst.by_id[n].compute_s for n in ids) for ids in inst.by_stage[1:]]
        slowest = max(n.compute_s for n in inst.nodes)
        assert s["bound_term"] == "compute"
        assert max(fluid) <= s["bound_compute_s"] <= max(fluid) + slowest


def test_summary_and_table_carry_the_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["simulate", str(SMOKE), "--seed", "2", "--out", str(out), "--no-progress",
                 "--set", "train.iterations=2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"gwtf", "swarm"}
    for s in summary.values():
        assert all(k in s for k in FIELDS), sorted(s)
        assert s["bound_term"] in ("compute", "traffic", "reduction", "route")
    # one instance, one bound: both systems carry the same numbers
    assert {k: summary["gwtf"][k] for k in FIELDS[1:7]} == {k: summary["swarm"][k] for k in FIELDS[1:7]}
    text = capsys.readouterr().out
    for label in ("time per iteration [s]", "iteration bound [s] (term)", "achieved / bound [x]"):
        assert label in text, text
    assert f"({summary['gwtf']['bound_term']})" in text.split("iteration bound")[1].splitlines()[0]
