"""`gwtf.model.transformer`: shapes, causality, init, determinism, dropout, and that it learns."""

from __future__ import annotations

import math

import pytest
import torch

from gwtf.model.presets import ModelSpec, preset_dims
from gwtf.model.stage import build_stage
from gwtf.model.transformer import apply_rope, build_model, rope_tables

torch.set_num_threads(1)

VOCAB, SEQ = 101, 24


def spec(family: str, **kw: object) -> ModelSpec:
    dims = {**preset_dims("tiny", family), "n_layer": 2, "d_model": 64}
    dims.update({"d_ff": 256} if family == "gpt" else {"d_ff": 160})
    return ModelSpec(family=family, vocab_size=VOCAB, seq_len=SEQ, **{**dims, **kw})  # type: ignore[arg-type]


def tokens(rows: int = 2, length: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_shapes_and_initial_loss_near_uniform(family: str) -> None:
    model = build_model(spec(family), seed=0)
    x = tokens()
    logits = model(x)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, SEQ, VOCAB)
    out = model(x, x)
    assert isinstance(out, tuple)
    assert abs(out[1].item() - math.log(VOCAB)) < 0.3  # small init -> near-uniform predictions


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_causal_future_tokens_do_not_change_past_logits(family: str) -> None:
    model = build_model(spec(family), seed=0)
    x = tokens()
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % VOCAB
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_shorter_sequences_work_and_longer_raise(family: str) -> None:
    model = build_model(spec(family), seed=0)
    x = tokens()
    torch.testing.assert_close(model(x[:, :7]), model(x)[:, :7])
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(length=SEQ + 1))


def test_build_is_deterministic_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = build_model(spec("llama"), seed=1).state_dict()
    b = build_model(spec("llama"), seed=1).state_dict()
    c = build_model(spec("llama"), seed=2).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_gpt2_style_init() -> None:
    s = spec("gpt", n_layer=8, d_model=128, d_ff=512)
    sd = build_model(s, seed=0).state_dict()
    assert torch.all(sd["blocks.0.attn.qkv.bias"] == 0)
    assert torch.all(sd["head.norm.weight"] == 1)
    assert sd["blocks.0.mlp.fc.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blocks.0.attn.proj.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert not torch.equal(sd["embedding.tokens.weight"][:, :64], sd["head.out.weight"][:, :64])  # untied


def test_llama_has_no_biases_and_gqa_shapes() -> None:
    s = spec("llama", n_head=4, n_kv_head=2)
    model = build_model(s, seed=0)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 2 * 16, 64)


def test_rope_preserves_norm_and_is_relative() -> None:
    s = spec("llama")
    cos, sin = rope_tables(SEQ, s, torch.float64, torch.device("cpu"))
    q = torch.randn(1, 1, 1, s.head_dim, dtype=torch.float64).expand(1, 1, SEQ, s.head_dim)
    k = torch.randn(1, 1, 1, s.head_dim, dtype=torch.float64).expand(1, 1, SEQ, s.head_dim)
    rq, rk = apply_rope(q, (cos, sin)), apply_rope(k, (cos, sin))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, 0, 3:] * rk[0, 0, :-3]).sum(-1)  # same offset 3 at every position
    torch.testing.assert_close(dots, dots[:1].expand_as(dots))


def test_dropout_is_off_by_default_and_works_when_set() -> None:
    x = tokens()
    plain = build_model(spec("gpt"), seed=0).train()
    torch.testing.assert_close(plain(x), plain(x))
    noisy = build_model(spec("gpt", dropout=0.3), seed=0).train()
    assert not torch.allclose(noisy(x), noisy(x))
    noisy.eval()
    torch.testing.assert_close(noisy(x), plain(x))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_few_adamw_steps_reduce_loss(family: str) -> None:
    model = build_model(spec(family), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(rows=4, seed=3)
    losses = []
    for _ in range(15):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_build_stage_rejects_bad_stage_index() -> None:
    with pytest.raises(ValueError):
        build_stage(spec("gpt"), 3, 3, seed=0)
    with pytest.raises(ValueError):
        build_stage(spec("gpt"), 1, 4, seed=0)  # 3 relay stages > 2 layers
