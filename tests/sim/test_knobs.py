"""Scenario knobs: GPU FLOP/s scale, link bandwidth scale, GPU mix, per-node downlink.

Each knob changes what it should in a small scenario, its defaults change nothing, and a bad
value is a UserError naming the key.
"""

from __future__ import annotations

import tomllib

import pytest

from gwtf.config import dump_toml, from_dict
from gwtf.errors import UserError
from gwtf.flow.generate import generate_instance
from gwtf.flow.network import Network
from gwtf.flow.profiles import DEFAULT_MIX
from gwtf.sim.models import NetworkModel
from gwtf.sim.scenario import ScenarioConfig, build, load_scenario
from gwtf.sim.simulator import run_scenario

# 124m stages on uniform A100s, no jitter: 20 ms of compute per microbatch and stage, so the
# iteration is bound by the network unless a knob says otherwise.
BASE = ["model.stages=3", "nodes.count=8", "nodes.data_holders=2", "nodes.relay_capacity=[1, 2]",
        "train.iterations=3", "train.microbatches=2", 'nodes.gpu_mix="uniform"', "sim.compute_jitter=0.0",
        # network-bound needs full-size (fp32) messages; the downlink test's fan-in is the gather reducer's
        'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
        'protocol.reduce="gather"']
COMPUTE_BOUND = ["nodes.link_bandwidth_scale=1000", "nodes.gpu_flops_scale=0.01"]  # ~2 s per microbatch-stage
NETWORK_BOUND = ["nodes.gpu_flops_scale=1000"]


def _time(*extra: str) -> float:
    s, _ = run_scenario(load_scenario(None, [*BASE, *extra]), 1)
    assert s["finished"] and s["invariant_violations"] == 0, s["violations"]
    return float(s["training_time_s"])


def test_default_knobs_build_the_instance_the_generator_builds_without_them() -> None:
    # the generator prices fp32 activations: the scenario's wire formats must say the same
    fp32 = ['wire.activations="fp32"', 'wire.gradients="fp32"']
    sc = load_scenario(None, ["nodes.count=12", "nodes.data_holders=3", *fp32])
    explicit = load_scenario(None, ["nodes.count=12", "nodes.data_holders=3", 'nodes.gpu_mix="default"',
                                    "nodes.gpu_flops_scale=1.0", "nodes.link_bandwidth_scale=1.0",
                                    "nodes.downlink_bytes_per_s=0", *fp32])
    plain = generate_instance(12, sc.model.stages, 3, seed=5, demand_per_dh=sc.train.microbatches)
    assert build(sc, 5)[0] == plain == build(explicit, 5)[0]
    assert sc.nodes.profile_mix() == DEFAULT_MIX


def test_gpu_flops_scale_divides_compute_and_halves_a_compute_bound_run() -> None:
    a = build(load_scenario(None, BASE), 3)[0]
    b = build(load_scenario(None, [*BASE, "nodes.gpu_flops_scale=2"]), 3)[0]
    assert [n.compute_s / 2 for n in a.nodes] == [n.compute_s for n in b.nodes]
    assert a.network == b.network
    slow, fast = _time(*COMPUTE_BOUND), _time(*COMPUTE_BOUND[:1], "nodes.gpu_flops_scale=0.02")
    assert 0.45 < fast / slow < 0.62, (slow, fast)  # the rest is latency


def test_link_bandwidth_scale_multiplies_every_link_and_speeds_a_network_bound_run() -> None:
    a = build(load_scenario(None, BASE), 3)[0]
    b = build(load_scenario(None, [*BASE, "nodes.link_bandwidth_scale=2"]), 3)[0]
    assert [[2 * x for x in row] for row in a.network.bandwidth_matrix_bytes_per_s] == \
        [list(row) for row in b.network.bandwidth_matrix_bytes_per_s]
    assert a.network.latency_matrix_s == b.network.latency_matrix_s and a.nodes == b.nodes
    slow, fast = _time(*NETWORK_BOUND), _time(*NETWORK_BOUND, "nodes.link_bandwidth_scale=2")
    assert 0.45 < fast / slow < 0.65, (slow, fast)
    # in the compute-bound regime bandwidth hardly matters
    assert _time(*COMPUTE_BOUND) / _time(*COMPUTE_BOUND, "nodes.link_bandwidth_scale=2000") < 1.1


@pytest.mark.parametrize(("mix", "allowed"), [('"uniform"', {"a100"}), ('"half-slow"', {"a100", "t4"}),
                                              ('[["t4", 1], ["v100", 0]]', {"t4"}),
                                              ('[["rtx3090", 0.5], ["t4", 0.5]]', {"rtx3090", "t4"})])
def test_gpu_mix_draws_only_its_profiles(mix: str, allowed: set[str]) -> None:
    inst = build(load_scenario(None, ["nodes.count=40", "nodes.data_holders=4", f"nodes.gpu_mix={mix}"]), 2)[0]
    assert {n.profile for n in inst.nodes} == allowed


def test_a_slow_gpu_mix_slows_a_compute_bound_run() -> None:
    # T4s have 1/6.4 of an A100's effective FLOP/s (flow.profiles)
    assert 5.0 < _time(*COMPUTE_BOUND, 'nodes.gpu_mix=[["t4", 1]]') / _time(*COMPUTE_BOUND) < 6.6


def test_an_explicit_mix_survives_the_resolved_toml() -> None:
    sc = load_scenario(None, ['nodes.gpu_mix=[["a100", 2], ["t4", 1]]'])
    assert sc.nodes.gpu_mix == (("a100", 2), ("t4", 1)) and hash(sc.nodes)
    again = from_dict(ScenarioConfig, tomllib.loads(dump_toml(sc)))
    assert again.nodes.profile_mix() == sc.nodes.profile_mix() == (("a100", 2.0), ("t4", 1.0))


def _one_region(bw: float) -> Network:
    return Network(name="one", regions=("r",), latency_matrix_s=((0.01,),), bandwidth_matrix_bytes_per_s=((bw,),))


def test_downlink_serialises_a_fan_in_after_the_uplinks() -> None:
    bw, size, ctrl = 1e6, 999_900, 100  # 1 s per message on any link
    for downlink, expected in ((0.0, [1.01] * 4), (1e6, [1.01, 2.01, 3.01, 4.01]), (4e6, [1.01] * 4)):
        net = NetworkModel(_one_region(bw), ctrl, downlink)
        for n in ("a", "b", "c", "d", "r"):
            net.add_node(n, "r")
        arrivals = [net.send(src, "r", size, 0.0) for src in ("a", "b", "c", "d")]
        assert [d for d, _ in arrivals] == [1.0] * 4  # the uplinks are untouched
        assert [round(t, 9) for _, t in arrivals] == expected, downlink
    net = NetworkModel(_one_region(bw), ctrl, 1e6)
    for n in ("a", "b", "r"):
        net.add_node(n, "r")
    net.send("a", "r", size, 0.0)
    assert net.send("b", "r", 0, 0.0) == (0.0001, 0.0101)  # control messages skip the downlink queue
    assert round(net.send("b", "r", size, 5.0)[1], 9) == 6.01  # an idle downlink adds nothing


def test_a_narrow_downlink_slows_the_gradient_fan_in() -> None:
    assert _time(*NETWORK_BOUND, "nodes.downlink_bytes_per_s=5e7") > 1.15 * _time(*NETWORK_BOUND)


@pytest.mark.parametrize(("override", "key"), [
    ("nodes.gpu_flops_scale=0", "nodes.gpu_flops_scale"), ("nodes.gpu_flops_scale=-1", "nodes.gpu_flops_scale"),
    ("nodes.gpu_flops_scale=inf", "nodes.gpu_flops_scale"), ("nodes.link_bandwidth_scale=0", "nodes.link_bandwidth_scale"),
    ("nodes.link_bandwidth_scale=nan", "nodes.link_bandwidth_scale"),
    ("nodes.downlink_bytes_per_s=-5", "nodes.downlink_bytes_per_s"),
    ('nodes.gpu_mix="fast"', "nodes.gpu_mix"), ('nodes.gpu_mix=[["h100", 1]]', "nodes.gpu_mix[0]"),
    ('nodes.gpu_mix=[["a100", -1]]', "nodes.gpu_mix[0]"), ('nodes.gpu_mix=[["a100"]]', "nodes.gpu_mix[0]"),
    ('nodes.gpu_mix=[["a100", 0]]', "nodes.gpu_mix"), ("nodes.gpu_mix=[]", "nodes.gpu_mix"),
    ("nodes.gpu_mix=3", "nodes.gpu_mix"),
])
def test_bad_knob_values_name_their_key(override: str, key: str) -> None:
    with pytest.raises(UserError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_scenario(None, [override])
