"""Text from a trained byte-level language model (the demo's "look, it learned" sample)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["sample_bytes"]


@torch.no_grad()
def sample_bytes(model: nn.Module, prompt: str, *, length: int = 200, context: int = 64,
                 temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> str:
    """Continue `prompt` by `length` bytes with a model mapping byte ids (B, T) to logits
    (B, T, V >= 256) or an output with `.logits`; the last `context` bytes are its input.

    Sampling is seeded (reproducible); `temperature` 0 means greedy. Undecodable byte sequences
    are shown with replacement characters.
    """
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt.encode("utf-8")) or [10]
    try:
        for _ in range(length):
            x = torch.tensor([ids[-context:]], dtype=torch.long)
            out = model(x)
            logits = (out.logits if hasattr(out, "logits") else out)[0, -1, :256].float()
            if temperature <= 0:
                nxt = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            ids.append(nxt)
    finally:
        model.train(was_training)
    return bytes(ids).decode("utf-8", errors="replace")
