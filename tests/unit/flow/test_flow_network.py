"""Shipped network tables: exact transcription spot checks, unit conversion, errors, jitter."""

from __future__ import annotations

import random

import pytest

from gwtf.errors import UserError
from gwtf.flow.network import (
    SAME_REGION_BANDWIDTH_BYTES_PER_S,
    SAME_REGION_LATENCY_S,
    load_network,
    perturb_network,
)


def test_geo10_matches_the_dtfm_table() -> None:
    net = load_network("geo10")
    assert len(net.regions) == 10
    assert net.latency_s("Oregon", "Virginia") == pytest.approx(0.067)
    assert net.bandwidth_bytes_per_s("Oregon", "Virginia") == pytest.approx(0.79e9 / 8)
    assert net.latency_s("Sydney", "Frankfurt") == pytest.approx(0.265)
    assert net.bandwidth_bytes_per_s("Ireland", "Seoul") == pytest.approx(0.335e9 / 8)
    assert net.latency_s("Tokyo", "Tokyo") == SAME_REGION_LATENCY_S
    assert net.bandwidth_bytes_per_s("Tokyo", "Tokyo") == SAME_REGION_BANDWIDTH_BYTES_PER_S


@pytest.mark.parametrize("name", ["geo10", "geo12"])
def test_tables_are_symmetric_and_positive(name: str) -> None:
    net = load_network(name)
    n = len(net.regions)
    for a in range(n):
        for b in range(n):
            assert net.latency_matrix_s[a][b] == net.latency_matrix_s[b][a] > 0
            assert net.bandwidth_matrix_bytes_per_s[a][b] == net.bandwidth_matrix_bytes_per_s[b][a] > 0


def test_geo12_units_are_gib_per_s_and_nl_london_uses_checkfree() -> None:
    net = load_network("geo12")
    assert len(net.regions) == 12
    assert net.latency_s("Germany", "Australia") == pytest.approx(0.1255)
    assert net.bandwidth_bytes_per_s("Belgium", "Germany") == pytest.approx(0.2425 * 1024**3)
    assert net.bandwidth_bytes_per_s("London", "NL") == pytest.approx(0.0237 * 1024**3)


def test_unknown_network_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"unknown network 'x' \(known: geo10, geo12\)"):
        load_network("x")


def test_perturb_is_seeded_and_bounded() -> None:
    net = load_network("geo10")
    a = perturb_network(net, random.Random(5), 0.2)
    b = perturb_network(net, random.Random(5), 0.2)
    c = perturb_network(net, random.Random(6), 0.2)
    assert a == b and a != c
    for row, base in zip(a.latency_matrix_s, net.latency_matrix_s):
        for x, y in zip(row, base):
            assert 0.8 * y <= x <= 1.2 * y
    assert perturb_network(net, random.Random(1), 0.0).latency_matrix_s == net.latency_matrix_s
    with pytest.raises(UserError):
        perturb_network(net, random.Random(1), 1.5)
