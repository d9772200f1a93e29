"""Model shapes and the arithmetic the simulator needs about them (parameters, FLOPs, bytes).

Owns: `ModelSpec` (the full shape of a GPT- or LLaMA-like model), `PRESETS` (named sizes), and
`model_spec` (config -> spec). Every count here is exact for the torch modules in
`gwtf.model.transformer` (tests compare `param_count()` with `sum(p.numel())`).

Conventions (see docs/model.md):
- The LM head is *untied* from the token embedding, so both live in stage 0 as separate weights.
- GPT: learned positions (`seq_len` rows), LayerNorm with bias, GELU MLP, biases on every Linear
  except the LM head, multi-head attention (`n_kv_head == n_head`).
- LLaMA: RoPE (no position parameters), RMSNorm (weight only), SwiGLU MLP, grouped-query
  attention, no biases anywhere.

FLOPs (fwd + bwd, per token) follow the PaLM appendix convention:
`6 * N_matmul + 12 * n_layer * d_model * seq_len`, where `N_matmul` counts the weights of every
matrix multiply (block projections + LM head; not embeddings, norms or biases) and the second
term is attention scores and weighted sum (2 matmuls x 2 FLOPs x 3 for fwd+bwd), without the
causal-mask discount.

Pure: must not import torch, asyncio, socket, threading or time (the simulator uses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gwtf.config import ModelConfig
from gwtf.errors import UserError
from gwtf.model.partition import partition_layers

FAMILIES = ("gpt", "llama")

# Shared dims at top level; per-family differences under the family key (they win).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "n_layer": 4, "d_model": 128, "n_head": 4,
        "gpt": {"n_kv_head": 4, "d_ff": 512},
        "llama": {"n_kv_head": 2, "d_ff": 352},
    },
    "small": {
        "n_layer": 6, "d_model": 256, "n_head": 8,
        "gpt": {"n_kv_head": 8, "d_ff": 1024},
        "llama": {"n_kv_head": 4, "d_ff": 704},
    },
    "124m": {
        "n_layer": 12, "d_model": 768, "n_head": 12,
        "gpt": {"n_kv_head": 12, "d_ff": 3072},
        "llama": {"n_kv_head": 4, "d_ff": 2048},
    },
    "500m": {
        "d_model": 1280, "n_head": 20,
        "gpt": {"n_layer": 20, "n_kv_head": 20, "d_ff": 5120},
        "llama": {"n_layer": 24, "n_kv_head": 4, "d_ff": 3424},
    },
    "1b": {
        "d_model": 2048,
        "gpt": {"n_layer": 16, "n_head": 16, "n_kv_head": 16, "d_ff": 8192},
        "llama": {"n_layer": 20, "n_head": 32, "n_kv_head": 8, "d_ff": 5632},
    },
}


def preset_dims(preset: str, family: str) -> dict[str, int]:
    """The five shape numbers (n_layer, d_model, n_head, n_kv_head, d_ff) of a preset for a family."""
    if preset not in PRESETS:
        raise UserError(f"model.preset {preset!r} is unknown; choose one of {sorted(PRESETS)}")
    if family not in FAMILIES:
        raise UserError(f"model.family {family!r} is unknown; choose one of {list(FAMILIES)}")
    entry = PRESETS[preset]
    dims = {k: v for k, v in entry.items() if k not in FAMILIES}
    dims.update(entry[family])
    return dims


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The complete shape of one model; the torch modules are built from this alone."""

    family: str  # "gpt" | "llama"
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    seq_len: int
    dropout: float = 0.0
    rope_theta: float = 10000.0  # llama only
    norm_eps: float = 1e-5
    init_from: str = ""  # initial weights (model.init_from: gwtf.model.pretrained), "" = the seeded init

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UserError(f"model family {self.family!r} is unknown; choose one of {list(FAMILIES)}")
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise UserError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise UserError(f"model d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise UserError(f"model n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.family == "gpt" and self.n_kv_head != self.n_head:
            raise UserError("model family 'gpt' uses multi-head attention: n_kv_head must equal n_head")
        if self.family == "llama" and self.head_dim % 2:
            raise UserError(f"model head_dim={self.head_dim} must be even for RoPE")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"model dropout must be in [0, 1), got {self.dropout}")

    # ---- shapes ---------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: n_kv_head * head_dim."""
        return self.n_kv_head * self.head_dim

    # ---- parameters -----------------------------------------------------------------------

    def _norm_params(self) -> int:
        return 2 * self.d_model if self.family == "gpt" else self.d_model

    def block_matmul_params(self) -> int:
        """Weights of the matrix multiplies in one block (no biases, no norms)."""
        d, ff = self.d_model, self.d_ff
        attn = d * (d + 2 * self.kv_dim) + d * d
        mlp = (2 if self.family == "gpt" else 3) * d * ff
        return attn + mlp

    def block_params(self) -> int:
        """All parameters of one transformer block."""
        n = self.block_matmul_params() + 2 * self._norm_params()
        if self.family == "gpt":  # biases: qkv, attn out, fc, fc out
            n += (self.d_model + 2 * self.kv_dim) + self.d_model + self.d_ff + self.d_model
        return n

    def stage0_params(self) -> int:
        """Token embedding (+ learned positions for gpt) + final norm + untied LM head."""
        n = 2 * self.vocab_size * self.d_model + self._norm_params()
        if self.family == "gpt":
            n += self.seq_len * self.d_model
        return n

    def param_count(self) -> int:
        """Exact number of parameters of the torch model (untied LM head)."""
        return self.stage0_params() + self.n_layer * self.block_params()

    def stage_param_count(self, stage: int, stages: int) -> int:
        """Parameters held by `stage` when the model is cut into `stages` stages."""
        blocks = self._blocks_of(stage, stages)
        return self.stage0_params() if stage == 0 else len(blocks) * self.block_params()

    def _blocks_of(self, stage: int, stages: int) -> range:
        ranges = partition_layers(self.n_layer, stages)
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} out of range for {stages} stages")
        return ranges[stage]

    # ---- FLOPs ----------------------------------------------------------------------------

    def block_flops_per_token(self) -> float:
        """fwd+bwd FLOPs of one block per token: 6 * matmul weights + 12 * d_model * seq_len."""
        return 6.0 * self.block_matmul_params() + 12.0 * self.d_model * self.seq_len

    def head_flops_per_token(self) -> float:
        """fwd+bwd FLOPs of stage 0 per token: the LM head matmul (embedding lookups are free)."""
        return 6.0 * self.vocab_size * self.d_model

    def flops_per_token(self) -> float:
        """Training (fwd+bwd) FLOPs per token: 6 * N_matmul + 12 * n_layer * d_model * seq_len."""
        return self.head_flops_per_token() + self.n_layer * self.block_flops_per_token()

    def stage_flops_per_microbatch(self, stage: int, stages: int, microbatch_size: int) -> float:
        """fwd+bwd FLOPs of `stage` for one microbatch of `microbatch_size` sequences."""
        tokens = microbatch_size * self.seq_len
        blocks = self._blocks_of(stage, stages)
        per_token = self.head_flops_per_token() if stage == 0 else len(blocks) * self.block_flops_per_token()
        return per_token * tokens

    # ---- bytes ----------------------------------------------------------------------------

    def activation_bytes(self, microbatch_size: int, dtype_bytes: int = 4) -> int:
        """Bytes of the hidden state crossing a stage boundary: mb * seq_len * d_model * dtype."""
        return microbatch_size * self.seq_len * self.d_model * dtype_bytes

    def stage_state_bytes(self, stage: int, stages: int, dtype_bytes: int = 4) -> int:
        """Bytes a joining node downloads: weights + AdamW exp_avg + exp_avg_sq (3 x params)."""
        return 3 * self.stage_param_count(stage, stages) * dtype_bytes


def config_dims(cfg: ModelConfig) -> dict[str, int]:
    """The five shape numbers of a config: the preset's, each replaced by its model key when that
    is set (> 0); "custom" takes them all from the keys (n_kv_head: n_head unless set). A gpt
    model's n_kv_head follows n_head unless set."""
    keys = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")
    dims = {k: 0 for k in keys} if cfg.preset == "custom" else preset_dims(cfg.preset, cfg.family)
    dims.update({k: getattr(cfg, k) for k in keys if getattr(cfg, k) > 0})
    if cfg.n_kv_head == 0 and (cfg.preset == "custom" or cfg.family == "gpt"):
        dims["n_kv_head"] = dims["n_head"]
    return dims


def model_spec(cfg: ModelConfig, vocab_size: int) -> ModelSpec:
    """Spec for a `gwtf.config.ModelConfig` and a tokenizer's vocabulary size (model.vocab_size,
    when set, is the embedding's size and must hold the tokenizer's).

    Raises:
        UserError: unknown preset/family, more relay stages (`stages - 1`) than layers, or a
        model.vocab_size smaller than the tokenizer's.
    """
    dims = config_dims(cfg)
    if cfg.stages - 1 > dims["n_layer"]:
        raise UserError(
            f"model.stages={cfg.stages} needs {cfg.stages - 1} relay stages but preset "
            f"{cfg.preset!r} ({cfg.family}) has only {dims['n_layer']} layers"
        )
    if cfg.vocab_size and vocab_size > cfg.vocab_size:
        raise UserError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({vocab_size} tokens)")
    return ModelSpec(
        family=cfg.family, vocab_size=cfg.vocab_size or vocab_size, seq_len=cfg.max_positions or cfg.seq_len,
        dropout=cfg.dropout, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, init_from=cfg.init_from, **dims
    )
