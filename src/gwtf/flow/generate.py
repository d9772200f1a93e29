"""Seeded routing-instance generator: heterogeneous nodes in world regions, cut into stages.

Owns: `generate_instance`, the one way benchmarks, the simulator and tests make an `Instance`.
Node ids are "n0".."n{N-1}"; data holders come first (stage 0), then relays, spread over stages
1..S-1 (round-robin so each stage has at least one, then a random stage for each extra relay).
Regions are uniform over the network's regions, profiles come from `flow.profiles` (seeded mix),
c_i = the stage's fwd+bwd FLOPs per microbatch / the profile's effective FLOP/s, capacity from the
memory model (or drawn uniformly from `relay_capacity` when given, as the authors' prototype does).
Scenario knobs: `flops_scale` multiplies every node's FLOP/s (c_i / scale), `bandwidth_scale` every
link's bandwidth (after the jitter); at 1.0 neither touches a number.

Default data-holder demand: the total is 1.2x the smallest relay stage's capacity, split evenly,
so demand is not trivially the bottleneck. Only `random.Random(seed)` is used: same arguments,
identical Instance.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from gwtf.config import ModelConfig
from gwtf.errors import UserError
from gwtf.flow.instance import Instance, NodeSpec
from gwtf.flow.network import Network, load_network, perturb_network
from gwtf.flow.profiles import (
    DEFAULT_CAP_MAX,
    DEFAULT_MIX,
    capacity_microbatches,
    compute_seconds,
    draw_profile,
)
from gwtf.model.presets import ModelSpec, model_spec

DEMAND_FACTOR = 1.2
DH_CAP_MAX = 1000  # data holders: memory bound only, in practice (the prototype uses up to 6000)


def _check_shape(n_nodes: int, stages: int, data_holders: int) -> None:
    if stages < 2:
        raise UserError(f"stages must be >= 2 (stage 0 plus a relay stage), got {stages}")
    if data_holders < 1:
        raise UserError(f"data_holders must be >= 1, got {data_holders}")
    if n_nodes < data_holders + stages - 1:
        raise UserError(
            f"n_nodes={n_nodes} leaves a stage with no node: need >= data_holders + stages - 1 "
            f"= {data_holders + stages - 1}"
        )


def _relay_stages(n_relays: int, stages: int, rng: random.Random) -> list[int]:
    """Round-robin over 1..S-1 for the first S-1 relays, then a uniform random stage each."""
    out = [1 + k for k in range(min(n_relays, stages - 1))]
    out += [rng.randrange(1, stages) for _ in range(n_relays - len(out))]
    return out


def generate_instance(
    n_nodes: int,
    stages: int,
    data_holders: int,
    network: str | Network = "geo10",
    seed: int = 0,
    model: str = "gpt",
    preset: str = "124m",
    microbatch_size: int = 8,
    seq_len: int = 1024,
    vocab_size: int = 2048,
    demand_per_dh: int | None = None,
    cap_max: int = DEFAULT_CAP_MAX,
    dh_cap_max: int = DH_CAP_MAX,
    relay_capacity: tuple[int, int] | None = None,
    mix: Sequence[tuple[str, float]] = DEFAULT_MIX,
    jitter_fraction: float = 0.0,
    flops_scale: float = 1.0,
    bandwidth_scale: float = 1.0,
) -> Instance:
    """A seeded heterogeneous instance; see the module docstring for every rule.

    Args:
        cap_max: relay capacity clamp (memory model); dh_cap_max: the same for data holders.
        relay_capacity: (lo, hi) to draw relay capacities uniformly instead of the memory model.
        jitter_fraction: per-link multiplicative noise on the network (0 = the table as is).
        flops_scale: multiplies every node's effective FLOP/s; bandwidth_scale: every link's bandwidth.

    Raises:
        UserError: S < 2, no data holder, a stage with no node, unknown network/model/preset,
            a bad capacity range, or a scale that is not a finite number > 0.
    """
    _check_shape(n_nodes, stages, data_holders)
    for name, scale in (("flops_scale", flops_scale), ("bandwidth_scale", bandwidth_scale)):
        if not (math.isfinite(scale) and scale > 0):
            raise UserError(f"{name} must be a finite number > 0, got {scale}")
    if min(cap_max, dh_cap_max) < 1:
        raise UserError(f"cap_max and dh_cap_max must be >= 1, got {cap_max} and {dh_cap_max}")
    if relay_capacity is not None and not 1 <= relay_capacity[0] <= relay_capacity[1]:
        raise UserError(f"relay_capacity must be (lo, hi) with 1 <= lo <= hi, got {relay_capacity}")
    rng = random.Random(seed)
    net = load_network(network) if isinstance(network, str) else network
    if jitter_fraction > 0.0:
        net = perturb_network(net, rng, jitter_fraction)
    if bandwidth_scale != 1.0:
        net = _scale_bandwidth(net, bandwidth_scale)
    cfg = ModelConfig(family=model, preset=preset, seq_len=seq_len,  # type: ignore[arg-type]
                      microbatch_size=microbatch_size, stages=stages)
    spec = model_spec(cfg, vocab_size)
    node_stages = [0] * data_holders + _relay_stages(n_nodes - data_holders, stages, rng)
    nodes = [
        _make_node(f"n{k}", stage, net, spec, stages, microbatch_size,
                   dh_cap_max if stage == 0 else cap_max, relay_capacity, mix, rng)
        for k, stage in enumerate(node_stages)
    ]
    if flops_scale != 1.0:
        nodes = [replace(n, compute_s=n.compute_s / flops_scale) for n in nodes]
    demand = demand_per_dh if demand_per_dh is not None else _default_demand(nodes, stages, data_holders)
    if demand < 1:
        raise UserError(f"demand_per_dh must be >= 1, got {demand}")
    nodes = [_with_demand(n, demand) if n.stage == 0 else n for n in nodes]
    return Instance(nodes=tuple(nodes), stages=stages, network=net,
                    activation_bytes=spec.activation_bytes(microbatch_size))


def _make_node(
    nid: str,
    stage: int,
    net: Network,
    spec: ModelSpec,
    stages: int,
    microbatch_size: int,
    cap_max: int,
    relay_capacity: tuple[int, int] | None,
    mix: Sequence[tuple[str, float]],
    rng: random.Random,
) -> NodeSpec:
    region = rng.choice(net.regions)
    profile = draw_profile(rng, mix)
    if relay_capacity is not None and stage > 0:
        capacity = rng.randint(*relay_capacity)
    else:
        capacity = capacity_microbatches(profile, spec, stage, stages, microbatch_size, cap_max)
    return NodeSpec(
        id=nid, stage=stage, region=region, profile=profile.name,
        compute_s=compute_seconds(profile, spec, stage, stages, microbatch_size), capacity=capacity,
    )


def _scale_bandwidth(net: Network, scale: float) -> Network:
    """Every link's bandwidth (same-region ones too) times `scale`."""
    return replace(net, bandwidth_matrix_bytes_per_s=tuple(tuple(x * scale for x in row)
                                                           for row in net.bandwidth_matrix_bytes_per_s),
                   source=f"{net.source} (bandwidth x {scale})")


def _default_demand(nodes: Sequence[NodeSpec], stages: int, data_holders: int) -> int:
    per_stage = [0] * stages
    for n in nodes:
        per_stage[n.stage] += n.capacity
    smallest = min(per_stage[1:])
    return max(1, math.ceil(DEMAND_FACTOR * smallest / data_holders))


def _with_demand(node: NodeSpec, demand: int) -> NodeSpec:
    return NodeSpec(id=node.id, stage=node.stage, region=node.region, profile=node.profile,
                    compute_s=node.compute_s, capacity=node.capacity, demand=demand)
