"""`runtime.stagegrad.StageGradCodec`: stage gradients in a lossy format, with error feedback.

What must hold: what a contributor sends decodes to its parts (the wire arrays and the decoded
value agree); with error feedback the sum of what was applied over many iterations stays within
one rounding of the sum of the true gradients (the residual carries the rest), while without it
the error grows; a round that never steps leaves the residual alone; reset forgets it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gwtf.model import wire
from gwtf.runtime.stagegrad import StageGradCodec


def _grads(n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # a constant small bias on top of noise: the part int8 rounds away every time without feedback
    return [torch.randn(n, generator=g) + 0.003 for _ in range(steps)]


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8"])
def test_parts_decode_to_what_is_sent(fmt: str) -> None:
    codec = StageGradCodec(fmt, 64, feedback=True)
    flat = _grads(1000, 1)[0]
    coded = codec.export(flat, 3, 0, 1)
    assert len(coded) == 3
    assert sum(int(d.numel()) for d, _ in coded) == flat.numel()
    for dec, arrays in coded:
        assert wire.check(arrays, 64) == fmt
        assert np.array_equal(wire.decode(arrays, 64), dec.numpy())


def _applied_error(feedback: bool, steps: int = 40) -> float:
    codec = StageGradCodec("int8", 256, feedback=feedback)
    true_sum = torch.zeros(4096)
    applied = torch.zeros(4096)
    for it, g in enumerate(_grads(4096, steps)):
        (dec, _), = codec.export(g, 1, it, 1)
        mean, _ = codec.reduced(dec, 0, it, 1)
        codec.stepped(it, 1)
        true_sum += g
        applied += mean
    return float((applied - true_sum).abs().max())


def test_error_feedback_keeps_the_error_from_accumulating() -> None:
    with_fb, without = _applied_error(True), _applied_error(False)
    one_rounding = 4.5 / 127  # |g| <~ 4.5: one int8 step of the block's scale, twice (sent, then the mean)
    assert with_fb <= 2 * one_rounding, with_fb
    assert without > 3 * with_fb, (without, with_fb)


def test_an_abandoned_round_changes_no_residual() -> None:
    g = _grads(512, 2)
    a, b = StageGradCodec("int8", 64, True), StageGradCodec("int8", 64, True)
    a.export(g[0] * 5, 1, 0, 1)  # round 1 of iteration 0 is abandoned (a replica died) ...
    for codec in (a, b):
        codec.export(g[0], 1, 0, 2)  # ... round 2 steps
        codec.stepped(0, 2)
    assert torch.equal(a.export(g[1], 1, 1, 3)[0][0], b.export(g[1], 1, 1, 3)[0][0])


def test_reset_forgets_the_residual() -> None:
    g = _grads(512, 2)
    a, fresh = StageGradCodec("int8", 64, True), StageGradCodec("int8", 64, True)
    a.export(g[0], 1, 0, 1)
    a.stepped(0, 1)
    assert a.residual is not None and float(a.residual.abs().max()) > 0
    a.reset()
    assert torch.equal(a.export(g[1], 1, 1, 1)[0][0], fresh.export(g[1], 1, 1, 1)[0][0])


def test_fp32_is_not_lossy() -> None:
    assert not StageGradCodec("fp32", 4096, True).lossy
