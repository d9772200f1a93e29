"""How the transformer blocks are cut into pipeline stages.

Owns: `partition_layers`, the single rule that maps a layer count and a stage count to the
contiguous block range each stage serves. Stage 0 (held by data holders) has no blocks: it owns
the embedding at the start and the final norm + LM head at the end of every microbatch
(DESIGN.md section 1). Relay stages 1..S-1 split the blocks as evenly as possible; when the
split is uneven the *earlier* relay stages get the extra block.

Pure: must not import torch, asyncio, socket, threading or time (the simulator uses it).
"""

from __future__ import annotations


def partition_layers(n_layer: int, stages: int) -> list[range]:
    """Block ranges per stage: index 0 is `range(0, 0)`, stages 1..S-1 cover 0..n_layer-1 once.

    Args:
        n_layer: number of transformer blocks in the model (>= 1).
        stages: pipeline stages including stage 0 (>= 2).

    Returns:
        `stages` ranges; relay stage sizes differ by at most one.

    Raises:
        ValueError: if `stages < 2`, `n_layer < 1` or a relay stage would get no block
            (`stages - 1 > n_layer`).
    """
    if stages < 2:
        raise ValueError(f"stages must be >= 2 (stage 0 plus a relay stage), got {stages}")
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    relays = stages - 1
    if relays > n_layer:
        raise ValueError(f"{relays} relay stages need at least {relays} layers, model has {n_layer}")
    base, extra = divmod(n_layer, relays)
    out = [range(0, 0)]
    start = 0
    for i in range(relays):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_of_layer(layer: int, n_layer: int, stages: int) -> int:
    """The stage (1..S-1) that serves block `layer`; ValueError if the layer does not exist."""
    if not 0 <= layer < n_layer:
        raise ValueError(f"layer {layer} out of range for a model with {n_layer} layers")
    for stage, blocks in enumerate(partition_layers(n_layer, stages)):
        if layer in blocks:
            return stage
    raise AssertionError("unreachable: partition covers every layer")  # pragma: no cover
