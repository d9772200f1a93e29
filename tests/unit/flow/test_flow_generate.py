"""Instance generator: shape rules, determinism, validation errors, cost inputs."""

from __future__ import annotations

import pytest

from gwtf.errors import UserError
from gwtf.flow.generate import generate_instance
from gwtf.flow.profiles import PROFILES, capacity_microbatches


def test_ids_stages_and_every_stage_served() -> None:
    inst = generate_instance(30, 5, 4, seed=2)
    assert [n.id for n in inst.nodes] == [f"n{k}" for k in range(30)]
    assert all(n.stage == 0 for n in inst.nodes[:4])
    assert all(n.stage >= 1 for n in inst.nodes[4:])
    assert [n.stage for n in inst.nodes[4:8]] == [1, 2, 3, 4]  # round-robin first
    assert all(len(s) >= 1 for s in inst.by_stage)
    regions = set(inst.network.regions)
    assert all(n.region in regions and n.compute_s > 0 and n.capacity >= 1 for n in inst.nodes)


def test_same_seed_same_instance_other_seed_differs() -> None:
    assert generate_instance(40, 4, 3, seed=7) == generate_instance(40, 4, 3, seed=7)
    assert generate_instance(40, 4, 3, seed=7) != generate_instance(40, 4, 3, seed=8)


def test_default_demand_is_above_the_smallest_relay_stage() -> None:
    inst = generate_instance(50, 4, 5, seed=1)
    smallest = min(sum(inst.by_id[n].capacity for n in s) for s in inst.by_stage[1:])
    demand = sum(inst.by_id[n].demand for n in inst.by_stage[0])
    assert demand >= 1.2 * smallest
    assert generate_instance(50, 4, 5, seed=1, demand_per_dh=3).nodes[0].demand == 3


def test_faster_profiles_compute_faster_and_cap_max_clamps() -> None:
    inst = generate_instance(80, 3, 2, seed=3, cap_max=4)
    by_profile = {n.profile: n.compute_s for n in inst.nodes if n.stage == 1}
    if "a100" in by_profile and "t4" in by_profile:
        assert by_profile["a100"] < by_profile["t4"]
    assert all(1 <= n.capacity <= 4 for n in inst.nodes if n.stage > 0)


def test_relay_capacity_range_is_respected() -> None:
    inst = generate_instance(40, 4, 2, seed=4, relay_capacity=(2, 5))
    assert all(2 <= n.capacity <= 5 for n in inst.nodes if n.stage > 0)


def test_memory_model_gives_bigger_cards_more_capacity() -> None:
    from gwtf.config import ModelConfig
    from gwtf.model.presets import model_spec

    spec = model_spec(ModelConfig(preset="124m", seq_len=1024, stages=4), 2048)
    a100 = capacity_microbatches(PROFILES["a100"], spec, 1, 4, 8, cap_max=1000)
    t4 = capacity_microbatches(PROFILES["t4"], spec, 1, 4, 8, cap_max=1000)
    assert a100 > t4 >= 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_nodes": 5, "stages": 1, "data_holders": 1}, "stages must be >= 2"),
        ({"n_nodes": 5, "stages": 3, "data_holders": 0}, "data_holders must be >= 1"),
        ({"n_nodes": 4, "stages": 4, "data_holders": 2}, "leaves a stage with no node"),
        ({"n_nodes": 9, "stages": 3, "data_holders": 2, "network": "mars"}, "unknown network 'mars'"),
        ({"n_nodes": 9, "stages": 3, "data_holders": 2, "preset": "huge"}, "preset"),
        ({"n_nodes": 9, "stages": 3, "data_holders": 2, "demand_per_dh": 0}, "demand_per_dh"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UserError, match=match):
        generate_instance(**kwargs)  # type: ignore[arg-type]
