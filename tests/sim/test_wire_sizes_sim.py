"""Simulated message sizes follow the scenario's [wire] formats (gwtf.model.wire.wire_bytes)."""

from __future__ import annotations

import pytest

from gwtf.model.wire import wire_bytes
from gwtf.sim.scenario import build, load_scenario

NUMEL = 8 * 128 * 128  # tiny preset: microbatch 8 x seq_len 128 x d_model 128


@pytest.mark.parametrize(("act", "grad"), [("fp32", "fp32"), ("bf16", "bf16"), ("int8", "bf16"), ("fp16", "int8")])
def test_scenario_wire_sets_forward_and_backward_bytes(act: str, grad: str) -> None:
    sc = load_scenario(None, ['model.preset="tiny"', "model.seq_len=128", f'wire.activations="{act}"',
                              f'wire.gradients="{grad}"', "wire.block_values=1000"])
    inst, train = build(sc, 0)
    assert train.activation_bytes == wire_bytes(NUMEL, act, 1000)
    assert train.activation_grad_bytes == wire_bytes(NUMEL, grad, 1000)
    assert inst.activation_bytes == train.route_bytes == (train.activation_bytes + train.activation_grad_bytes) // 2
    # the same block size: the default stage gradients (int8) are sized by it
    assert train.stage_grad_bytes == build(load_scenario(None, ['model.preset="tiny"', "model.seq_len=128",
                                                                "wire.block_values=1000"]), 0)[
        1].stage_grad_bytes  # stage gradients follow wire.stage_gradients, not these


def test_default_is_int8_and_butterfly() -> None:
    base = ['model.preset="tiny"', "model.seq_len=128"]
    sc = load_scenario(None, base)
    assert (sc.wire.activations, sc.wire.gradients, sc.wire.stage_gradients) == ("int8", "int8", "int8")
    assert sc.protocol.reduce == "butterfly"
    _, train = build(sc, 0)
    block = sc.wire.block_values
    assert train.activation_bytes == train.activation_grad_bytes == wire_bytes(NUMEL, "int8", block)
    fp32 = build(load_scenario(None, [*base, 'wire.stage_gradients="fp32"']), 0)[1].stage_grad_bytes  # 4n each
    assert train.stage_grad_bytes == tuple(wire_bytes(b // 4, "int8", block) for b in fp32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8"])
def test_stage_gradient_format_sets_the_reduction_bytes(fmt: str) -> None:
    """`wire.stage_gradients`: a stage gradient of n parameters costs wire_bytes(n, fmt) in the
    reduction (the fp32 run's bytes are 4n)."""
    base = ['model.preset="tiny"', "model.seq_len=128"]
    fp32 = build(load_scenario(None, [*base, 'wire.stage_gradients="fp32"']), 0)[1].stage_grad_bytes  # 4n bytes
    got = build(load_scenario(None, [*base, f'wire.stage_gradients="{fmt}"', "wire.block_values=1000"]), 0)[1]
    assert got.stage_grad_bytes == tuple(wire_bytes(b // 4, fmt, 1000) for b in fp32)
    assert all(g < f for g, f in zip(got.stage_grad_bytes, fp32, strict=True))
