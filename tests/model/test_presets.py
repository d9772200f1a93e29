"""`gwtf.model.presets`: exact parameter counts vs the torch modules, FLOPs, bytes, validation.

Big presets are built on the meta device (no memory, no init) to count parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gwtf.config import ModelConfig
from gwtf.errors import UserError
from gwtf.model.presets import PRESETS, ModelSpec, model_spec, preset_dims
from gwtf.model.stage import split_model
from gwtf.model.transformer import Transformer, build_model

torch.set_num_threads(1)

VOCAB = {"gpt": 50257, "llama": 32000}
FAMILIES = ("gpt", "llama")


def spec_for(preset: str, family: str, vocab: int | None = None, seq_len: int = 1024) -> ModelSpec:
    return ModelSpec(
        family=family, vocab_size=vocab or VOCAB[family], seq_len=seq_len, **preset_dims(preset, family)
    )


def meta_model(spec: ModelSpec) -> Transformer:
    with torch.device("meta"):
        return Transformer(spec)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_equals_torch_count(preset: str, family: str) -> None:
    spec = spec_for(preset, family)
    model = meta_model(spec)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_param_count_of_real_tiny_models(preset: str, family: str) -> None:
    spec = spec_for(preset, family, vocab=512, seq_len=64)
    model = build_model(spec, seed=0)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    for stages in (2, 3, 5):
        parts = split_model(model, stages)
        counts = [sum(p.numel() for p in m.parameters()) for m in parts]
        assert counts == [spec.stage_param_count(s, stages) for s in range(stages)]


@pytest.mark.parametrize("family", FAMILIES)
def test_matmul_params_match_linear_weights(family: str) -> None:
    """N_matmul (the FLOPs basis) = every Linear weight in the blocks + the LM head."""
    spec = spec_for("small", family)
    model = meta_model(spec)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == spec.n_layer * spec.block_matmul_params() + spec.vocab_size * spec.d_model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stages", [2, 3, 5, 13])
def test_stage_counts_sum_to_totals(family: str, stages: int) -> None:
    spec = spec_for("124m", family)
    assert sum(spec.stage_param_count(s, stages) for s in range(stages)) == spec.param_count()
    mb = 3
    total = sum(spec.stage_flops_per_microbatch(s, stages, mb) for s in range(stages))
    assert total == pytest.approx(spec.flops_per_token() * mb * spec.seq_len, rel=1e-12)
    state = sum(spec.stage_state_bytes(s, stages, dtype_bytes=2) for s in range(stages))
    assert state == 3 * 2 * spec.param_count()
    with pytest.raises(ValueError):
        spec.stage_param_count(stages, stages)


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_grow_with_preset_size(family: str) -> None:
    flops = [spec_for(p, family).flops_per_token() for p in PRESETS]
    params = [spec_for(p, family).param_count() for p in PRESETS]
    assert flops == sorted(flops) and len(set(flops)) == len(flops)
    assert params == sorted(params)
    longer = ModelSpec(**{**_fields(spec_for("tiny", family)), "seq_len": 2048})
    assert longer.flops_per_token() > spec_for("tiny", family).flops_per_token()


def _fields(spec: ModelSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__slots__}


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_match_torch_flop_counter(family: str) -> None:
    """torch's counter sees every matmul; CPU SDPA kernels may be uncounted, so accept either."""
    spec = spec_for("tiny", family, vocab=300, seq_len=32)
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(tokens, tokens)
        loss.backward()
    n_tokens = tokens.numel()
    attention = 12.0 * spec.n_layer * spec.d_model * spec.seq_len * n_tokens
    expected = spec.flops_per_token() * n_tokens
    assert counter.get_total_flops() in (pytest.approx(expected), pytest.approx(expected - attention))


def test_activation_bytes_formula() -> None:
    spec = spec_for("124m", "gpt")
    assert spec.activation_bytes(8) == 8 * 1024 * 768 * 4
    assert spec.activation_bytes(3, dtype_bytes=2) == 3 * 1024 * 768 * 2


@pytest.mark.parametrize(
    ("preset", "family", "low_m", "high_m"),
    [("124m", "llama", 110, 140), ("124m", "gpt", 150, 175), ("500m", "gpt", 450, 560),
     ("500m", "llama", 450, 560), ("1b", "gpt", 950, 1100), ("1b", "llama", 950, 1100)],
)
def test_preset_sizes_match_their_names(preset: str, family: str, low_m: int, high_m: int) -> None:
    """gpt 124m is GPT-2 small with an untied head: 124M + 38.6M head = 163M."""
    assert low_m * 1e6 <= spec_for(preset, family).param_count() <= high_m * 1e6


def test_model_spec_from_config() -> None:
    cfg = ModelConfig(family="llama", preset="small", seq_len=64, stages=4, dropout=0.1)
    spec = model_spec(cfg, vocab_size=1000)
    assert (spec.family, spec.seq_len, spec.vocab_size, spec.dropout) == ("llama", 64, 1000, 0.1)
    assert spec.n_layer == preset_dims("small", "llama")["n_layer"]
    with pytest.raises(UserError, match="stages"):
        model_spec(ModelConfig(preset="tiny", stages=6), vocab_size=1000)
    model_spec(ModelConfig(preset="tiny", stages=5), vocab_size=1000)


@pytest.mark.parametrize(
    "bad",
    [{"family": "bert"}, {"n_head": 5}, {"n_kv_head": 3}, {"n_layer": 0}, {"dropout": 1.0},
     {"family": "gpt", "n_kv_head": 2}],
)
def test_spec_validation(bad: dict[str, object]) -> None:
    base = _fields(spec_for("tiny", "llama", vocab=300, seq_len=32))
    with pytest.raises(UserError):
        ModelSpec(**{**base, **bad})


def test_unknown_preset_is_user_error() -> None:
    with pytest.raises(UserError, match="preset"):
        preset_dims("7b", "gpt")
