"""Text generation with a trained `Transformer`: next-token choice, the token loop, streamed text.

Owns: `choose_next` (greedy at temperature 0, else temperature + top-k sampling from a seeded
`torch.Generator`, so a seed gives the same tokens every time), `generate_ids` (the
autoregressive loop: the context is cropped to the model's `seq_len`; it stops after
`max_new_tokens` or at the end-of-text token) and `TextStream` (turns ids into printable text
as they come, holding back an incomplete UTF-8 character or BPE merge until it decodes).
No KV cache: every step runs the whole (cropped) context, which is fine for the sizes gwtf trains.
Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from gwtf.model.tokenizer import Tokenizer
from gwtf.model.transformer import Transformer

__all__ = ["TextStream", "choose_next", "generate_ids"]


def choose_next(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """The next token from the last position's logits [V]: argmax when temperature == 0, else a
    draw from softmax(logits / temperature) restricted to the `top_k` largest (0 = all)."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_ids(
    model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
    top_k: int = 0, seed: int = 0, stop_id: int | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids, one per forward pass, stopping after `stop_id`
    (not yielded). `prompt_ids` must not be empty."""
    if not prompt_ids:
        raise ValueError("generation needs at least one context token")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    window = model.spec.seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        logits = model(context)
        assert isinstance(logits, Tensor)
        token = choose_next(logits[0, -1].cpu(), temperature, top_k, generator)
        if token == stop_id:
            return
        ids.append(token)
        yield token


class TextStream:
    """Incremental detokenisation: `push(id)` returns the new printable text (possibly "").

    Decodes everything generated so far and emits what was not emitted yet; text ending in the
    replacement character (an incomplete UTF-8 sequence) is held back until the next token
    completes it, and `flush()` returns whatever is left at the end.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self.tokenizer.decode(self.ids))

    def _take(self, text: str) -> str:
        new = text[self.emitted:]
        self.emitted = len(text)
        return new
