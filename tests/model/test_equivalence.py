"""Issue acceptance: the staged model computes exactly what the monolithic model computes.

Each test runs a microbatch through the stage modules the way separate processes would: the
activation is detached and re-leafed (`h.detach().requires_grad_(True)`) at every stage
boundary, the loss is taken at stage 0's head, then each stage runs `out.backward(grad)` with
the gradient received from the next stage. Loss and every parameter gradient (matched by
monolithic name) must equal the monolithic model's.

Tolerances: float64 rtol=1e-10, atol=1e-12; float32 rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gwtf.model.presets import ModelSpec
from gwtf.model.stage import (
    FirstStage,
    assemble_model,
    build_stage,
    split_model,
    stage_forward_backward_reference,
)
from gwtf.model.transformer import Transformer, build_model

torch.set_num_threads(1)

TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
VOCAB, SEQ, BATCH = 97, 16, 3


def small_spec(family: str) -> ModelSpec:
    return ModelSpec(
        family=family, n_layer=4, d_model=32, n_head=4, n_kv_head=4 if family == "gpt" else 2,
        d_ff=64 if family == "gpt" else 96, vocab_size=VOCAB, seq_len=SEQ,
    )


def batch(seed: int, rows: int = BATCH) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def monolithic_grads(model: Transformer, tokens: Tensor, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    _, loss = model(tokens, targets)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters())), "every parameter must receive a gradient"
    return loss.detach(), grads


def staged_pass(stages: list[nn.Module], tokens: Tensor, targets: Tensor) -> Tensor:
    """Forward with detach/re-leaf at each boundary, loss at stage 0, backward stage by stage."""
    first = stages[0]
    assert isinstance(first, FirstStage)
    sent = [first.embed(tokens)]
    received: list[Tensor] = []
    for relay in stages[1:]:
        h = sent[-1].detach().requires_grad_(True)
        received.append(h)
        sent.append(relay(h))
    h_last = sent[-1].detach().requires_grad_(True)
    loss = first.head_loss(h_last, targets)
    loss.backward()
    grad = h_last.grad
    for out, inp in zip(reversed(sent[1:]), reversed(received)):
        assert grad is not None
        out.backward(grad)
        grad = inp.grad
    sent[0].backward(grad)
    return loss.detach()


def stage_grads(stages: list[nn.Module]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for mod in stages:
        for local, p in mod.named_parameters():
            assert p.grad is not None, local
            out[mod.global_param_name(local)] = p.grad  # type: ignore[operator]
    return out


def assert_grads_close(got: dict[str, Tensor], want: dict[str, Tensor], dtype: torch.dtype) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_staged_equals_monolithic(family: str, stages: int, dtype: torch.dtype) -> None:
    model = build_model(small_spec(family), seed=7).to(dtype)
    parts = split_model(model, stages)
    tokens, targets = batch(seed=stages)
    want_loss, want = monolithic_grads(model, tokens, targets)
    got_loss = staged_pass(parts, tokens, targets)
    torch.testing.assert_close(got_loss, want_loss, **TOL[dtype])
    assert_grads_close(stage_grads(parts), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_two_accumulated_microbatches_equal_concatenated_batch(family: str, dtype: torch.dtype) -> None:
    model = build_model(small_spec(family), seed=3).to(dtype)
    parts = split_model(model, 3)
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    want_loss, want = monolithic_grads(model, torch.cat([x1, x2]), torch.cat([y1, y2]))
    loss1 = stage_forward_backward_reference(parts, x1, y1, loss_scale=0.5)
    loss2 = stage_forward_backward_reference(parts, x2, y2, loss_scale=0.5)
    torch.testing.assert_close((loss1 + loss2) / 2, want_loss, **TOL[dtype])
    assert_grads_close(stage_grads(parts), want, dtype)


def test_skipping_a_stage_backward_is_detected() -> None:
    """Control: the comparison fails if one boundary gradient is not passed on."""
    model = build_model(small_spec("gpt"), seed=1).double()
    parts = split_model(model, 3)
    tokens, targets = batch(seed=0)
    _, want = monolithic_grads(model, tokens, targets)
    first = parts[0]
    assert isinstance(first, FirstStage)
    h = parts[2](parts[1](first.embed(tokens).detach().requires_grad_(True)))
    first.head_loss(h, targets).backward()  # the embedding never gets its gradient
    assert parts[0].embedding.tokens.weight.grad is None  # type: ignore[union-attr]
    assert want["embedding.tokens.weight"].abs().sum() > 0


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("stages", [2, 5])
def test_build_stage_is_bit_identical_to_split(family: str, stages: int) -> None:
    spec = small_spec(family)
    parts = split_model(build_model(spec, seed=11), stages)
    for s in range(stages):
        alone = build_stage(spec, s, stages, seed=11).state_dict()
        cut = parts[s].state_dict()
        assert alone.keys() == cut.keys()
        assert all(torch.equal(alone[k], cut[k]) for k in cut)
    other = build_stage(spec, 1, stages, seed=12).state_dict()
    assert not all(torch.equal(other[k], parts[1].state_dict()[k]) for k in other)


def test_split_shares_nothing_and_assembles_back() -> None:
    model = build_model(small_spec("llama"), seed=5)
    parts = split_model(model, 3)
    model_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not model_ptrs & {p.data_ptr() for m in parts for p in m.parameters()}
    tokens, _ = batch(seed=4)
    rebuilt = assemble_model(parts)
    assert torch.equal(rebuilt(tokens), model(tokens))
