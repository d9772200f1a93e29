"""`model.trainer.StageGradRounding`: the local trainer's emulation of `wire.stage_gradients`."""

from __future__ import annotations

import torch

from gwtf.model.trainer import StageGradRounding


def test_rounds_in_shape_and_carries_the_residual() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, 16, generator=g), torch.randn(5, generator=g) * 1e-3]
    r = StageGradRounding("int8", 64, feedback=True)
    q = r.round(1, 0, grads)
    assert [t.shape for t in q] == [t.shape for t in grads]
    flat = torch.cat([t.reshape(-1) for t in grads])
    qflat = torch.cat([t.reshape(-1) for t in q])
    assert not torch.equal(flat, qflat)  # int8 rounds
    assert torch.equal(r.residuals[(1, 0)], flat - qflat)
    # a zero gradient next: what is sent is the residual, rounded; without feedback nothing
    zeros = [torch.zeros_like(t) for t in grads]
    sent = torch.cat([t.reshape(-1) for t in r.round(1, 0, zeros)])
    assert float((sent - (flat - qflat)).abs().max()) <= float((flat - qflat).abs().max())
    assert float(sent.abs().max()) > 0
    plain = StageGradRounding("int8", 64, feedback=False)
    plain.round(1, 0, grads)
    assert float(torch.cat([t.reshape(-1) for t in plain.round(1, 0, zeros)]).abs().max()) == 0.0
    assert plain.residuals == {}
