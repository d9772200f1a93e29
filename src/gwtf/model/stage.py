"""Pipeline stages: the pieces of `Transformer` that separate nodes hold.

Owns: `FirstStage` (stage 0, on data holders: embedding at the start and final norm + LM head +
loss at the end of every microbatch), `RelayStage` (stages 1..S-1: a contiguous run of blocks,
see `gwtf.model.partition`), `split_model`, `build_stage`, `assemble_model` and the reference
microbatch pass `stage_forward_backward_reference` that the runtime mirrors across processes.

Stage modules take and return plain tensors, because activations and their gradients cross
process boundaries. Local parameter names map to the monolithic model's names with
`global_param_name` (stage 0: identical; relay: `blocks.<j>` -> `blocks.<first + j>`).

Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gwtf.model import wire
from gwtf.model.device import compute_autocast
from gwtf.model.partition import partition_layers
from gwtf.model.presets import ModelSpec
from gwtf.model.transformer import Block, Embedding, Head, Transformer, init_weights, lm_loss, run_blocks


class FirstStage(nn.Module):
    """Stage 0: token embedding (+ gpt positions), final norm and untied LM head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.stage = 0
        self.embedding = Embedding(spec)
        self.head = Head(spec)

    def embed(self, tokens: Tensor) -> Tensor:
        """[B, T] long -> hidden [B, T, d]; the start of a microbatch."""
        if tokens.shape[1] > self.spec.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds seq_len={self.spec.seq_len}")
        out: Tensor = self.embedding(tokens)
        return out

    def head_logits(self, hidden: Tensor) -> Tensor:
        """[B, T, d] -> logits [B, T, V] (evaluation and sampling)."""
        out: Tensor = self.head(hidden)
        return out

    def head_loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Final norm + LM head + mean cross-entropy (scalar); the end of a microbatch."""
        return lm_loss(self.head(hidden), targets)

    def global_param_name(self, local: str) -> str:
        """Name of a parameter of this stage in the monolithic `Transformer` (identity)."""
        return local


class RelayStage(nn.Module):
    """Stages 1..S-1: blocks `layers` of the model; [B, T, d] -> [B, T, d]."""

    def __init__(self, spec: ModelSpec, layers: range) -> None:
        super().__init__()
        if len(layers) == 0 or layers.step != 1 or layers.start < 0 or layers.stop > spec.n_layer:
            raise ValueError(f"relay stage needs a non-empty contiguous block range, got {layers}")
        self.spec = spec
        self.layers = layers
        self.blocks = nn.ModuleList(Block(spec) for _ in layers)

    def forward(self, hidden: Tensor) -> Tensor:
        return run_blocks(self.blocks, self.spec, hidden)

    def global_param_name(self, local: str) -> str:
        """`blocks.<j>.rest` -> `blocks.<layers.start + j>.rest` (the monolithic name)."""
        head, j, rest = local.split(".", 2)
        if head != "blocks":
            raise ValueError(f"not a relay-stage parameter name: {local!r}")
        return f"blocks.{self.layers.start + int(j)}.{rest}"


def _empty_stage(spec: ModelSpec, stage: int, stages: int) -> nn.Module:
    """An uninitialised stage module on the meta device (no memory, no RNG use)."""
    ranges = partition_layers(spec.n_layer, stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    with torch.device("meta"):
        return FirstStage(spec) if stage == 0 else RelayStage(spec, ranges[stage])


def split_model(model: Transformer, stages: int) -> list[nn.Module]:
    """Cut `model` into `[FirstStage, RelayStage, ...]`; every stage holds deep copies."""
    spec = model.spec
    out: list[nn.Module] = []
    for s in range(stages):
        mod = _empty_stage(spec, s, stages)
        if isinstance(mod, FirstStage):
            mod.embedding = copy.deepcopy(model.embedding)
            mod.head = copy.deepcopy(model.head)
        else:
            assert isinstance(mod, RelayStage)
            mod.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in mod.layers)
        mod.train(model.training)
        out.append(mod)
    return out


def build_stage(
    spec: ModelSpec, stage: int, stages: int, seed: int, device: str | torch.device = "cpu"
) -> nn.Module:
    """Stage `stage` alone, bit-identical to `split_model(build_model(spec, seed), stages)[stage]`;
    with `spec.init_from` (model.init_from) its weights are that source's instead."""
    mod = _empty_stage(spec, stage, stages)
    mod.to_empty(device=device)
    if spec.init_from:
        from gwtf.model.pretrained import load_initial_weights

        load_initial_weights(mod, spec, mod.global_param_name)  # type: ignore[arg-type]
    else:
        init_weights(mod, spec, seed, global_name=mod.global_param_name)  # type: ignore[arg-type]
    return mod


def global_state_dict(stage_module: nn.Module) -> dict[str, Tensor]:
    """The stage's state dict keyed by monolithic parameter names."""
    rename = stage_module.global_param_name
    return {rename(k): v for k, v in stage_module.state_dict().items()}  # type: ignore[operator]


def assemble_model(stage_modules: Sequence[nn.Module]) -> Transformer:
    """Rebuild a monolithic `Transformer` (deep copies) from one module per stage."""
    spec: ModelSpec = stage_modules[0].spec  # type: ignore[assignment]
    with torch.device("meta"):
        model = Transformer(spec)
    state: dict[str, Tensor] = {}
    for mod in stage_modules:
        state.update(global_state_dict(mod))
    model.load_state_dict(state, strict=True, assign=True)
    return copy.deepcopy(model)


def round_on_wire(t: Tensor, fmt: str, block_values: int = 4096) -> Tensor:
    """`t` as a receiver gets it when sent in wire format `fmt` (`gwtf.model.wire.roundtrip`:
    the very function the runtime's encode/decode pair amounts to), in `t`'s dtype and device."""
    if fmt == "fp32":
        return t
    arr = wire.roundtrip(t.detach().float().cpu().contiguous().numpy(), fmt, block_values)
    return torch.from_numpy(arr).to(t.device, t.dtype)


def stage_forward_backward_reference(
    stage_modules: Sequence[nn.Module], tokens: Tensor, targets: Tensor, loss_scale: float = 1.0,
    precision: str = "fp32",
    wire_formats: tuple[str, str, int] | None = None,
) -> Tensor:
    """One microbatch through all stages as the distributed runtime does it, in one process.

    At every stage boundary the activation is detached and re-leafed (what a receiver gets off
    the wire); the loss is computed at stage 0's head and scaled by `loss_scale` (e.g. 1/M for
    M accumulated microbatches); then each stage runs `out.backward(grad)` with the gradient
    received from the stage after it. Parameter gradients accumulate into `.grad`.
    `precision` (`train.precision`): the forward passes run in `gwtf.model.device.compute_autocast`
    ("bf16-autocast": bfloat16 compute, float32 parameters and gradients); backward runs outside it.
    `wire_formats` = (activations, gradients, block_values) rounds every boundary tensor as that
    wire format does (`round_on_wire`); None: exact.

    Returns:
        The unscaled loss, detached.
    """
    first = stage_modules[0]
    assert isinstance(first, FirstStage)
    act_fmt, grad_fmt, block = wire_formats if wire_formats is not None else ("fp32", "fp32", 1)
    inputs: list[Tensor] = []
    with compute_autocast(tokens.device, precision):
        outputs: list[Tensor] = [first.embed(tokens)]
    for relay in stage_modules[1:]:
        received = round_on_wire(outputs[-1].detach(), act_fmt, block).requires_grad_(True)
        inputs.append(received)
        with compute_autocast(tokens.device, precision):
            outputs.append(relay(received))
    final = round_on_wire(outputs[-1].detach(), act_fmt, block).requires_grad_(True)
    with compute_autocast(tokens.device, precision):
        loss = first.head_loss(final, targets)
    (loss * loss_scale).backward()
    assert final.grad is not None
    grad = round_on_wire(final.grad, grad_fmt, block)
    for out, inp in zip(reversed(outputs[1:]), reversed(inputs), strict=True):
        out.backward(grad)
        assert inp.grad is not None
        grad = round_on_wire(inp.grad, grad_fmt, block)
    outputs[0].backward(grad)
    return loss.detach()
