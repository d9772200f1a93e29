"""The monolithic GPT-/LLaMA-like decoder and the building blocks the pipeline stages reuse.

Owns: `Transformer` (one module for both families, chosen by `spec.family`), its parts
(`Embedding`, `Block`, `Head`, attention, MLPs, RoPE tables) and the deterministic
initialisation `init_weights` / `build_model`.

Parameter names are the contract with `gwtf.model.stage`: `embedding.*` and `head.*` belong to
stage 0, `blocks.<i>.*` to the relay stage serving block i. Initialisation draws each parameter
from its own `torch.Generator` seeded by (seed, global parameter name), so a stage built alone
is bit-identical to the same stage cut out of a full model, and the global torch RNG is never
touched. The LM head is untied from the token embedding.

Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gwtf.model.presets import ModelSpec

INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.proj", "mlp.proj", "mlp.down")  # scaled init (GPT-2 style)

Rope = tuple[Tensor, Tensor]


def make_norm(spec: ModelSpec) -> nn.Module:
    """LayerNorm with bias for gpt, RMSNorm (weight only) for llama."""
    if spec.family == "gpt":
        return nn.LayerNorm(spec.d_model, eps=spec.norm_eps)
    return nn.RMSNorm(spec.d_model, eps=spec.norm_eps)


def rope_tables(seq_len: int, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Rope:
    """cos/sin tables [T, head_dim] for rotate-half RoPE, computed in float64 then cast."""
    hd = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    pos = torch.arange(seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate [B, H, T, hd] queries or keys by position."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention; grouped-query when n_kv_head < n_head; RoPE when given tables."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.family == "gpt"
        self.n_head, self.n_kv_head, self.head_dim = spec.n_head, spec.n_kv_head, spec.head_dim
        self.dropout = spec.dropout
        self.qkv = nn.Linear(spec.d_model, spec.d_model + 2 * spec.kv_dim, bias=bias)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=bias)

    def forward(self, x: Tensor, rope: Rope | None) -> Tensor:
        B, T, C = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split((C, kv, kv), dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GeluMLP(nn.Module):
    """GPT MLP: Linear -> GELU(tanh) -> Linear, with biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.d_model, spec.d_ff)
        self.proj = nn.Linear(spec.d_ff, spec.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """LLaMA MLP: down(silu(gate(x)) * up(x)); gate and up fused in one Linear, no biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up = nn.Linear(spec.d_model, 2 * spec.d_ff, bias=False)
        self.down = nn.Linear(spec.d_ff, spec.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm1 = make_norm(spec)
        self.attn = Attention(spec)
        self.norm2 = make_norm(spec)
        self.mlp: nn.Module = GeluMLP(spec) if spec.family == "gpt" else SwiGLU(spec)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor, rope: Rope | None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope))
        return x + self.drop(self.mlp(self.norm2(x)))


def run_blocks(blocks: nn.ModuleList, spec: ModelSpec, hidden: Tensor) -> Tensor:
    """Apply `blocks` in order; RoPE tables (llama) are derived here from the hidden shape."""
    rope = None
    if spec.family == "llama":
        rope = rope_tables(hidden.shape[1], spec, hidden.dtype, hidden.device)
    for block in blocks:
        hidden = block(hidden, rope)
    return hidden


class Embedding(nn.Module):
    """Token embedding (+ learned positions for gpt), then dropout: [B, T] long -> [B, T, d]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab_size, spec.d_model)
        self.positions = nn.Embedding(spec.seq_len, spec.d_model) if spec.family == "gpt" else None
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tokens(tokens)
        if self.positions is not None:
            h = h + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.drop(h)


class Head(nn.Module):
    """Final norm + untied LM head: [B, T, d] -> logits [B, T, V]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = make_norm(spec)
        self.out = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.out(self.norm(hidden))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all positions (targets == -100 are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Transformer(nn.Module):
    """The whole model in one module; the reference the pipeline stages must match."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embedding = Embedding(spec)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layer))
        self.head = Head(spec)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Logits [B, T, V]; with `targets` also the mean cross-entropy loss (scalar)."""
        if tokens.shape[1] > self.spec.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds seq_len={self.spec.seq_len}")
        logits = self.head(run_blocks(self.blocks, self.spec, self.embedding(tokens)))
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)


def param_seed(seed: int, global_name: str) -> int:
    """A stable 63-bit seed for one parameter, independent of Python's hash randomisation."""
    digest = hashlib.blake2b(f"{seed}:{global_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _init_one(p: Tensor, owner: nn.Module, global_name: str, spec: ModelSpec, seed: int) -> None:
    if isinstance(owner, (nn.LayerNorm, nn.RMSNorm)):
        p.fill_(1.0 if global_name.endswith("weight") else 0.0)
    elif global_name.endswith("bias"):
        p.zero_()
    else:
        std = INIT_STD
        if any(global_name.endswith(r + ".weight") for r in RESIDUAL_PROJECTIONS):
            std = INIT_STD / math.sqrt(2 * spec.n_layer)
        # drawn on the CPU so a seed gives the same weights on any device (CPU: in place, as before)
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, global_name))
        if p.device.type == "cpu":
            p.normal_(0.0, std, generator=gen)
        else:
            p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, std, generator=gen))


@torch.no_grad()
def init_weights(
    module: nn.Module, spec: ModelSpec, seed: int, global_name: Callable[[str], str] = lambda n: n
) -> None:
    """GPT-2 style init in place: N(0, 0.02) weights, residual projections / sqrt(2 L), zero
    biases, unit norms. `global_name` maps a local parameter name to the monolithic one."""
    for mod_name, owner in module.named_modules():
        for p_name, p in owner.named_parameters(recurse=False):
            local = f"{mod_name}.{p_name}" if mod_name else p_name
            _init_one(p, owner, global_name(local), spec, seed)


def build_model(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """A freshly initialised float32 model; same (spec, seed) -> bit-identical weights."""
    with torch.device("meta"):
        model = Transformer(spec)
    model.to_empty(device=device)
    init_weights(model, spec, seed)
    return model
