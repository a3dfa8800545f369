"""Train your own nn.Module on a fusion cluster from Python (a notebook cell, or a script).

    fusionctl local up -n 3                                   # or any running cluster
    export FUSION_API_SOCKET=/tmp/fusion-local-$(id -u)/node0/fusiond.sock
    python examples/notebook.py

The module is captured here; only its operator graph and weights travel (docs/jobs.md).
"""

from __future__ import annotations

import torch
from torch import nn

from fusionctl.notebook import train


class CharMLP(nn.Module):
    """A next-byte model small enough to train in seconds: embed, two layers, logits."""

    def __init__(self, vocab: int = 256, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(x))))


def main() -> tuple[nn.Module, nn.Module, list[float]]:
    """Train, print what happened; (the module as submitted, the trained one, the losses)."""
    torch.manual_seed(0)
    model = CharMLP()
    run = train(model, steps=30, seq_len=32, batch_size=8, lr=3e-3, stages=2, name="notebook")
    print(f"job {run.job_id} started")
    losses = []
    for step in run.follow():
        losses.append(step["loss"])
        if step["step"] % 10 == 0:
            print(f"step {step['step'] + 1}: loss {step['loss']:.3f}")
    trained = run.result()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; the trained module is a "
          f"{type(trained).__name__}")
    with torch.no_grad():  # what it learned: the most likely byte after "def"
        logits = trained(torch.tensor([list(b"def")]))
    print("after 'def' it expects", repr(chr(int(logits[0, -1].argmax()))))
    return model, trained, losses


if __name__ == "__main__":
    main()
