"""Property tests for `gwtf.model.partition`: exact cover, contiguity, balance, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gwtf.model.partition import partition_layers, stage_of_layer


@st.composite
def layers_and_stages(draw: st.DrawFn) -> tuple[int, int]:
    n_layer = draw(st.integers(min_value=1, max_value=200))
    stages = draw(st.integers(min_value=2, max_value=n_layer + 1))
    return n_layer, stages


@given(layers_and_stages())
def test_partition_covers_each_layer_once_contiguous_and_balanced(case: tuple[int, int]) -> None:
    n_layer, stages = case
    ranges = partition_layers(n_layer, stages)
    assert len(ranges) == stages
    assert ranges[0] == range(0, 0)
    relays = ranges[1:]
    assert all(r.step == 1 and len(r) >= 1 for r in relays)
    flat = [layer for r in relays for layer in r]
    assert flat == list(range(n_layer))  # exactly once, in order => contiguous, no gaps
    for a, b in zip(relays, relays[1:]):
        assert a.stop == b.start
    sizes = [len(r) for r in relays]
    assert max(sizes) - min(sizes) <= 1


@given(layers_and_stages(), st.data())
def test_stage_of_layer_agrees_with_partition(case: tuple[int, int], data: st.DataObject) -> None:
    n_layer, stages = case
    layer = data.draw(st.integers(min_value=0, max_value=n_layer - 1))
    stage = stage_of_layer(layer, n_layer, stages)
    assert 1 <= stage < stages
    assert layer in partition_layers(n_layer, stages)[stage]


@given(st.integers(min_value=1, max_value=50), st.integers(min_value=1, max_value=60))
def test_too_many_stages_or_too_few_raise(n_layer: int, extra: int) -> None:
    with pytest.raises(ValueError):
        partition_layers(n_layer, n_layer + 1 + extra)
    with pytest.raises(ValueError):
        partition_layers(n_layer, 1)


@pytest.mark.parametrize(("n_layer", "stages"), [(0, 2), (4, 0), (4, -3)])
def test_degenerate_inputs_raise(n_layer: int, stages: int) -> None:
    with pytest.raises(ValueError):
        partition_layers(n_layer, stages)


def test_known_split() -> None:
    """Earlier relay stages take the extra block."""
    assert partition_layers(10, 4) == [range(0, 0), range(0, 4), range(4, 7), range(7, 10)]
    with pytest.raises(ValueError):
        stage_of_layer(10, 10, 4)
